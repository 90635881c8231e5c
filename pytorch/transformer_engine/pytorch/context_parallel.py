"""Context parallelism of DotProductAttention: the sequence split over the ranks of a group.

Each rank holds two of the sequence's ``2 * cp`` equal chunks, ``r`` and ``2 * cp - 1 - r``
(the load-balanced layout that NVIDIA TE and Megatron-LM use: under a causal mask every rank
then has the same amount of work), and computes exactly its rows of attention over the whole
sequence. ``cp_comm_type`` says how the rest of the sequence reaches it:

* ``"all_gather"`` (here): k and v are gathered over the group (all-gather along the sequence,
  put back in sequence order; the backward reduce-scatters their gradients) and each local q
  chunk attends to the keys up to its own end with a bottom-right causal mask (or to all keys
  without a mask), through the module's own attention (its backends, FP8).
* ``"p2p"`` (context_parallel_ring.py): a ring; the k/v blocks travel from rank to rank and
  the partial results merge by their softmax statistics, so a rank holds two blocks of k and v
  at a time, never the whole sequence.
* ``"a2a"`` (context_parallel_a2a.py): all-to-alls trade the split of the sequence for a split
  of the heads and back; each rank attends whole sequences for ``h / cp`` heads.
* ``"a2a+p2p"`` (``cp_group`` = [all-to-all group, ring group]): an all-to-all inside the
  first group gives each of its ranks all its chunks for a share of the heads, and those
  travel the ring across the groups.

The ring and the all-to-all compute attention themselves (the module does not return its
softmax statistics, and checks for its own number of heads), in high precision, with the
module's softmax scale and dropout. Under ``fp8_dpa`` attention stays FP8 whatever the comm
type: the other types then gather k and v as ``"all_gather"`` does, with a warning (once per
comm type) that says so.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

from . import distributed
from .context_parallel_a2a import a2a_attention, check_heads, heads_to_ranks, sequence_to_ranks
from .context_parallel_ring import Ring, ring_attention
from .float8_tensor import to_high_precision

__all__ = ["ContextParallel", "attend", "attend_packed", "check_comm_type"]

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
MASKS = ("causal", "no_mask")


def check_comm_type(comm_type: str) -> None:
    if comm_type not in COMM_TYPES:
        raise ValueError(f"DotProductAttention: cp_comm_type must be one of {COMM_TYPES}, got "
                         f"{comm_type!r}")


class ContextParallel:
    """A module's context-parallel group (shared, not copied, by a deep copy of the module:
    communicators cannot be copied). ``size`` and ``rank`` are those of the whole split; under
    ``"a2a+p2p"`` ``group`` is the pair (all-to-all group, ring group) and the rank is
    ``ring rank * all-to-all size + all-to-all rank`` (the all-to-all groups hold consecutive
    ranks)."""

    __slots__ = ("group", "size", "rank", "comm_type", "a2a_size")

    def __init__(self, group: Any, comm_type: str) -> None:
        import torch.distributed as dist

        check_comm_type(comm_type)
        hierarchical = comm_type == "a2a+p2p"
        if hierarchical != isinstance(group, (list, tuple)):
            raise ValueError(f"DotProductAttention: cp_group must be a list of two process "
                             f"groups (all-to-all, ring) exactly when cp_comm_type is "
                             f"'a2a+p2p', got {type(group).__name__} with {comm_type!r}")
        self.group, self.comm_type = group, comm_type
        if hierarchical:
            if len(group) != 2:
                raise ValueError(f"DotProductAttention: cp_comm_type 'a2a+p2p' takes cp_group "
                                 f"as [all-to-all group, ring group], got {len(group)} groups")
            a2a, ring = group
            self.a2a_size = dist.get_world_size(a2a)
            self.size = self.a2a_size * dist.get_world_size(ring)
            self.rank = dist.get_rank(ring) * self.a2a_size + dist.get_rank(a2a)
        else:
            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
            self.a2a_size = self.size if comm_type == "a2a" else 1

    def __deepcopy__(self, memo) -> "ContextParallel":
        return self

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The sequence chunks ``rank`` holds, in order."""
        return rank, 2 * self.size - 1 - rank

    def chunks(self) -> tuple[int, int]:
        """The sequence chunks this rank holds, in order."""
        return self.chunks_of(self.rank)

    def a2a_chunks(self, ring_rank: int) -> list[tuple[int, int]]:
        """The chunks of each rank of the all-to-all group at ``ring_rank`` on the ring."""
        first = ring_rank * self.a2a_size
        return [self.chunks_of(first + i) for i in range(self.a2a_size)]


