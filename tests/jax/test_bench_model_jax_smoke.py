"""The JAX model-stack benchmark (bench_transformer_layer_jax.py --model) runs end to end at
its CPU smoke shapes: every contender compiles, steps and is timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_model_stack_smoke_runs_every_contender(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_transformer_layer_jax as bench
    finally:
        sys.path.remove(str(BENCH))
    bench.main_model(smoke=True)
    out = capsys.readouterr().out
    for name in ("te_transformer_layer_fp8_delayed", "te_transformer_layer_fp8_current",
                 "te_transformer_layer_bf16", "flax_layer_bf16"):
        assert f"{name}" in out and "FAILED" not in out, out[-2000:]
