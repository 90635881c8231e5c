"""NVIDIA's ``SequenceDescriptor`` (where the sequences of an attention call lie in its rows),
and its packed forms laid onto our thd packing.

NVIDIA's JAX THD keeps q, k, v as ``[batch, seqlen, heads, dim]``: each batch row holds several
sequences ("segments") one after the other, with padding rows between and after them. Its
descriptor has three forms:

* :meth:`SequenceDescriptor.from_seqlens`: one valid length per row (int32 [batch]), the
  ``cu_seqlens_q`` / ``cu_seqlens_kv`` of :meth:`~SequenceDescriptor.cu_seqlens`.
* :meth:`SequenceDescriptor.from_seqlens_and_offsets`: per row the segments' lengths
  ([batch, n]; unused entries <= 0, NVIDIA writes -1) and where each starts in its row
  ([batch, n + 1]; unused entries -1). A row's k-th used length goes with its k-th used
  offset; offsets past the row's segments are ignored (NVIDIA's docstring example lists the
  end of the last segment too, its tests do not).
* :meth:`SequenceDescriptor.from_segment_ids_and_pos`: each token's segment id ([batch,
  seqlen]; ids from 1, 0 is padding), each segment's tokens one run of rows. The positions
  are checked, not read (NVIDIA derives the lengths through its causal mask over them, which
  for positions rising within each segment gives these lengths).

:func:`thd_offsets` lays a packed descriptor onto our thd over the ``batch * seqlen`` rows:
row b's k-th segment is one sequence of the packing, from row ``b * seqlen + offset``, and
:func:`~transformer_engine.jax.attention.fused_attn` runs it on the padded packing
(:mod:`~transformer_engine.jax.padded_packing`). Every index is a jnp op on static shapes,
so the descriptor may be traced (it is a pytree).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import numpy as np

import jax
import jax.numpy as jnp
from transformer_engine.jax.padded_packing import cumulative

__all__ = ["SequenceDescriptor", "thd_offsets"]

Pair = Union[jax.Array, Sequence[jax.Array]]


def _pair(op: str, name: str, value: Pair) -> tuple[jax.Array, jax.Array]:
    """(q, kv) int32 of one array (both the same) or a pair."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{op}: {name} must be one array or a pair (q, kv), got "
                             f"{len(value)} entries")
        q, kv = value
    else:
        q = kv = value
    return jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)


