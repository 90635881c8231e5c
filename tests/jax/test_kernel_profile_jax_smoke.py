"""The JAX kernel probe (benchmarks/kernel_profile_jax.py) runs end to end at its CPU smoke
shapes: every contender compiles, steps, and is profiled (no kernels on a CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
def test_kernel_probe_smoke_runs_every_contender(capsys, monkeypatch):
    pytest.importorskip("torch")
    sys.path.insert(0, str(BENCH))
    try:
        import kernel_profile_jax as probe
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(sys, "argv", ["kernel_profile_jax.py", "--smoke", "--steps", "1"])
    probe.main()
    out = capsys.readouterr().out
    for name in ("te_transformer_layer_fp8_delayed", "te_transformer_layer_bf16",
                 "flax_layer_bf16"):
        assert f"{name}: wall" in out, out[-2000:]
