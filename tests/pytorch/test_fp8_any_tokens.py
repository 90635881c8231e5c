"""FP8 modules take any token count: the GEMMs' FP8 operands are padded to the tensor cores'
granule of 16 inside (linear_fn.pad_gemm_operands), while the feature dimensions keep their
rule of multiples of 16 with a clear error.

The reference of a run on T tokens is the same module (a copy) on P = T rounded up to 16
tokens, a shape the GEMMs take without padding: the input's extra rows repeat its last row,
so every amax and scale (after a LayerNorm, after GELU, by blocks) is that of the T real
rows, and the output gradient's extra rows are zeros, so they add exact zeros to the weight
and bias gradients. The first T rows of that run (and its gradients and FP8 state) must
equal the T-token run bit for bit. A wrong padding (zero rows before the norm, say) or a
padded row leaking into a sum makes them differ. Besides, the outputs stay within FP8 error
of the high-precision module, and the amax recorded for the input is that of the T rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import ops
from transformer_engine.pytorch.linear_fn import fp8_gemm
from transformer_engine.pytorch.quantization import make_plan, quantize

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling}
TOKENS = [1, 8, 17, 1000]
K, N = 32, 48  # features (multiples of 16); LayerNormMLP: hidden K, ffn N * 2
_STATE = ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd", "scale_inv_bwd")


def _module(kind: str, device) -> torch.nn.Module:
    if kind == "Linear":
        m = te.Linear(K, N, device=device)
    elif kind == "LayerNormLinear":
        m = te.LayerNormLinear(K, N, device=device)
    else:
        m = te.LayerNormMLP(K, 2 * N, device=device)
    with torch.no_grad():  # non-trivial norm parameters and biases: a zero row's LN or GELU
        for p in m.parameters():  # is then not zero
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 1 / K ** 0.5))
            if p.dim() == 1:
                p.add_(0.5)
    return m


def _shape(tokens: int) -> tuple:
    return (8, 125) if tokens == 1000 else (tokens,)  # 1000 also through leading dims


def _step(m, x, dy, fp8_recipe):
    x = x.detach().requires_grad_()
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        y = m(x)
        first_amax = m.amax_history_fwd[0, 0].clone()  # before the exit's update moves it
    y.backward(dy)
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads, first_amax


def _check_module(kind: str, scaling: str, tokens: int, device) -> None:
    fp8_recipe = RECIPES[scaling]()
    m = _module(kind, device)
    ref = copy.deepcopy(m)
    n_out = m(torch.zeros(1, K, device=device)).shape[-1]
    padded = -(-tokens // 16) * 16
    for _ in range(2):  # delayed scaling: the second step runs with the first step's scales
        x = torch.randn(*_shape(tokens), K, device=device) * 2
        dy = torch.randn(*_shape(tokens), n_out, device=device)
        y, dx, grads, amax = _step(m, x, dy, fp8_recipe)
        # The reference's extra rows: the last real row again (input), zeros (gradient).
        x2, dy2 = x.reshape(tokens, K), dy.reshape(tokens, n_out)
        x_ref = torch.cat([x2, x2[-1:].expand(padded - tokens, K)])
        dy_ref = torch.cat([dy2, dy2.new_zeros(padded - tokens, n_out)])
        y_ref, dx_ref, grads_ref, _ = _step(ref, x_ref, dy_ref, fp8_recipe)
        assert torch.equal(y.reshape(tokens, n_out), y_ref[:tokens])
        assert torch.equal(dx.reshape(tokens, K), dx_ref[:tokens])
        for g, g_ref in zip(grads, grads_ref, strict=True):
            assert torch.equal(g, g_ref)
        for name in _STATE:
            assert torch.equal(getattr(m, name), getattr(ref, name)), name
        if scaling == "delayed" and kind == "Linear":
            assert amax.item() == x.abs().max().item()
    with torch.no_grad():  # the last step's output against high precision
        y_hp = m(x)
    assert ((y - y_hp).abs().max() / y_hp.abs().max()).item() < 0.25


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_any_token_count_equals_the_padded_run(kind, scaling, tokens):
    _check_module(kind, scaling, tokens, torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [17, 1000])
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_cuda_any_token_count_equals_the_padded_run(kind, scaling, tokens):
    from transformer_engine.common import core

    if not core().built_with_cuda():
        pytest.skip("this build of the core has no CUDA kernels")
    _check_module(kind, scaling, tokens, torch.device("cuda", torch.cuda.current_device()))


@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("m, k", [(17, 32), (1000, 64), (32, 1000), (1, 17)])
def test_gemm_pads_by_hand(scaling, m, k):
    """fp8_gemm on any M and K against the plain GEMM op fed operands padded by hand: the
    quantized rows with FP8 zero rows below (block scale_inv 1 for them) and zero columns
    after K."""
    plan = make_plan(RECIPES[scaling]())
    a = quantize(plan, "grad_output", torch.randn(m, k), True, False,
                 torch.ones(1), 0, torch.zeros(1, 1))
    b = quantize(plan, "weight", torch.randn(48, k), True, False,
                 torch.ones(1), 0, torch.zeros(1, 1))
    got = fp8_gemm(a.data, a.scale_inv, b.data, b.scale_inv, a.fp8_dtype, b.fp8_dtype,
                   a.mode, b.mode, torch.float32, None, True)
    pm, pk = -(-m // 16) * 16, -(-k // 16) * 16
    a_data, b_data = torch.zeros(pm, pk, dtype=torch.uint8), torch.zeros(48, pk, dtype=torch.uint8)
    a_data[:m, :k], b_data[:, :k] = a.data, b.data
    a_sinv = a.scale_inv
    if a.mode == "block_1x128":
        a_sinv = torch.ones(pm, a.scale_inv.shape[1])
        a_sinv[:m] = a.scale_inv
    want = ops.gemm_fp8(a_data, a_sinv, a.fp8_dtype, a.mode, b_data, b.scale_inv, b.fp8_dtype,
                        b.mode, torch.float32, None, True)[:m]
    assert got.shape == (m, 48)
    assert torch.equal(got, want)


@pytest.mark.parametrize("make, name, value", [
    (lambda: te.Linear(24, 32), "in_features", 24),
    (lambda: te.Linear(32, 40), "out_features", 40),
    (lambda: te.LayerNormLinear(32, 8), "out_features", 8),
    (lambda: te.LayerNormMLP(24, 32), "in_features", 24),
    (lambda: te.LayerNormMLP(32, 40), "out_features", 40),
])
def test_feature_dims_must_still_be_multiples_of_16(make, name, value):
    m = make()
    in_features = 24 if name == "in_features" and value == 24 else 32
    x = torch.randn(17, in_features)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()), \
            pytest.raises(ValueError, match=rf"{name} must be a multiple of 16, got {value}"):
        m(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_output_amax_is_that_of_the_real_rows(dtype):
    """te.Linear(fp8_output=True) under delayed scaling: the GEMM's epilogue casts to FP8 and
    takes the amax of its whole output. A zero row's output would be the bias, larger here
    than every real output (positive inputs, negative weights, bias 5), so it must not be a
    padded row's output."""
    fp8_recipe = recipe.DelayedScaling()
    m = te.Linear(K, N, params_dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(-m.weight.abs())
        m.bias.fill_(5.0)
    ref = copy.deepcopy(m)
    x = torch.rand(17, K, dtype=dtype)
    x_ref = torch.cat([x, x[-1:].expand(15, K)])
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        y = m(x, fp8_output=True)
        y_ref = ref(x_ref, fp8_output=True)
        amax = m.amax_history_out[0, 0].item()
        assert amax == ref.amax_history_out[0, 0].item()
    assert amax < 5.0
    assert torch.equal(y._data, y_ref._data[:17])
    assert torch.equal(y.dequantize(), y_ref.dequantize()[:17])
