"""Context parallelism by all-to-all (``cp_comm_type="a2a"``, DeepSpeed's Ulysses): an
all-to-all over the group trades the split of the sequence for a split of the heads, each rank
attends whole sequences for its ``h / cp`` heads, and a second all-to-all trades back.

A rank holds chunks ``r`` and ``2 * cp - 1 - r`` of the sequence, so the pieces that arrive
from the ranks are put in sequence order before attention (and taken out of it after). Under
``"a2a+p2p"`` the all-to-all runs inside a smaller group, whose chunks (ascending) then go
round the ring (context_parallel_ring.py). The
backward runs the same all-to-alls the other way (an all-to-all with equal splits is its own
adjoint). Attention runs in torch's ``scaled_dot_product_attention`` (the module's attention
checks for its own number of heads, and here a rank has ``h / cp``), in the inputs' dtype.
"""

from __future__ import annotations

import torch

__all__ = ["a2a_attention", "check_heads", "heads_to_ranks", "sequence_to_ranks"]


def check_heads(comm_type: str, size: int, heads: int, kv_heads: int) -> None:
    if heads % size or kv_heads % size:
        raise ValueError(f"DotProductAttention: cp_comm_type {comm_type!r} splits the heads "
                         f"over the {size} ranks of its all-to-all group, so "
                         f"num_attention_heads and num_gqa_groups must be divisible by {size}, "
                         f"got {heads} and {kv_heads}")


class _AllToAll(torch.autograd.Function):
    """Piece ``i`` of dimension 0 goes to rank ``i``; piece ``i`` of the result came from rank
    ``i``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(t, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(t: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous()
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t, group=group)
    return out


def _ascending(chunks: list[tuple[int, ...]]) -> list[int]:
    """For each piece of the result (ascending chunks), its place among the ranks' pieces
    (rank-major: ``chunks[i]`` are rank i's, in the order it holds them)."""
    flat = [chunk for rank_chunks in chunks for chunk in rank_chunks]
    return sorted(range(len(flat)), key=flat.__getitem__)


def _reorder(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Dimension 0 in len(order) equal pieces, piece ``order[m]`` put at ``m``."""
    pieces = t.reshape(len(order), t.shape[0] // len(order), *t.shape[1:])
    index = torch.tensor(order, device=t.device)
    return pieces.index_select(0, index).reshape(t.shape)


def heads_to_ranks(t: torch.Tensor, group, chunks: list[tuple[int, ...]]) -> torch.Tensor:
    """[s_local, b, h, d] (this rank's chunks) -> [s_group, b, h / size, d]: every rank's
    chunks, ascending, for this rank's share of the heads. ``chunks[i]``: rank i's."""
    size = len(chunks)
    s_local, b, h, d = t.shape
    pieces = t.view(s_local, b, size, h // size, d).permute(2, 0, 1, 3, 4)
    gathered = _AllToAll.apply(pieces, group)  # [size (source rank), s_local, b, h / size, d]
    return _reorder(gathered.view(size * s_local, b, h // size, d), _ascending(chunks))


def sequence_to_ranks(t: torch.Tensor, group, chunks: list[tuple[int, ...]]) -> torch.Tensor:
    """The inverse of heads_to_ranks: [s_group, b, h / size, d] -> [s_local, b, h, d]."""
    size = len(chunks)
    s, b, hl, d = t.shape
    order = _ascending(chunks)
    inverse = [0] * len(order)
    for m, place in enumerate(order):
        inverse[place] = m
    rank_major = _reorder(t, inverse).view(size, s // size, b, hl, d)
    returned = _AllToAll.apply(rank_major, group)  # [size (head share), s_local, b, hl, d]
    return returned.permute(1, 2, 0, 3, 4).reshape(s // size, b, size * hl, d)


def a2a_attention(group, chunks: list[tuple[int, ...]], q, k, v, causal: bool, scale: float,
                  dropout: float) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, split over ``group`` (rank i
    holding ``chunks[i]``, together every chunk): q [s_local, b, h, d], k, v
    [s_local, b, hk, d] -> [s_local, b, h, dv]. The heads must divide by the group's size
    (check_heads)."""
    qs, ks, vs = (heads_to_ranks(t, group, chunks).permute(1, 2, 0, 3) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, dropout_p=dropout, is_causal=causal, scale=scale,
        enable_gqa=qs.shape[1] != ks.shape[1])
    return sequence_to_ranks(o.permute(2, 0, 1, 3), group, chunks)
