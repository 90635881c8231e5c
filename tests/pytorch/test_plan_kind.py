"""Checks that ask only which kind a recipe is go through its plan (kind_of)."""

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from transformer_engine.pytorch.quantization import kind_of


def test_kind_of_each_recipe():
    assert kind_of(DelayedScaling()) == "delayed"
    assert kind_of(Float8CurrentScaling()) == "current"
    assert kind_of(Float8BlockScaling()) == "block"
    # No plan (the GEMM cannot run it): no kind, and no error for a check that only asks.
    assert kind_of(MXFP8BlockScaling()) is None


def test_calibration_records_only_under_delayed():
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    for recipe, recorded in ((DelayedScaling(), True), (Float8CurrentScaling(), False),
                             (MXFP8BlockScaling(), False)):
        m = te.Linear(32, 16)
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
            m(x)
        assert bool(m.amax_history_fwd.any()) == recorded, recipe


def test_history_length_at_creation_follows_delayed_kind():
    # A delayed recipe sizes a new module's state; the other kinds leave the default length.
    default = DelayedScaling().amax_history_len
    with te.fp8_autocast(enabled=False, calibrating=True,
                         fp8_recipe=DelayedScaling(amax_history_len=default + 3)):
        assert te.Linear(32, 16).amax_history_fwd.shape[0] == default + 3
    for recipe in (Float8CurrentScaling(), MXFP8BlockScaling()):
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
            assert te.Linear(32, 16).amax_history_fwd.shape[0] == default
