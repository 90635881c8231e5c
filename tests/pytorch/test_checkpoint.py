"""FP8 state in checkpoints: versioned extra state, round trips into fresh modules, and a
training run stopped and resumed that takes a bit-identical next step."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPE = recipe.DelayedScaling(amax_history_len=4)


def _model():
    return torch.nn.Sequential(te.Linear(32, 64, device="cpu"), torch.nn.GELU(),
                               te.Linear(64, 16, device="cpu"))


def _step(model, opt, x, target):
    with te.fp8_autocast(fp8_recipe=RECIPE):
        loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 32, generator=g), torch.randn(32, 16, generator=g)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def test_extra_state_is_versioned_and_round_trips():
    layer = te.Linear(32, 16, device="cpu")
    with te.fp8_autocast(fp8_recipe=RECIPE):
        layer(torch.randn(16, 32)).sum().backward()
    state = layer.get_extra_state()
    assert state["version"] == 1
    assert state["recipe"]["recipe"] == "DelayedScaling"
    assert state["recipe"]["amax_history_len"] == 4 and state["recipe"]["fp8_format"] == "HYBRID"
    fresh = te.Linear(32, 16, device="cpu")
    fresh.load_state_dict(_roundtrip(layer.state_dict()))
    for name in ("amax_history_fwd", "scale_fwd", "scale_inv_fwd", "amax_history_bwd",
                 "scale_bwd", "scale_inv_bwd"):
        assert torch.equal(getattr(fresh, name), getattr(layer, name)), name
    assert torch.equal(fresh.weight, layer.weight)
    with pytest.raises(ValueError, match="state version must be 1"):
        fresh.set_extra_state({**state, "version": 99})


def test_resumed_run_takes_a_bit_identical_next_step():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        _step(model, opt, *_data(step))
    checkpoint = _roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    reference = copy.deepcopy(model)  # what the uninterrupted run holds after 3 steps
    losses = [_step(model, opt, *_data(step)) for step in (3, 4)]

    resumed = _model()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed_opt.load_state_dict(checkpoint["opt"])
    for a, b in zip(resumed.state_dict().values(), reference.state_dict().values(),
                    strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
    resumed_losses = [_step(resumed, resumed_opt, *_data(step)) for step in (3, 4)]
    assert [x.item() for x in resumed_losses] == [x.item() for x in losses]
    for (name, a), b in zip(resumed.state_dict().items(), model.state_dict().values(),
                                strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            for key in ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd"):
                assert torch.equal(a[key], b[key]), (name, key)


def test_plain_nn_linear_checkpoint_loads():
    plain = torch.nn.Linear(32, 16)
    layer = te.Linear(32, 16, device="cpu")
    layer.load_state_dict(plain.state_dict())  # no FP8 state in it: fresh scales
    assert torch.equal(layer.weight, plain.weight) and torch.equal(layer.bias, plain.bias)


def test_nvidia_checkpoint_without_fp8_state_loads():
    """NVIDIA's modules write an empty uint8 tensor (a BytesIO before its 2.0) as the extra
    state of a module that never ran in FP8: such a checkpoint loads, scales fresh. (Their
    FP8 states load too: test_nvidia_extra_state.py.) Bytes that are no such state are
    refused by name, and change nothing."""
    source = te.Linear(32, 16, device="cpu")
    for empty in (torch.empty(0, dtype=torch.uint8), io.BytesIO()):
        state = dict(source.state_dict(), _extra_state=empty)
        layer = te.Linear(32, 16, device="cpu")
        fresh = layer.scale_fwd.clone()
        layer.load_state_dict(state)
        assert torch.equal(layer.weight, source.weight) and torch.equal(layer.scale_fwd, fresh)
    state = dict(source.state_dict(), _extra_state=torch.ones(40, dtype=torch.uint8))
    layer = te.Linear(32, 16, device="cpu")
    fresh = layer.scale_fwd.clone()
    with pytest.raises(ValueError, match=r"Linear.set_extra_state: expected NVIDIA Transformer "
                                         r"Engine's pickled FP8 state .*40 bytes do not decode"):
        layer.load_state_dict(state)
    assert torch.equal(layer.scale_fwd, fresh)
