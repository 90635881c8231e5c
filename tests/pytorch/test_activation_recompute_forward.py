"""NVIDIA's ``activation_recompute_forward`` (transformer_engine.pytorch.distributed), which
Megatron-LM's own activation checkpoint wraps around its first forward and its recompute:
layers checkpointed that way give the bits of a run without recompute under delayed scaling
(outputs, gradients, FP8 state over several steps), though the recomputes run in reverse
layer order, after the autocast's exit has moved the scales."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.distributed import (
    activation_recompute_forward,
    in_fp8_activation_recompute_phase,
    is_fp8_activation_recompute_enabled,
)


class _CallerCheckpoint(torch.autograd.Function):
    """A checkpoint written as Megatron writes its own: the forward keeps only the input, the
    backward runs the block again (in the autocast the step used) and differentiates it."""

    @staticmethod
    def forward(ctx, block, recipe, x):
        ctx.block, ctx.recipe = block, recipe
        ctx.save_for_backward(x)
        with torch.no_grad(), activation_recompute_forward(activation_recompute=True):
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), te.fp8_autocast(fp8_recipe=ctx.recipe), \
                activation_recompute_forward(activation_recompute=True, recompute_phase=True):
            y = ctx.block(x)
        torch.autograd.backward(y, grad)
        return None, None, x.grad


def _blocks():
    torch.manual_seed(0)
    return torch.nn.ModuleList([
        te.LayerNormMLP(32, 64, device="cpu"),
        te.LayerNormLinear(32, 32, device="cpu"),
        te.Linear(32, 32, device="cpu"),
    ])


def _train(blocks, recipe, checkpointed: bool, steps: int = 3):
    gen = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(steps):
        x = (torch.randn(16, 32, generator=gen) * 3).requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=recipe):
            y = x
            for block in blocks:
                y = _CallerCheckpoint.apply(block, recipe, y) if checkpointed else block(y)
        y.float().square().sum().backward()
        outs += [y.detach(), x.grad]
    return outs + [p.grad for p in blocks.parameters()] + list(blocks.buffers())


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_caller_checkpoint_gives_the_bits_of_no_recompute(recipe):
    plain = _blocks()
    checkpointed = copy.deepcopy(plain)
    want = _train(plain, recipe, checkpointed=False)
    got = _train(checkpointed, recipe, checkpointed=True)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


def test_flags_and_no_effect_outside_fp8():
    assert not is_fp8_activation_recompute_enabled()
    with activation_recompute_forward(activation_recompute=True):  # no autocast: nothing
        assert not is_fp8_activation_recompute_enabled()
    with te.fp8_autocast():
        with activation_recompute_forward(activation_recompute=True):
            assert is_fp8_activation_recompute_enabled()
            assert not in_fp8_activation_recompute_phase()
        with activation_recompute_forward(activation_recompute=True, recompute_phase=True):
            assert in_fp8_activation_recompute_phase()
        with activation_recompute_forward(activation_recompute=False, recompute_phase=True):
            assert not in_fp8_activation_recompute_phase()
    assert not in_fp8_activation_recompute_phase()


def test_a_recompute_without_its_first_run_is_an_error():
    layer = te.Linear(16, 16, device="cpu")
    with te.fp8_autocast(fp8_recipe=DelayedScaling()), \
            activation_recompute_forward(activation_recompute=True, recompute_phase=True):
        with pytest.raises(RuntimeError, match="no first run"):
            layer(torch.randn(16, 16))
