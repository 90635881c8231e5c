"""Post-training calibration metadata (QuantizationCalibrationConfig, calibration.py): what a
calibrating forward keeps per GEMM operand, under which names, with which decay; what it
refuses."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.quantization import (
    FP8GlobalStateManager,
    QuantizationCalibrationConfig,
)

CURRENT = "_tensor_scale_inv_fp8_current_scaling_te_ptq_calibrated"
DELAYED = "_tensor_amax_fp8_delayed_scaling_te_ptq_calibrated"


def _kept(module) -> dict:
    return {n: v.clone() for n, v in module.named_buffers() if n.endswith("_te_ptq_calibrated")}


def _calibrate(module, *args, fp8_recipe=None, config=None, calibrating=False):
    with te.autocast(enabled=False, calibrating=calibrating,
                     recipe=fp8_recipe or recipe.Float8CurrentScaling(),
                     calibration_config=config):
        return module(*args)


def test_config_checks_its_decay():
    assert QuantizationCalibrationConfig().transformer_engine_calibration_decay == 0.0
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="transformer_engine_calibration_decay must be "
                                             "non-negative"):
            QuantizationCalibrationConfig(transformer_engine_calibration_decay=bad)
    with pytest.raises(TypeError, match="must be a number, got str"):
        QuantizationCalibrationConfig(transformer_engine_calibration_decay="0.5")


def test_current_scaling_keeps_scale_invs_with_the_activations_decay():
    m = te.Linear(32, 32, bias=False)
    config = QuantizationCalibrationConfig(transformer_engine_calibration_decay=0.5)
    _calibrate(m, torch.full((16, 32), 448.0), config=config)
    kept = _kept(m)
    assert set(kept) == {"input" + CURRENT, "weight" + CURRENT}
    torch.testing.assert_close(kept["input" + CURRENT], torch.ones(1), rtol=0, atol=0)
    # the weight's: 1 / (448 / max|w|), the scale current scaling would quantize it with
    expected = torch.reciprocal(torch.tensor([448.0]) / m.weight.detach().abs().max())
    torch.testing.assert_close(kept["weight" + CURRENT], expected, rtol=0, atol=0)
    _calibrate(m, torch.full((16, 32), 112.0), config=config)
    # the activation: max(0.25, 0.5 x 1.0); the weight: this forward's alone
    torch.testing.assert_close(m.get_buffer("input" + CURRENT), torch.tensor([0.5]))
    torch.testing.assert_close(m.get_buffer("weight" + CURRENT), kept["weight" + CURRENT])
    # without decay the activation keeps this forward's value
    _calibrate(m, torch.full((16, 32), 112.0), config=QuantizationCalibrationConfig())
    torch.testing.assert_close(m.get_buffer("input" + CURRENT), torch.tensor([0.25]))


def test_delayed_scaling_keeps_amaxes_and_still_records_its_history():
    m = te.Linear(32, 32, bias=False)
    _calibrate(m, torch.full((16, 32), 2.0), fp8_recipe=recipe.DelayedScaling(),
               config=QuantizationCalibrationConfig())
    kept = _kept(m)
    assert set(kept) == {"input" + DELAYED, "weight" + DELAYED}
    torch.testing.assert_close(kept["input" + DELAYED], torch.tensor([2.0]), rtol=0, atol=0)
    torch.testing.assert_close(kept["weight" + DELAYED], m.weight.detach().abs().max().view(1))
    assert m.fp8_calibration  # (NVIDIA's flag of a calibrating forward, as before)


@pytest.mark.parametrize("kind, names", [
    ("linear", ["input", "weight"]),
    ("layernorm_linear", ["input", "weight"]),
    ("layernorm_mlp", ["fc1_input", "fc1_weight", "fc2_input", "fc2_weight"]),
    ("grouped_linear", ["input_gemm0", "input_gemm1", "weight_gemm0", "weight_gemm1"]),
])
def test_each_module_keeps_its_operands(kind, names):
    make = {"linear": lambda: te.Linear(32, 32, bias=False),
            "layernorm_linear": lambda: te.LayerNormLinear(32, 32, bias=False),
            "layernorm_mlp": lambda: te.LayerNormMLP(32, 64, bias=False),
            "grouped_linear": lambda: te.GroupedLinear(2, 32, 32, bias=False)}[kind]
    m = make()
    x = torch.randn(16, 32)
    args = (x, [8, 8]) if kind == "grouped_linear" else (x,)
    _calibrate(m, *args, config=QuantizationCalibrationConfig())
    kept = _kept(m)
    assert sorted(kept) == sorted(n + CURRENT for n in names)
    assert all(torch.isfinite(v).all() and (v > 0).all() for v in kept.values())
    # (buffers outside the state dict: a checkpoint loads into a module that never calibrated)
    assert not any(k.endswith("_te_ptq_calibrated") for k in m.state_dict())
    make().load_state_dict(m.state_dict())


def test_calibrating_alone_keeps_it_by_the_default_config_and_block_recipes_keep_nothing():
    m = te.Linear(128, 128)
    with te.autocast(enabled=False, calibrating=True, recipe=recipe.Float8CurrentScaling()):
        assert FP8GlobalStateManager.get_calibration_config() == QuantizationCalibrationConfig()
        m(torch.randn(16, 128))
    assert len(_kept(m)) == 2
    assert FP8GlobalStateManager.get_calibration_config() is None
    block = te.Linear(128, 128)
    _calibrate(block, torch.randn(16, 128), fp8_recipe=recipe.Float8BlockScaling(),
               config=QuantizationCalibrationConfig())
    assert not _kept(block)


def test_the_config_is_the_one_given_and_fp8_forwards_refuse_it():
    config = QuantizationCalibrationConfig(transformer_engine_calibration_decay=0.5)
    with te.autocast(enabled=False, calibrating=True, calibration_config=config):
        assert FP8GlobalStateManager.get_calibration_config() is config
    with pytest.raises(NotImplementedError, match="calibration_config is recorded by "
                                                  "calibrating forwards with FP8 off"):
        te.autocast(enabled=True, calibration_config=config)
    with pytest.raises(TypeError, match="calibration_config must be a "
                                        "QuantizationCalibrationConfig or None, got dict"):
        te.fp8_autocast(enabled=False, calibration_config={"decay": 0.5})


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_recomputed_forward_keeps_nothing_new(use_reentrant):
    m = te.Linear(32, 32, bias=False)
    config = QuantizationCalibrationConfig(transformer_engine_calibration_decay=0.5)
    with torch.no_grad():
        _calibrate(m, torch.full((16, 32), 448.0), config=config)

    def forward(inp):
        return _calibrate(m, inp, config=config)

    inp = torch.full((16, 32), 56.0, requires_grad=True)
    out = checkpoint(forward, inp, use_reentrant=use_reentrant)
    after_forward = m.get_buffer("input" + CURRENT).clone()
    torch.testing.assert_close(after_forward, torch.tensor([0.5]))  # max(0.125, 0.5 x 1)
    out.sum().backward()
    torch.testing.assert_close(m.get_buffer("input" + CURRENT), after_forward)
