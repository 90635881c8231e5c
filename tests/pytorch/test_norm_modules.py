"""te.LayerNorm and te.RMSNorm against torch's norms in float64: outputs and the gradients of
the input, weight and bias; zero-centered gamma, shapes, compilation, checkpoints, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from te_torch_tests._tolerances import COMPILE_RTOL, NORM_RTOL, assert_within

import transformer_engine.pytorch as te
from transformer_engine.pytorch import ops

_MODULES = {"layernorm": te.LayerNorm, "rmsnorm": te.RMSNorm}


def _make(norm: str, hidden: int, dtype, device, zero_centered_gamma=False, eps=1e-5):
    """A module with random parameters (the default ones and zeros would hide mistakes)."""
    module = _MODULES[norm](hidden, eps, zero_centered_gamma=zero_centered_gamma,
                            params_dtype=dtype, device=device)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.5 + (0 if p is module.bias
                                                                       else 0.3))
    return module


def _reference(module, x: torch.Tensor, dy: torch.Tensor):
    """float64 output and gradients by torch, and the magnitudes the errors are bounded by
    (see NORM_RTOL in _tolerances.py)."""
    n, eps = module.hidden_size, module.eps
    x64 = x.detach().double().requires_grad_()
    w64 = module.weight.detach().double().requires_grad_()
    g = w64 + 1 if module.zero_centered_gamma else w64
    layernorm = module.bias is not None
    if layernorm:
        b64 = module.bias.detach().double().requires_grad_()
        y = F.layer_norm(x64, (n,), g, b64, eps)
    else:
        y = F.rms_norm(x64, (n,), g, eps)
    dy64 = dy.double()
    y.backward(dy64)
    with torch.no_grad():
        xd = x.double()
        if layernorm:
            centered = xd - xd.mean(-1, keepdim=True)
            rsigma = (centered.square().mean(-1, keepdim=True) + eps).rsqrt()
        else:
            centered = xd
            rsigma = (xd.square().mean(-1, keepdim=True) + eps).rsqrt()
        xhat = centered * rsigma
        ax = xhat.abs() + 1
        gabs = g.detach().abs()
        mag_y = ax * gabs + (module.bias.detach().double().abs() if layernorm else 0)
        dyg = (dy64 * gabs).abs()
        mag_dx = rsigma * (dyg + dyg.mean(-1, keepdim=True)
                           + ax * (dyg * xhat.abs()).mean(-1, keepdim=True))
        mag_dg = (dy64.abs() * ax).reshape(-1, n).sum(0)
        mag_db = dy64.abs().reshape(-1, n).sum(0)
    ref = {"y": (y.detach(), mag_y), "grad_input": (x64.grad, mag_dx),
           "grad_weight": (w64.grad, mag_dg)}
    if layernorm:
        ref["grad_bias"] = (b64.grad, mag_db)
    return ref


def _check_against_reference(module, x, rtol, label):
    x = x.detach().requires_grad_()
    y = module(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    got = {"y": y, "grad_input": x.grad, "grad_weight": module.weight.grad}
    if module.bias is not None:
        got["grad_bias"] = module.bias.grad
        assert module.bias.grad.dtype == module.bias.dtype
    assert module.weight.grad.dtype == module.weight.dtype
    for name, (want, magnitude) in _reference(module, x, dy).items():
        assert_within(got[name], want, magnitude, rtol, f"{label} {name}")


@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc_gamma"])
@pytest.mark.parametrize("hidden", [1, 17, 33, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_matches_torch_in_float64(norm, dtype, hidden, zero_centered_gamma, device):
    """A rank-3 input in the parameters' dtype, random weight and bias."""
    module = _make(norm, hidden, dtype, device, zero_centered_gamma)
    x = (torch.randn(3, 7, hidden, device=device) * 2 + 0.5).to(dtype)
    _check_against_reference(module, x, NORM_RTOL[dtype], f"{norm} {dtype} N={hidden}")


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_bf16_input_with_fp32_parameters(norm, device):
    """fp32 parameters go to the kernels as they are: bf16 output, fp32 weight gradients."""
    module = _make(norm, 64, torch.float32, device, eps=1e-3)
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    _check_against_reference(module, x, NORM_RTOL[torch.bfloat16], f"{norm} mixed")


