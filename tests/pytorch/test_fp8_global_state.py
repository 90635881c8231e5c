"""NVIDIA's FP8GlobalStateManager (imported by Megatron-LM from ``transformer_engine.pytorch.fp8``)
and the autocast names of ``transformer_engine.pytorch.quantization``: what they report inside
and outside the contexts, the snapshot/restore pair, the early scale update, and
``fp8_model_init``'s third keyword."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch import fp8
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager


def test_the_names_megatron_imports():
    from transformer_engine.pytorch import quantization
    from transformer_engine.pytorch.fp8 import fp8_autocast, fp8_model_init

    assert quantization.FP8GlobalStateManager is FP8GlobalStateManager
    for name in ("fp8_autocast", "autocast", "fp8_model_init", "quantized_model_init",
                 "is_fp8_available", "get_default_recipe"):
        assert getattr(quantization, name) is getattr(te, name), name
    assert fp8_autocast is te.fp8_autocast and fp8_model_init is te.fp8_model_init
    with pytest.raises(AttributeError):
        quantization.not_a_name  # noqa: B018


def test_state_inside_and_outside():
    current = Float8CurrentScaling()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), DelayedScaling)
    with te.fp8_autocast(fp8_recipe=current):
        assert FP8GlobalStateManager.is_fp8_enabled()
        assert FP8GlobalStateManager.get_fp8_recipe() is current
        assert FP8GlobalStateManager.get_fp8_group() is None
        with te.fp8_autocast(enabled=False, calibrating=True):
            assert not FP8GlobalStateManager.is_fp8_enabled()
            assert FP8GlobalStateManager.is_fp8_calibration()
        assert FP8GlobalStateManager.is_fp8_enabled()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert not FP8GlobalStateManager.with_fp8_parameters()
    with te.fp8_model_init(enabled=True):
        assert FP8GlobalStateManager.with_fp8_parameters()
    ok, reason = FP8GlobalStateManager.is_fp8_available()
    assert ok is te.is_fp8_available() and isinstance(reason, str)
    assert not FP8GlobalStateManager.fp8_graph_capturing()


def test_snapshot_and_restore():
    """Megatron saves the state around a region that must run outside FP8."""
    with te.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        saved = FP8GlobalStateManager.get_fp8_autocast_state()
        with te.fp8_autocast(enabled=False):
            inner = FP8GlobalStateManager.get_fp8_autocast_state()
        FP8GlobalStateManager.set_fp8_autocast_state(inner)
        assert not FP8GlobalStateManager.is_fp8_enabled()
        FP8GlobalStateManager.set_fp8_autocast_state(saved)
        assert FP8GlobalStateManager.is_fp8_enabled()
    assert not FP8GlobalStateManager.is_fp8_enabled() and fp8.STATE.depth == 0
    with pytest.raises(TypeError, match="set_fp8_autocast_state: state must be"):
        FP8GlobalStateManager.set_fp8_autocast_state([True])


def test_early_forward_scale_update():
    """reduce_and_update_fp8_tensors(forward=True) runs the update the outermost exit would:
    the scale after it is the one a plain exit gives."""
    torch.manual_seed(0)
    a = te.Linear(16, 16, device="cpu")
    b = te.Linear(16, 16, device="cpu")
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 16) * 5
    with te.fp8_autocast():
        a(x)
        FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True)
        assert not fp8.STATE.pending
        a_scales = [t.clone() for n, t in a.named_buffers() if "scale" in n]
    with te.fp8_autocast():
        b(x)
    b_scales = [t.clone() for n, t in b.named_buffers() if "scale" in n]
    assert a_scales and all(torch.equal(s, t) for s, t in zip(a_scales, b_scales, strict=True))
    assert any(not torch.equal(s, torch.ones_like(s)) for s in a_scales)


def test_reset():
    ctx = te.fp8_autocast()
    ctx.__enter__()
    FP8GlobalStateManager.reset()
    assert not FP8GlobalStateManager.is_fp8_enabled() and fp8.STATE.depth == 0


def test_fp8_model_init_takes_preserve_high_precision_init_val():
    """Megatron builds FP8 weights with NVIDIA's three keywords."""
    with te.fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=True):
        layer = te.Linear(16, 16, device="cpu")
    kept = layer.weight.get_high_precision_init_val()
    assert kept.shape == (16, 16) and kept.device.type == "cpu"
    torch.testing.assert_close(layer.weight.dequantize().float(), kept.float(), rtol=0.07,
                               atol=1e-3)
    with te.fp8_model_init(enabled=True):
        plain = te.Linear(16, 16, device="cpu")
    assert plain.weight.get_high_precision_init_val() is None
    with pytest.raises(TypeError, match="fp8_model_init: preserve_high_precision_init_val"):
        with te.fp8_model_init(preserve_high_precision_init_val=1):
            pass


def test_add_fp8_tensors_to_global_buffer_has_the_exit_update_the_module():
    """A replayed graph writes a module's amaxes without running its forward's Python;
    Megatron-LM then calls add_fp8_tensors_to_global_buffer(module.fp8_meta), and the
    outermost autocast's exit updates that module's forward scales as after its forward."""
    import copy

    r = DelayedScaling()
    lin = te.Linear(32, 32, device="cpu")
    with te.fp8_autocast(fp8_recipe=r):
        lin(torch.randn(16, 32))  # state sized and past its first step
    called, skipped = lin, copy.deepcopy(lin)
    for module, call in ((called, True), (skipped, False)):
        with te.fp8_autocast(fp8_recipe=r):
            with torch.no_grad():
                # what the replay's kernels wrote (above any amax the history holds, so
                # the max over the history is this)
                module.amax_history_fwd[0, :2] = 100.0
            if call:
                FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(module.fp8_meta)
    # E4M3's largest value over the amax, margin 0
    assert torch.equal(called.scale_fwd[:2], torch.full((2,), 448.0 / 100.0))
    assert not torch.equal(skipped.scale_fwd[:2], called.scale_fwd[:2])
    with pytest.raises(ValueError, match="fp8_meta dict of a transformer_engine module"):
        FP8GlobalStateManager.add_fp8_tensors_to_global_buffer({"recipe": r})
    # outside an FP8 autocast: nothing to update, nothing registered
    FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(called.fp8_meta)
