"""Clamped SwiGLU through PyTorch: the ops, te.LayerNormMLP / te.TransformerLayer with NVIDIA's
``activation="clamped_swiglu"`` and ``activation_params``, and te.ops.ClampedSwiGLU, against
torch's own clamp, sigmoid and autograd in float64 (the core's kernel itself is checked in
tests/common/test_clamped_swiglu.py)."""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._tolerances import FP8_EPS

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.module.layernorm_mlp import apply_activation

RECIPES = {"delayed": recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling()}
H, FFN = 64, 48
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def clamped_swiglu64(h, limit=7.0, alpha=1.702, offset=1.0):
    """torch's formula, parameters rounded to fp32 as the core takes them."""
    limit, alpha, offset = (torch.tensor(v, dtype=torch.float32).item()
                            for v in (limit, alpha, offset))
    a, b = h.double().chunk(2, dim=-1)
    g = a.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (b.clamp(-limit, limit) + offset)


def mlp64(mlp, x, **params):
    """The block in float64 from the module's parameters: (output, grads of x and params)."""
    p = {n: t.detach().double().requires_grad_() for n, t in mlp.named_parameters()}
    x = x.detach().double().requires_grad_()
    ln = torch.nn.functional.layer_norm(x, (H,), p["layer_norm_weight"], p["layer_norm_bias"],
                                        mlp.cfg.eps)
    h = torch.nn.functional.linear(ln, p["fc1_weight"], p["fc1_bias"])
    y = torch.nn.functional.linear(clamped_swiglu64(h, **params), p["fc2_weight"],
                                   p["fc2_bias"])
    return y, x, p


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_against_torch_autograd(device, dtype):
    torch.manual_seed(0)
    act = ops.activation.clamped_swiglu(0.75, 1.702, 0.5)
    h = (torch.randn(40, 2 * 24) * 1.5).to(dtype).to(device)
    h[0, :4] = 0.75  # at the bounds: the gradient passes there
    h[1, 24:28] = -0.75
    want_h = h.detach().double().cpu().requires_grad_()
    want = clamped_swiglu64(want_h, 0.75, 1.702, 0.5)
    dy = torch.randn(want.shape, dtype=torch.float64)
    want.backward(dy)
    got = ops.activation_forward(h, act)
    dx, dbias = ops.activation_backward(dy.to(dtype).to(device), h, act, True)
    # fp32: a few roundings; bf16: the output's own rounding (2^-9) and the rounded dy.
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double().cpu(), want.detach(), rtol=tol, atol=tol)
    want_dx = torch.autograd.grad(clamped_swiglu64(want_h, 0.75, 1.702, 0.5),
                                  want_h, dy.to(dtype).double())[0]
    torch.testing.assert_close(dx.double().cpu(), want_dx, rtol=tol, atol=tol)
    # dbias sums the unrounded fp32 values: within one tolerance per row of the exact sums
    torch.testing.assert_close(dbias.double().cpu(), want_dx.sum(0), rtol=tol,
                               atol=tol * h.shape[0])


def test_act_strings_carry_their_parameters():
    assert ops.activation.parse(ops.activation.clamped_swiglu()) == (
        "clamped_swiglu", (7.0, 1.702, 1.0))
    assert ops.activation.parse("swiglu") == ("swiglu", None)
    with pytest.raises(ValueError, match=r"activation_forward: act 'clamped_swiglu' needs its "
                                         r"parameters \('limit', 'alpha', 'linear_offset'\)"):
        ops.activation_forward(torch.randn(2, 4), "clamped_swiglu")
    with pytest.raises(ValueError, match=r"act 'gelu' takes no parameters"):
        ops.activation_forward(torch.randn(2, 4), "gelu:1.0")
    with pytest.raises(ValueError, match=r"clamped_swiglu: alpha must be a finite number > 0"):
        ops.activation.clamped_swiglu(alpha=float("nan"))


def _mlp(params, spread=8.0):
    torch.manual_seed(1)
    mlp = te.LayerNormMLP(H, FFN, activation="clamped_swiglu", activation_params=params,
                          device="cpu")
    with torch.no_grad():  # FC1's outputs spread over the clamps (limit 0.75 and 7)
        mlp.fc1_weight.mul_(spread)
    return mlp


@pytest.mark.parametrize("params", [None, {"limit": 0.75},
                                    {"alpha": 1.0, "glu_linear_offset": 0.0}],
                         ids=["defaults", "limit", "alpha_offset"])
