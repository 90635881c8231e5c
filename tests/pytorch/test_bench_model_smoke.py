"""benchmarks/bench_model.py runs on the CPU at its tiny shape and writes a complete result.

The benchmark is run as users run it (a fresh interpreter, TE_BENCH_RESULTS naming the output
folder), without torch.compile (inductor's C++ builds take minutes on a small CPU); the CUDA-only
executions must be recorded as skipped, never silently dropped. Its ratio arithmetic is
checked on made-up rows, since a CPU run without compilation has no torch peer to divide by.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPT = BENCHMARKS / "bench_model.py"


def _run(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "TE_BENCH_RESULTS": str(tmp_path), "TE_GIT_COMMIT": "test123"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", *args],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return json.loads((tmp_path / "model.json").read_text())


def _finite_positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.slow  # two fresh processes of the benchmark
def test_isolated_cases_run_in_processes_of_their_own(tmp_path):
    """--isolate: each case in a fresh process; its row comes back into the one result."""
    data = _run(tmp_path, "--no-compile", "--isolate", "--module-iters", "0", "--steps", "1",
                "--variants", "te_layer/fp8_delayed/eager", "te_layer_modules/bf16/eager")
    assert data["config"]["isolate"] is True
    rows = {row["case"]: row for row in data["results"]}
    assert set(rows) == {"te_layer/fp8_delayed/eager", "te_layer_modules/bf16/eager"}
    for name, row in rows.items():
        assert "error" not in row, (name, row["error"])
        assert row["stack"] == name.split("/")[0] and row["hidden"] == 256
        for key in ("median_ms", "host_issue_ms", "first_step_s"):
            assert _finite_positive(row[key]), (name, key)


@pytest.mark.slow  # about 15 s on a 2-core CPU: 7 models of 4 blocks, a few steps each
def test_tiny_cpu_run_writes_every_case(tmp_path):
    data = _run(tmp_path, "--no-compile", "--steps", "1", "--module-iters", "3")
    assert data["benchmark"] == "model"
    env = data["environment"]
    assert env["device"].startswith("cpu") and env["git_commit"] == "test123" and env["date"]
    assert data["config"]["shapes_bsh_heads"] == [[2, 32, 256, 2]]
    rows = {row["case"]: row for row in data["results"]}
    assert len(rows) == len(data["results"]) == 48  # 3 stacks x 3 recipes x 5 + torch's 3
    for name, row in rows.items():
        stack, recipe, execution = name.split("/")
        assert "error" not in row, (name, row["error"])
        if execution in ("reduce_overhead", "cuda_graph", "graphed_modules"):
            assert row["skipped"] == "needs CUDA", name
        elif execution == "compile":
            assert row["skipped"] == "--no-compile", name
        else:
            for key in ("median_ms", "host_issue_ms", "host_back_to_back_ms", "first_step_s"):
                assert _finite_positive(row[key]), (name, key, row.get(key))
    assert {n for n in rows if n.startswith("torch/")} == {
        "torch/bf16/eager", "torch/bf16/compile", "torch/bf16/reduce_overhead"}
    assert data["ratios"] == []  # no compiled torch peer in this run
    modules = {row["module"]: row for row in data["module_host"]}
    assert len(modules) == 12  # five of them with a fast path off, for the comparison
    assert "torch block (nn.LayerNorm, nn.Linear, SDPA) bf16" in modules
    assert {n for n in modules if n.endswith("whole blocks off")} == {
        "te.MultiheadAttention + te.LayerNormMLP fp8_delayed, whole blocks off",
        "te.TransformerLayer fp8_delayed, whole blocks off"}
    assert "te.TransformerLayer fp8_delayed, packed attention off" in modules
    assert "te.TransformerLayer fp8_delayed, layer node off" in modules
    assert "te.TransformerLayer bf16, layer node off" in modules
    for name, row in modules.items():
        assert _finite_positive(row["host_ms"]), name
        assert _finite_positive(row["ratio_to_nn_linear"]), name
    assert modules["nn.Linear(256, 256) bf16"]["ratio_to_nn_linear"] == 1.0


def test_spent_budget_and_variants_still_write_the_file(tmp_path):
    """A budget spent before the first case skips every selected case and still writes."""
    data = _run(tmp_path, "--budget-s", "0", "--variants", "te_layer/fp8_*/eager",
                "--module-iters", "0")
    assert [row["case"] for row in data["results"]] == [
        "te_layer/fp8_delayed/eager", "te_layer/fp8_current/eager"]
    for row in data["results"]:
        assert row["skipped"] == "time budget of 0 s spent" and "median_ms" not in row
    assert data["module_host"] == [] and data["ratios"] == []


def test_ratios_divide_ours_by_the_torch_peer(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the benchmark imports its sibling harness
    spec = importlib.util.spec_from_file_location("bench_model_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(case, ms):
        return {"case": case, "hidden": 1024, "median_ms": ms}

    rows = [row("torch/bf16/compile", 10.0), row("torch/bf16/reduce_overhead", 8.0),
            row("te_layer/fp8_delayed/eager", 6.0), row("te_layer/fp8_delayed/compile", 5.0),
            row("te_layer/fp8_delayed/cuda_graph", 4.0),
            {"case": "te_mha_mlp/fp8_delayed/eager", "hidden": 1024, "error": "X: failed"}]
    got = {(r["stack"], r["recipe"], r["ratio"]): r["value"] for r in bench.ratios(rows)}
    assert got == {("te_layer", "fp8_delayed", "eager_over_torch_compiled"): 0.6,
                   ("te_layer", "fp8_delayed", "compiled_over_torch_compiled"): 0.5,
                   ("te_layer", "fp8_delayed", "graphed_over_torch_reduce_overhead"): 0.5}
