"""XLA's command buffers (CUDA graphs) around our FFI handlers (GPU).

The CUDA handlers are marked compatible with command buffers (jax/src/ffi_common.h): where XLA
forms command buffers with custom calls, it captures ours with the fusions around them into
CUDA graphs. The same FP8 training steps with command buffers forced on for every kind of call
(at the smallest graph size) and turned off must give the same bits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

SCRIPT = Path(__file__).with_name("_graph_steps_script.py")
ON = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
      "--xla_gpu_graph_min_graph_size=1")
OFF = "--xla_gpu_enable_command_buffer="  # an empty list turns them off


def _run(tmp_path: Path, name: str, flags: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    out = tmp_path / f"{name}.npz"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as arrays:
        return dict(arrays)


def test_fp8_steps_in_cuda_graphs_equal_the_steps_launched_op_by_op(tmp_path):
    graphed = _run(tmp_path, "graphed", ON)
    plain = _run(tmp_path, "plain", OFF)
    assert graphed.keys() == plain.keys()
    for key in graphed:
        np.testing.assert_array_equal(graphed[key], plain[key], err_msg=key)
    assert np.all(np.isfinite(graphed["loss"])) and graphed["loss"][-1] < graphed["loss"][0]
