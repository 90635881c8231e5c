"""Packed (thd) sequences with padding between them: ``fused_attn``'s ``cu_seqlens_q_padded``
and ``cu_seqlens_kv_padded`` (NVIDIA's names; its ``SequenceDescriptor`` calls them
``seq_offsets``), as Megatron-LM packs sequences whose lengths are rounded up.

Sequence b's tokens are rows ``cu_padded[b] .. cu_padded[b] + len(b) - 1`` of the tensor,
``len(b) = cu[b + 1] - cu[b]``; the rows after them up to ``cu_padded[b + 1]`` (and any rows
past ``cu_padded[-1]``) are padding. The core's attention takes the sequences back to back, so
the rows are gathered into that packing first and the output gathered back, its padding rows
0. Every index is computed with jnp ops from the cumulative lengths, so the offsets may be
traced (static shapes, no host read); the gradients flow back through the same gathers, and
padding rows get 0.

The two index helpers (:func:`segments`, :func:`rows_in`) also lay out the pieces of
context-parallel thd attention (:mod:`~transformer_engine.jax.context_parallel_thd`).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

import jax
import jax.numpy as jnp

__all__ = ["cumulative", "segments", "rows_in", "take", "check_offsets", "attend"]


def cumulative(counts: jax.Array) -> jax.Array:
    """int32 [n + 1]: 0, then the running sums of ``counts``."""
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


def segments(counts: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each of ``rows`` rows lies when segments of ``counts`` rows sit back to back:
    (segment, position in it, inside a segment); the rows after the last segment are
    outside (segment and position then meaningless but in range)."""
    cu = cumulative(counts)
    r = jnp.arange(rows, dtype=jnp.int32)
    # right: an empty segment ends where the next starts, so a row belongs to the next one
    seg = jnp.clip(jnp.searchsorted(cu[1:], r, side="right"), 0, counts.shape[0] - 1)
    inside = r < cu[-1]
    return seg.astype(jnp.int32), jnp.where(inside, r - cu[seg], 0), inside


def rows_in(starts: jax.Array, counts: jax.Array,
            rows: int) -> tuple[jax.Array, jax.Array]:
    """For each of ``rows`` rows of a tensor whose segment s holds its ``counts[s]`` tokens
    from row ``starts[s]`` on (``starts`` non-decreasing, segments not overlapping): (its row
    in the back-to-back packing of the tokens, is a token); non-tokens give row 0."""
    r = jnp.arange(rows, dtype=jnp.int32)
    # the last segment starting at or before r: among equal starts the non-empty one, which
    # comes last (a segment with tokens ends after its start)
    seg = jnp.clip(jnp.searchsorted(starts, r, side="right") - 1, 0, starts.shape[0] - 1)
    pos = r - starts[seg]
    token = (pos >= 0) & (pos < counts[seg])
    return jnp.where(token, cumulative(counts)[seg] + pos, 0), token


def _concrete(x) -> Optional[np.ndarray]:
    """``x``'s values where they are known while tracing (not a traced argument), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_offsets(op: str, name: str, cu, cu_padded, rows: int, multiple: int = 1,
                  why: str = "") -> None:
    """Shapes always; values where they are known (a traced offset is the caller's word):
    ``cu_padded`` starts at 0, gives each sequence at least its length in ``cu``, a multiple
    of ``multiple`` rows (``why`` says why), and ends within the tensor's ``rows`` rows."""
    if cu_padded.ndim != 1 or cu_padded.shape != cu.shape:
        raise ValueError(f"{op}: {name}_padded must have the shape of {name} "
                         f"({tuple(cu.shape)}), got {tuple(cu_padded.shape)}")
    values, padded = _concrete(cu), _concrete(cu_padded)
    if values is None or padded is None or not padded.size:
        return
    lengths, sizes = np.diff(values), np.diff(padded)
    if padded[0] != 0 or (sizes < lengths).any() or padded[-1] > rows:
        raise ValueError(f"{op}: {name}_padded must start at 0, give each sequence at least its "
                         f"length in {name} ({lengths.tolist()}) and end within the tensor's "
                         f"{rows} rows, got {padded.tolist()}")
    if (sizes % multiple).any():
        raise ValueError(f"{op}: each sequence's padded length ({name}_padded) must be a "
                         f"multiple of {multiple}{why}, got lengths {sizes.tolist()} "
                         f"({name}_padded {padded.tolist()})")


def take(x: jax.Array, index: jax.Array, keep: jax.Array) -> jax.Array:
    """``x[index]`` where ``keep``, else 0 (rows of x along dimension 0)."""
    # where, not a product: the rows kept out read row 0, which may be padding holding NaN
    return jnp.where(keep.reshape(-1, *([1] * (x.ndim - 1))), x[index], 0)


def _packing(cu: jax.Array, cu_padded: jax.Array, rows: int):
    """(source row of each packed row, packed row holds a token; packed row of each row, row
    holds a token)."""
    lengths = jnp.diff(cu)
    seg, pos, inside = segments(lengths, rows)
    source = jnp.where(inside, cu_padded[seg] + pos, 0)
    back, token = rows_in(cu_padded[:-1], lengths, rows)
    return source, inside, back, token


def attend(attend_packed: Callable, q, k, v, cu_q, cu_kv, cu_q_padded, cu_kv_padded):
    """``attend_packed(q, k, v)`` (thd attention of back-to-back sequences) on the rows of q, k,
    v laid out by the padded offsets (either None: that side back to back already); the
    output in q's layout, its padding rows 0."""
    back = None
    if cu_kv_padded is not None:
        source, inside, _, _ = _packing(cu_kv, cu_kv_padded, k.shape[0])
        k, v = take(k, source, inside), take(v, source, inside)
    if cu_q_padded is not None:
        source, inside, back, token = _packing(cu_q, cu_q_padded, q.shape[0])
        q = take(q, source, inside)
    o = attend_packed(q, k, v)
    return o if back is None else take(o, back, token)
