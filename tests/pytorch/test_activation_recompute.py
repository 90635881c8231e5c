"""te.checkpoint: the recompute quantizes with the first run's FP8 scales, records nothing,
repeats the RNG draws, and so gives the gradients and FP8 state of a run without recompute,
bit for bit. (test_checkpoint.py is about state_dict checkpoints.)"""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import fp8

RECIPES = {
    "none": None,
    "delayed": recipe.DelayedScaling(amax_history_len=3),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        te.LayerNormMLP(32, 64, activation="swiglu", device="cpu"),
        torch.nn.Dropout(0.25),  # the recompute must draw the same mask
        te.LayerNormLinear(32, 48, device="cpu"),
        te.Linear(48, 32, device="cpu"))


def _train(model, r, recompute: bool, steps: int = 3):
    """Per step: the loss, input grad and parameter grads, and the FP8 buffers after it."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(2, 16, 32, requires_grad=True)
        with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            y = te.checkpoint(model, x) if recompute else model(x)
        loss = y.square().mean()
        loss.backward()  # after the autocast exit: delayed scales have moved since forward
        record.append((loss.detach(), x.grad, [p.grad.clone() for p in model.parameters()],
                       [b.clone() for b in model.buffers()]))
        opt.step()
        opt.zero_grad()
    return record


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recompute_is_bit_identical_to_no_recompute(name):
    r = RECIPES[name]
    plain, recomputed = _train(_model(), r, False), _train(_model(), r, True)
    for step, (a, b) in enumerate(zip(plain, recomputed, strict=True)):
        assert torch.equal(a[0], b[0]), step
        assert torch.equal(a[1], b[1]), step
        for i, (ga, gb) in enumerate(zip(a[2], b[2], strict=True)):
            assert torch.equal(ga, gb), (step, i)
        # histories and scales: the recompute appended no amax and moved no scale
        for i, (ba, bb) in enumerate(zip(a[3], b[3], strict=True)):
            assert torch.equal(ba, bb), (step, i)


def test_recompute_updates_the_scales_once(monkeypatch):
    calls = []
    real = fp8.scale_update  # every delayed-scaling update goes through it

    def spy(histories, scales, scale_invs, fp8_dtype, algo, margin):
        calls.append(len(histories))
        return real(histories, scales, scale_invs, fp8_dtype, algo, margin)

    monkeypatch.setattr(fp8, "scale_update", spy)
    counts = []
    for recompute in (False, True):
        calls.clear()
        _train(_model(), RECIPES["delayed"], recompute, steps=1)
        counts.append(list(calls))
    assert counts[0] == counts[1] and counts[0]
    assert fp8.RECOMPUTE.recording is None and not fp8.RECOMPUTE.replaying
    assert fp8.STATE.pending == {}  # the recompute registered nothing for a later exit


def test_rng_tracker_states_are_restored_for_the_recompute():
    class Tracker:
        def __init__(self):
            self.states = {"model-parallel": torch.tensor([1])}
            self.set_calls = []

        def get_states(self):
            return dict(self.states)

        def set_states(self, states):
            self.set_calls.append(dict(states))
            self.states = dict(states)

    tracker = Tracker()
    layer = te.LayerNormLinear(32, 16, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(layer, x, get_rng_state_tracker=lambda: tracker)
    tracker.states = {"model-parallel": torch.tensor([2])}  # advanced after the forward
    y.sum().backward()
    first, restored = tracker.set_calls
    assert first["model-parallel"].item() == 1 and restored["model-parallel"].item() == 2


def test_kwargs_go_to_the_function():
    layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    y = te.checkpoint(lambda t, *, scale: layer(t) * scale, x, scale=3.0)
    torch.testing.assert_close(y, layer(x) * 3.0, rtol=0, atol=0)
    y.sum().backward()
    assert x.grad is not None


def test_bad_uses_give_clear_errors():
    layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    with pytest.raises(TypeError, match="te.checkpoint: function must be callable"):
        te.checkpoint(3, x)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        te.checkpoint(layer, x, distribute_saved_activations=True, use_reentrant=False)
    with pytest.raises(NotImplementedError, match="nested activation checkpoints"):
        te.checkpoint(lambda t: te.checkpoint(layer, t), x)
    assert fp8.RECOMPUTE.recording is None
