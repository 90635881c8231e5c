"""benchmarks/bench_host_profile.py runs on the CPU and writes each case's host time with its
two profiles (torch.profiler's ops, cProfile's Python functions), as users run it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_profile.py"


def _run(tmp_path, *args: str) -> dict:
    """The script on the CPU with ``args``, writing into tmp_path: its JSON."""
    env = {**os.environ, "TE_BENCH_RESULTS": str(tmp_path), "TE_GIT_COMMIT": "test123"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--warmup", "1",
                             *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return json.loads((tmp_path / "host_profile.json").read_text())


def test_tiny_cpu_run_writes_both_profiles(tmp_path):
    cases = ["te_layer/fp8_delayed", "torch/bf16"]
    data = _run(tmp_path, "--steps", "2", "--top", "3", "--cases", *cases)
    assert data["benchmark"] == "host_profile"
    assert data["environment"]["git_commit"] == "test123"
    assert [r["case"] for r in data["results"]] == cases
    for row in data["results"]:
        assert math.isfinite(row["host_ms_per_step"]) and row["host_ms_per_step"] > 0
        assert len(row["ops"]) == len(row["python"]) == 3
        assert all(op["self_us_per_step"] >= 0 and op["calls_per_step"] > 0
                   for op in row["ops"])
        assert all(fn["own_us_per_step"] >= 0 for fn in row["python"])
    # the FP8 layer's block operators are among what the profiler saw
    names = {op["name"] for op in data["results"][0]["ops"]}
    assert any(name.startswith("te_eager::") for name in names), names


def test_rounds_time_the_cases_in_turn_without_profiles(tmp_path):
    data = _run(tmp_path, "--steps", "1", "--rounds", "3", "--cases", "te_layer/bf16",
                "torch/bf16")
    assert data["config"]["rounds"] == 3
    for row in data["results"]:
        assert len(row["rounds_ms"]) == 3 and all(t > 0 for t in row["rounds_ms"])
        assert row["host_ms_per_step"] == sorted(row["rounds_ms"])[1]
        assert "ops" not in row and "python" not in row
