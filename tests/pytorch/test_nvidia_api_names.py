"""NVIDIA Transformer Engine's public PyTorch names, called the way its documentation shows:
availability helpers, quantized_model_init and the recipes under fp8_autocast."""

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from transformer_engine.pytorch.float8_tensor import Float8Tensor

CPU = not torch.cuda.is_available()

# ------------------------------------------------------------------ availability


@pytest.mark.parametrize("name", ["is_fp8_available", "is_fp8_block_scaling_available",
                                  "is_mxfp8_available", "is_nvfp4_available",
                                  "is_bf16_available"])
def test_availability_is_a_bool_and_a_pair_on_request(name):
    fn = getattr(te, name)
    ok = fn()
    assert type(ok) is bool
    pair = fn(return_reason=True)
    assert type(pair) is tuple and len(pair) == 2
    assert pair[0] is ok and isinstance(pair[1], str) and pair[1]


def test_if_not_is_fp8_available_reads_right():
    # The old answer was a (bool, reason) tuple: always truthy, even when FP8 was missing.
    ok, _ = te.is_fp8_available(return_reason=True)
    ran = "skipped"
    if not te.is_fp8_available():
        ran = "no fp8"
    else:
        ran = "fp8"
    assert ran == ("fp8" if ok else "no fp8")


def test_is_fp8_available_agrees_with_the_check_at_autocast_entry():
    from transformer_engine.pytorch import fp8

    assert te.is_fp8_available(return_reason=True) == fp8.is_fp8_available()


@pytest.mark.skipif(not CPU, reason="the answers of a machine without CUDA")
def test_on_the_cpu_fp8_runs_through_the_core_and_capabilities_read_zero():
    assert te.is_fp8_available() is True
    assert "CPU" in te.is_fp8_available(return_reason=True)[1]
    assert te.is_fp8_block_scaling_available() is True
    assert te.is_bf16_available() is True
    assert te.get_device_compute_capability() == (0, 0)
    assert te.get_cudnn_version() == (0, 0, 0)


def test_mxfp8_and_nvfp4_are_never_available_and_say_why():
    ok, reason = te.is_mxfp8_available(return_reason=True)
    assert ok is False and "MXFP8BlockScaling is not supported" in reason
    ok, reason = te.is_nvfp4_available(return_reason=True)
    assert ok is False and "no FP4 (E2M1) GEMM" in reason


def test_capability_and_cudnn_are_int_tuples():
    cc = te.get_device_compute_capability()
    assert type(cc) is tuple and len(cc) == 2 and all(type(v) is int for v in cc)
    version = te.get_cudnn_version()
    assert type(version) is tuple and len(version) == 3 and all(type(v) is int for v in version)
    if torch.cuda.is_available():
        assert cc == torch.cuda.get_device_capability()


def test_default_recipe_is_the_one_autocast_uses():
    from transformer_engine.pytorch import fp8

    r = te.get_default_recipe()
    assert r == DelayedScaling() and r.delayed()
    with te.fp8_autocast():
        assert fp8.STATE.recipe is r


# ------------------------------------------------------------------ quantized_model_init


def test_quantized_model_init_makes_fp8_weights_like_fp8_model_init():
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=Float8CurrentScaling()):
        new = te.Linear(32, 16, bias=False)
    torch.manual_seed(0)
    with te.fp8_model_init(enabled=True, recipe=Float8CurrentScaling()):
        old = te.Linear(32, 16, bias=False)
    assert isinstance(new.weight, Float8Tensor) and isinstance(old.weight, Float8Tensor)
    assert torch.equal(new.weight._data, old.weight._data)
    assert torch.equal(new.weight._scale_inv, old.weight._scale_inv)
    assert new.weight.get_high_precision_init_val() is None  # not asked for


def test_quantized_model_init_disabled_makes_plain_weights():
    with te.quantized_model_init(enabled=False, preserve_high_precision_init_val=True):
        layer = te.Linear(32, 16)
    assert not isinstance(layer.weight, Float8Tensor)


def test_block_scaled_weights_through_quantized_model_init():
    with te.quantized_model_init(recipe=Float8BlockScaling()):
        layer = te.Linear(128, 128, bias=False)
    assert layer.weight._scaling_mode == "block_128x128"