def _gather_ranks(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Every rank's ``t`` along dimension 0, in rank order. Under ``"a2a+p2p"`` inside the
    all-to-all group first, then across the ring: ring-major, as the ranks are numbered."""
    if isinstance(cp.group, (list, tuple)):
        a2a, ring = cp.group
        return distributed.gather_first_dim(distributed.gather_first_dim(t, a2a), ring)
    return distributed.gather_first_dim(t, cp.group)


def _reduce_scatter_ranks(t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The reverse of _gather_ranks: this rank's share of ``t`` summed over every rank (across
    the ring first, then inside the all-to-all group)."""
    what = "context parallelism"
    if isinstance(cp.group, (list, tuple)):
        a2a, ring = cp.group
        return distributed.reduce_scatter_first_dim(
            distributed.reduce_scatter_first_dim(t, ring, what), a2a, what)
    return distributed.reduce_scatter_first_dim(t, cp.group, what)


class _GatherSequence(torch.autograd.Function):
    """Every rank's two chunks (dimension 0) gathered and put in sequence order; the backward
    sums the gradient over the ranks and returns this rank's two chunks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        gathered = _gather_ranks(t, cp)  # rank-major: [r: c_r, c_2cp-1-r]
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
        return _reduce_scatter_ranks(torch.cat(rank_major), cp), None


def attend(attend_one: Callable, cp: ContextParallel, query, key, value, layout: str,
           mask: str, softmax_scale: float, dropout: float, fp8: bool) -> torch.Tensor:
    """The rank's rows of attention over the whole sequence, flattened over the heads.
    ``attend_one(q, k, v, mask)`` is the module's attention of one call (in ``layout``);
    ``softmax_scale`` and ``dropout`` (0 outside training) are the module's, for the paths
    that compute attention blocks themselves; ``fp8``: the module's attention runs in FP8
    (fp8_dpa), which only the all-gather path keeps."""
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
    if cp.comm_type == "all_gather" or fp8:
        if fp8 and cp.comm_type != "all_gather":
            _warn_fp8_gathers(cp.comm_type)
        return _attend_gathered(attend_one, cp, query, key, value, seq, mask)
    if cp.comm_type != "p2p":
        check_heads(cp.comm_type, cp.a2a_size, query.shape[-2], key.shape[-2])
    query, key, value = (to_high_precision(t) for t in (query, key, value))
    scale = softmax_scale
    causal = mask == "causal"
    if cp.comm_type == "a2a":  # works in sbhd
        q, k, v = (t.movedim(seq, 0) for t in (query, key, value))
        o = a2a_attention(cp.group, cp.a2a_chunks(0), q, k, v, causal, scale, dropout)
        o = o.movedim(0, seq)
    elif cp.comm_type == "p2p":  # the ring works in [b, h, s, d]
        q, k, v = (t.movedim(seq, 2) if seq == 0 else t.transpose(1, 2)
                   for t in (query, key, value))
        ring = Ring(cp.group, [cp.chunks_of(r) for r in range(cp.size)])
        o = ring_attention(ring, q, k, v, causal, scale, dropout)
        o = o.permute(2, 0, 1, 3) if seq == 0 else o.transpose(1, 2)
    else:
        q, k, v = (t.movedim(seq, 0) for t in (query, key, value))
        o = _attend_hierarchical(cp, q, k, v, causal, scale, dropout).movedim(0, seq)
    return o.reshape(*o.shape[:2], o.shape[2] * o.shape[3])


def attend_packed(attend_padded: Callable, cp: ContextParallel, query, key, value,
                  attention_mask, window, mask: str, cu_q, cu_kv, padded: Optional[tuple],
                  max_seqlen_q, max_seqlen_kv) -> torch.Tensor:
    """The rank's rows of attention of packed (thd) sequences split over the group
    (context_parallel_thd.py), with the group's collectives."""
    from .context_parallel_thd import attend_packed as attend_thd

    return attend_thd(attend_padded, cp, query, key, value, attention_mask, window, mask, cu_q,
                      cu_kv, padded, max_seqlen_q, max_seqlen_kv,
                      lambda t: _gather_ranks(t, cp), lambda t: _reduce_scatter_ranks(t, cp))


def _attend_hierarchical(cp: ContextParallel, q, k, v, causal: bool, scale: float,
                         dropout: float) -> torch.Tensor:
    """``"a2a+p2p"``: an all-to-all inside the all-to-all group trades its ranks' chunks for
    a share of the heads, the ring across the groups attends those chunks, and an all-to-all
    trades back. [s_local, b, h, d] -> [s_local, b, h, dv]."""
    a2a_group, ring_group = cp.group
    ring_size = cp.size // cp.a2a_size
    here = cp.a2a_chunks(cp.rank // cp.a2a_size)
    # each all-to-all group's chunks, ascending: the order heads_to_ranks puts them in
    blocks = [tuple(sorted(c for pair in cp.a2a_chunks(r) for c in pair))
              for r in range(ring_size)]
    qs, ks, vs = (heads_to_ranks(t, a2a_group, here).permute(1, 2, 0, 3) for t in (q, k, v))
    o = ring_attention(Ring(ring_group, blocks), qs, ks, vs, causal, scale, dropout)
    return sequence_to_ranks(o.permute(2, 0, 1, 3), a2a_group, here)


_WARNED_FP8: set = set()


def _warn_fp8_gathers(comm_type: str) -> None:
    """FP8 attention keeps its numerics over the comm type: the ring and the all-to-all
    compute their blocks in high precision, so under fp8_dpa k and v are all-gathered
    instead (said once per comm type)."""
    if comm_type not in _WARNED_FP8:
        _WARNED_FP8.add(comm_type)
        warnings.warn(f"DotProductAttention: FP8 attention (fp8_dpa) under context parallelism "
                      f"gathers k and v (cp_comm_type 'all_gather') instead of "
                      f"cp_comm_type {comm_type!r}, whose attention blocks run in high "
                      f"precision here; the results are FP8 attention's, the memory that of "
                      f"whole-sequence k and v", stacklevel=4)


def _attend_gathered(attend_one: Callable, cp: ContextParallel, query, key, value, seq: int,
                     mask: str) -> torch.Tensor:
    """``"all_gather"``: k and v gathered over the group, attended by the module."""

    def gather(t):
        t = t.movedim(seq, 0)
        return _GatherSequence.apply(t.contiguous(), cp).movedim(0, seq)

    keys, values = gather(key), gather(value)
    if mask == "no_mask":
        return attend_one(query, keys, values, "no_mask")
    c = query.shape[seq] // 2
    outs = []
    for i, chunk in enumerate(cp.chunks()):
        q = query.narrow(seq, i * c, c)
        end = (chunk + 1) * c  # keys up to this chunk's end, the last c of them its own
        outs.append(attend_one(q, keys.narrow(seq, 0, end), values.narrow(seq, 0, end),
                               "causal_bottom_right"))
    return torch.cat(outs, dim=seq)
