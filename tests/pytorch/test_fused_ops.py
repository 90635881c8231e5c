"""The fused custom ops under te.LayerNormLinear / te.LayerNormMLP: activations (high
precision and FP8, forward and backward with dbias) and the norm with FP8 output.

Each FP8 output is checked bit for bit against torch's own float8 cast of the op's fp32
high-precision result with the same scale (the core quantizes by the same rule), the
column-wise copy against its transpose; on CUDA every output must equal the CPU's bit for bit
(activation.h, norm.h). The fake implementations must give the real outputs' shapes and
dtypes. The kernels' numerics against formulas are tested in tests/common."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from transformer_engine.pytorch import ops
from transformer_engine.pytorch.ops._backend import TORCH_FP8

ACTS = ["identity", "gelu", "relu", "silu", "qgelu", "srelu", "geglu", "swiglu", "reglu",
        "qgeglu", "sreglu", "glu"]
GATED = ("geglu", "swiglu", "reglu", "qgeglu", "sreglu", "glu")
E4M3, E5M2 = "float8_e4m3", "float8_e5m2"
M, N = 40, 72  # no multiple of the CUDA kernels' tiles


def _fp8(data: torch.Tensor, fp8_dtype: str) -> torch.Tensor:
    return data.view(TORCH_FP8[fp8_dtype]).float()


def _want_fp8(v: torch.Tensor, scale: float, fp8_dtype: str) -> torch.Tensor:
    fmax = 448.0 if fp8_dtype == E4M3 else 57344.0
    return (v.float() * scale).clamp(-fmax, fmax).to(TORCH_FP8[fp8_dtype]).float()


def _input(act, device):
    cols = 2 * N if act in GATED else N
    return (torch.randn(M, cols) * 3).to(device)


@pytest.mark.parametrize("act", ACTS)
def test_activation_fp8_forward_is_the_cast_of_the_high_precision_one(act, device):
    x = _input(act, device)
    scale = torch.tensor([5.0], device=device)
    hp = ops.activation_forward(x, act)
    data, col, scale_inv, amax = ops.activation_forward_fp8(x, act, scale, E4M3, True, True)
    assert hp.shape == (M, N) and data.shape == (M, N) and col.shape == (N, M)
    assert torch.equal(_fp8(data, E4M3), _want_fp8(hp, 5.0, E4M3))
    assert torch.equal(col.t(), data)
    assert amax.item() == hp.abs().max().item()
    assert scale_inv.item() == torch.tensor(1.0, dtype=torch.float32).div(5.0).item()
    if device.type == "cuda":
        cpu = ops.activation_forward_fp8(x.cpu(), act, scale.cpu(), E4M3, True, True)
        for a, b in zip((data, col, scale_inv, amax), cpu, strict=True):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("act", ACTS)
def test_activation_fp8_backward_is_the_cast_with_the_bias_gradient(act, device):
    x = _input(act, device)
    dy = torch.randn(M, N, device=device)
    scale = torch.tensor([64.0], device=device)
    dx, dbias = ops.activation_backward(dy, x, act, True)
    data, col, sinv, amax, dbias8 = ops.activation_backward_fp8(dy, x, act, scale, E5M2, True,
                                                                True, True)
    assert torch.equal(_fp8(data, E5M2), _want_fp8(dx, 64.0, E5M2))
    assert torch.equal(col.t(), data) and amax.item() == dx.abs().max().item()
    assert torch.equal(dbias, dbias8) and dbias.dtype == torch.float32
    # fp32 column sums of M = 40 terms, in the core's order against torch's
    torch.testing.assert_close(dbias, dx.sum(0), rtol=0, atol=M * 2.0**-23 * dx.abs().max())
    _, _, _, _, none = ops.activation_backward_fp8(dy, x, act, scale, E5M2, False, True, False)
    assert none.numel() == 0
    if device.type == "cuda":
        cpu = ops.activation_backward_fp8(dy.cpu(), x.cpu(), act, scale.cpu(), E5M2, True,
                                          True, True)
        for a, b in zip((data, col, sinv, amax, dbias8), cpu, strict=True):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norm_fp8_output_is_the_cast_of_the_high_precision_one(norm, device):
    x = torch.randn(M, N, device=device) * 2 + 0.5
    gamma = torch.randn(N, device=device)
    beta = torch.randn(N, device=device) if norm == "layernorm" else None
    scale = torch.tensor([16.0], device=device)
    y, mu, rsigma = ops.norm_forward(x, gamma, beta, norm, 1e-5, False)
    out = ops.norm_forward_fp8(x, gamma, beta, norm, 1e-5, False, scale, E4M3, True, True)
    y8, data, col, scale_inv, amax, mu8, rsigma8 = out
    assert torch.equal(y8, y) and torch.equal(mu8, mu) and torch.equal(rsigma8, rsigma)
    assert torch.equal(_fp8(data, E4M3), _want_fp8(y, 16.0, E4M3))
    assert torch.equal(col.t(), data) and amax.item() == y.abs().max().item()
    assert scale_inv.item() == 1 / 16.0
    y_none, data_only, col_none = ops.norm_forward_fp8(x, gamma, beta, norm, 1e-5, False, scale,
                                                       E4M3, False, False)[:3]
    assert y_none.numel() == 0 and col_none.numel() == 0 and torch.equal(data_only, data)
    if device.type == "cuda":
        cpu = ops.norm_forward_fp8(x.cpu(), gamma.cpu(), None if beta is None else beta.cpu(),
                                   norm, 1e-5, False, scale.cpu(), E4M3, True, True)
        for a, b in zip(out, cpu, strict=True):
            assert torch.equal(a.cpu(), b)


def _calls(x, dy, h, scale, gamma, beta):
    return [
        lambda: ops.activation_forward(h, "swiglu"),
        lambda: ops.activation_forward_fp8(h, "swiglu", scale, E4M3, True, False),
        lambda: ops.activation_backward(dy, h, "swiglu", True),
        lambda: ops.activation_backward_fp8(dy, h, "swiglu", scale, E5M2, False, True, True),
        lambda: ops.norm_forward_fp8(x, gamma, beta, "layernorm", 1e-5, True, scale, E4M3,
                                     True, True),
    ]


def test_fake_implementations_give_the_real_shapes():
    def tensors():
        return (torch.randn(M, N), torch.randn(M, N), torch.randn(M, 2 * N),
                torch.ones(1), torch.randn(N), torch.randn(N))

    real = [call() for call in _calls(*tensors())]
    with FakeTensorMode() as mode:
        fake_in = [mode.from_tensor(t) for t in tensors()]
        fake = [call() for call in _calls(*fake_in)]
    for r, f in zip(real, fake, strict=True):
        r, f = (r, f) if isinstance(r, tuple) else ((r,), (f,))
        assert [(t.shape, t.dtype) for t in r] == [(t.shape, t.dtype) for t in f]


def test_bad_arguments_give_clear_errors():
    x = torch.randn(4, 7)
    with pytest.raises(ValueError, match="activation_forward: act must be one of"):
        ops.activation_forward(x, "tanh")
    with pytest.raises(ValueError, match="needs an even number of input columns"):
        ops.activation_forward(x, "swiglu")
    with pytest.raises(ValueError, match=r"grad_output must be \[4, 7\]"):
        ops.activation_backward(torch.randn(4, 6), x, "gelu", False)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        ops.activation_forward_fp8(x, "gelu", torch.ones(1), "float8", True, False)
    with pytest.raises(ValueError, match="rowwise or columnwise must be True"):
        ops.activation_forward_fp8(x, "gelu", torch.ones(1), E4M3, False, False)
    with pytest.raises(ValueError, match="norm_forward_fp8: RMSNorm takes no beta"):
        ops.norm_forward_fp8(x, torch.ones(7), torch.ones(7), "rmsnorm", 1e-5, False,
                             torch.ones(1), E4M3, True, False)
