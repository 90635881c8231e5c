"""Renders a benchmark's JSON result as a grouped bar chart (PNG beside the JSON).

    python benchmarks/plot.py benchmarks/results/quantize.json [--metric effective_tbps]

Rows with the same (op, activation, shape, timing) form a group; each implementation is one bar. The
metric is the first of METRICS that the rows carry, unless --metric names one. A dashed line
marks the result's ``target_tbps`` (or ``target``) when it has one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRICS = ("effective_tbps", "tflops", "tokens_per_s", "speedup", "median_ms", "host_us")


def _shape(row: dict) -> str:
    for key, value in row.items():
        if key.startswith("shape"):
            return "x".join(map(str, value)) if isinstance(value, list) else str(value)
    return ""


def _group(row: dict) -> str:
    label = row["op"] + (f" {row['activation']}" if "activation" in row else "")
    label += f"\n{_shape(row)}"
    return label + (f"\n{row['timing']}" if "timing" in row else "")


def _rows(data: dict) -> list[dict]:
    """The result rows: data["results"], or, for results grouped under other keys (lists of
    rows with a "name"), those rows with the key as their op and the name as their impl."""
    if "results" in data:
        return data["results"]
    rows = []
    for key, value in data.items():
        if isinstance(value, list):
            rows += [{"op": key, "impl": r["name"], **r} for r in value if "name" in r]
    return rows


def plot(path: Path, metric: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(path.read_text())
    rows = [r for r in _rows(data) if "impl" in r]
    if metric == "auto":
        metric = next((m for m in METRICS if any(m in r for r in rows)), METRICS[0])
    rows = [r for r in rows if metric in r]
    if not rows:
        raise SystemExit(f"{path}: no row carries {metric!r}; name one with --metric")
    groups = list(dict.fromkeys(_group(r) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(min(24, max(6, 0.9 * len(groups))), 5))
    for j, impl in enumerate(impls):
        values = []
        for g in groups:
            match = [r[metric] for r in rows if r["impl"] == impl and _group(r) == g]
            values.append(match[0] if match else 0.0)
        xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, values, width, label=impl)
        ax.bar_label(bars, fmt="%.4g", fontsize=6)
    target = data.get("target_tbps", data.get("target"))
    if target is not None:
        ax.axhline(target, linestyle="--", color="gray", linewidth=1, label=f"target {target}")
    ax.set_xticks(range(len(groups)), groups, fontsize=6, rotation=60, ha="right")
    ax.set_ylabel(metric)
    env = data.get("environment", {})
    ax.set_title(
        f"{data['benchmark']} on {env.get('device', '?')} ({env.get('date', '')[:10]})", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+")
    parser.add_argument("--metric", default="auto")
    args = parser.parse_args()
    for p in args.json:
        plot(p, args.metric)


if __name__ == "__main__":
    main()