def _check_rank(op: str, name: str, x: jax.Array, what: str, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must be {what}, got shape {tuple(x.shape)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceDescriptor:
    """How the sequences of an attention call lie in its rows, for q and for k/v; one of the
    three forms of the module docstring (the other fields None). Build it with a ``from_*``
    constructor and pass it to ``fused_attn(..., sequence_descriptor=...)`` or to the flax
    ``DotProductAttention`` call.

    Example:
        >>> import jax.numpy as jnp
        >>> from transformer_engine.jax.attention import SequenceDescriptor
        >>> # row 0: segments of 2 and 1 tokens; row 1: one of 3 tokens after a padding row
        >>> desc = SequenceDescriptor.from_seqlens_and_offsets(
        ...     jnp.array([[2, 1, -1], [3, -1, -1]]), jnp.array([[0, 2, -1, -1], [1, -1, -1, -1]]))
        >>> desc.packed
        True
    """

    q_seqlens: Optional[jax.Array] = None
    kv_seqlens: Optional[jax.Array] = None
    q_offsets: Optional[jax.Array] = None
    kv_offsets: Optional[jax.Array] = None
    q_segment_ids: Optional[jax.Array] = None
    kv_segment_ids: Optional[jax.Array] = None
    q_segment_pos: Optional[jax.Array] = None
    kv_segment_pos: Optional[jax.Array] = None

    @property
    def packed(self) -> bool:
        """Several sequences per row (NVIDIA's THD forms), not one length per row."""
        return self.q_offsets is not None or self.q_segment_ids is not None

    @classmethod
    def from_seqlens(cls, seqlens: Pair) -> "SequenceDescriptor":
        """From one [batch] array of lengths (q and k/v the same) or a pair (q, kv)."""
        op = "SequenceDescriptor.from_seqlens"
        q, kv = _pair(op, "seqlens", seqlens)
        if q.ndim != 1 or kv.shape != q.shape:
            raise ValueError(f"{op}: the lengths must be [batch] arrays of one shape, got "
                             f"{q.shape} and {kv.shape}")
        return cls(q, kv)

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens: Pair, seq_offsets: Pair) -> "SequenceDescriptor":
        """From each row's segment lengths [batch, n] and where they start in the row
        [batch, n + 1]; one array each (q and k/v the same) or pairs (q, kv)."""
        op = "SequenceDescriptor.from_seqlens_and_offsets"
        q, kv = _pair(op, "seqlens", seqlens)
        q_off, kv_off = _pair(op, "seq_offsets", seq_offsets)
        for side, lengths, offsets in (("q", q, q_off), ("kv", kv, kv_off)):
            _check_rank(op, f"seqlens ({side})", lengths, "[batch, n]", 2)
            want = (lengths.shape[0], lengths.shape[1] + 1)
            if offsets.shape != want:
                raise ValueError(f"{op}: seq_offsets ({side}) must be [batch, n + 1] = {want} "
                                 f"for seqlens of shape {tuple(lengths.shape)}, got "
                                 f"{tuple(offsets.shape)}")
        if kv.shape[0] != q.shape[0]:
            raise ValueError(f"{op}: seqlens must have one batch for q and kv, got "
                             f"{q.shape[0]} and {kv.shape[0]}")
        return cls(q, kv, q_off, kv_off)

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids: Pair,
                                 segment_pos: Optional[Pair] = None) -> "SequenceDescriptor":
        """From each row token's segment id [batch, seqlen] (0: padding) and, optionally, its
        position in the segment (same shape). The positions are checked, not read: each
        segment's tokens are its rows in order."""
        op = "SequenceDescriptor.from_segment_ids_and_pos"
        q, kv = _pair(op, "segment_ids", segment_ids)
        for side, ids in (("q", q), ("kv", kv)):
            _check_rank(op, f"segment_ids ({side})", ids, "[batch, seqlen]", 2)
        if kv.shape[0] != q.shape[0]:
            raise ValueError(f"{op}: segment_ids must have one batch for q and kv, got "
                             f"{q.shape[0]} and {kv.shape[0]}")
        q_pos = kv_pos = None
        if segment_pos is not None:
            q_pos, kv_pos = _pair(op, "segment_pos", segment_pos)
            for side, ids, pos in (("q", q, q_pos), ("kv", kv, kv_pos)):
                if pos.shape != ids.shape:
                    raise ValueError(f"{op}: segment_pos ({side}) must have the shape of "
                                     f"segment_ids {tuple(ids.shape)}, got {tuple(pos.shape)}")
        return cls(q_segment_ids=q, kv_segment_ids=kv, q_segment_pos=q_pos,
                   kv_segment_pos=kv_pos)

    def cu_seqlens(self) -> tuple[jax.Array, jax.Array]:
        """(cu_seqlens_q, cu_seqlens_kv): int32 [batch + 1] cumulative lengths (the lengths
        form only)."""
        if self.packed:
            raise ValueError("SequenceDescriptor.cu_seqlens: the descriptor must be of "
                             "from_seqlens (one length per row), got a packed one (offsets or "
                             "segment ids): pass it to fused_attn as sequence_descriptor")
        return cumulative(self.q_seqlens), cumulative(self.kv_seqlens)


def _compact(values: jax.Array, keep: jax.Array, fill: int) -> jax.Array:
    """Per row, the entries of ``values`` where ``keep`` first, in their order, then ``fill``."""
    order = jnp.argsort(~keep, axis=-1, stable=True)
    kept = jnp.take_along_axis(keep, order, axis=-1)
    return jnp.where(kept, jnp.take_along_axis(values, order, axis=-1), fill)


