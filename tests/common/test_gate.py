"""The gate slot (tensor.h): an amax-producing op that runs only while its gate holds 0.

Delayed scaling's first step needs a tensor's amax before its cast; a compiled caller that
cannot see on the host whether the amax history is empty runs the op once more with the
history's max as the gate. Checked here for every gated op, on the CPU and (cuda marker) on
the GPU: an open gate (0) gives exactly the ungated call's results, a shut one (nonzero)
writes amax = 0 and leaves every other output as it was; the combinations a gate cannot
serve are refused with the op's message.
"""

from __future__ import annotations

import numpy as np
import pytest

from transformer_engine.common import _core as core

F32 = np.float32
SENTINEL = 0x5A


def _gate(device, value):
    return device.put(np.array([value], F32))


def _amax_call(device, x, gate):
    amax = device.put(np.array([-7.0], F32))
    core.compute_amax(device.put(x), core.Tensor(amax=amax, gate=gate), stream=device.stream)
    return {"amax": device.get(amax)}


def _fp8_out(device, rows, cols, fmt=core.DType.float8_e4m3):
    arrays = {
        "data": device.put(np.full((rows, cols), SENTINEL, np.uint8)),
        "scale": device.put(np.array([2.0], F32)),
        "scale_inv": device.put(np.array([-1.0], F32)),
        "amax": device.put(np.array([-7.0], F32)),
    }
    return arrays, fmt


def _read(device, arrays):
    return {k: device.get(v) for k, v in arrays.items() if k != "scale"}


def _norm_call(device, x, gate):
    rows, cols = x.shape
    arrays, fmt = _fp8_out(device, rows, cols)
    mu = device.put(np.full(rows, 7.0, F32))
    rs = device.put(np.full(rows, 7.0, F32))
    gamma = device.put(np.linspace(0.5, 1.5, cols).astype(F32))
    beta = device.put(np.linspace(-0.1, 0.1, cols).astype(F32))
    q = core.Tensor(dtype=fmt, gate=gate, **arrays)
    core.norm_forward(core.Norm.layernorm, device.put(x), gamma, beta, output_fp8=q, mu=mu,
                      rsigma=rs, eps=1e-5, stream=device.stream)
    got = _read(device, arrays)
    got.update(mu=device.get(mu), rsigma=device.get(rs))
    return got


def _act_forward_call(device, x, gate):
    arrays, fmt = _fp8_out(device, *x.shape)
    out = core.Tensor(dtype=fmt, gate=gate, **arrays)
    core.activation_forward(core.Activation.gelu, device.put(x), out, stream=device.stream)
    return _read(device, arrays)


def _act_backward_call(device, x, gate):
    arrays, _ = _fp8_out(device, *x.shape)
    g = core.Tensor(dtype=core.DType.float8_e5m2, gate=gate, **arrays)
    dy = (x[::-1] * 1e-6).copy()
    core.activation_backward(core.Activation.gelu, device.put(dy), device.put(x), g,
                             stream=device.stream)
    return _read(device, arrays)


CALLS = {"compute_amax": _amax_call, "norm_forward": _norm_call,
         "activation_forward": _act_forward_call, "activation_backward": _act_backward_call}


def _ungated(device, call, x):
    return call(device, x, None)


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("shape", [(16, 64), (33, 40), (0, 16)])
def test_open_gate_is_the_ungated_call(device, op, shape):
    x = np.random.default_rng(list(shape)).standard_normal(shape).astype(F32) * 3
    want = _ungated(device, CALLS[op], x)
    got = CALLS[op](device, x, _gate(device, 0.0))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{op}: {k}")
    assert want["amax"][0] == np.float32(np.abs(x).max(initial=0.0)) or op != "compute_amax"


@pytest.mark.parametrize("op", list(CALLS))
@pytest.mark.parametrize("gate", [1.0, 1e-30, -2.0, float("nan"), float("inf")])
def test_shut_gate_writes_only_a_zero_amax(device, op, gate):
    x = np.random.default_rng(5).standard_normal((32, 64)).astype(F32)
    got = CALLS[op](device, x, _gate(device, gate))
    assert got["amax"][0] == 0.0
    for k, v in got.items():
        if k == "amax":
            continue
        sentinel = SENTINEL if v.dtype == np.uint8 else (-1.0 if k == "scale_inv" else 7.0)
        assert np.all(v == sentinel), f"{op}: {k} was written behind a shut gate"


def test_gate_is_refused_where_it_cannot_serve():
    x = np.ones((4, 8), F32)
    g = np.zeros(1, F32)
    with pytest.raises(ValueError,
                       match=r"^compute_amax: output.gate must have 1 element, got float32 \[2\]"):
        core.compute_amax(x, core.Tensor(amax=np.zeros(1, F32), gate=np.zeros(2, F32)))
    with pytest.raises(TypeError, match=r"^compute_amax: output.gate must be float32"):
        core.compute_amax(x, core.Tensor(amax=np.zeros(1, F32), gate=np.zeros(1, np.float16)))
    fp8 = dict(dtype=core.DType.float8_e4m3, scale=np.ones(1, F32), scale_inv=np.ones(1, F32))
    with pytest.raises(ValueError, match=r"^activation_forward: output.gate needs output.amax"):
        core.activation_forward(core.Activation.gelu, x,
                                core.Tensor(np.zeros((4, 8), np.uint8), gate=g, **fp8))
    with pytest.raises(ValueError, match=r"^activation_forward: output.gate needs accumulate_amax"):
        core.activation_forward(core.Activation.gelu, x,
                                core.Tensor(np.zeros((4, 8), np.uint8), gate=g,
                                            amax=np.zeros(1, F32), **fp8),
                                accumulate_amax=True)
    with pytest.raises(ValueError, match=r"^activation_backward: grad_input.gate allows no"):
        core.activation_backward(core.Activation.gelu, x, x,
                                 core.Tensor(np.zeros((4, 8), np.uint8), gate=g,
                                             amax=np.zeros(1, F32), **fp8),
                                 dbias=np.zeros(8, F32))
    with pytest.raises(ValueError, match=r"^norm_forward: output_fp8.gate allows no"):
        core.norm_forward(core.Norm.rmsnorm, x, np.ones(8, F32), None,
                          output_fp8=core.Tensor(np.zeros((4, 8), np.uint8),
                                                 columnwise_data=np.zeros((8, 4), np.uint8),
                                                 gate=g, amax=np.zeros(1, F32), **fp8),
                          rsigma=np.zeros(4, F32))
