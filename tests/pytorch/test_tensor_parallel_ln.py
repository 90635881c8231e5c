"""te.LayerNormLinear (parallel_mode="column") and te.LayerNormMLP (set_parallel_mode=True) on
torch.distributed (gloo, CPU processes).

Each world runs _tp_rank_ln.py in one process per rank: every rank builds the parallel modules
and the single-process ones from the same seed and checks its shards of the outputs, the input
gradient and the parameter gradients against the single-process module's (bit-exact in fp32
where the arithmetic is the same; bounded where the ranks sum what one process sums in one
GEMM; FP8 against FP8 within FP8's rounding), and that with fp8_group=tp_group every rank ends
each delayed-scaling step with the same scales. The argument checks run here, with a stand-in
group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from te_torch_tests._tp_world import SizedGroup, run_world

import transformer_engine.pytorch as te

_RANK_SCRIPT = Path(__file__).resolve().parent / "_tp_rank_ln.py"


def _run_world(world: int) -> None:
    run_world(_RANK_SCRIPT, world)


@pytest.mark.slow
def test_two_ranks():
    """Both modules (LayerNorm and RMSNorm, GELU and SwiGLU, the norm's output returned), fp32
    and bf16, every FP8 recipe kind, fp8_group scales, options, bad inputs."""
    _run_world(2)


@pytest.mark.slow
def test_four_ranks():
    """Both modules in fp32, and under delayed scaling with fp8_group."""
    _run_world(4)





@pytest.mark.parametrize("kwargs, error, words", [
    (dict(tp_group=SizedGroup(2), tp_size=2, parallel_mode="row"), NotImplementedError,
     ["te.LayerNormLinear", "parallel_mode='row' is not implemented", "full input features",
      "parallel_mode='column'"]),
    (dict(tp_group=SizedGroup(3), tp_size=3, parallel_mode="column"), ValueError,
     ["te.LayerNormLinear", "out_features must be divisible by tp_size=3, got 64"]),
    (dict(tp_group=SizedGroup(2), tp_size=4, parallel_mode="column"), ValueError,
     ["te.LayerNormLinear", "tp_size must equal the size of tp_group (2)", "got 4"]),
    (dict(parallel_mode="diagonal"), ValueError,
     ["te.LayerNormLinear", "parallel_mode", "'diagonal'"]),
], ids=["row", "out-features", "size-mismatch", "mode"])
def test_layernorm_linear_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        te.LayerNormLinear(32, 64, device="cpu", **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(tp_group=SizedGroup(3), tp_size=3, set_parallel_mode=True), ValueError,
     ["te.LayerNormMLP", "ffn_hidden_size must be divisible by tp_size=3, got 64"]),
    (dict(tp_group=SizedGroup(2), tp_size=4, set_parallel_mode=True), ValueError,
     ["te.LayerNormMLP", "tp_size must equal the size of tp_group (2)", "got 4"]),
    (dict(tp_group=SizedGroup(2), set_parallel_mode=True), ValueError,  # tp_size left at 1
     ["tp_size must equal the size of tp_group (2)", "got 1"]),
    (dict(tp_group=object(), tp_size=2, set_parallel_mode=True), TypeError,
     ["te.LayerNormMLP", "tp_group must be a torch.distributed ProcessGroup"]),
    (dict(tp_group=SizedGroup(2), tp_size=2, set_parallel_mode="column"), TypeError,
     ["te.LayerNormMLP", "set_parallel_mode must be a bool", "'column'"]),
], ids=["ffn", "size-mismatch", "size-default", "not-a-group",
        "mode-not-bool"])
def test_layernorm_mlp_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        te.LayerNormMLP(32, 64, device="cpu", **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("cls, args, tp", [
    (te.LayerNormLinear, (32, 64), dict(parallel_mode=None)),
    (te.LayerNormMLP, (32, 64), dict(set_parallel_mode=False)),
], ids=["layernorm-linear", "layernorm-mlp"])
def test_replicated_module_with_a_group_is_a_plain_module(cls, args, tp):
    """No parallel mode with a group: nothing is split (the group is only checked), and the
    module is the one tp_size=1 builds from the same seed."""
    torch.manual_seed(0)
    plain = cls(*args, device="cpu")
    torch.manual_seed(0)
    replicated = cls(*args, device="cpu", tp_group=SizedGroup(2), tp_size=2, **tp)
    assert replicated.tp_group is None
    for (name, a), (_, b) in zip(plain.named_parameters(), replicated.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