def test_layernorm_mlp_high_precision_against_float64(params):
    mlp = _mlp(params)
    full = {"limit": 7.0, "alpha": 1.702, "offset": 1.0}
    for k, v in (params or {}).items():
        full["offset" if k == "glu_linear_offset" else k] = v
    x = torch.randn(32, H, requires_grad=True)
    g = torch.randn(32, H)
    (mlp(x) * g).sum().backward()
    want, x64, p64 = mlp64(mlp, x, **full)
    grads = torch.autograd.grad((want * g.double()).sum(), [x64, *p64.values()])
    torch.testing.assert_close(mlp(x).double(), want.detach(), rtol=1e-5, atol=1e-5)
    got = [x.grad, *[p.grad for p in mlp.parameters()]]
    for name, a, b in zip(["input", *p64], got, grads, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * b.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_layernorm_mlp_fp8_within_fp8_error(name):
    r = RECIPES[name]
    # FC1's outputs within a few units, mostly inside the clamps: where FP8's rounding moves
    # an output across a clamp its gradient jumps by O(1), which no FP8 bound covers (the
    # clamps themselves are checked in high precision above and bit for bit below).
    mlp = _mlp(None, spread=4.0)
    x = torch.randn(32, H, requires_grad=True)
    g = torch.randn(32, H) * 1e-2
    for _ in range(2):  # delayed: the second step quantizes with scales from amaxes
        x.grad = None
        mlp.zero_grad()
        with te.fp8_autocast(fp8_recipe=r):
            y = mlp(x)
        (y * g).sum().backward()
    want, x64, p64 = mlp64(mlp, x)
    grads = torch.autograd.grad((want * g.double()).sum(), [x64, *p64.values()])
    # As test_layernorm_mlp.py's FP8 checks: the error norms sit near one FP8 rounding of the
    # result's norm; a wrong activation or parameter errs by O(1).
    rel = ((y.double() - want).norm() / want.norm()).item()
    assert rel < 2 * FP8_EPS[r.fp8_format.fwd_dtype_name], rel
    for n, a, b in zip(["input", *p64], [x.grad, *[p.grad for p in mlp.parameters()]], grads,
                       strict=True):
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel < 3 * FP8_EPS[r.fp8_format.bwd_dtype_name], (n, rel)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_layernorm_mlp_fp8_is_bit_identical_to_the_unfused_te_modules(name):
    """The fused block's kernels write the FP8 bytes te.Linear's quantize makes of the core's
    activation (see test_layernorm_mlp.py for the same check of the other activations)."""
    r = RECIPES[name]
    mlp = _mlp({"limit": 0.75})
    norm, fc1, fc2 = (te.LayerNorm(H, device="cpu"), te.Linear(H, 2 * FFN, device="cpu"),
                      te.Linear(FFN, H, device="cpu"))
    with torch.no_grad():
        for dst, src in ((norm.weight, mlp.layer_norm_weight), (norm.bias, mlp.layer_norm_bias),
                         (fc1.weight, mlp.fc1_weight), (fc1.bias, mlp.fc1_bias),
                         (fc2.weight, mlp.fc2_weight), (fc2.bias, mlp.fc2_bias)):
            dst.copy_(src)
    x = torch.randn(32, H)
    g = torch.randn(32, H) * 1e-2
    for _ in range(2):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with te.fp8_autocast(fp8_recipe=r):
            fused = mlp(xs[0])
            unfused = fc2(apply_activation(fc1(norm(xs[1])), mlp._act))
        (fused * g).sum().backward()
        (unfused * g).sum().backward()
        assert torch.equal(fused, unfused)
        assert torch.equal(xs[0].grad, xs[1].grad)
        assert torch.equal(mlp.fc1_weight.grad, fc1.weight.grad)
        assert torch.equal(mlp.fc2_weight.grad, fc2.weight.grad)
        for m in (mlp, norm, fc1, fc2):
            m.zero_grad()


def test_transformer_layer_takes_activation_params():
    torch.manual_seed(0)
    layer = te.TransformerLayer(H, FFN, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                activation="clamped_swiglu", activation_params={"limit": 2.0},
                                device="cpu")
    assert layer.layernorm_mlp._act == ops.activation.clamped_swiglu(2.0)
    x = torch.randn(8, 2, H, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        y = layer(x)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_te_ops_clamped_swiglu_is_the_core_activation():
    x = torch.randn(6, 2 * 8) * 3
    op = te.ops.ClampedSwiGLU(limit=0.75, alpha=1.5)
    torch.testing.assert_close(op(x).double(), clamped_swiglu64(x, 0.75, 1.5), rtol=1e-6,
                               atol=1e-6)
    with pytest.raises(NotImplementedError, match="te.ops.ClampedSwiGLU: "
                                                  "cache_quantized_input=True is not supported"):
        te.ops.ClampedSwiGLU(cache_quantized_input=True)
    with pytest.raises(ValueError, match="te.ops.ClampedSwiGLU: a gated activation needs an "
                                         "even last dimension"):
        op(torch.randn(2, 5))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"activation": "gelu", "activation_params": {"limit": 1.0}}, ValueError,
     r"te.LayerNormMLP: activation_params apply to clamped_swiglu only; 'gelu' takes none"),
    ({"activation": "clamped_swiglu", "activation_params": {"beta": 1.0}}, ValueError,
     r"te.LayerNormMLP: activation_params of clamped_swiglu takes the keys \('limit', 'alpha', "
     r"'glu_linear_offset'\), got unknown \['beta'\]"),
    ({"activation": "clamped_swiglu", "activation_params": {"limit": -1.0}}, ValueError,
     r"te.LayerNormMLP: activation_params: clamped_swiglu: limit must be a finite number > 0, "
     r"got -1.0"),
    ({"activation": "clamped_swiglu", "activation_params": [7.0]}, TypeError,
     r"te.LayerNormMLP: activation_params must be a dict or None, got list"),
])
def test_bad_activation_params_are_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        te.LayerNormMLP(H, FFN, device="cpu", **kwargs)
    with pytest.raises(error, match=message.replace("te.LayerNormMLP", "te.TransformerLayer")):
        te.TransformerLayer(H, FFN, 4, device="cpu", **kwargs)
