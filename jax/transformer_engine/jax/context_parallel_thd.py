"""Context parallelism of packed (thd) sequences, in NVIDIA TE's (and Megatron-LM's) layout.

Each sequence's rows are padded to a multiple of ``2 * n`` (``n`` devices on the
context-parallel axis; ``cu_seqlens_*_padded`` are the global offsets, ``cu_seqlens_*`` the
global lengths, saying how many rows are tokens) and cut into ``2 * n`` equal chunks; device r
holds chunks r and ``2n - 1 - r`` of every sequence, one sequence after the other, so its shard
of the tensor [T, heads, dim] has ``T / n`` rows, sequence s from local row
``cu_seqlens_padded[s] / n`` on. Rows past ``cu_seqlens_padded[-1]`` (a tensor with room for
more tokens, as static shapes need) are padding, split evenly at the end of every shard.
:func:`reorder_thd_load_balancing` puts a padded packing in this order (a shard per device,
rank-major) and :func:`inverse_reorder_thd_load_balancing` back. The causal work is balanced
per sequence (the dual chunk swap of the bshd/sbhd layouts), whatever
``context_parallel_causal_load_balanced`` says.

Attention (the all-gather strategy): k and v are all-gathered (the backward reduce-scatters
their gradients), and each of the device's ``2 * batch`` chunks ("pieces") attends its own
sequence's keys: under a causal mask those up to the chunk's last token (bottom-right aligned:
query i of a chunk starting at position p sees keys up to p + i, the global causal mask where
a sequence has at least as many keys as queries), else all of them. The pieces run as one plain
thd call: the queries gathered back to back, and for each piece a copy of the keys it attends
(at most twice the gathered keys). Padding rows attend nothing: their output and gradient are
0. Every index is computed on the device from the cumulative lengths (jnp ops under jit,
static shapes). The ring strategy takes bshd/sbhd only: thd gathers k and v instead, with a
warning.
"""

from __future__ import annotations

import warnings
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from transformer_engine.jax import partitioning
from transformer_engine.jax.padded_packing import check_offsets, cumulative, rows_in, segments
from transformer_engine.jax.padded_packing import take as _take

__all__ = ["reorder_thd_load_balancing", "inverse_reorder_thd_load_balancing", "Pieces",
           "pieces", "layout_row", "check_call", "check_call_offsets", "attention_forward",
           "attention_backward"]

# Whether each mask is causal: thd attention always takes the sequences' lengths, so no_mask
# and causal are padding and padding_causal.
MASKS = {"padding": False, "padding_causal": True, "no_mask": False, "causal": True}


def layout_row(cu_padded: jax.Array, seq: jax.Array, pos: jax.Array, size: int,
               local_rows: int) -> jax.Array:
    """The row, in the rank-major concatenation of the devices' shards (``local_rows``
    each), of position ``pos`` of sequence ``seq`` (``pos`` below its padded length)."""
    chunk = (cu_padded[seq + 1] - cu_padded[seq]) // (2 * size)
    c = pos // jnp.maximum(chunk, 1)
    second = c >= size
    rank = jnp.where(second, 2 * size - 1 - c, c)
    local = cu_padded[seq] // size + jnp.where(second, chunk, 0) + pos - c * chunk
    return rank * local_rows + local


