"""Float8Tensor: values, repr, device moves, pickling, fallback ops; fp8_model_init."""

from __future__ import annotations

import io

import pytest
import torch
from te_torch_tests import _reference as ref

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import Float8Tensor


@pytest.mark.parametrize("fp8_dtype", ["float8_e4m3", "float8_e5m2"])
def test_quantize_and_dequantize_match_the_reference(fp8_dtype, device):
    x = torch.randn(32, 48, device=device) * 3
    q = Float8Tensor.quantize(x, fp8_dtype)
    assert isinstance(q, Float8Tensor) and q.dtype == torch.float32 and q.shape == x.shape
    assert q._data.dtype == torch.uint8 and q._data.element_size() == 1
    # the exact float64 product rounded once to fp32 is what the core's fp32 multiply gives
    want = ref.quantize_current(x.cpu(), fp8_dtype).float()
    assert torch.equal(q.dequantize().cpu(), want)


def test_native_float8_storage_is_accepted():
    x = torch.randn(16, 16)
    native = (x * 8).to(torch.float8_e4m3fn)
    q = Float8Tensor(native, torch.tensor([0.125]), dtype=torch.bfloat16)
    assert q._fp8_dtype == "float8_e4m3" and q.dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.float32), native.float() * 0.125)
    with pytest.raises(ValueError, match="fp8_dtype must match"):
        Float8Tensor(native, torch.tensor([1.0]), "float8_e5m2")
    with pytest.raises(TypeError, match="data must be uint8"):
        Float8Tensor(torch.zeros(4), torch.tensor([1.0]), "float8_e4m3")


def test_repr_names_format_mode_and_values():
    q = Float8Tensor.quantize(torch.ones(4, 16))
    text = repr(q)
    for part in ("Float8Tensor(", "fp8_dtype=float8_e4m3", "scaling_mode=tensor",
                 "shape=[4, 16]", "dtype=torch.float32", "values=[1.0"):
        assert part in text, text


def test_other_ops_see_dequantized_values():
    x = torch.randn(8, 16)
    q = Float8Tensor.quantize(x)
    deq = q.dequantize()
    out = q * 2 + 1
    assert type(out) is torch.Tensor
    assert torch.equal(out, deq * 2 + 1)
    assert torch.equal(torch.matmul(q, x.t()), deq @ x.t())
    assert type(q.detach()) is Float8Tensor and type(q.clone()) is Float8Tensor
    as_bf16 = q.to(torch.bfloat16)  # the same bytes, dequantizing to bf16
    assert type(as_bf16) is Float8Tensor and as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16._data, q._data)
    assert torch.equal(as_bf16.dequantize(), deq.to(torch.bfloat16))
    assert type(q.double()) is torch.Tensor and torch.equal(q.double(), deq.double())


def test_in_place_ops_stay_fp8():
    x = torch.randn(8, 16)
    q = Float8Tensor.quantize(x)
    data = q._data
    q.add_(torch.ones_like(x))
    assert type(q) is Float8Tensor and q._data is data  # same bytes, rewritten
    want = ref.quantize_current(ref.quantize_current(x, "float8_e4m3").float() + 1,
                                "float8_e4m3")  # current scaling of the updated values
    assert torch.equal(q.dequantize(), want.float())


def test_updates_through_an_alias_keep_the_transpose_in_step():
    q = Float8Tensor.quantize(torch.randn(16, 32))
    q.transpose_data()  # cached
    q.detach().mul_(3.0)  # e.g. an update through .data
    data, _ = q.transpose_data()
    assert torch.equal(data, q._data.t())


def test_torch_save_and_load_round_trip():
    q = Float8Tensor.quantize(torch.randn(16, 32), "float8_e5m2", with_transpose=True)
    buf = io.BytesIO()
    torch.save({"q": q}, buf)
    buf.seek(0)
    loaded = torch.load(buf)["q"]  # weights_only=True: the rebuild function is allow-listed
    assert type(loaded) is Float8Tensor and loaded._fp8_dtype == "float8_e5m2"
    assert torch.equal(loaded._data, q._data) and torch.equal(loaded._scale_inv, q._scale_inv)
    assert torch.equal(loaded._transpose, q._transpose)


@pytest.mark.cuda
def test_moves_between_devices():
    q = Float8Tensor.quantize(torch.randn(16, 32), with_transpose=True)
    on_gpu = q.cuda()
    assert type(on_gpu) is Float8Tensor and on_gpu.device.type == "cuda"
    assert on_gpu._data.is_cuda and on_gpu._scale_inv.is_cuda and on_gpu._transpose.is_cuda
    back = on_gpu.to("cpu")
    assert type(back) is Float8Tensor and torch.equal(back._data, q._data)
    assert torch.equal(on_gpu.dequantize().cpu(), q.dequantize())


def test_to_cpu_keeps_the_bytes():
    q = Float8Tensor.quantize(torch.randn(16, 32))
    moved = q.cpu()
    assert type(moved) is Float8Tensor and torch.equal(moved._data, q._data)


@pytest.mark.parametrize("r,mode", [(recipe.DelayedScaling(), "tensor"),
                                    (recipe.Float8BlockScaling(), "block_128x128")])
