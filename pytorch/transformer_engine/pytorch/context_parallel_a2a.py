"""Context parallelism by all-to-all (``cp_comm_type="a2a"``, DeepSpeed's Ulysses): an
all-to-all over the group trades the split of the sequence for a split of the heads, each rank
attends whole sequences for its ``h / cp`` heads, and a second all-to-all trades back.

A rank holds chunks ``r`` and ``2 * cp - 1 - r`` of the sequence, so the pieces that arrive
from the ranks are put in sequence order before attention (and taken out of it after). The
backward runs the same all-to-alls the other way (an all-to-all with equal splits is its own
adjoint). Attention runs in torch's ``scaled_dot_product_attention`` (the module's attention
checks for its own number of heads, and here a rank has ``h / cp``), in the inputs' dtype.
"""

from __future__ import annotations

import torch

__all__ = ["a2a_attention", "check_heads"]


def check_heads(cp_size: int, heads: int, kv_heads: int) -> None:
    if heads % cp_size or kv_heads % cp_size:
        raise ValueError(f"DotProductAttention: cp_comm_type 'a2a' splits the heads over the "
                         f"{cp_size} ranks of cp_group, so the query heads and the key/value "
                         f"heads must be divisible by {cp_size}, got {heads} and {kv_heads}")


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


def _sequence_order(cp_size: int) -> list[int]:
    """For each chunk of the sequence, its place among the ranks' pieces (rank-major: rank i
    holds chunks i and 2 * cp - 1 - i)."""
    return [2 * m if m < cp_size else 2 * (2 * cp_size - 1 - m) + 1 for m in range(2 * cp_size)]


def _reorder(t: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Dimension 0 in len(order) equal pieces, piece ``order[m]`` put at ``m``."""
    pieces = t.reshape(len(order), t.shape[0] // len(order), *t.shape[1:])
    index = torch.tensor(order, device=t.device)
    return pieces.index_select(0, index).reshape(t.shape)


def _heads_to_ranks(t: torch.Tensor, cp) -> torch.Tensor:
    """[s_local, b, h, d] (this rank's chunks) -> [s, b, h / cp, d]: the whole sequence of this
    rank's share of the heads."""
    s_local, b, h, d = t.shape
    pieces = t.view(s_local, b, cp.size, h // cp.size, d).permute(2, 0, 1, 3, 4)
    gathered = _AllToAll.apply(pieces, cp.group)  # [cp (source rank), s_local, b, h / cp, d]
    return _reorder(gathered.view(cp.size * s_local, b, h // cp.size, d),
                    _sequence_order(cp.size))


def _sequence_to_ranks(t: torch.Tensor, cp) -> torch.Tensor:
    """The inverse of _heads_to_ranks: [s, b, h / cp, d] -> [s_local, b, h, d]."""
    s, b, hl, d = t.shape
    order = _sequence_order(cp.size)
    inverse = [0] * len(order)
    for m, place in enumerate(order):
        inverse[place] = m
    rank_major = _reorder(t, inverse).view(cp.size, s // cp.size, b, hl, d)
    returned = _AllToAll.apply(rank_major, cp.group)  # [cp (head share), s_local, b, hl, d]
    return returned.permute(1, 2, 0, 3, 4).reshape(s // cp.size, b, cp.size * hl, d)


def a2a_attention(cp, q, k, v, causal: bool, scale: float, dropout: float) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence: q [s_local, b, h, d], k, v
    [s_local, b, hk, d] -> [s_local, b, h, dv]."""
    check_heads(cp.size, q.shape[2], k.shape[2])
    qs, ks, vs = (_heads_to_ranks(t, cp).permute(1, 2, 0, 3) for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        qs, ks, vs, dropout_p=dropout, is_causal=causal, scale=scale,
        enable_gqa=qs.shape[1] != ks.shape[1])
    return _sequence_to_ranks(o.permute(2, 0, 1, 3), cp)