def _order(cu_padded: jax.Array, rows: int, size: int) -> jax.Array:
    """For each row of the padded packing, its row in the context-parallel order."""
    g = jnp.arange(rows, dtype=jnp.int32)
    total = cu_padded[-1]
    seq = jnp.clip(jnp.searchsorted(cu_padded[1:], g, side="right"), 0,
                   cu_padded.shape[0] - 2)
    local_rows = rows // size
    in_seqs = layout_row(cu_padded, seq, g - cu_padded[seq], size, local_rows)
    # the rows past the sequences: each device's share at the end of its shard
    extra = g - total
    share = jnp.maximum((rows - total) // size, 1)
    past = (extra // share) * local_rows + total // size + extra % share
    return jnp.where(g < total, in_seqs, past)


def _check_layout(op: str, tensor, cu_padded, cp_size: int):
    if cp_size < 1:
        raise ValueError(f"{op}: cp_size must be >= 1, got {cp_size}")
    tensor = jnp.asarray(tensor)
    cu_padded = jnp.asarray(cu_padded, jnp.int32)
    if tensor.ndim < 1 or tensor.shape[0] % cp_size:
        raise ValueError(f"{op}: the tensor's rows (dimension 0) must be a multiple of cp_size "
                         f"= {cp_size}, got shape {tuple(tensor.shape)}")
    check_offsets(op, "cu_seqlens", cu_padded, cu_padded, tensor.shape[0], 2 * cp_size,
                  " (2 * cp_size)")
    return tensor, cu_padded


def reorder_thd_load_balancing(tensor: jax.Array, cu_seqlens_padded: jax.Array,
                               cp_size: int) -> jax.Array:
    """The rows of a padded packing ``tensor`` [T, ...] (sequence s at rows
    ``cu_seqlens_padded[s]`` on, each padded length a multiple of ``2 * cp_size``) in the
    context-parallel order: device r's shard (rows ``r * T / cp_size`` on) holds chunks r and
    ``2 * cp_size - 1 - r`` of every sequence, then its share of the rows past the last.
    Works under jit (``cu_seqlens_padded`` may be traced)."""
    op = "reorder_thd_load_balancing"
    tensor, cu_padded = _check_layout(op, tensor, cu_seqlens_padded, cp_size)
    if cp_size == 1:
        return tensor
    return jnp.zeros_like(tensor).at[_order(cu_padded, tensor.shape[0], cp_size)].set(tensor)


def inverse_reorder_thd_load_balancing(tensor: jax.Array, cu_seqlens_padded: jax.Array,
                                       cp_size: int) -> jax.Array:
    """The inverse of :func:`reorder_thd_load_balancing` (same arguments): the padded packing
    back in sequence order."""
    op = "inverse_reorder_thd_load_balancing"
    tensor, cu_padded = _check_layout(op, tensor, cu_seqlens_padded, cp_size)
    if cp_size == 1:
        return tensor
    return tensor[_order(cu_padded, tensor.shape[0], cp_size)]


class Pieces(NamedTuple):
    """One device's ``2 * batch`` pieces as a plain thd call: ``cu_q`` / ``cu_kv`` the
    pieces' tokens and keys back to back; ``q_piece`` / ``q_pos`` / ``q_source`` /
    ``q_inside`` for each packed query row its piece, position in it, row in the shard and
    whether it is a token; ``q_back`` / ``q_token`` for each row of the shard its packed row
    and whether it is a token; ``kv_source`` / ``kv_inside`` for each packed key row its row
    in the gathered keys (rank-major) and whether it is a key."""

    cu_q: jax.Array
    cu_kv: jax.Array
    q_piece: jax.Array
    q_pos: jax.Array
    q_source: jax.Array
    q_inside: jax.Array
    q_back: jax.Array
    q_token: jax.Array
    kv_source: jax.Array
    kv_inside: jax.Array


def pieces(rank, size: int, cu_q, cu_q_padded, cu_kv, cu_kv_padded, q_rows: int,
           kv_rows: int, causal: bool) -> Pieces:
    """The pieces of device ``rank`` (traced or not) of ``size``, from the global cumulative
    lengths and padded offsets; ``q_rows`` / ``kv_rows``: the shard's rows."""
    chunk = jnp.diff(cu_q_padded) // (2 * size)
    first = jnp.stack([rank * chunk, (2 * size - 1 - rank) * chunk], axis=1)  # [b, 2]
    tokens = jnp.clip(jnp.diff(cu_q)[:, None] - first, 0, chunk[:, None])
    kv_len = jnp.diff(cu_kv)[:, None]
    # causal: the keys up to the piece's last token (its diagonal bottom right)
    keys = jnp.minimum(first + tokens, kv_len) if causal else jnp.broadcast_to(kv_len,
                                                                               tokens.shape)
    keys = jnp.where(tokens > 0, keys, 0)  # a piece without queries reads no key
    starts = (cu_q_padded[:-1] // size)[:, None] + jnp.stack([jnp.zeros_like(chunk), chunk], 1)
    tokens, keys, starts = (t.reshape(-1).astype(jnp.int32) for t in (tokens, keys, starts))

    seg_q, pos_q, q_inside = segments(tokens, q_rows)
    q_source = jnp.where(q_inside, starts[seg_q] + pos_q, 0)
    q_back, q_token = rows_in(starts, tokens, q_rows)
    # at most twice the keys: each sequence's two pieces read their own copy
    seg, pos, kv_inside = segments(keys, 2 * size * kv_rows)
    kv_source = jnp.where(kv_inside, layout_row(cu_kv_padded, seg // 2, pos, size, kv_rows), 0)
    return Pieces(cumulative(tokens), cumulative(keys), seg_q, pos_q, q_source, q_inside,
                  q_back, q_token, kv_source, kv_inside)


def _lse_rows(lse: jax.Array, p: Pieces) -> jax.Array:
    """The pieces' lse [2 batch, heads, max tokens] as one value per row of the shard
    [rows, heads] (0 in the padding rows): the residual splits as q does."""
    packed = lse[p.q_piece, :, p.q_pos]
    return _take(packed, p.q_back, p.q_token)


def _lse_pieces(rows: jax.Array, p: Pieces, tokens: int) -> jax.Array:
    """The inverse of :func:`_lse_rows` (0 past each piece's tokens, which the core does
    not read)."""
    packed = _take(rows, p.q_source, p.q_inside)
    at = p.cu_q[:-1, None] + jnp.arange(tokens)  # [pieces, tokens]: packed row
    inside = at < p.cu_q[1:, None]
    out = jnp.where(inside[..., None], packed[jnp.clip(at, 0, rows.shape[0] - 1)], 0)
    return jnp.transpose(out, (0, 2, 1))


def _maxima(q, k, size: int, max_q: int, max_kv: int) -> tuple[int, int]:
    """Static bounds of the pieces' tokens and keys (the lse's last dim)."""
    return min(max_q, q.shape[0] // size), min(max_kv, k.shape[0])


def _rank_forward(run: Callable, rank, size: int, q, k_all, v_all, cu_q, cu_kv, causal: bool,
                  maxima: tuple[int, int]):
    """(o, lse) of device ``rank``'s shard ``q`` given every device's keys and values."""
    p = pieces(rank, size, cu_q[0], cu_q[1], cu_kv[0], cu_kv[1], q.shape[0],
               k_all.shape[0] // size, causal)
    o, lse = run(_take(q, p.q_source, p.q_inside), _take(k_all, p.kv_source, p.kv_inside),
                 _take(v_all, p.kv_source, p.kv_inside), p.cu_q, p.cu_kv, *maxima)
    return _take(o, p.q_back, p.q_token), _lse_rows(lse, p)


def _rank_backward(run: Callable, rank, size: int, q, k_all, v_all, o, d_o, lse, cu_q, cu_kv,
                   causal: bool, maxima: tuple[int, int]):
    """(dq of the shard, dk and dv of every device's keys (fp32)) of device ``rank``."""
    p = pieces(rank, size, cu_q[0], cu_q[1], cu_kv[0], cu_kv[1], q.shape[0],
               k_all.shape[0] // size, causal)
    rows = [_take(t, p.q_source, p.q_inside) for t in (q, o, d_o)]
    kv = [_take(t, p.kv_source, p.kv_inside) for t in (k_all, v_all)]
    lse = _lse_pieces(lse, p, maxima[0])
    dq, dk, dv = run(rows[0], *kv, *rows[1:], lse, p.cu_q, p.cu_kv, *maxima)

    def add_back(grad, like):
        # a key read by both of a sequence's pieces gets both shares, added in fp32
        grad = jnp.where(p.kv_inside.reshape(-1, 1, 1), grad, 0).astype(jnp.float32)
        return jnp.zeros(like.shape, jnp.float32).at[p.kv_source].add(grad)

    return _take(dq, p.q_back, p.q_token), add_back(dk, k_all), add_back(dv, v_all)


def _gather(t: jax.Array, axis: str) -> jax.Array:
    return jax.lax.all_gather(t, axis, axis=0, tiled=True)


def _shard(t: jax.Array, rank: int, size: int) -> jax.Array:
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def attention_forward(run: Callable, q, k, v, cu_q, cu_kv, rng, *, causal: bool, axis: str,
                      size: int, max_q: int, max_kv: int):
    """(o, lse) of thd attention with the rows split over ``axis`` (``size`` devices), as one
    partitioned op. ``cu_q`` / ``cu_kv``: int32 [2, batch + 1], the global cumulative lengths
    over the global padded offsets. ``run(q, k, v, cu_q, cu_kv, max_q, max_kv)`` is the plain
    thd forward (padding mask, bottom-right causal if ``causal``). The lse (the backward's
    residual) has one value per query row and head [T, heads]."""
    maxima = _maxima(q, k, size, max_q, max_kv)

    def shard(qs, ks, vs, lq, lkv, _):
        rank = jax.lax.axis_index(axis)
        return _rank_forward(run, rank, size, qs, _gather(ks, axis), _gather(vs, axis), lq, lkv,
                             causal, maxima)

    def whole(q, k, v, lq, lkv, _):  # every device's part, on one device
        parts = [_rank_forward(run, r, size, _shard(q, r, size), k, v, lq, lkv, causal, maxima)
                 for r in range(size)]
        return tuple(jnp.concatenate(t) for t in zip(*parts, strict=True))

    batch = 2 * (cu_q.shape[1] - 1)
    results = (jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype),
               jax.ShapeDtypeStruct(q.shape[:2], jnp.float32))
    return partitioning.attention_forward(
        (q, k, v, cu_q, cu_kv, rng), whole, results, layout="thd",
        shape=(batch, q.shape[1], k.shape[1], *maxima), cp=(axis, shard))


def attention_backward(run: Callable, q, k, v, o, d_o, lse, cu_q, cu_kv, rng, *, causal: bool,
                       axis: str, size: int, max_q: int, max_kv: int):
    """(dq, dk, dv) of :func:`attention_forward`; ``run(q, k, v, o, d_o, lse, cu_q, cu_kv,
    max_q, max_kv)`` is the plain thd backward. Every device's share of a key's gradient is
    summed onto the device that holds the key (reduce-scatter)."""
    maxima = _maxima(q, k, size, max_q, max_kv)

    def shard(qs, ks, vs, os_, dos, lses, lq, lkv, _):
        rank = jax.lax.axis_index(axis)
        dq, dk, dv = _rank_backward(run, rank, size, qs, _gather(ks, axis), _gather(vs, axis),
                                    os_, dos, lses, lq, lkv, causal, maxima)
        return (dq, *(jax.lax.psum_scatter(g.astype(t.dtype), axis, scatter_dimension=0,
                                           tiled=True) for g, t in ((dk, ks), (dv, vs))))

    def whole(q, k, v, o, d_o, lse, lq, lkv, _):  # every device's part, on one device
        dqs, dk, dv = [], 0.0, 0.0
        for r in range(size):
            dq_r, dk_r, dv_r = _rank_backward(
                run, r, size, _shard(q, r, size), k, v, _shard(o, r, size),
                _shard(d_o, r, size), _shard(lse, r, size), lq, lkv, causal, maxima)
            dqs, dk, dv = dqs + [dq_r], dk + dk_r, dv + dv_r
        return jnp.concatenate(dqs), dk.astype(k.dtype), dv.astype(v.dtype)

    results = tuple(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (q, k, v))
    return partitioning.attention_backward(
        (q, k, v, o, d_o, lse, cu_q, cu_kv, rng), whole, results, layout="thd",
        shape=(2 * (cu_q.shape[1] - 1), q.shape[1], k.shape[1], *maxima), cp=(axis, shard))


def check_call(caller: str, mask: str, strategy: str) -> str:
    """The strategy thd runs (``"all_gather"``); raises, naming the feature, for a mask it
    does not take, and warns when the ring was asked for."""
    if mask not in MASKS:
        raise NotImplementedError(f"{caller}: context parallelism of packed (thd) sequences "
                                  f"takes attn_mask_type 'padding' or 'padding_causal' (or "
                                  f"'no_mask', 'causal': the same for thd), got {mask!r}")
    if strategy == "ring":
        warnings.warn(f"{caller}: context parallelism of packed (thd) sequences gathers k and v "
                      "(context_parallel_strategy 'all_gather') instead of 'ring', which takes "
                      "bshd/sbhd only; the results are the same, the memory that of the whole "
                      "sequences' k and v", stacklevel=4)
    return "all_gather"


def check_call_offsets(caller: str, size: int, name: str, cu, cu_padded, rows: int) -> None:
    """The offsets of one side (``name``: cu_seqlens_q or cu_seqlens_kv) and its rows."""
    if cu_padded is None:
        raise ValueError(f"{caller}: qkv_layout 'thd' under context parallelism needs "
                         f"{name}_padded (each sequence's first row in the padded packing, "
                         f"its length a multiple of 2 * {size} devices), got None")
    if rows % size:
        raise ValueError(f"{caller}: under context parallelism the thd tensors' rows must be a "
                         f"multiple of the context-parallel axis's {size} devices, got {rows} "
                         f"rows for {name}")
    check_offsets(caller, name, cu, cu_padded, rows, 2 * size,
                  f" (2 x the context-parallel axis's {size} devices)")
