"""One rank of the late-group test (test_parallel_worlds.py): ``python _tp_rank_late_group.py
RANK WORLD PORT``. Each module built with ``tp_size`` and no ``tp_group``, then given the group
by ``set_tensor_parallel_group`` (NVIDIA's way), holds the parameters of the module built with
the group, and gives its outputs and gradients; before the group it refuses to run.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case

import transformer_engine.pytorch as te

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
H = 32


def builders():
    kw = dict(device="cpu", tp_size=WORLD)
    return {
        "Linear column": (lambda g: te.Linear(H, 2 * H, tp_group=g, parallel_mode="column",
                                              **kw), (8, H)),
        "Linear column split": (lambda g: te.Linear(H, 3 * H, tp_group=g, parallel_mode="column",
                                                    parameters_split=("query", "key", "value"),
                                                    **kw), (8, H)),
        "Linear row": (lambda g: te.Linear(2 * H, H, tp_group=g, parallel_mode="row", **kw),
                       (8, 2 * H // WORLD)),
        "LayerNormLinear": (lambda g: te.LayerNormLinear(H, 2 * H, tp_group=g,
                                                         parallel_mode="column", **kw), (8, H)),
        "LayerNormMLP swiglu": (lambda g: te.LayerNormMLP(H, 2 * H, tp_group=g,
                                                          set_parallel_mode=True,
                                                          activation="swiglu", **kw), (8, H)),
        "TransformerLayer": (lambda g: te.TransformerLayer(H, 2 * H, 4, tp_group=g,
                                                           set_parallel_mode=True,
                                                           hidden_dropout=0.0,
                                                           attention_dropout=0.0, **kw),
                             (6, 2, H)),
    }


def check(name):
    build, shape = builders()[name]
    torch.manual_seed(0)
    early = build(GROUP)
    torch.manual_seed(0)
    late = build(None)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(RANK))
    try:
        late(x)
    except RuntimeError as e:
        assert "set_tensor_parallel_group(tp_group) before its forward" in str(e), e
    else:
        raise AssertionError(f"{name}: ran without its group")
    late.set_tensor_parallel_group(GROUP)
    late.set_tensor_parallel_group(GROUP)  # the same group again: nothing to do
    a = dict(early.named_parameters()) | dict(early.named_buffers())
    b = dict(late.named_parameters()) | dict(late.named_buffers())
    assert a.keys() == b.keys(), (name, a.keys() ^ b.keys())
    for key in a:
        assert torch.equal(a[key], b[key]), (name, key)
    for p, q in zip(early.parameters(), late.parameters(), strict=True):
        assert getattr(p, "partition_dim", None) == getattr(q, "partition_dim", None), name
    outs = []
    for m in (early, late):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.sum().backward()
        outs.append((y.detach(), xi.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), name


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for name in builders():
        case(check, name)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
