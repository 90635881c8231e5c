"""te.LayerNormLinear: against nn.LayerNorm / RMSNorm + nn.Linear in float64 (high precision
and, with the FP8 error bound carried through, every recipe), bit for bit against the unfused
te.LayerNorm + te.Linear in FP8, its options, state and errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from te_torch_tests import _reference as ref
from te_torch_tests._tolerances import (
    FP8_EPS,
    NORM_RTOL,
    assert_bounded,
    assert_within,
    fp8_error,
    gemm_error,
)

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPES = {
    "delayed": recipe.DelayedScaling(margin=1, amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}
# [B, S, K] -> N: 2 * 24 = 48 tokens; K = 160 leaves a ragged 1x128 block, N = 144 a tile.
B, S, K, N = 2, 24, 160, 144
NORM = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}


def _layer(normalization="LayerNorm", **kw):
    layer = te.LayerNormLinear(K, N, normalization=normalization, device="cpu", **kw)
    with torch.no_grad():  # gamma and beta away from their 1 / 0 start, so both matter
        layer.layer_norm_weight.add_(torch.randn(K) * 0.3)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.normal_(0.0, 0.3)
    return layer


def _step(layer, x, g, r=None, **kw):
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        y = layer(x, **kw)
    (y * g).sum().backward()
    return y


def _params(layer):
    return [p for p in layer.parameters()]


def ln_error(ln: torch.Tensor, gamma, beta, zero_centered_gamma: bool) -> torch.Tensor:
    """NORM_RTOL (fp32) of the norm's magnitude (|xhat| + 1) |g| + |beta| (_tolerances.py)."""
    g = gamma.detach().double() + (1.0 if zero_centered_gamma else 0.0)
    b = torch.zeros_like(g) if beta is None else beta.detach().double()
    return NORM_RTOL[torch.float32] * ((ln - b).abs() + g.abs() + b.abs())


def _reference(layer, x, g):
    """float64 output and gradients (input, then the parameters in order) of the unfused
    block, and (ln, weight) for the bounds."""
    params = [p.detach().double().requires_grad_() for p in layer.parameters()]
    gamma, beta, w, b = params if len(params) == 4 else (params[0], None, *params[1:])
    x64 = x.detach().double().requires_grad_()
    ln = ref.norm64(x64, gamma, beta, layer.cfg.norm, layer.cfg.eps,
                    layer.cfg.zero_centered_gamma)
    y = torch.nn.functional.linear(ln, w, b)
    grads = torch.autograd.grad((y * g.double()).sum(), [x64, *params])
    return y.detach(), grads, ln.detach(), w.detach()


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_high_precision_matches_the_unfused_block(normalization, zero_centered_gamma):
    layer = _layer(normalization, zero_centered_gamma=zero_centered_gamma)
    x = torch.randn(B, S, K, requires_grad=True)
    g = torch.randn(B, S, N)
    y = _step(layer, x, g)
    want, grads, ln, w = _reference(layer, x, g)
    # the norm's error goes through the GEMM, which adds its own (GEMM_RTOL of |ln| |w|)
    ln = ln.reshape(-1, K)
    e_ln = ln_error(ln, layer.layer_norm_weight, layer.layer_norm_bias, zero_centered_gamma)
    bound = gemm_error(ln, e_ln, w, torch.zeros_like(w), layer.bias.detach().double(),
                       torch.float32)
    assert_bounded(y.reshape(-1, N), want.reshape(-1, N), bound, "forward")
    # Gradients: the same two stages backwards; relative to the largest gradient element, as
    # the norm backward's magnitudes (sums of dy g xhat over the row) are of that order here.
    for got, exp, name in zip([x.grad, *[p.grad for p in _params(layer)]], grads,
                              ["input", "layer_norm_weight", "layer_norm_bias", "weight", "bias"]
                              if normalization == "LayerNorm" else
                              ["input", "layer_norm_weight", "weight", "bias"], strict=True):
        scale = exp.abs().max().expand_as(exp)
        assert_within(got, exp, scale, 1e-4, f"grad of {name}")


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fp8_forward_within_the_quantization_bound(name, normalization):
    r = RECIPES[name]
    layer = _layer(normalization)
    x = torch.randn(B, S, K, requires_grad=True)
    g = torch.randn(B, S, N) * 1e-2
    _step(layer, x, g, r)  # delayed: the second step quantizes with scales from amaxes
    for p in (x, *layer.parameters()):
        p.grad = None
    y = _step(layer, x, g, r)
    want, grads, ln, w = _reference(layer, x, g)
    fwd = r.fp8_format.fwd_dtype_name
    ln = ln.reshape(-1, K)
    e_ln = fp8_error(ln, ln_error(ln, layer.layer_norm_weight, layer.layer_norm_bias, False),
                     fwd)
    e_w = fp8_error(w, torch.zeros_like(w), fwd)
    bound = gemm_error(ln, e_ln, w, e_w, layer.bias.detach().double(), torch.float32)
    assert_bounded(y.reshape(-1, N), want.reshape(-1, N), bound, f"{name} forward")
    # The bound is the worst case, where every rounding errs its most in one direction; in
    # fact they are independent and cancel, and the error norm sits near FP8_EPS of the
    # output's norm (measured 0.6 to 0.9 of it). A wrong operand (transposed, unscaled, another
    # activation) errs by O(1) of it: 2 FP8_EPS tells them apart.
    rel = ((y.double() - want).norm() / want.norm()).item()
    assert rel < 2 * FP8_EPS[r.fp8_format.fwd_dtype_name], rel
    # Gradients, by the same norm check: each passes through one E5M2 (grad_output) and one
    # E4M3 (weight or ln_out) rounding, within 2 FP8_EPS[e5m2] (measured: under 0.5 of it).
    for got, exp in zip([x.grad, *[p.grad for p in layer.parameters()]], grads, strict=True):
        rel = ((got.double() - exp).norm() / exp.norm()).item()
        assert rel < 2 * FP8_EPS[r.fp8_format.bwd_dtype_name], rel


