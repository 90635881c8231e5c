"""What the demo shows of its two runs: a table, the loss curves (PNG) and the numbers (JSON)."""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .data import decode
from .loop import CLIP_NORM, FINAL_LOSS_STEPS, RunResult


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def print_table(runs: dict[str, RunResult]) -> None:
    print(f"\n{'run':>16} {'first loss':>11} {'final loss':>11} {'valid loss':>11} "
          f"{'tokens/s':>10} {'peak memory':>12} {'grad norm':>10} {'clipped':>8}")
    for run in runs.values():
        print(f"{run.label:>16} {run.first_loss:11.4f} {run.final_loss:11.4f} "
              f"{run.valid_loss:11.4f} {run.tokens_per_s:10.0f} {_mib(run.peak_memory):>12} "
              f"{_median(run.grad_norms):10.3f} {run.clipped:8.0%}")
    notes = sorted({run.memory_note for run in runs.values()})
    print(f"(final loss: mean of the last {FINAL_LOSS_STEPS} steps; peak memory: "
          f"{'; '.join(notes)}; grad norm: the median over the steps of the gradients' "
          f"global norm before clipping; clipped: the steps where it was above {CLIP_NORM})")


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def print_comparison(fp8: RunResult, high: RunResult, recipe_name: str, emulated: bool) -> None:
    gap = (fp8.final_loss - high.final_loss) / high.final_loss
    speed = fp8.tokens_per_s / high.tokens_per_s
    why = " (on the CPU the core emulates FP8, so it is not meant to be faster)" if emulated else ""
    print(f"\nFP8 ({recipe_name}) final loss is {gap:+.2%} from high precision, validation loss "
          f"{(fp8.valid_loss - high.valid_loss) / high.valid_loss:+.2%}; the loss fell from "
          f"{high.first_loss:.2f} to {high.final_loss:.2f}. FP8 ran at {speed:.2f}x the "
          f"tokens/s of high precision{why}.")


def print_samples(runs: dict[str, RunResult], prompts: np.ndarray) -> None:
    for run in runs.values():
        if not run.samples:
            continue
        print(f"\nSamples from {run.label} (prompt | continuation):")
        for prompt, text in zip(prompts, run.samples, strict=True):
            print(f"  {decode(prompt)!r} | {decode(text)!r}")


def plot(runs: dict[str, RunResult], path: str, title: str) -> bool:
    """Writes the loss curves to ``path``; False (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no loss plot written ({path})")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs.values():
        steps = np.arange(1, len(run.losses) + 1)
        ax.plot(steps, run.losses, lw=1, alpha=0.35)
        window = min(FINAL_LOSS_STEPS, len(run.losses))
        smooth = np.convolve(run.losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=2, color=ax.lines[-1].get_color(),
                label=f"{run.label} (valid {run.valid_loss:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves written to {path}")
    return True


def write_json(path: str, runs: dict[str, RunResult], config: dict, device: str,
               versions: dict) -> None:
    """The table's numbers with the configuration, device and versions (for results files)."""
    out = {"config": config, "device": device,
           "versions": {"python": platform.python_version(), "numpy": np.__version__,
                        **versions},
           "runs": {}}
    for key, run in runs.items():
        fields = asdict(run)
        fields["samples"] = [decode(s) for s in run.samples]
        fields.update(first_loss=run.first_loss, final_loss=run.final_loss,
                      median_grad_norm=_median(run.grad_norms), clipped=run.clipped)
        out["runs"][key] = fields
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"results written to {path}")
