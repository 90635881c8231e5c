"""reset_parameters() of modules built on device="meta" (deferred init): after to_empty, the
values the constructor makes on that device, FP8 state included."""

from __future__ import annotations

import pickle

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import first_step

BUILDERS = {
    "Linear": lambda d: te.Linear(32, 16, device=d),
    "LayerNormLinear": lambda d: te.LayerNormLinear(32, 48, device=d,
                                                    parameters_split=("q", "k", "v")),
    "LayerNormMLP": lambda d: te.LayerNormMLP(32, 64, activation="swiglu", device=d),
    "DotProductAttention": lambda d: te.DotProductAttention(2, 16, device=d),
    "MultiheadAttention": lambda d: te.MultiheadAttention(32, 2, input_layernorm=True, device=d),
    "TransformerLayer": lambda d: te.TransformerLayer(32, 64, 2, device=d),
    "GroupedLinear": lambda d: te.GroupedLinear(3, 32, 16, device=d),
    "LayerNorm": lambda d: te.LayerNorm(32, device=d),
    "ops.Linear": lambda d: te.ops.Linear(32, 16, device=d),
    "ops.Bias": lambda d: te.ops.Bias(16, device=d),
}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_meta_then_reset_equals_building_on_the_device(kind):
    torch.manual_seed(0)
    want = BUILDERS[kind]("cpu")
    torch.manual_seed(0)
    m = BUILDERS[kind]("meta")
    assert all(p.is_meta for p in m.parameters())
    m = m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    for (name, a), b in zip(m.named_parameters(), want.parameters(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(m.buffers(), want.buffers(), strict=True):
        assert torch.equal(a, b)
    history = getattr(m, "amax_history_fwd", None)
    if history is not None:  # a fresh FP8 state waits for its first step
        assert first_step.has_empty(history)


def test_reset_module_trains_in_fp8():
    m = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                            device="meta").to_empty(device="cpu")
    m.reset_parameters()
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        y = m(torch.randn(8, 2, 32))
    y.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_reset_keeps_the_parameter_objects_and_forgets_the_fp8_state():
    m = te.Linear(32, 16, device="cpu")
    weight = m.weight
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        m(torch.randn(16, 32)).sum().backward()
    assert m.amax_history_fwd.abs().sum() > 0
    m.reset_parameters()
    assert m.weight is weight
    assert m.amax_history_fwd.abs().sum() == 0 and torch.equal(m.scale_fwd,
                                                              torch.ones_like(m.scale_fwd))


def test_errors_and_defer_init():
    m = te.Linear(32, 16, device="meta")
    with pytest.raises(RuntimeError, match=r"te.Linear.reset_parameters: the module is on the "
                                           r"meta device; move it first"):
        m.reset_parameters()
    m.reset_parameters(defer_init=True)  # nothing
    back = pickle.loads(pickle.dumps(te.Linear(32, 16, device="cpu")))
    with pytest.raises(RuntimeError, match="not kept across pickling"):
        back.reset_parameters()
