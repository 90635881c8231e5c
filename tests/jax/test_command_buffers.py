"""Our CUDA custom calls inside XLA's command buffers (CUDA graphs).

The CUDA handlers are declared compatible with command buffers, so XLA records them into the
CUDA graphs of the ops around them and replays those at every step instead of running each
handler on the host. On the GPU: the calls of an FP8 layer step are inside command buffers,
and three steps give the same bits as with command buffers off (XLA's flag, read when the
backend starts: each run is a fresh process). On the CPU: the HLO reader that says which calls
are inside.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from transformer_engine.jax import hlo

_SCRIPT = Path(__file__).resolve().parent / "_command_buffer_step.py"

_TEXT = """HloModule step

command_buffer {
  p = f32[4]{0} parameter(0)
  a = f32[4]{0} custom-call(p), custom_call_target="te_gemm_ffi"
  b = f32[4]{0} custom-call(a), custom_call_target="te_gemm_ffi"
}

%command_buffer.1 (p: f32[4]) -> f32[4] {
  c = f32[4]{0} custom-call(p), custom_call_target="te_quantize_ffi"
}

ENTRY %main (x: f32[4]) -> f32[4] {
  d = f32[4]{0} custom-call(x), custom_call_target="te_grouped_gemm_ffi"
  e = f32[4]{0} call(d), to_apply=command_buffer
}
"""


def test_command_buffer_targets_counts_the_calls_inside_command_buffers_only():
    assert hlo.command_buffer_targets(_TEXT) == {"te_gemm_ffi": 2, "te_quantize_ffi": 1}
    assert hlo.target_counts(_TEXT)["te_grouped_gemm_ffi"] == 1


def _run_step(tmp_path: Path, name: str, xla_flags: str) -> tuple[dict, str]:
    out, text = tmp_path / f"{name}.npz", tmp_path / f"{name}.txt"
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip(),
               JAX_PLATFORMS="cuda", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, str(_SCRIPT), str(out), str(text)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    with np.load(out) as arrays:
        return dict(arrays), text.read_text()


@pytest.mark.cuda
def test_fp8_step_in_command_buffers_equals_the_step_without(tmp_path):
    on, on_text = _run_step(tmp_path, "on", "")
    off, off_text = _run_step(tmp_path, "off", "--xla_gpu_enable_command_buffer=")
    inside = hlo.command_buffer_targets(on_text)
    ours = {t: n for t, n in hlo.target_counts(on_text).items() if t.startswith("te_")}
    # Each kind of call of ours is recorded (GEMMs, norms, quantization, attention, the
    # delayed-scaling update): a kind missing would mean its handler lost the trait.
    assert {t for t in ours if inside.get(t, 0) == 0} == set(), (inside, ours)
    assert not hlo.command_buffer_targets(off_text)
    assert on.keys() == off.keys()
    for key in on:
        np.testing.assert_array_equal(on[key], off[key], err_msg=key)
