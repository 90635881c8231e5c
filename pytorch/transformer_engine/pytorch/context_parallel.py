"""Context parallelism of DotProductAttention: the sequence split over the ranks of a group.

Each rank holds two of the sequence's ``2 * cp`` equal chunks, ``r`` and ``2 * cp - 1 - r``
(the load-balanced layout that NVIDIA TE and Megatron-LM use: under a causal mask every rank
then has the same amount of work). Attention gathers k and v over the group (all-gather along
the sequence, put back in sequence order; the backward reduce-scatters their gradients) and
each local q chunk attends to the keys up to its own end with a bottom-right causal mask (or
to all keys without a mask), so every rank computes exactly its rows of full attention. This
is NVIDIA's ``cp_comm_type="all_gather"``; the other comm types (p2p rings, all-to-all) give
the same numbers with other communication and run this one here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import distributed

__all__ = ["ContextParallel", "attend", "check_comm_type"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
MASKS = ("causal", "no_mask")


def check_comm_type(comm_type: str) -> None:
    if comm_type not in COMM_TYPES:
        raise ValueError(f"DotProductAttention: cp_comm_type must be one of {COMM_TYPES}, got "
                         f"{comm_type!r}")


class ContextParallel:
    """A module's context-parallel group (shared, not copied, by a deep copy of the module:
    communicators cannot be copied)."""

    __slots__ = ("group", "size", "rank", "comm_type")

    def __init__(self, group: Any, comm_type: str) -> None:
        import torch.distributed as dist

        check_comm_type(comm_type)
        self.group, self.comm_type = group, comm_type
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __deepcopy__(self, memo) -> "ContextParallel":
        return self

    def chunks(self) -> tuple[int, int]:
        """The sequence chunks this rank holds, in order."""
        return self.rank, 2 * self.size - 1 - self.rank


class _GatherSequence(torch.autograd.Function):
    """Every rank's two chunks (dimension 0) gathered and put in sequence order; the backward
    sums the gradient over the ranks and returns this rank's two chunks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        gathered = distributed.gather_first_dim(t, cp.group)  # rank-major: [r: c_r, c_2cp-1-r]
        pieces = gathered.chunk(2 * cp.size)
        order = [None] * (2 * cp.size)
        for r in range(cp.size):
            order[r], order[2 * cp.size - 1 - r] = pieces[2 * r], pieces[2 * r + 1]
        return torch.cat(order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        pieces = grad.chunk(2 * cp.size)
        rank_major = [p for r in range(cp.size) for p in (pieces[r], pieces[2 * cp.size - 1 - r])]
        return distributed.reduce_scatter_first_dim(torch.cat(rank_major), cp.group,
                                                    "context parallelism"), None


def attend(attend_one: Callable, cp: ContextParallel, query, key, value, layout: str,
           mask: str) -> torch.Tensor:
    """The rank's rows of attention over the whole sequence. ``attend_one(q, k, v, mask)`` is
    the module's attention of one call (in ``layout``)."""
    if layout not in ("sbhd", "bshd"):
        raise NotImplementedError(f"DotProductAttention: context parallelism takes qkv_format "
                                  f"'sbhd' or 'bshd', got {layout!r}")
    if mask not in MASKS:
        raise NotImplementedError(f"DotProductAttention: context parallelism supports "
                                  f"attn_mask_type in {MASKS}, got {mask!r}")
    seq = 0 if layout == "sbhd" else 1
    local = query.shape[seq]
    if local % 2 or key.shape[seq] != local:
        raise ValueError(f"DotProductAttention: under context parallelism each rank holds two "
                         f"equal chunks of the sequence (an even local length, the same for q "
                         f"and k), got q {list(query.shape)} and k {list(key.shape)}")

    def gather(t):
        t = t.movedim(seq, 0)
        return _GatherSequence.apply(t.contiguous(), cp).movedim(0, seq)

    keys, values = gather(key), gather(value)
    if mask == "no_mask":
        return attend_one(query, keys, values, "no_mask")
    c = local // 2
    outs = []
    for i, chunk in enumerate(cp.chunks()):
        q = query.narrow(seq, i * c, c)
        end = (chunk + 1) * c  # keys up to this chunk's end, the last c of them its own
        outs.append(attend_one(q, keys.narrow(seq, 0, end), values.narrow(seq, 0, end),
                               "causal_bottom_right"))
    return torch.cat(outs, dim=seq)
