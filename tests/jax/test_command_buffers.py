"""Our CUDA custom calls inside XLA's command buffers (CUDA graphs).

The CUDA handlers (all but the activation backward's and the grouped GEMM's) are declared
compatible with command buffers, so XLA records them, by stream capture, into the CUDA graphs
it replays at every step. A call that could not be captured, or that captured a node XLA
cannot embed (an allocation), fails the step; one whose host decisions depended on the data
would replay the wrong work. So on the GPU: three FP8 training steps of a layer (GEMMs, norms,
quantization, attention, activations, the delayed-scaling update) give the same bits with
command buffers on (XLA's default) as with them off. XLA reads its flags once, when the
backend starts: each run is a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

_SCRIPT = Path(__file__).resolve().parent / "_command_buffer_step.py"


def _run_step(tmp_path: Path, name: str, xla_flags: str) -> dict:
    out, text = tmp_path / f"{name}.npz", tmp_path / f"{name}.txt"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip(),
               JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, str(_SCRIPT), str(out), str(text)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as arrays:
        return dict(arrays)


def test_fp8_step_in_command_buffers_equals_the_step_without(tmp_path):
    on = _run_step(tmp_path, "on", "")
    off = _run_step(tmp_path, "off", "--xla_gpu_enable_command_buffer=")
    assert on.keys() == off.keys()
    for key in on:
        np.testing.assert_array_equal(on[key], off[key], err_msg=key)