def _unfused(layer):
    """te.LayerNorm / te.RMSNorm + te.Linear holding the same parameters and FP8 state."""
    cls = te.LayerNorm if layer.cfg.norm == "layernorm" else te.RMSNorm
    norm = cls(K, eps=layer.cfg.eps, zero_centered_gamma=layer.cfg.zero_centered_gamma,
               device="cpu")
    linear = te.Linear(K, N, device="cpu")
    with torch.no_grad():
        norm.weight.copy_(layer.layer_norm_weight)
        if layer.layer_norm_bias is not None:
            norm.bias.copy_(layer.layer_norm_bias)
        linear.weight.copy_(layer.weight)
        linear.bias.copy_(layer.bias)
    return torch.nn.Sequential(norm, linear)


@pytest.mark.parametrize("name,dtype", [
    *[(n, torch.float32) for n in sorted(RECIPES)],
    ("current", torch.bfloat16), ("block", torch.bfloat16)])
def test_fp8_is_bit_identical_to_the_unfused_te_modules(name, dtype):
    """The fused norm writes the FP8 bytes that te.Linear's quantize makes of te.LayerNorm's
    output, so every output, gradient and delayed-scaling state agrees bit for bit. (Not
    with bf16 activations under delayed scaling, by design: the fused norm quantizes its
    fp32 output, te.LayerNorm's output is rounded to bf16 before te.Linear quantizes it.)"""
    r = RECIPES[name]
    layer = _layer("LayerNorm")
    unfused = _unfused(layer)
    layer, unfused = layer.to(dtype), unfused.to(dtype)
    x = torch.randn(B, S, K, dtype=dtype)
    g = (torch.randn(B, S, N) * 1e-2).to(dtype)
    for _ in range(2):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [_step(m, xi, g, r) for m, xi in zip((layer, unfused), xs, strict=True)]
        check = torch.equal
        assert check(ys[0], ys[1])
        assert check(xs[0].grad, xs[1].grad)
        for a, b in zip(_params(layer), _params(unfused), strict=True):
            assert check(a.grad, b.grad), a.shape
            a.grad = b.grad = None
        lin = unfused[1]
        for a, b in ((layer.amax_history_fwd, lin.amax_history_fwd),
                     (layer.scale_fwd, lin.scale_fwd), (layer.amax_history_bwd,
                                                        lin.amax_history_bwd),
                     (layer.scale_bwd, lin.scale_bwd)):
            assert check(a, b)


