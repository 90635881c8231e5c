"""One rank of the DDP tests (test_parallel_worlds.py): ``python _ddp_rank.py RANK WORLD PORT``.
A stack of te.TransformerLayer wrapped in torch's DistributedDataParallel trains on this
rank's share of a batch; DDP averages the gradients over the ranks, so each training step
(gradients, then the parameters after an SGD step) must match the unwrapped stack's on the
whole batch: fp32, FP8 current scaling, delayed scaling with the amaxes reduced over the group
(fp8_group), and fp8_model_init weights (Float8Tensor parameters). The replicas stay
identical: every rank holds the same parameters (FP8 bytes included) and FP8 state.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import copy
import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import (
    case,
    fp8_state_same_on_ranks,
    gathered,
    generator,
    layer_stack,
    rms_close,
)

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.float8_tensor import Float8Tensor
from transformer_engine.pytorch.module.base import FP8Module

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H = 16, 4, 64  # sequence, global batch (split over the ranks), hidden


def stack(fp8_weights=None):
    """Two layers (_tp_world.layer_stack); ``fp8_weights`` a recipe: under fp8_model_init."""
    return layer_stack(H, fp8_weights)


def loss_of(model, x, r, group=None):
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r, fp8_group=group):
        y = model(x)
    return y.float().square().sum() / x.shape[1]  # a mean over the batch: DDP averages


def values(p):
    return p.dequantize() if isinstance(p, Float8Tensor) else p.detach()


def check(r, rel, group=None, fp8_weights=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref = stack(r if fp8_weights else None)
    model = DDP(copy.deepcopy(ref))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x = torch.randn(S, B, H, generator=generator(1))
    for step in range(2):
        what = f"{r} fp8_weights={fp8_weights} step {step}"
        loss_of(ref, x, r).backward()
        loss_of(model, x.chunk(WORLD, dim=1)[RANK], r, group).backward()
        scale = max(float(q.grad.norm()) for q in ref.parameters())
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters(), strict=True):
            if float(q.grad.norm()) < 1e-4 * scale:  # the key bias: zero but for rounding
                assert float(p.grad.norm()) < 1e-3 * scale, f"{what} {name}.grad"
            else:
                rms_close(p.grad, q.grad, rel, f"{what} {name}.grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters(), strict=True):
            if float(values(q).norm()) < 1e-6:  # the key bias: zero but for rounding
                assert float(values(p).norm()) < 1e-4, f"{what} {name} after the step"
            else:
                rms_close(values(p), values(q), rel, f"{what} {name} after the step")
    same_replicas(model.module, group or dist.group.WORLD)


def same_replicas(module, group):
    """Every rank holds the same parameters (an FP8 weight: its bytes and scale) and, where
    the amaxes were reduced, the same FP8 state."""
    for name, p in module.named_parameters():
        parts = (p._data, p._scale_inv) if isinstance(p, Float8Tensor) else (p.detach(),)
        for part in parts:
            copies = gathered(part, WORLD, group)
            assert all(torch.equal(c, copies[0]) for c in copies), f"{name} differs over ranks"
    for name, m in module.named_modules():
        if isinstance(m, FP8Module) and not getattr(m, "_fp8_unused", False):
            assert all(fp8_state_same_on_ranks(m, WORLD, group)), f"{name}: FP8 state differs"


if __name__ == "__main__":
    _tp_world.start(RANK, WORLD, PORT)
    case(check, None, 1e-5)
    case(check, recipe.Float8CurrentScaling(), 0.15)
    case(check, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check, recipe.Float8CurrentScaling(), 0.15, None, True)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