def test_parameters_of_another_dtype_are_cast_to_the_input():
    """bf16 parameters with an fp32 input: the kernels take gamma in fp32 or the input's
    dtype, so the module casts them, and autograd brings the gradient back to bf16."""
    module = _make("layernorm", 32, torch.bfloat16, "cpu")
    x = torch.randn(5, 32, requires_grad=True)
    y = module(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert module.weight.grad.dtype == torch.bfloat16
    assert module.bias.grad.dtype == torch.bfloat16
    want = F.layer_norm(x.detach(), (32,), module.weight.float(), module.bias.float())
    torch.testing.assert_close(y, want, rtol=NORM_RTOL[torch.float32], atol=1e-5)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_leading_dimensions_are_flattened(norm):
    """Rank 2, 3 and 4 views of the same rows give the same bits."""
    module = _make(norm, 24, torch.float32, "cpu")
    x = torch.randn(2, 3, 4, 24)
    flat = module(x.reshape(-1, 24))
    for shape in ((6, 4, 24), (2, 3, 4, 24)):
        out = module(x.reshape(shape))
        assert out.shape == shape
        assert torch.equal(out.reshape(-1, 24), flat)
    # A non-contiguous input is fine as well.
    t = torch.randn(24, 10).t()
    assert torch.equal(module(t), module(t.contiguous()))


def test_empty_input():
    module = _make("layernorm", 8, torch.float32, "cpu")
    x = torch.randn(0, 3, 8, requires_grad=True)
    y = module(x)
    assert y.shape == (0, 3, 8)
    y.sum().backward()
    assert torch.equal(module.weight.grad, torch.zeros(8))
    assert x.grad.shape == (0, 3, 8)


def test_parameters_and_defaults():
    ln = te.LayerNorm(16)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]
    assert torch.equal(ln.weight, torch.ones(16)) and torch.equal(ln.bias, torch.zeros(16))
    assert ln.weight.dtype == torch.get_default_dtype()
    assert ln.weight.device == (torch.device("cuda", torch.cuda.current_device())
                                if torch.cuda.is_available() else torch.device("cpu"))
    rms = te.RMSNorm(16, zero_centered_gamma=True, params_dtype=torch.bfloat16, device="cpu")
    assert [n for n, _ in rms.named_parameters()] == ["weight"] and rms.bias is None
    assert torch.equal(rms.weight, torch.zeros(16, dtype=torch.bfloat16))
    # With zero-centered gamma the fresh module is the plain norm (scale 1 + 0).
    x = torch.randn(4, 16)
    torch.testing.assert_close(rms(x.bfloat16()).float(),
                               F.rms_norm(x.bfloat16().double(), (16,), eps=1e-5).float(),
                               rtol=2.0**-8, atol=2.0**-8)
    sp = te.LayerNorm(16, device="cpu", sequence_parallel=True)
    assert sp.weight.sequence_parallel and sp.bias.sequence_parallel
    assert "LayerNorm" in te.__all__ and "RMSNorm" in te.__all__
    assert "16, eps=1e-05, zero_centered_gamma=True" in repr(rms)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_state_dict_round_trip(norm):
    module = _make(norm, 40, torch.float32, "cpu", zero_centered_gamma=True)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    fresh = _MODULES[norm](40, zero_centered_gamma=True, device="cpu")
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert sorted(fresh.state_dict()) == sorted(module.state_dict())
    x = torch.randn(3, 40)
    assert torch.equal(fresh(x), module(x))


def test_wrong_last_dimension_names_the_module_and_argument():
    with pytest.raises(ValueError, match=r"te\.LayerNorm: input must have hidden_size=16 as "
                                         r"its last dimension, got shape \[4, 8\]"):
        te.LayerNorm(16, device="cpu")(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"te\.RMSNorm: input must have hidden_size=16"):
        te.RMSNorm(16, device="cpu")(torch.tensor(1.0))
    with pytest.raises(TypeError, match=r"te\.RMSNorm: input must be float32"):
        te.RMSNorm(16, device="cpu")(torch.ones(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"te\.LayerNorm: hidden_size must be positive"):
        te.LayerNorm(0, device="cpu")


def test_compiled_forward_and_backward_match_eager():
    """torch.compile(fullgraph=True) traces both norms' custom ops (a graph break raises)."""
    torch._dynamo.reset()
    eager = torch.nn.Sequential(_make("layernorm", 48, torch.float32, "cpu"),
                                _make("rmsnorm", 48, torch.float32, "cpu",
                                      zero_centered_gamma=True))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True)
    x = torch.randn(2, 8, 48)
    target = torch.randn(2, 8, 48)
    results = []
    for model in (eager, compiled):
        inp = x.clone().requires_grad_()
        loss = (model(inp) * target).sum()
        loss.backward()
        results.append((loss.detach(), inp.grad, *(p.grad for p in model.parameters())))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=COMPILE_RTOL, atol=1e-6)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_custom_ops_pass_opcheck(norm):
    """Schemas, fake implementations and tracing of the two custom ops (torch.library)."""
    x, gamma = torch.randn(6, 20), torch.randn(20)
    beta = torch.randn(20) if norm == "layernorm" else None
    args = (x, gamma, beta, norm, 1e-5, True)
    torch.library.opcheck(ops.norm_forward.op, args)
    _, mu, rsigma = ops.norm_forward(*args)
    torch.library.opcheck(ops.norm_backward.op,
                          (torch.randn(6, 20), x, mu, rsigma, gamma, norm, True))


@pytest.mark.cuda
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_cuda_matches_cpu_bit_for_bit(norm):
    """norm.h sums in one fixed order on both devices: equal outputs and gradients."""
    from transformer_engine.common import core

    if not core().built_with_cuda():
        pytest.skip("this build of the core has no CUDA kernels")
    cpu = _make(norm, 1000, torch.bfloat16, "cpu", zero_centered_gamma=True)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(70, 1000).to(torch.bfloat16)
    dy = torch.randn(70, 1000).to(torch.bfloat16)
    results = []
    for module, device in ((cpu, "cpu"), (gpu, "cuda")):
        # detach: on the CPU .to() returns x itself, which must not become the graph's leaf.
        inp = x.to(device).detach().requires_grad_()
        out = module(inp)
        out.backward(dy.to(device))
        results.append([t.cpu() for t in (out, inp.grad, *(p.grad for p in module.parameters()))])
    names = ["output", "grad_input"] + [f"grad_{n}" for n, _ in cpu.named_parameters()]
    for name, got, want in zip(names, results[1], results[0], strict=True):
        diff = (got.float() - want.float()).abs()
        assert torch.equal(got, want), (
            f"{name}: {int((diff > 0).sum())} of {got.numel()} differ, max {diff.max().item()}")
