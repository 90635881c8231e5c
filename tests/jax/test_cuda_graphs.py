"""XLA's command buffers (CUDA graphs) around our FFI handlers.

The CUDA handlers are marked compatible with command buffers (jax/src/ffi_common.h), so XLA
captures them with the fusions around them into CUDA graphs. On the GPU: the same FP8 training
steps with command buffers on and off give the same bits, and the graphs do hold our calls.
On the CPU: the reading of command buffers from compiled HLO.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from transformer_engine.jax import hlo

SCRIPT = Path(__file__).with_name("_graph_steps_script.py")

HLO = """HloModule m

%command_buffer (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %q = f32[4]{0} custom-call(%p0), custom_call_target="te_quantize_ffi"
  ROOT %g = f32[4]{0} custom-call(%q), custom_call_target="te_gemm_ffi"
}

%command_buffer.1 (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %g = f32[4]{0} custom-call(%p0), custom_call_target="te_gemm_ffi"
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %d = f32[4]{0} custom-call(%a), custom_call_target="te_activation_backward_dbias_ffi"
  %c = f32[4]{0} call(%d), to_apply=%command_buffer
  ROOT %r = f32[4]{0} call(%c), to_apply=%command_buffer.1
}
"""


def test_command_buffer_targets_reads_the_outlined_computations():
    assert hlo.command_buffer_targets(HLO) == {"te_quantize_ffi": 1, "te_gemm_ffi": 2}
    assert hlo.command_buffer_targets(HLO.replace("command_buffer", "fused")) == {}


def _run(tmp_path: Path, name: str, command_buffers: bool) -> tuple[dict, dict]:
    env = dict(os.environ)
    if not command_buffers:  # an empty list turns XLA's command buffers off
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    out = tmp_path / f"{name}.npz"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as arrays:
        result = dict(arrays)
    return result, json.loads(out.with_suffix(".json").read_text())


@pytest.mark.cuda
def test_fp8_steps_in_cuda_graphs_equal_the_steps_launched_op_by_op(tmp_path):
    graphed, info = _run(tmp_path, "graphed", True)
    plain, plain_info = _run(tmp_path, "plain", False)
    # Our handlers were captured: the GEMMs, casts, norms and the scale update, not the
    # activation's backward with dbias (it allocates, so it stays out).
    captured = info["captured"]
    for target in ("te_gemm_ffi", "te_norm_forward_ffi", "te_norm_backward_ffi",
                   "te_delayed_scaling_update_ffi"):
        assert captured.get(target, 0) > 0, (target, info)
    assert "te_activation_backward_dbias_ffi" not in captured, info
    assert plain_info["captured"] == {}, plain_info
    assert graphed.keys() == plain.keys()
    for key in graphed:
        np.testing.assert_array_equal(graphed[key], plain[key], err_msg=key)
    assert np.all(np.isfinite(graphed["loss"])) and graphed["loss"][-1] < graphed["loss"][0]
