"""te.Linear in FP8, every recipe: forward, dgrad, wgrad and bias grad against float64 GEMMs
of operands quantized by the reference (torch's float8 casts), never by the core."""

from __future__ import annotations

import math

import pytest
import torch
from te_torch_tests import _reference as ref
from te_torch_tests._tolerances import assert_gemm_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import first_step

E4M3, E5M2 = "float8_e4m3", "float8_e5m2"

RECIPES = {
    "delayed-hybrid": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4),
    "delayed-e4m3-margin1": recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, margin=1,
                                                  amax_history_len=4),
    "current-hybrid": recipe.Float8CurrentScaling(),
    "current-e4m3-pow2": recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3,
                                                     power_2_scale=True),
    "block-e4m3": recipe.Float8BlockScaling(),
    "block-hybrid": recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID),
}
# Shapes: tokens M, in_features K, out_features N, all multiples of 16 (the FP8 granule);
# 160 leaves a ragged 1x128 block, 144 a ragged 128x128 tile.
M, K, N = 48, 160, 144


def _reference_operands(r, x, w, g, scales):
    """Dequantized (input row-wise, weight, grad_output row-wise, input column-wise^T,
    grad_output column-wise^T), all [rows, cols] of the original orientation."""
    fwd, bwd = r.fp8_format.fwd_dtype_name, r.fp8_format.bwd_dtype_name
    if r.delayed():
        s_in, s_w, s_g = scales
        qx, qw, qg = (ref.quantize_tensor(x, s_in, fwd), ref.quantize_tensor(w, s_w, fwd),
                      ref.quantize_tensor(g, s_g, bwd))
        return qx, qw, qg, qx, qg
    if r.float8_current_scaling():
        p2 = r.power_2_scale
        qx, qw, qg = (ref.quantize_current(x, fwd, p2), ref.quantize_current(w, fwd, p2),
                      ref.quantize_current(g, bwd, p2))
        return qx, qw, qg, qx, qg
    qx = ref.quantize_blocks(x, 1, 128, fwd)
    qw = ref.quantize_blocks(w, 128, 128, fwd)
    qg = ref.quantize_blocks(g, 1, 128, bwd)
    qx_col = ref.quantize_blocks(x.t().contiguous(), 1, 128, fwd).t()
    qg_col = ref.quantize_blocks(g.t().contiguous(), 1, 128, bwd).t()
    return qx, qw, qg, qx_col, qg_col


def _step(layer, r, x, g):
    with te.fp8_autocast(fp8_recipe=r):
        y = layer(x)
    (y * g).sum().backward()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp8_linear_matches_gemms_of_quantized_operands(name, dtype, device):
    r = RECIPES[name]
    layer = te.Linear(K, N, params_dtype=dtype, device=device)
    x = torch.randn(M, K, dtype=dtype, device=device, requires_grad=True)
    g = (torch.randn(M, N, device=device) * 1e-3).to(dtype)  # grad_output: loss = sum(y * g)
    _step(layer, r, x, g)  # a first step, so delayed scaling runs with scales from amaxes
    scales = (*layer.scale_fwd.tolist(), layer.scale_bwd.item())
    for t in (x, layer.weight, layer.bias):
        t.grad = None
    y = _step(layer, r, x, g)

    xc, wc, gc = x.detach().cpu(), layer.weight.detach().cpu(), g.cpu()
    qx, qw, qg, qx_col, qg_col = _reference_operands(r, xc, wc, gc, scales)
    bias = layer.bias.detach().cpu().double()
    want, mag = ref.matmul_tn(qx, qw)
    assert y.dtype == dtype and y.shape == (M, N)
    assert_gemm_close(y, want + bias, mag + bias.abs(), dtype, f"{name} forward")
    want, mag = ref.matmul_tn(qg, qw.t())
    assert_gemm_close(x.grad, want, mag, dtype, f"{name} dgrad")
    want, mag = ref.matmul_tn(qg_col.t(), qx_col.t())
    assert layer.weight.grad.dtype == dtype
    assert_gemm_close(layer.weight.grad, want, mag, dtype, f"{name} wgrad")
    bias_grad = gc.double().sum(0)
    assert_gemm_close(layer.bias.grad, bias_grad, gc.double().abs().sum(0), dtype, "bias grad")