def test_returned_layernorm_output_and_bias():
    layer = _layer("LayerNorm", return_layernorm_output=True, return_bias=True)
    plain = copy.deepcopy(layer)
    plain.return_bias, plain.cfg = False, plain.cfg._replace(return_ln_out=False)
    x = torch.randn(B, S, K, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    r = RECIPES["current"]
    with te.fp8_autocast(fp8_recipe=r):
        out, bias, ln_out = layer(x)
        ref_out = plain(x2)
    assert bias is layer.bias
    assert torch.equal(out + bias, ref_out)
    gamma, beta = layer.layer_norm_weight, layer.layer_norm_bias
    want_ln = ref.norm64(x, gamma, beta, "layernorm", 1e-5)
    torch.testing.assert_close(ln_out.double(), want_ln, rtol=1e-5, atol=1e-5)
    # ln_out's gradient joins the block's: d/dx of sum(ln_out) goes into x.grad
    (out.sum() + ln_out.square().sum()).backward()
    x3 = x.detach().clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y3 = plain(x3)
    ln3 = te.LayerNorm(K, device="cpu")
    with torch.no_grad():
        ln3.weight.copy_(gamma)
        ln3.bias.copy_(beta)
    (y3.sum() + ln3(x3).square().sum()).backward()
    torch.testing.assert_close(x.grad, x3.grad, rtol=1e-5, atol=1e-6)


def test_zero_centered_gamma_stores_gamma_minus_one():
    layer = te.LayerNormLinear(K, N, zero_centered_gamma=True, device="cpu")
    assert torch.equal(layer.layer_norm_weight, torch.zeros(K))
    plain = te.LayerNormLinear(K, N, device="cpu")
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        plain.layer_norm_weight.add_(1.0)
    x = torch.randn(48, K)
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-6, atol=1e-6)


def test_state_dict_round_trip_into_a_fresh_module():
    layer = _layer("RMSNorm")
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        layer(torch.randn(48, K)).sum().backward()
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    fresh = te.LayerNormLinear(K, N, normalization="RMSNorm", device="cpu")
    fresh.load_state_dict(torch.load(buf))
    assert "layer_norm_bias" not in dict(fresh.named_parameters())
    for (name, a), b in zip(fresh.state_dict().items(), layer.state_dict().values(),
                            strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
    for key in ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd"):
        assert torch.equal(getattr(fresh, key), getattr(layer, key)), key
    mlp_state = te.LayerNormMLP(K, 32, device="cpu").get_extra_state()
    with pytest.raises(ValueError, match="must have 2 columns"):
        fresh.set_extra_state(mlp_state)


def test_fp8_model_init_keeps_fp8_weights():
    with te.fp8_model_init():
        layer = te.LayerNormLinear(K, N, device="cpu")
    assert type(layer.weight) is te.Float8Tensor
    assert type(layer.layer_norm_weight) is torch.nn.Parameter  # the norm stays high precision
    x = torch.randn(48, K, requires_grad=True)
    with te.fp8_autocast():
        layer(x).sum().backward()
    assert torch.isfinite(x.grad).all() and layer.weight.grad is not None


def test_parameters_split():
    layer = te.LayerNormLinear(K, 96, parameters_split=("q", "k", "v"), device="cpu")
    assert {n for n, _ in layer.named_parameters()} == {
        "layer_norm_weight", "layer_norm_bias", "q_weight", "k_weight", "v_weight", "q_bias",
        "k_bias", "v_bias"}
    with te.fp8_autocast(fp8_recipe=RECIPES["block"]):
        y = layer(torch.randn(48, K))
    assert y.shape == (48, 96)


def test_bad_inputs_give_clear_errors():
    layer = te.LayerNormLinear(K, N, device="cpu")
    with pytest.raises(ValueError, match=r"te.LayerNormLinear: input must have 160 features"):
        layer(torch.randn(4, 8))
    with pytest.raises(TypeError, match="input must be float32, bfloat16 or float16"):
        layer(torch.ones(4, K, dtype=torch.int32))
    with te.fp8_autocast():  # any token count (padded inside); features keep the rule
        assert layer(torch.randn(10, K)).shape == (10, N)
    with te.fp8_autocast(), pytest.raises(ValueError, match="out_features must be a multiple"):
        te.LayerNormLinear(K, 24, device="cpu")(torch.randn(16, K))
    with pytest.raises(ValueError, match="normalization must be one of"):
        te.LayerNormLinear(K, N, normalization="BatchNorm")
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        te.LayerNormLinear(K, N, tp_size=0)
