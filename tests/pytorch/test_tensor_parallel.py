"""te.Linear with parallel_mode "column" and "row" on torch.distributed (gloo, CPU processes).

Each world runs _tp_rank.py in one process per rank: every rank builds the parallel layer and
the single-process layer from the same seed and checks its shards of the output, the input
gradient and the parameter gradients against the single-process layer's (bit-exact in fp32
where the arithmetic is the same; bounded where a sum is taken in another order; FP8 against
FP8 within FP8's rounding), and that with fp8_group=tp_group every rank ends each delayed-
scaling step with the same scales. The argument checks run here, with a stand-in group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from te_torch_tests._tp_world import SizedGroup, run_world

import transformer_engine.pytorch as te

_RANK_SCRIPT = Path(__file__).resolve().parent / "_tp_rank.py"


def _run_world(world: int) -> None:
    run_world(_RANK_SCRIPT, world)


@pytest.mark.slow
def test_two_ranks():
    """Column and row, fp32 and bf16, every FP8 recipe kind, fp8_group scales, bad inputs."""
    _run_world(2)


@pytest.mark.slow
def test_four_ranks():
    """Column and row in fp32 and under delayed scaling with fp8_group."""
    _run_world(4)





@pytest.mark.parametrize("kwargs, error, words", [
    (dict(parallel_mode="diagonal"), ValueError,
     ["te.Linear", "parallel_mode", "'column' or 'row'", "'diagonal'"]),
    (dict(tp_group=SizedGroup(2), tp_size=4, parallel_mode="column"), ValueError,
     ["te.Linear", "tp_size must equal the size of tp_group (2)", "got 4"]),
    (dict(tp_group=SizedGroup(2), parallel_mode="row"), ValueError,  # tp_size left at 1
     ["tp_size must equal the size of tp_group (2)", "got 1"]),
    (dict(tp_group=object(), tp_size=2, parallel_mode="row"), TypeError,
     ["te.Linear", "tp_group must be a torch.distributed ProcessGroup", "object"]),
    (dict(tp_group=SizedGroup(3), tp_size=3, parallel_mode="row"), ValueError,
     ["te.Linear", "in_features must be divisible by tp_size=3, got 32"]),
    (dict(tp_group=SizedGroup(3), tp_size=3, parallel_mode="column"), ValueError,
     ["te.Linear", "out_features must be divisible by tp_size=3, got 64"]),
    (dict(tp_size=0), ValueError, ["te.Linear", "tp_size must be a positive int", "0"]),
    (dict(tp_group=SizedGroup(2), tp_size=2, parallel_mode="column",
          parameters_split={"q": 33, "k": 31}), ValueError,
     ["te.Linear", "the size of parameters_split block 'q' must be divisible by tp_size=2",
      "got 33"]),
], ids=["mode", "size-mismatch", "size-default", "not-a-group", "in-features",
        "out-features", "size-zero", "split-block"])
def test_bad_arguments_are_refused(kwargs, error, words):
    with pytest.raises(error) as info:
        te.Linear(32, 64, device="cpu", **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_replicated_layer_with_a_group_is_a_plain_layer():
    """parallel_mode=None with a group: nothing is split (the group is only checked), and the
    layer is the one tp_size=1 builds from the same seed."""
    torch.manual_seed(0)
    plain = te.Linear(32, 64, device="cpu")
    torch.manual_seed(0)
    replicated = te.Linear(32, 64, device="cpu", tp_group=SizedGroup(2), tp_size=2)
    assert replicated.tp_group is None and replicated.weight.shape == (64, 32)
    assert torch.equal(plain.weight, replicated.weight)
    assert torch.equal(plain.bias, replicated.bias)


@pytest.mark.parametrize("make", [
    lambda: te.Linear(32, 64, tp_size=2, parallel_mode="column", device="cpu"),
    lambda: te.LayerNormMLP(32, 64, tp_size=2, set_parallel_mode=True, device="cpu"),
    lambda: te.TransformerLayer(32, 64, 4, tp_size=2, set_parallel_mode=True, device="cpu"),
], ids=["Linear", "LayerNormMLP", "TransformerLayer"])
def test_built_without_its_group_a_module_waits_for_set_tensor_parallel_group(make):
    """NVIDIA's way: tp_size at construction, the group later. Until then the forward refuses;
    a group of another size is refused (the late group itself: _tp_rank_late_group.py)."""
    m = make()
    x = torch.randn(2, 3, 32) if isinstance(m, te.TransformerLayer) else torch.randn(4, 32)
    with pytest.raises(RuntimeError, match=r"split over tp_size=2 ranks but has no "
                                           r"tensor-parallel group yet; call "
                                           r"set_tensor_parallel_group\(tp_group\)"):
        m(x)
    with pytest.raises(ValueError, match="the group must have tp_size=2 ranks, got 3"):
        m.set_tensor_parallel_group(SizedGroup(3))
    with pytest.raises(ValueError, match="set_tensor_parallel_group needs the group"):
        m.set_tensor_parallel_group(None)


def test_a_module_not_split_takes_only_a_group_of_one():
    m = te.Linear(32, 64, device="cpu")
    m.set_tensor_parallel_group(None)
    m.set_tensor_parallel_group(SizedGroup(1))
    with pytest.raises(ValueError, match="got a group of 2 ranks, but the module is not split"):
        m.set_tensor_parallel_group(SizedGroup(2))
