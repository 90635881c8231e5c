"""One rank of te.parallel_cross_entropy's split-vocabulary tests (test_cross_entropy.py):
``python _cross_entropy_rank.py RANK WORLD PORT``.

Every rank of a group builds the same logits over the whole vocabulary and keeps its slice
(the group's rank r holds columns [r V / tp, (r + 1) V / tp)); its loss and its slice of the
gradient are checked against torch's cross entropy of the whole logits in float64: float32 and
bfloat16, label smoothing, ignored tokens, the mean, the z-loss, the sbhd layout, targets in
every rank's slice; and under torch.compile (in the world of 2). In a world of 4, also two
groups of 2 with different logits, where a rank's place in its group (not in the world) picks
its slice.
Failures are printed and the exit status is 1. A standalone script, as _tp_rank.py.
"""

from __future__ import annotations

import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _reference import cross_entropy64
from _tolerances import CROSS_ENTROPY_RTOL, assert_within
from _tp_world import case

import transformer_engine.pytorch as te

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, V = 6, 2, 96  # sequence, batch, whole vocabulary


def inputs(seed: int, dtype: torch.dtype, ignore_idx: int):
    """[s, b, V] logits, the same on every rank of a group; [s, b] targets, every fourth
    token ignored, the others spread over the vocabulary (every rank's slice holds some)."""
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(S, B, V, generator=gen, dtype=torch.float64)).to(dtype)
    t = torch.randint(0, V, (S, B), generator=gen)
    t.view(-1)[::4] = ignore_idx
    w = torch.randn(S, B, generator=gen, dtype=torch.float64)  # the incoming gradient
    return x, t, w


def check_slice(group, seed, dtype, label_smoothing, reduce_loss, z_loss_weight, compiled=False):
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    width = V // tp
    ignore_idx = -100
    x, t, w = inputs(seed, dtype, ignore_idx)
    mine = x[..., r * width:(r + 1) * width].clone().requires_grad_()
    fn = torch.compile(te.parallel_cross_entropy, fullgraph=True) if compiled \
        else te.parallel_cross_entropy
    loss = fn(mine, t, label_smoothing, reduce_loss, group, ignore_idx,
              z_loss_weight=z_loss_weight)
    kept = (t != ignore_idx).double()
    if reduce_loss:
        assert loss.dim() == 0, loss.shape
        w = kept / kept.sum()
        loss.backward()
    else:
        (loss * w.to(loss.dtype)).sum().backward()
    ref, grad, loss_mag, grad_mag = cross_entropy64(x, t, w, label_smoothing, ignore_idx,
                                                    z_loss_weight)
    if reduce_loss:
        ref, loss_mag = ref.sum() / kept.sum(), loss_mag.sum() / kept.sum()
    what = f"group of {tp} rank {r} {dtype} eps={label_smoothing} mean={reduce_loss} " \
           f"z={z_loss_weight} compiled={compiled}"
    assert_within(loss, ref, loss_mag, CROSS_ENTROPY_RTOL[torch.float32], what + " loss")
    assert_within(mine.grad, grad[..., r * width:(r + 1) * width],
                  grad_mag[..., r * width:(r + 1) * width], CROSS_ENTROPY_RTOL[dtype],
                  what + " grad")


def groups():
    """(a group this rank is in, a seed for its logits): all ranks; in a world of 4 also
    ranks 0, 1 and ranks 2, 3, with different logits (every rank creates every group)."""
    pairs = [dist.new_group(list(r)) for r in ((0, 1), (2, 3))] if WORLD == 4 else None
    return [(GROUP, 0)] + ([(pairs[RANK // 2], 1 + RANK // 2)] if pairs else [])


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for group, seed in groups():
        for dtype in (torch.float32, torch.bfloat16):
            case(check_slice, group, seed, dtype, 0.0, False, 0.0)
            case(check_slice, group, seed, dtype, 0.1, True, 0.0)
        case(check_slice, group, seed, torch.float32, 0.1, False, 1e-2)
    if WORLD == 2:  # compiling takes seconds: once is enough
        case(check_slice, GROUP, 0, torch.float32, 0.1, True, 1e-2, True)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