def test_fp8_model_init_keeps_one_byte_parameters(r, mode):
    with te.fp8_model_init(recipe=r):
        layer = te.Linear(128, 64, device="cpu")
    w = layer.weight
    assert isinstance(w, Float8Tensor) and isinstance(w, torch.nn.Parameter)
    assert w._scaling_mode == mode and w.requires_grad
    assert w._data.element_size() == 1 and w._data.numel() == 128 * 64
    assert w._transpose is None  # no second copy until a backward needs it
    x = torch.randn(32, 128, requires_grad=True)  # dgrad reads the weight's transpose
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with te.fp8_autocast(fp8_recipe=r):
        loss = layer(x).square().mean()
    loss.backward()
    before = w.dequantize()
    opt.step()
    assert type(layer.weight) is Float8Tensor and layer.weight._data.element_size() == 1
    assert not torch.equal(layer.weight.dequantize(), before)  # the update landed in FP8
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_fp8_model_init_weights_take_the_recipes_scale_options_and_keep_them():
    """Float8BlockScaling asks for power-of-2 scales: an fp8_model_init weight has the bytes
    and scales that quantizing its value under the recipe's plan gives, at creation and after
    an optimizer step (which quantizes in place with the same options)."""
    from transformer_engine.pytorch.quantization import plan_of, quantize

    r = recipe.Float8BlockScaling()
    plan = plan_of(r)
    assert plan.force_pow2_scales
    with te.fp8_model_init(recipe=r):
        layer = te.Linear(256, 128, device="cpu")
    opt = torch.optim.SGD(layer.parameters(), lr=0.37)
    for step in range(2):
        w = layer.weight
        sinv = w._scale_inv
        assert torch.equal(sinv, torch.exp2(torch.round(torch.log2(sinv)))), step
        want = quantize(plan, "weight", w.dequantize(), True, False)
        assert torch.equal(w._data, want.data) and torch.equal(sinv, want.scale_inv), step
        with te.fp8_autocast(fp8_recipe=r):
            layer(torch.randn(32, 256)).square().mean().backward()
        opt.step()


def test_fp8_model_init_weights_in_1x128_runs_train():
    """Float8BlockScaling(w_block_scaling_dim=1): 1x128 runs do not transpose, so the weight
    keeps a column-wise copy quantized from the same values (two bytes per element); a
    training step runs, and its input gradient is that of the dequantized weight's layer
    within FP8 rounding."""
    r = recipe.Float8BlockScaling(w_block_scaling_dim=1)
    with te.fp8_model_init(recipe=r):
        layer = te.Linear(256, 128, device="cpu")
    w = layer.weight
    assert w._scaling_mode == "block_1x128" and w._transpose is not None
    ref = te.Linear(256, 128, device="cpu")
    ref.load_state_dict({"weight": w.dequantize(), "bias": layer.bias.detach()}, strict=False)
    x = torch.randn(64, 256)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        layer(xa).square().mean().backward()
        ref(xb).square().mean().backward()
    assert torch.isfinite(xa.grad).all() and w.grad is not None
    # the same FP8 GEMMs up to the weight's requantization (one E4M3 step, 2^-3 relative)
    assert torch.allclose(xa.grad, xb.grad, rtol=0.25, atol=1e-3 * xb.grad.abs().max())
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.step()
    assert layer.weight._transpose is not None  # the update keeps both copies


def test_transposed_tiles_equal_a_columnwise_quantization():
    """A 128x128 tensor's lazily transposed copy has the bytes that quantizing with the
    transpose gives (same tiles, same scales)."""
    x = torch.randn(200, 144)
    lazy = Float8Tensor.quantize(x, scaling_mode="block_128x128")
    eager = Float8Tensor.quantize(x, scaling_mode="block_128x128", with_transpose=True)
    data, scale_inv = lazy.transpose_data()
    assert torch.equal(data, eager._transpose)
    assert torch.equal(scale_inv, eager._transpose_scale_inv)


def test_fp8_model_init_weights_load_back_byte_for_byte():
    with te.fp8_model_init():
        a = te.Linear(64, 32, device="cpu")
        b = te.Linear(64, 32, device="cpu")
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    assert torch.equal(b.weight._data, a.weight._data)
    assert torch.equal(b.weight._scale_inv, a.weight._scale_inv)
    plain = te.Linear(64, 32, device="cpu")  # into a high-precision module: dequantized
    plain.load_state_dict(a.state_dict())
    assert torch.equal(plain.weight, a.weight.dequantize())


def test_module_dtype_conversion_keeps_fp8_weights():
    with te.fp8_model_init():
        layer = te.Linear(32, 16, device="cpu")
    data = layer.weight._data.clone()
    layer.bfloat16()
    w = layer.weight
    assert type(w) is Float8Tensor and w.dtype == torch.bfloat16 and torch.equal(w._data, data)
    assert layer.bias.dtype == torch.bfloat16
    with te.fp8_autocast():
        y = layer(torch.randn(16, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


def test_fp8_weights_get_gradients_outside_fp8_autocast():
    """In high precision an FP8 weight takes part through its dequantized values, and its
    gradient still reaches it."""
    with te.fp8_model_init():
        layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(8, 32)
    y = layer(x)
    w = layer.weight.dequantize()
    assert torch.equal(y, torch.nn.functional.linear(x, w, layer.bias))
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(layer.weight.grad, g.t() @ x, rtol=1e-6, atol=1e-6)
