"""The examples of the JAX package run: the seed example exactly as written, and the optax
training loop, whose loss falls while the FP8 state follows the data."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[2] / "jax" / "examples"


def test_seed_example_runs_as_written(tmp_path):
    # A fresh interpreter, as a user runs it (the FP8 layer, 10 eager training steps).
    result = subprocess.run([sys.executable, str(EXAMPLES / "jax_dense_fp8.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_training_loop_with_optax():
    train = runpy.run_path(str(EXAMPLES / "train_mlp_fp8.py"), run_name="example")["train"]
    losses, metas = train(steps=25)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.3 * losses[0], losses
    first, last = metas[0]["DenseGeneral_0"], metas[-1]["DenseGeneral_0"]
    # After one step every scale came from a real amax (it was 1 at init) ...
    for role in ("x", "kernel", "grad"):
        assert float(first[f"{role}_scale"][0]) != 1.0
    # ... and the weight and gradient scales keep following the training.
    assert float(first["kernel_scale"][0]) != float(last["kernel_scale"][0])
    assert float(first["grad_scale"][0]) != float(last["grad_scale"][0])
    assert np.count_nonzero(last["x_amax_history"]) == 3  # H - 1 amaxes, slot 0 cleared