def _runs(ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(lengths, starts) [batch, seqlen] of each row's runs of one nonzero id, unused 0, -1."""
    edge = jnp.zeros_like(ids[:, :1])
    before = jnp.concatenate([edge, ids[:, :-1]], axis=1)
    after = jnp.concatenate([ids[:, 1:], edge], axis=1)
    rows = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    starts = _compact(rows, (ids != 0) & (ids != before), -1)
    ends = _compact(rows, (ids != 0) & (ids != after), -1)
    return jnp.where(starts >= 0, ends - starts + 1, 0), starts


def _segments(desc: SequenceDescriptor, side: str) -> tuple[jax.Array, jax.Array]:
    """(lengths, starts in the row) [batch, n] of one side's segments, each row's used ones
    first; unused: length 0."""
    ids = getattr(desc, f"{side}_segment_ids")
    if ids is not None:
        return _runs(ids)
    seqlens, offsets = getattr(desc, f"{side}_seqlens"), getattr(desc, f"{side}_offsets")
    lengths = _compact(seqlens, seqlens > 0, 0)
    starts = _compact(offsets, offsets >= 0, -1)[:, :seqlens.shape[1]]
    return jnp.where(starts >= 0, lengths, 0), starts


def _columns(x: jax.Array, n: int) -> jax.Array:
    """The first n columns of x, unused ones (0) added where it has fewer."""
    return x[:, :n] if x.shape[1] >= n else jnp.pad(x, ((0, 0), (0, n - x.shape[1])))


def _check_values(op: str, side: str, lengths, starts, rows: int, n: int) -> None:
    """Where the values are known while tracing: at most n segments a row, each within its row
    and after the previous one (traced values are the caller's word)."""
    if isinstance(lengths, jax.core.Tracer) or isinstance(starts, jax.core.Tracer):
        return
    lengths, starts = np.asarray(lengths), np.asarray(starts)
    counts = (lengths > 0).sum(axis=1)
    if (counts > n).any():
        raise ValueError(f"{op}: each row of sequence_descriptor ({side}) must hold at most "
                         f"max_segments_per_seq = {n} segments, got {counts.tolist()}")
    ends = starts + lengths
    outside = (lengths > 0) & (ends > rows)
    overlap = (lengths[:, 1:] > 0) & (starts[:, 1:] < ends[:, :-1])
    if outside.any() or overlap.any():
        raise ValueError(f"{op}: the segments of sequence_descriptor ({side}) must lie within "
                         f"their row of {rows} rows, one after the other, got starts "
                         f"{starts.tolist()} and lengths {lengths.tolist()}")


def _check_shape(op: str, desc: SequenceDescriptor, side: str, batch: int, rows: int) -> None:
    ids = getattr(desc, f"{side}_segment_ids")
    lengths = getattr(desc, f"{side}_seqlens")
    if ids is not None and tuple(ids.shape) != (batch, rows):
        raise ValueError(f"{op}: sequence_descriptor's segment ids ({side}) must be "
                         f"[batch, seqlen] = {(batch, rows)} as {side}'s rows, got "
                         f"{tuple(ids.shape)}")
    if ids is None and lengths.shape[0] != batch:
        raise ValueError(f"{op}: sequence_descriptor's seqlens ({side}) must have {side}'s "
                         f"batch {batch}, got shape {tuple(lengths.shape)}")


def thd_offsets(desc: SequenceDescriptor, op: str, batch: int, rows_q: int, rows_kv: int,
                max_segments: Optional[int] = None) -> tuple[jax.Array, ...]:
    """(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded) of a packed
    descriptor over ``batch`` rows of ``rows_q`` / ``rows_kv`` tokens, seen as one thd
    packing of ``batch * rows`` rows: int32 [batch * max_segments + 2] each.

    Row b's k-th q segment attends row b's k-th kv segment. ``max_segments``: the segments
    kept per row (NVIDIA's static ``max_segments_per_seq``; None: the descriptor's width).
    """
    for side, rows in (("q", rows_q), ("kv", rows_kv)):
        _check_shape(op, desc, side, batch, rows)
    (q_len, q_start), (kv_len, kv_start) = _segments(desc, "q"), _segments(desc, "kv")
    n = max_segments or max(q_len.shape[1], kv_len.shape[1])
    out = []
    for side, lengths, starts, rows in (("q", q_len, q_start, rows_q),
                                        ("kv", kv_len, kv_start, rows_kv)):
        _check_values(op, side, lengths, starts, rows, n)
        lengths, starts = _columns(lengths, n), _columns(starts, n)
        row = (jnp.arange(batch, dtype=jnp.int32) * rows)[:, None]
        # an unused segment is an empty sequence at its row's end: the used ones come first
        # in the row, so the starts never decrease, as the padded packing needs
        first = jnp.where(lengths > 0, row + starts, row + rows).ravel()
        zero, end = jnp.zeros((1,), jnp.int32), jnp.full((1,), batch * rows, jnp.int32)
        # a leading empty sequence at row 0: the padded offsets start at 0 even when the first
        # row starts with padding
        cu = cumulative(jnp.concatenate([zero, lengths.ravel()]))
        out.append((cu, jnp.concatenate([zero, first, end]).astype(jnp.int32)))
    (cu_q, pad_q), (cu_kv, pad_kv) = out
    return cu_q, cu_kv, pad_q, pad_kv
