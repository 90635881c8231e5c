"""te.checkpoint(distribute_saved_activations=True, tp_group=...): the input kept for the
recompute is split over the tensor-parallel group and all-gathered back in the backward.

Each world runs _recompute_tp_rank.py in one process per rank (gloo, CPU): te blocks under the
split checkpoint give the bits of a run without recompute (fp32 and FP8, a tensor-parallel
LayerNormMLP and two TransformerLayers, element counts tp does not divide, two groups of two
ranks in a world of four), and what the checkpoint keeps of the input is 1/tp of it. The
argument checks and the cases with nothing to split run here, in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from te_torch_tests._tp_world import SizedGroup, run_world

import transformer_engine.pytorch as te

_RANK_SCRIPT = Path(__file__).resolve().parent / "_recompute_tp_rank.py"


def test_two_ranks():
    run_world(_RANK_SCRIPT, 2)


@pytest.mark.slow
def test_four_ranks():
    """Also two groups of two ranks with different inputs."""
    run_world(_RANK_SCRIPT, 4)


def _grads(checkpointed: bool, tokens: int = 4, **keywords):
    torch.manual_seed(0)
    layer = te.LayerNormLinear(32, 16, device="cpu")
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = te.checkpoint(layer, x, **keywords) if checkpointed else layer(x)
    (y.square().sum() + 1.0).backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("tp_group, tokens", [(None, 4), (SizedGroup(1), 4), (SizedGroup(2), 0)],
                         ids=["None", "one-rank", "empty-input"])
def test_nothing_to_split_is_the_plain_checkpoint(tp_group, tokens):
    # (the stand-in group has no rank and no collective: using either would raise)
    want = _grads(False, tokens)
    got = _grads(True, tokens, distribute_saved_activations=True, tp_group=tp_group)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_bad_arguments():
    layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(4, 32, requires_grad=True)
    with pytest.raises(ValueError, match=r"te.checkpoint: distribute_saved_activations=True "
                                         r"needs use_reentrant=True or None.*got "
                                         r"use_reentrant=False"):
        te.checkpoint(layer, x, distribute_saved_activations=True, tp_group=SizedGroup(2),
                      use_reentrant=False)
    with pytest.raises(TypeError, match=r"te.checkpoint: distribute_saved_activations=True "
                                        r"needs a tensor .* got \('int', 'float'\)"):
        te.checkpoint(lambda a, b: layer(x) * a * b, 2, 3.0, distribute_saved_activations=True)
    with pytest.raises(TypeError, match="te.checkpoint: tp_group must be a torch.distributed "
                                        "ProcessGroup or None, got int"):
        te.checkpoint(layer, x, distribute_saved_activations=True, tp_group=2)
    # without distribute_saved_activations the group is not looked at, as in NVIDIA's
    te.checkpoint(layer, x, tp_group=2, use_reentrant=False).sum().backward()
