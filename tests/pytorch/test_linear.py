"""te.Linear as a drop-in nn.Linear in high precision, its arguments, and its errors."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_high_precision_matches_nn_linear(dtype, device):
    """Outside fp8_autocast te.Linear runs torch's own linear: equal bits, values and grads."""
    layer = te.Linear(48, 24, params_dtype=dtype, device=device)
    plain = torch.nn.Linear(48, 24, dtype=dtype, device=device)
    with torch.no_grad():
        plain.weight.copy_(layer.weight)
        plain.bias.copy_(layer.bias)
    x = torch.randn(3, 5, 48, dtype=dtype, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = layer(x), plain(x2)
    assert y.shape == (3, 5, 24) and y.dtype == dtype
    assert torch.equal(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(layer.weight.grad, plain.weight.grad)
    assert torch.equal(layer.bias.grad, plain.bias.grad)


def test_parameters_look_like_nn_linear():
    layer = te.Linear(64, 32, device="cpu")
    assert layer.weight.shape == (32, 64) and layer.bias.shape == (32,)
    assert layer.weight.dtype == torch.get_default_dtype()
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    bound = 1 / 64**0.5  # nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in)) for both
    assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
    assert te.Linear(4, 4, bias=False, device="cpu").bias is None
    assert "in_features=64, out_features=32, bias=True" in repr(layer)


def test_init_method_and_return_bias():
    layer = te.Linear(16, 16, device="cpu", init_method=torch.nn.init.ones_, return_bias=True)
    assert torch.equal(layer.weight, torch.ones(16, 16))
    x = torch.randn(4, 16)
    out, bias = layer(x)
    assert bias is layer.bias
    assert torch.equal(out, x @ torch.ones(16, 16))  # the bias is left to the caller
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        out8, bias8 = layer(torch.randn(16, 16))
    assert bias8 is layer.bias


def test_parameters_split_keeps_named_blocks():
    layer = te.Linear(16, 48, device="cpu", parameters_split={"q": 16, "k": 16, "v": 16})
    names = [n for n, _ in layer.named_parameters()]
    assert names == ["q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias"]
    x = torch.randn(16, 16)
    weight = torch.cat([layer.q_weight, layer.k_weight, layer.v_weight])
    bias = torch.cat([layer.q_bias, layer.k_bias, layer.v_bias])
    assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, bias))
    with te.fp8_autocast():
        layer(x).sum().backward()
    assert layer.k_weight.grad.shape == (16, 16)
    with pytest.raises(ValueError, match="parameters_split"):
        te.Linear(16, 48, device="cpu", parameters_split=("a", "b", "c", "d", "e"))


def test_tensor_parallel_arguments_without_a_group():
    te.Linear(16, 16, device="cpu", tp_size=1, parallel_mode="column")
    # without a parallel mode tp_size splits nothing (as in NVIDIA TE)
    assert te.Linear(16, 16, device="cpu", tp_size=2).weight.shape == (16, 16)
    # sequence parallelism splits the activations of a split layer only
    unsplit = te.Linear(16, 16, device="cpu", sequence_parallel=True)
    assert not unsplit.sequence_parallel and not hasattr(unsplit.bias, "sequence_parallel")
    with pytest.raises(ValueError, match="parallel_mode must be"):
        te.Linear(16, 16, device="cpu", parallel_mode="diagonal")


def test_wrong_in_features_names_the_argument():
    layer = te.Linear(32, 16, device="cpu")
    with pytest.raises(ValueError, match=r"in_features=32 .* got shape \[4, 31\]"):
        layer(torch.randn(4, 31))


@pytest.mark.parametrize("shape,name", [((16, 24), "in_features"), ((16, 32), "out_features")])
def test_fp8_shape_rule_names_the_dimension(shape, name):
    out_features = 24 if name == "out_features" else 16
    layer = te.Linear(shape[1], out_features, device="cpu")
    with te.fp8_autocast():
        with pytest.raises(ValueError, match=rf"{name}[^;]* must be a multiple of 16"):
            layer(torch.randn(*shape))


def test_fp8_takes_any_token_count():
    # The feature dimensions keep the rule; tokens are padded inside (test_fp8_any_tokens.py).
    layer = te.Linear(32, 16, device="cpu")
    with te.fp8_autocast():
        assert layer(torch.randn(10, 32)).shape == (10, 16)


def test_bad_recipes_are_rejected():
    layer = te.Linear(32, 16, device="cpu")
    with pytest.raises(TypeError, match="fp8_recipe must be"):
        with te.fp8_autocast(fp8_recipe="delayed"):
            pass
    with te.fp8_autocast(fp8_recipe=recipe.MXFP8BlockScaling()):
        with pytest.raises(NotImplementedError, match="MXFP8BlockScaling is not supported"):
            layer(torch.randn(16, 32))
    with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling(x_block_scaling_dim=2)):
        with pytest.raises(NotImplementedError, match="x_block_scaling_dim must be 1"):
            layer(torch.randn(16, 32))


def test_the_core_s_errors_reach_the_user():
    from transformer_engine.pytorch import ops

    with pytest.raises(ValueError, match="quantize: fp8_dtype must be one of"):
        ops.quantize(torch.randn(4, 4), torch.ones(1), "float8_e3m4", True, False)
    with pytest.raises(ValueError, match="gemm: a .* and b .* must share K"):
        a = torch.zeros(16, 32, dtype=torch.uint8)
        ops.gemm_fp8(a, torch.ones(1), "float8_e4m3", "tensor", a.t().contiguous(),
                     torch.ones(1), "float8_e4m3", "tensor", torch.float32, None, False)


def test_is_fp8_available_explains_itself():
    assert te.is_fp8_available() is te.is_fp8_available(return_reason=True)[0]
    ok, reason = te.is_fp8_available(return_reason=True)
    assert isinstance(ok, bool) and reason
    if not torch.cuda.is_available():
        assert ok and "emulated" in reason


def test_dtype_conversion_keeps_the_scaling_state_fp32():
    layer = te.Linear(32, 16, device="cpu")
    with te.fp8_autocast():
        layer(torch.randn(16, 32))
    scale = layer.scale_fwd.clone()
    layer.bfloat16()
    assert layer.weight.dtype == torch.bfloat16
    for name in ("amax_history_fwd", "scale_fwd", "scale_inv_fwd", "amax_history_bwd",
                 "scale_bwd", "scale_inv_bwd"):
        assert getattr(layer, name).dtype == torch.float32, name
    assert torch.equal(layer.scale_fwd, scale)
    with te.fp8_autocast():
        assert layer(torch.randn(16, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_ops_take_non_contiguous_inputs():
    """The ops hand the core bare pointers; a strided input is made contiguous first."""
    from transformer_engine.pytorch import ops

    x = torch.randn(32, 48)
    want = ops.quantize(x.t().contiguous(), torch.ones(1), "float8_e4m3", True, True)
    got = ops.quantize(x.t(), torch.ones(1), "float8_e4m3", True, True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="C-contiguous"):
        ops._backend.raw(x.t())


@pytest.mark.cuda
def test_input_on_another_device_names_both():
    """In FP8 the input and the module must share a device (the core's buffers all do); the
    error names both, and nothing is recorded."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    layer = te.Linear(32, 16, device="cuda")
    history = layer.amax_history_fwd.clone() if hasattr(layer, "amax_history_fwd") else None
    with te.fp8_autocast():
        with pytest.raises(RuntimeError, match=r"input must be on the device .*cuda.*got cpu"):
            layer(torch.randn(16, 32))
    if history is not None:
        assert torch.equal(layer.amax_history_fwd, history)