def test_hybrid_puts_gradients_in_e5m2():
    """A gradient beyond E4M3's range (448) but within E5M2's survives HYBRID, not E4M3."""
    weight = torch.randn(16, 32)
    qw = ref.quantize_tensor(weight, 1.0, E4M3)  # scale 1: a module past its first step
    g = torch.full((16, 16), 1000.0)
    # 1000 on the E5M2 grid (768, 896, 1024) is 1024; E4M3 saturates it to 448.
    for fmt, g_fp8 in ((recipe.Format.HYBRID, 1024.0), (recipe.Format.E4M3, 448.0)):
        layer = te.Linear(32, 16, bias=False, device="cpu")
        with torch.no_grad():
            layer.weight.copy_(weight)
        for history in (layer.amax_history_fwd, layer.amax_history_bwd):
            first_step.mark_empty(history, ())  # no first-step scales: the scales of 1 apply
        x = torch.randn(16, 32, requires_grad=True)
        _step(layer, recipe.DelayedScaling(fp8_format=fmt), x, g)
        want = torch.full((16, 16), g_fp8, dtype=torch.float64) @ qw
        torch.testing.assert_close(x.grad.double(), want, rtol=1e-6, atol=0)


def test_seed_example_runs_on_cpu():
    """The seed example as written, with device="cuda" replaced by "cpu"."""
    in_features, out_features, hidden_size = 768, 3072, 2048
    model = te.Linear(in_features, out_features, bias=True, device="cpu")
    inp = torch.randn(hidden_size, in_features, device="cpu")
    fp8_recipe = recipe.DelayedScaling(margin=0, fp8_format=recipe.Format.E4M3)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out = model(inp)
    loss = out.sum()
    loss.backward()
    assert out.shape == (hidden_size, out_features)
    assert model.weight.grad is not None and torch.isfinite(model.weight.grad).all()
    # close to the high-precision result (E4M3 keeps ~2^-4).
    hp = torch.nn.functional.linear(inp, model.weight, model.bias)
    assert (out - hp).abs().max() < 0.1 * hp.abs().max()


def test_weight_cache_across_microbatches():
    """is_first_microbatch=True quantizes and keeps the weight; False reuses it even after
    the high-precision weight changed (it changes only at the optimizer step)."""
    r = recipe.Float8CurrentScaling()
    layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(16, 32)
    with te.fp8_autocast(fp8_recipe=r):
        first = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(2.0)
        reused = layer(x, is_first_microbatch=False)
        fresh = layer(x, is_first_microbatch=None)
    torch.testing.assert_close(reused, first, rtol=0, atol=0)
    assert not torch.allclose(fresh, first)


def test_leading_dimensions_are_tokens():
    """[B, S, K] input: the same numbers as its [B*S, K] view, gradients in the input shape."""
    layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(2, 24, 32, requires_grad=True)
    x2 = x.detach().reshape(48, 32).requires_grad_()
    r = recipe.Float8CurrentScaling()
    g = torch.randn(2, 24, 16)
    y = _step(layer, r, x, g)
    y2 = _step(layer, r, x2, g.reshape(48, 16))
    assert y.shape == (2, 24, 16) and x.grad.shape == x.shape
    assert torch.equal(y.reshape(48, 16), y2)
    assert torch.equal(x.grad.reshape(48, 32), x2.grad)


def test_torch_autocast_sets_the_activation_dtype():
    layer = te.Linear(32, 16, device="cpu")  # fp32 parameters
    x = torch.randn(16, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), te.fp8_autocast():
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("name", ["delayed-hybrid", "block-e4m3"])
def test_backward_keeps_only_fp8_copies(name):
    """What autograd saves for the backward: FP8 bytes (the column-wise input and weight)
    and their fp32 scales, never the high-precision input or weight."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    layer = te.Linear(K, N, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.fp8_autocast(fp8_recipe=RECIPES[name]):
            y = layer(x)
    y.sum().backward()
    assert all(dtype in (torch.uint8, torch.float32) for dtype, _ in saved), saved
    # The column-wise input [K, M] and weight [K, N]: two tensors, or on te.Linear's compiled
    # path (delayed scaling) one byte buffer that also holds their scales and some alignment.
    fp8_bytes = sum(math.prod(shape) for dtype, shape in saved if dtype == torch.uint8)
    assert K * M + K * N <= fp8_bytes <= K * M + K * N + 1024, saved
    # fp32 only for scales: one per tensor or per 128-element block (at most one per row
    # here), far fewer than the FP8 elements
    scales = [math.prod(shape) for dtype, shape in saved if dtype == torch.float32]
    assert all(n <= M * K // 16 for n in scales), saved