def test_preserve_high_precision_init_val_keeps_the_initial_weight_on_the_cpu():
    torch.manual_seed(1)
    with te.quantized_model_init(enabled=True, preserve_high_precision_init_val=True):
        layer = te.Linear(32, 16)
    torch.manual_seed(1)
    reference = te.Linear(32, 16).weight.detach()  # the same init in high precision
    kept = layer.weight.get_high_precision_init_val()
    assert kept is not None and kept.device.type == "cpu"
    assert kept.dtype == layer.weight.dtype
    assert torch.equal(kept, reference.cpu())
    # The FP8 weight is that value quantized: close, not equal.
    assert not torch.equal(layer.weight.dequantize().cpu(), kept)
    torch.testing.assert_close(layer.weight.dequantize().cpu(), kept, atol=0.0,
                               rtol=0.07)
    layer.weight.clear_high_precision_init_val()
    assert layer.weight.get_high_precision_init_val() is None


def test_preserving_ends_with_the_context():
    with te.quantized_model_init(preserve_high_precision_init_val=True):
        pass
    with te.fp8_model_init():
        layer = te.Linear(32, 16)
    assert layer.weight.get_high_precision_init_val() is None


def test_preserve_must_be_a_bool():
    with pytest.raises(TypeError, match="preserve_high_precision_init_val must be a bool"):
        with te.quantized_model_init(preserve_high_precision_init_val="yes"):
            pass


# ------------------------------------------------------------------ recipes


def test_recipe_imports_of_nvidia_programs():
    from transformer_engine.common.recipe import (  # noqa: F401
        CustomRecipe,
        DelayedScaling,
        Float8BlockScaling,
        Float8CurrentScaling,
        Format,
        MXFP8BlockScaling,
        NVFP4BlockScaling,
    )

    assert recipe.Format.E2M1.max_fwd == 6.0


def test_nvidia_keywords_run_under_autocast():
    layer = te.Linear(32, 32)
    x = torch.randn(16, 32)
    for r in (DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                             amax_compute_algo="max"),
              Float8CurrentScaling(use_power_2_scales=True,
                                   fp8_gemm_fprop=MMParams(use_split_accumulator=False)),
              Float8BlockScaling(use_f32_scales=True)):
        with te.fp8_autocast(enabled=True, fp8_recipe=r):
            y = layer(x if not r.float8_block_scaling() else torch.randn(128, 32))
        y.sum().backward()
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("r, message", [
    (NVFP4BlockScaling(), "NVFP4BlockScaling is not supported: this package has no FP4"),
    (CustomRecipe(qfactory=lambda role: None),
     "CustomRecipe is not supported: custom quantizer factories"),
    (Float8CurrentScaling(backward_override="high_precision"),
     "backward_override='high_precision') is not supported"),
    (Float8CurrentScaling(fp8_gemm_dgrad=MMParams(use_split_accumulator=False)),
     "fp8_gemm_dgrad=MMParams(use_split_accumulator=False)) is not supported"),
    (MXFP8BlockScaling(), "MXFP8BlockScaling is not supported"),
], ids=["nvfp4", "custom", "backward_override", "fp8_gemm_dgrad", "mxfp8"])
def test_refused_recipes_raise_clearly_under_autocast(r, message):
    layer = te.Linear(32, 32)
    with pytest.raises(NotImplementedError, match="te.Linear: ") as info:
        with te.fp8_autocast(enabled=True, fp8_recipe=r):
            layer(torch.randn(16, 32))
    assert message in str(info.value)


def test_refused_recipe_under_quantized_model_init_raises_clearly():
    with pytest.raises(NotImplementedError, match="NVFP4BlockScaling is not supported"):
        with te.quantized_model_init(recipe=NVFP4BlockScaling()):
            te.Linear(32, 32)


def test_new_names_are_public():
    for name in ("is_fp8_available", "is_bf16_available", "is_fp8_block_scaling_available",
                 "is_mxfp8_available", "is_nvfp4_available", "get_device_compute_capability",
                 "get_cudnn_version", "get_default_recipe", "quantized_model_init"):
        assert name in te.__all__ and callable(getattr(te, name))
