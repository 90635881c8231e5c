"""One rank of the FSDP2 tests (test_parallel_worlds.py): ``python _fsdp_rank.py RANK WORLD PORT``.
A stack of te.TransformerLayer sharded with torch's ``fully_shard`` (each layer, then the
whole) trains on this rank's share of a batch; its gradients (FSDP averages them over the
ranks) are checked against the unsharded stack's on the whole batch, in fp32 and in FP8
(current scaling; delayed scaling with the amaxes reduced over the group).

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import copy
import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H = 16, 4, 64  # sequence, global batch (split over the ranks), hidden


def stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(*(te.TransformerLayer(H, 2 * H, 4, hidden_dropout=0.0,
                                                     attention_dropout=0.0, device="cpu")
                                 for _ in range(2)))


def loss_of(model, x, r, group=None):
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r, fp8_group=group):
        y = model(x)
    return y.float().square().sum() / x.shape[1]  # a mean over the batch: FSDP averages


def check(r, rel, group=None):
    from torch.distributed.fsdp import fully_shard

    ref = stack()
    model = copy.deepcopy(ref)
    for layer in model:
        fully_shard(layer, mesh=MESH)
    fully_shard(model, mesh=MESH)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        loss_of(ref, x, r).backward()
        loss_of(model, x.chunk(WORLD, dim=1)[RANK], r, group).backward()
        scale = max(float(q.grad.norm()) for q in ref.parameters())
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            got = p.grad.full_tensor()
            what = f"{r} step {step} {name}.grad"
            if float(q.grad.norm()) < 1e-4 * scale:  # the key bias: zero but for rounding
                assert float(got.norm()) < 1e-3 * scale, what
            else:
                rms_close(got, q.grad, rel, what)
            p.grad = q.grad = None


def check_meta_init():
    """Built on the meta device, sharded, moved with to_empty and reset: the sharded stack
    holds the values of one built on the CPU (reset_parameters fills each rank's shard)."""
    from torch.distributed.fsdp import fully_shard

    ref = stack()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(te.TransformerLayer(H, 2 * H, 4, hidden_dropout=0.0,
                                                      attention_dropout=0.0, device="meta")
                                  for _ in range(2)))
    for layer in model:
        fully_shard(layer, mesh=MESH)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in model:
        layer.reset_parameters()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q), name


if __name__ == "__main__":
    _tp_world.start(RANK, WORLD, PORT)
    from torch.distributed.device_mesh import init_device_mesh

    MESH = init_device_mesh("cpu", (WORLD,))  # one mesh for every check
    case(check, None, 1e-5)
    case(check, recipe.Float8CurrentScaling(), 0.15)
    case(check, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_meta_init)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
