"""Context parallelism of packed (thd) sequences, in NVIDIA TE's layout.

Each sequence's rows are padded to a multiple of ``2 * cp`` (``cu_seqlens_padded``, the
global offsets; ``cu_seqlens``, the global lengths, say how many of them are tokens) and cut
into ``2 * cp`` chunks; rank r holds chunks r and ``2 * cp - 1 - r`` of every sequence, one
sequence after the other: its tensor has ``cu_seqlens_padded[-1] / cp`` rows, sequence s at
local rows ``cu_seqlens_padded[s] / cp`` onwards (the load-balanced layout of the sbhd/bshd
path, per sequence).

Attention: k and v are all-gathered over the group (the backward reduce-scatters their
gradients) and put in the global padded order; each of the rank's ``2 * b`` chunks ("pieces")
then attends its own sequence's keys: under a causal mask the keys up to the chunk's last
token (bottom-right aligned: query i of a chunk starting at position p sees keys up to p + i),
else all of them. The pieces run as one call of the module's attention on packed sequences
with padding between them (padded_packing.py): the queries are the local rows as they lie, the
keys each piece's copy of its sequence's keys. Every index is computed on the device from the
cumulative lengths, without reading them on the host.

The ring and the all-to-all take sbhd/bshd only: for thd every comm type gathers k and v as
``"all_gather"`` does (with a warning, once per comm type, that says so).
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple, Optional

import torch

from . import padded_packing

__all__ = ["Pieces", "attend_packed", "chunks", "pieces", "gather_index", "partitioned_indices",
           "check"]


def check(op: str, cp_size: int, cu: torch.Tensor, cu_padded: torch.Tensor, rows: int,
          name: str) -> None:
    """Shapes always; values where they are on the CPU (reading CUDA memory would stall the
    stream): every padded length a multiple of 2 * cp, the local rows the padded total / cp."""
    padded_packing.check_shape(op, name, cu, cu_padded)
    if cu_padded.device.type != "cpu" or torch.compiler.is_compiling():
        return
    padded = cu_padded[1:] - cu_padded[:-1]
    if bool((padded % (2 * cp_size) != 0).any()) or int(cu_padded[-1]) != rows * cp_size:
        raise ValueError(f"{op}: under context parallelism with qkv_format 'thd' each "
                         f"sequence's padded length must be a multiple of 2 * cp_size = "
                         f"{2 * cp_size} and {name}_padded must end at the rank's rows times "
                         f"cp_size ({rows} * {cp_size}), got {name}_padded "
                         f"{cu_padded.tolist()}")


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def chunks(cu_padded: torch.Tensor, cp_size: int,
           rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s 2 * batch chunks of the global padded offsets ``cu_padded``: each
    sequence's chunk size [batch], the chunks' cumulative offsets in the rank's tensor
    [2 * batch + 1] and each chunk's first position in its sequence [batch, 2]."""
    cu_padded = cu_padded.to(torch.int64)
    size = (cu_padded[1:] - cu_padded[:-1]) // (2 * cp_size)
    starts = torch.stack([rank * size, (2 * cp_size - 1 - rank) * size], dim=1)
    return size, _cumulative(size.repeat_interleave(2)), starts


def gather_index(cu_padded: torch.Tensor, cp_size: int, local_rows: int) -> torch.Tensor:
    """For each row of the global padded layout, its row in the rank-major all-gather of the
    ranks' local tensors (``cp_size * local_rows`` rows)."""
    cu_padded = cu_padded.to(torch.int64)
    g = torch.arange(local_rows * cp_size, device=cu_padded.device)
    seq = torch.searchsorted(cu_padded[1:], g, right=True).clamp_(max=cu_padded.shape[0] - 2)
    chunk = (cu_padded[seq + 1] - cu_padded[seq]) // (2 * cp_size)
    offset = g - cu_padded[seq]
    c, within = offset // chunk.clamp(min=1), offset % chunk.clamp(min=1)
    second = c >= cp_size
    rank = torch.where(second, 2 * cp_size - 1 - c, c)
    local = cu_padded[seq] // cp_size + second.to(torch.int64) * chunk + within
    return rank * local_rows + local


def partitioned_indices(cu_padded: torch.Tensor, cp_size: int, rank: int,
                        rows: int) -> torch.Tensor:
    """For each of rank ``rank``'s first ``rows`` local rows, its row in the global padded
    layout (the inverse of :func:`gather_index` on this rank's rows). Local rows past the last
    chunk continue the last sequence's second chunk, as NVIDIA's
    ``thd_get_partitioned_indices`` does for a tensor longer than ``cu_padded[-1]``."""
    cu_padded = cu_padded.to(torch.int64)
    _, cu_local, starts = chunks(cu_padded, cp_size, rank)
    cu_local = cu_local.to(torch.int64)
    first = (cu_padded[:-1].view(-1, 1) + starts).flatten()  # each chunk's first global row
    local = torch.arange(rows, device=cu_padded.device)
    # right=True skips empty chunks (zero-length sequences), whose end equals their start
    chunk = torch.searchsorted(cu_local[1:], local, right=True).clamp_(max=first.shape[0] - 1)
    return first[chunk] + local - cu_local[chunk]


class Pieces(NamedTuple):
    """The rank's 2 * b chunks as packed sequences with padding between them: per piece
    ``cu_q`` (its tokens), ``cu_q_padded`` (its rows in the local tensor), ``cu_kv`` (the keys
    it attends), ``cu_kv_padded`` (its copy of its sequence's padded keys), and ``kv_rows``:
    for each row of those copies, its row in the all-gather."""

    cu_q: torch.Tensor
    cu_q_padded: torch.Tensor
    cu_kv: torch.Tensor
    cu_kv_padded: torch.Tensor
    kv_rows: torch.Tensor


def pieces(cp_size: int, rank: int, cu_q, cu_q_padded, cu_kv, cu_kv_padded, local_rows: int,
           causal: bool) -> Pieces:
    """The pieces of rank ``rank`` (global cumulative lengths in, on the tensors' device)."""
    cu_q, cu_kv, cu_kv_padded = (t.to(torch.int64) for t in (cu_q, cu_kv, cu_kv_padded))
    chunk, cu_q_pieces, starts = chunks(cu_q_padded, cp_size, rank)
    lq = (cu_q[1:] - cu_q[:-1]).view(-1, 1)
    lk = (cu_kv[1:] - cu_kv[:-1]).view(-1, 1)
    tokens = (lq - starts).clamp(min=0).minimum(chunk.view(-1, 1))  # [b, 2]
    keys = (starts + tokens).minimum(lk) if causal else lk.expand_as(tokens)
    keys = torch.where(tokens > 0, keys, 0)  # a piece without queries reads no key
    padded_kv = (cu_kv_padded[1:] - cu_kv_padded[:-1]).repeat_interleave(2)
    cu_kv_pieces = _cumulative(padded_kv)
    # each piece's copy of its sequence's padded keys, as rows of the all-gather
    rows = 2 * local_rows * cp_size
    j = torch.arange(rows, device=cu_q.device)
    piece = torch.searchsorted(cu_kv_pieces[1:].to(torch.int64), j, right=True)
    piece = piece.clamp_(max=padded_kv.shape[0] - 1)
    global_row = cu_kv_padded[piece // 2] + j - cu_kv_pieces[piece]
    kv_rows = gather_index(cu_kv_padded, cp_size, local_rows)[global_row]
    return Pieces(_cumulative(tokens.flatten()), cu_q_pieces, _cumulative(keys.flatten()),
                  cu_kv_pieces, kv_rows)


class _GatherRanks(torch.autograd.Function):
    """Every rank's tensor along dimension 0, rank-major; the backward sums the gradient over
    the ranks and returns this rank's share."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, gather, reduce_scatter) -> torch.Tensor:
        ctx.reduce_scatter = reduce_scatter
        return gather(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.reduce_scatter(grad.contiguous()), None, None


_WARNED: set = set()


def _warn_gathers(comm_type: str) -> None:
    if comm_type not in _WARNED:
        _WARNED.add(comm_type)
        warnings.warn(f"DotProductAttention: context parallelism of packed (thd) sequences "
                      f"gathers k and v (cp_comm_type 'all_gather') instead of cp_comm_type "
                      f"{comm_type!r}, which takes sbhd/bshd only here; the results are the "
                      f"same, the memory that of whole-sequence k and v", stacklevel=5)


def attend_packed(attend_padded: Callable, cp, query, key, value, attention_mask, window,
                  mask: str, cu_q, cu_kv, padded: Optional[tuple], max_seqlen_q, max_seqlen_kv,
                  gather: Callable, reduce_scatter: Callable) -> torch.Tensor:
    """The rank's rows of attention of packed sequences split over the group.
    ``attend_padded(q, k, v, mask, cu_q, cu_kv, cu_q_padded, cu_kv_padded, max_q, max_kv)`` is
    the module's attention of packed sequences with padding between them; ``padded`` the
    forward's (cu_seqlens_q_padded, cu_seqlens_kv_padded) or None; ``gather`` /
    ``reduce_scatter`` the group's collectives along dimension 0 (rank-major)."""
    op = "DotProductAttention"
    if attention_mask is not None or window not in (None, (-1, -1), (-1, 0)):
        raise NotImplementedError(f"{op}: context parallelism of packed (thd) sequences "
                                  "takes no attention_mask or sliding window")
    if cu_q is None or cu_kv is None or max_seqlen_q is None or max_seqlen_kv is None:
        raise ValueError(f"{op}: qkv_format 'thd' under context parallelism needs cu_seqlens_q "
                         "and cu_seqlens_kv (the whole sequences' lengths), max_seqlen_q and "
                         "max_seqlen_kv")
    if mask not in ("padding", "padding_causal", "causal", "no_mask"):
        raise NotImplementedError(f"{op}: context parallelism of packed (thd) sequences takes "
                                  f"attn_mask_type 'padding', 'padding_causal' (or 'no_mask', "
                                  f"'causal', the same for thd), got {mask!r}")
    if cp.comm_type != "all_gather":
        _warn_gathers(cp.comm_type)
    cu_q_padded, cu_kv_padded = padded or (None, None)
    cu_q_padded = cu_q if cu_q_padded is None else cu_q_padded
    cu_kv_padded = cu_kv if cu_kv_padded is None else cu_kv_padded
    check(op, cp.size, cu_q, cu_q_padded, query.shape[0], "cu_seqlens_q")
    check(op, cp.size, cu_kv, cu_kv_padded, key.shape[0], "cu_seqlens_kv")
    device = query.device
    cu_q, cu_kv, cu_q_padded, cu_kv_padded = (
        t.to(device) for t in (cu_q, cu_kv, cu_q_padded, cu_kv_padded))
    causal = "causal" in mask
    p = pieces(cp.size, cp.rank, cu_q, cu_q_padded, cu_kv, cu_kv_padded, key.shape[0], causal)
    keys, values = (_GatherRanks.apply(t.contiguous(), gather, reduce_scatter).index_select(
        0, p.kv_rows) for t in (key, value))
    return attend_padded(query, keys, values,
                         "padding_causal_bottom_right" if causal else "padding",
                         p.cu_q, p.cu_kv, p.cu_q_padded, p.cu_kv_padded, max_seqlen_q,
                         max_seqlen_kv)

