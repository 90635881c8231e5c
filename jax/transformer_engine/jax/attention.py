"""``fused_attn``: dot-product attention as a ``jax.custom_vjp`` over the core's attention entry
points (cuDNN's fused kernels or the core's CUDA math path on GPUs, the CPU reference on the
CPU), one custom call forward and one backward.

Semantics (masks, windows, GQA, padding, dropout) are the core's ``attention.h``. The forward
saves ``o`` and the fp32 row log-sum-exp for the backward pass. Dropout draws its
(seed, offset) from the ``dropout_rng`` key: the same key gives the same mask.

Under ``jax.jit`` over a mesh both calls are partitioned
(:func:`transformer_engine.jax.partitioning.attention_forward`): the batch and the heads of
q, k, v may stay split (each device attends its own rows and heads, with no communication),
the sequences and head dims are made whole. With the heads split, each device's key/value
heads must be those of its query heads: the key/value head count a multiple of the split (or
one, MQA); otherwise the heads are gathered. Dropout gives each shard its own random
numbers; with only the batch split they are those of the unsharded call.

NVIDIA's enums :class:`AttnMaskType`, :class:`QKVLayout` (and :class:`QKVFormat`,
:class:`AttnBiasType`, :class:`SequenceDescriptor`) are defined in ``_attention_types``; the
members are our option strings, so they can be passed as ``attn_mask_type`` / ``qkv_layout``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp
from transformer_engine.jax import context_parallel, context_parallel_thd, padded_packing
from transformer_engine.jax._attention_types import (
    AttnBiasType,
    AttnMaskType,
    AttnSoftmaxType,
    QKVFormat,
    QKVLayout,
    SequenceDescriptor,
    softmax_type_of,
)
from transformer_engine.jax._native import TARGETS, load
from transformer_engine.jax.autocast import get_mesh_resource
from transformer_engine.jax.context_parallel import (
    CPStrategy,
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.context_parallel_thd import (
    inverse_reorder_thd_load_balancing,
    reorder_thd_load_balancing,
)
from transformer_engine.jax.sequence_descriptor import thd_offsets

__all__ = ["fused_attn", "LAYOUTS", "MASKS", "AttnMaskType", "AttnBiasType", "AttnSoftmaxType",
           "QKVFormat",
           "QKVLayout", "SequenceDescriptor", "CPStrategy", "ReorderStrategy",
           "reorder_causal_load_balancing", "inverse_reorder_causal_load_balancing",
           "reorder_thd_load_balancing", "inverse_reorder_thd_load_balancing"]

load()

LAYOUTS = {"bshd": 0, "sbhd": 1, "thd": 2}
MASKS = {"no_mask": 0, "causal": 1, "causal_bottom_right": 2, "padding": 3, "padding_causal": 4,
         "padding_causal_bottom_right": 5}
_BACKEND_AUTO = -1  # te_attn_backend: the core picks the first backend that takes the call
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_TE_NAMES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.float16): "float16",
             jnp.dtype(jnp.bfloat16): "bfloat16"}
_VMAP = "sequential"


def _sizes(q, k, v, layout: str, batch: int, max_sq: int, max_skv: int) -> list[int]:
    if layout == "thd":
        return [batch, q.shape[1], k.shape[1], max_sq, max_skv, q.shape[2], v.shape[2],
                q.shape[0], k.shape[0]]
    b, sq = (q.shape[0], q.shape[1]) if layout == "bshd" else (q.shape[1], q.shape[0])
    skv = k.shape[1] if layout == "bshd" else k.shape[0]
    return [b, q.shape[2], k.shape[2], sq, skv, q.shape[3], v.shape[3], b * sq, b * skv]


def _workspace_bytes(params, sizes, dtype, backward: bool, strides=()) -> int:
    """CUDA workspace of the call, asked of the core for device 0 (0 when JAX runs on the CPU:
    the CPU reference needs none); ``strides`` those of q, k, v read in place (the packed
    calls)."""
    if jax.default_backend() == "cpu":
        return 0
    from transformer_engine.common import core

    c = core()
    layout, mask, wl, wr, scale, dropout, max_sq, max_skv, deterministic = params
    cfg = c.AttentionConfig(c.AttnLayout(layout), c.AttnMask(mask), window_left=wl,
                            window_right=wr, softmax_scale=scale, dropout=dropout,
                            max_seqlen_q=max_sq, max_seqlen_kv=max_skv,
                            deterministic=deterministic, strides=list(strides))
    te = getattr(c.DType, _TE_NAMES[jnp.dtype(dtype)])
    return int(c.attention_workspace_size(cfg, sizes, te, te, te, device_id=0, backward=backward))


def _attrs(params) -> dict:
    layout, mask, wl, wr, scale, dropout, max_sq, max_skv, _ = params
    return dict(layout=np.int32(layout), mask_type=np.int32(mask), window_left=np.int64(wl),
                window_right=np.int64(wr), softmax_scale=np.float32(scale),
                dropout=np.float32(dropout), max_seqlen_q=np.int64(max_sq),
                max_seqlen_kv=np.int64(max_skv), backend=np.int32(_BACKEND_AUTO))


def _partitioner():
    """The partitioned forms of the calls (:mod:`transformer_engine.jax.partitioning`) while a
    mesh is in context or the mesh resource names axes, else None."""
    from transformer_engine.jax import partitioning

    return partitioning if partitioning.active() else None


def _lengths(cu: jax.Array, layout: str) -> jax.Array:
    """What the partitioned call takes for cu_seqlens: each sequence's length (a [batch] array
    that splits with the batch; the shard's cu_seqlens are rebuilt from its lengths), or the
    cu_seqlens themselves for thd (whose packed tokens are not split)."""
    return cu if layout == "thd" or not cu.size else jnp.diff(cu)


def _cumulative(lengths: jax.Array, layout: str) -> jax.Array:
    if layout == "thd" or not lengths.size:
        return lengths
    return padded_packing.cumulative(lengths)


def _piece_args(q, params, mask):
    """The plain call's (params, cu_q, cu_kv, rng) for one piece of a context-parallel
    attention (:mod:`~transformer_engine.jax.context_parallel`). ``mask``: ``"full"`` (every
    key), ``"causal"`` (the diagonal of two chunks of one length), or each sequence's
    (query lengths, key lengths, causal) (int32 [batch] each; causal: bottom right)."""
    empty, rng = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.uint32)
    if isinstance(mask, str):  # (the ring's causal pair: two chunks of one length)
        kind = MASKS["no_mask" if mask == "full" else "causal"]
        return (params[0], kind, *params[2:]), empty, empty, rng
    q_lengths, kv_lengths, causal = mask
    plain = (params[0], MASKS["padding_causal_bottom_right" if causal else "padding"],
             *params[2:])
    return plain, _cumulative(q_lengths, "bshd"), _cumulative(kv_lengths, "bshd"), rng


def _forward_piece(q, k, v, mask, *, params):
    plain, cu_q, cu_kv, rng = _piece_args(q, params, mask)
    return _forward_call(q, k, v, cu_q, cu_kv, rng, plain)


def _backward_piece(q, k, v, o, d_o, lse, mask, *, params):
    plain, cu_q, cu_kv, rng = _piece_args(q, params, mask)
    return _backward_call(q, k, v, o, d_o, lse, cu_q, cu_kv, rng, plain)


def _cp_shard(cp, params, backward: bool):
    """(axis, the per-device function) of the partitioned call under context parallelism,
    or None; ``cp`` is (mesh axis, its size, load balanced, strategy) or None."""
    if cp is None:
        return None
    axis, size, balanced, strategy = cp
    layout = list(LAYOUTS)[params[0]]
    mask = next(name for name, code in MASKS.items() if code == params[1])
    padding = mask.startswith("padding")
    kw = dict(layout=layout, causal="causal" in mask, axis=axis, size=size, balanced=balanced)
    ring = strategy == "ring"
    if backward:
        fn = context_parallel.ring_backward if ring else context_parallel.shard_backward
        run = functools.partial(_backward_piece, params=params)

        def shard(qs, ks, vs, os_, dos, lses, lq, lkv, _):
            lengths = (lq, lkv) if padding else None
            return fn(run, qs, ks, vs, os_, dos, lses, **kw, lengths=lengths)
    else:
        fn = context_parallel.ring_forward if ring else context_parallel.shard_forward
        run = functools.partial(_forward_piece, params=params)

        def shard(qs, ks, vs, lq, lkv, _):
            lengths = (lq, lkv) if padding else None
            return fn(run, qs, ks, vs, **kw, lengths=lengths)
    return axis, shard


def _thd_params(params, causal: bool, max_q: int, max_kv: int) -> tuple:
    """The plain thd call of context-parallel thd pieces: each piece's queries end its
    causal diagonal (bottom right)."""
    mask = MASKS["padding_causal_bottom_right" if causal else "padding"]
    return (params[0], mask, *params[2:6], max_q, max_kv, params[8])


def _thd_cp(cp, params) -> dict:
    """The keywords of :mod:`~transformer_engine.jax.context_parallel_thd`'s calls."""
    mask = next(name for name, code in MASKS.items() if code == params[1])
    return dict(causal=context_parallel_thd.MASKS[mask], axis=cp[0], size=cp[1],
                max_q=params[6], max_kv=params[7])


def _forward_call(q, k, v, cu_q, cu_kv, rng, params, cp=None):
    layout = list(LAYOUTS)[params[0]]
    if cp is not None and layout == "thd":
        kw = _thd_cp(cp, params)

        # (no dropout under context parallelism: the pieces' calls take no random state)
        def run(q, k, v, cu_q, cu_kv, max_q, max_kv):
            return _forward_call(q, k, v, cu_q, cu_kv, jnp.zeros((0,), jnp.uint32),
                                 _thd_params(params, kw["causal"], max_q, max_kv))

        return context_parallel_thd.attention_forward(run, q, k, v, cu_q, cu_kv, rng, **kw)
    batch = cu_q.shape[0] - 1 if layout == "thd" else None
    sizes = _sizes(q, k, v, layout, batch, params[6], params[7])
    part = _partitioner()
    if part is not None:
        def body(qs, ks, vs, lq, lkv, r):
            return _forward_call(qs, ks, vs, _cumulative(lq, layout), _cumulative(lkv, layout),
                                 r, params)

        results = (jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype),
                   jax.ShapeDtypeStruct((sizes[0], sizes[1], sizes[3]), jnp.float32))
        o, lse = part.attention_forward(
            (q, k, v, _lengths(cu_q, layout), _lengths(cu_kv, layout), rng), body, results,
            layout=layout, shape=(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]),
            cp=_cp_shard(cp, params, backward=False))
        return o, lse
    lse_shape = (sizes[0], sizes[1], sizes[3])
    results = (jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype),
               jax.ShapeDtypeStruct(lse_shape, jnp.float32),
               jax.ShapeDtypeStruct((_workspace_bytes(params, sizes, q.dtype, False),), jnp.uint8))
    call = jax.ffi.ffi_call(TARGETS["attention_forward"], results, vmap_method=_VMAP)
    o, lse, _ = call(q, k, v, cu_q, cu_kv, rng, **_attrs(params))
    return o, lse


def _backward_call(q, k, v, o, d_o, lse, cu_q, cu_kv, rng, params, cp=None):
    layout = list(LAYOUTS)[params[0]]
    if cp is not None and layout == "thd":
        kw = _thd_cp(cp, params)

        def run(q, k, v, o, d_o, lse, cu_q, cu_kv, max_q, max_kv):
            return _backward_call(q, k, v, o, d_o, lse, cu_q, cu_kv,
                                  jnp.zeros((0,), jnp.uint32),
                                  _thd_params(params, kw["causal"], max_q, max_kv))

        return context_parallel_thd.attention_backward(run, q, k, v, o, d_o, lse, cu_q, cu_kv,
                                                       rng, **kw)
    batch = cu_q.shape[0] - 1 if layout == "thd" else None
    sizes = _sizes(q, k, v, layout, batch, params[6], params[7])
    part = _partitioner()
    if part is not None:
        def body(qs, ks, vs, os_, dos, lses, lq, lkv, r):
            return _backward_call(qs, ks, vs, os_, dos, lses, _cumulative(lq, layout),
                                  _cumulative(lkv, layout), r, params)

        results = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype))
        dq, dk, dv = part.attention_backward(
            (q, k, v, o, d_o, lse, _lengths(cu_q, layout), _lengths(cu_kv, layout), rng), body,
            results, layout=layout, shape=(sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]),
            cp=_cp_shard(cp, params, backward=True))
        return dq, dk, dv
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((_workspace_bytes(params, sizes, q.dtype, True),), jnp.uint8))
    call = jax.ffi.ffi_call(TARGETS["attention_backward"], results, vmap_method=_VMAP)
    dq, dk, dv, _ = call(q, k, v, o, d_o, lse, cu_q, cu_kv, rng, **_attrs(params),
                         deterministic=bool(params[8]))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, cu_q, cu_kv, rng, params, cp):
    return _forward_call(q, k, v, cu_q, cu_kv, rng, params, cp)[0]


def _attention_fwd(q, k, v, cu_q, cu_kv, rng, params, cp):
    o, lse = _forward_call(q, k, v, cu_q, cu_kv, rng, params, cp)
    return o, (q, k, v, o, lse, cu_q, cu_kv, rng)


def _attention_bwd(params, cp, residuals, d_o):
    q, k, v, o, lse, cu_q, cu_kv, rng = residuals
    dq, dk, dv = _backward_call(q, k, v, o, d_o.astype(o.dtype), lse, cu_q, cu_kv, rng, params,
                                cp)
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# --- attention over packed projection outputs ------------------------------------------------
# q is either a QKV projection's output [s0, s1, 3, heads, dim] (kv then has no element) or a
# dense q [s0, s1, heads, dim] beside a KV projection's output kv [s0, s1', 2, kv heads, dim].


def _packed_strides(q, kv) -> list[int]:
    """The config's (row, head) strides of q, k and v read in place: a part of a [.., parts,
    heads, dim] output has its tokens parts * heads * dim elements apart, its heads dim; a
    dense q has (0, 0)."""
    if kv.size == 0:
        return [3 * q.shape[3] * q.shape[4], q.shape[4]] * 3
    return [0, 0] + [2 * kv.shape[3] * kv.shape[4], kv.shape[4]] * 2


def _part_shapes(q, kv) -> tuple:
    """The shapes of q, k and v as the packed call reads them (each [s0, s1, heads, dim])."""
    if kv.size == 0:
        part = (*q.shape[:2], *q.shape[3:])
        return part, part, part
    part = (*kv.shape[:2], *kv.shape[3:])
    return q.shape, part, part


def _packed_sizes(q, kv, layout: int) -> list[int]:
    """_sizes of the packed call."""
    parts = (jax.ShapeDtypeStruct(shape, q.dtype) for shape in _part_shapes(q, kv))
    return _sizes(*parts, list(LAYOUTS)[layout], None, 0, 0)


def _packed_workspace_bytes(q, kv, params, backward: bool) -> int:
    return _workspace_bytes(params, _packed_sizes(q, kv, params[0]), q.dtype, backward,
                            _packed_strides(q, kv))


def _packed_attrs(params) -> dict:
    attrs = _attrs(params)
    del attrs["max_seqlen_q"], attrs["max_seqlen_kv"]
    return attrs


def _forward_packed_call(q, kv, rng, params):
    b, heads, _, sq = _packed_sizes(q, kv, params[0])[:4]
    results = (jax.ShapeDtypeStruct(_part_shapes(q, kv)[0], q.dtype),
               jax.ShapeDtypeStruct((b, heads, sq), jnp.float32),
               jax.ShapeDtypeStruct((_packed_workspace_bytes(q, kv, params, False),), jnp.uint8))
    call = jax.ffi.ffi_call(TARGETS["attention_forward_packed"], results, vmap_method=_VMAP)
    o, lse, _ = call(q, kv, rng, **_packed_attrs(params))
    return o, lse


def _backward_packed_call(q, kv, o, d_o, lse, rng, params):
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(kv.shape, kv.dtype),
               jax.ShapeDtypeStruct((_packed_workspace_bytes(q, kv, params, True),), jnp.uint8))
    call = jax.ffi.ffi_call(TARGETS["attention_backward_packed"], results, vmap_method=_VMAP)
    dq, dkv, _ = call(q, kv, o, d_o, lse, rng, **_packed_attrs(params),
                      deterministic=bool(params[8]))
    return dq, dkv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention_packed(q, kv, rng, params):
    return _forward_packed_call(q, kv, rng, params)[0]


def _attention_packed_fwd(q, kv, rng, params):
    o, lse = _forward_packed_call(q, kv, rng, params)
    return o, (q, kv, o, lse, rng)


def _attention_packed_bwd(params, residuals, d_o):
    q, kv, o, lse, rng = residuals
    dq, dkv = _backward_packed_call(q, kv, o, d_o.astype(o.dtype), lse, rng, params)
    return dq, dkv, None


_attention_packed.defvjp(_attention_packed_fwd, _attention_packed_bwd)


def _packable(q, kv, layout: str) -> bool:
    """Whether q and kv have the shapes packed_attention reads in place, each head's bytes a
    multiple of 16 (where cuDNN reads a strided operand)."""
    if kv.size == 0:
        ok = q.ndim == 5 and q.shape[2] == 3
    else:
        batch_axis = 0 if layout == "bshd" else 1
        ok = (q.ndim == 4 and kv.ndim == 5 and kv.shape[2] == 2 and q.shape[3] == kv.shape[4]
              and q.shape[2] % kv.shape[3] == 0 and q.shape[batch_axis] == kv.shape[batch_axis])
    return ok and (q.shape[-1] * jnp.dtype(q.dtype).itemsize) % 16 == 0


def packed_attention(q: jax.Array, kv: Optional[jax.Array] = None, *, qkv_layout: str,
                     attn_mask_type: str, window_size: Optional[tuple[int, int]],
                     scale_factor: float, dropout_probability: float,
                     dropout_rng: Optional[jax.Array],
                     deterministic: bool = False) -> Optional[jax.Array]:
    """fused_attn over projection outputs read in place: with ``kv`` None, q, k, v =
    q[:, :, 0], q[:, :, 1], q[:, :, 2] of a QKV output [batch, seqlen, 3, heads, dim]
    (``"bshd"``; ``"sbhd"``: [seqlen, batch, ...]); else k, v = kv[:, :, 0], kv[:, :, 1] of a
    KV output [batch, seqlen_kv, 2, kv heads, dim] beside a dense q [batch, seqlen, heads,
    dim]. The gradients come back in the arrays' own shapes. The numbers of fused_attn on the
    parts, without copying them out or joining their gradients. None where that does not
    apply (a padding mask, another layout, rows or heads not at 16-byte multiples, a mesh in
    context), and the caller slices."""
    layout = qkv_layout.lower()
    kv = jnp.zeros((0,), q.dtype) if kv is None else kv
    if (layout not in ("bshd", "sbhd") or attn_mask_type.startswith("padding")
            or attn_mask_type not in MASKS or jnp.dtype(q.dtype) not in _DTYPES
            or kv.dtype != q.dtype or _partitioner() is not None
            or not _packable(q, kv, layout)):
        return None
    left, right = window_size if window_size is not None else (-1, -1)
    rng = (jax.random.bits(dropout_rng, (4,), jnp.uint32) if dropout_probability > 0.0
           else jnp.zeros((0,), jnp.uint32))
    params = (LAYOUTS[layout], MASKS[attn_mask_type], int(left), int(right), float(scale_factor),
              float(dropout_probability), 0, 0, bool(deterministic))
    return _attention_packed(q, kv, rng, params)


def _check(q, k, v, layout: str) -> None:
    rank = 3 if layout == "thd" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != rank:
            raise ValueError(f"fused_attn: {name} must have rank {rank} for qkv_layout "
                             f"{layout!r}, got shape {t.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"fused_attn: q and k must have the same head dim, got {q.shape[-1]} "
                         f"and {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0 or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"fused_attn: q's heads ({q.shape[-2]}) must be a multiple of k's "
                         f"({k.shape[-2]}), and v must have k's heads (got {v.shape[-2]})")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"fused_attn: q, k, v must share one of float32, float16, bfloat16, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype}")


def fused_attn(q: jax.Array, k: jax.Array, v: jax.Array, *, qkv_layout: str = "bshd",
               attn_mask_type: str = "causal", window_size: Optional[tuple[int, int]] = None,
               scale_factor: Optional[float] = None, dropout_probability: float = 0.0,
               dropout_rng: Optional[jax.Array] = None, cu_seqlens_q: Optional[jax.Array] = None,
               cu_seqlens_kv: Optional[jax.Array] = None,
               cu_seqlens_q_padded: Optional[jax.Array] = None,
               cu_seqlens_kv_padded: Optional[jax.Array] = None, max_seqlen_q: Optional[int] = None,
               max_seqlen_kv: Optional[int] = None, deterministic: bool = False,
               context_parallel_strategy="default",
               context_parallel_causal_load_balanced: bool = False,
               context_parallel_axis: Optional[str] = None,
               sequence_descriptor: Optional[SequenceDescriptor] = None,
               max_segments_per_seq: Optional[int] = None,
               softmax_type="vanilla") -> jax.Array:
    """softmax(q k^T * scale_factor + mask) v per head, in q's layout with v's head dim.

    Args:
        q, k, v: ``"bshd"`` [batch, seqlen, heads, dim], ``"sbhd"`` [seqlen, batch, heads, dim]
            or ``"thd"`` [tokens, heads, dim] (sequences packed, with cu_seqlens); k and v may
            have fewer heads than q (GQA/MQA: a divisor of q's).
        attn_mask_type: one of :data:`MASKS`. The padding masks (and thd) take each
            sequence's lengths from ``cu_seqlens_q`` / ``cu_seqlens_kv`` (int32 [batch + 1]).
        window_size: (left, right) sliding window, -1 an unbounded side; causal masks set
            right = 0.
        scale_factor: default 1 / sqrt(head_dim).
        dropout_probability, dropout_rng: dropout of the attention weights; the key is needed
            when the probability is > 0.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: thd only, with padding between the
            sequences: each one's first row (int32 [batch + 1], NVIDIA's names; its JAX
            ``SequenceDescriptor`` calls them ``seq_offsets``). The rows after a sequence's
            tokens up to the next one's first row are padding: output 0, gradient 0. None:
            that side back to back. Under context parallelism both are needed: the global
            padded packing, each sequence's padded length a multiple of 2 x the axis's size
            (:mod:`~transformer_engine.jax.context_parallel_thd`).
        max_seqlen_q, max_seqlen_kv: thd only: the longest sequences (static ints); a
            packed ``sequence_descriptor`` takes the row lengths instead.
        deterministic: ask the backward for a deterministic dk/dv reduction.
        context_parallel_axis: the mesh axis the sequences are split over (default
            ``MeshResource.cp_resource``); under ``jax.jit`` over a mesh where it has more than
            one device, the attention runs context parallel
            (:mod:`~transformer_engine.jax.context_parallel`; thd:
            :mod:`~transformer_engine.jax.context_parallel_thd`, in the order of
            :func:`reorder_thd_load_balancing`).
        context_parallel_causal_load_balanced: the sequences come in the order of
            :func:`reorder_causal_load_balancing` (for that axis's size), and the output goes
            out in it.
        context_parallel_strategy: ``"default"`` / ``"all_gather"`` (gather k and v), or
            ``"ring"`` (pass k and v round the devices, one block held at a time); NVIDIA's
            :class:`CPStrategy` members too.
        sequence_descriptor: NVIDIA's :class:`SequenceDescriptor`, in place of the
            cu_seqlens. ``from_seqlens``: the ``cu_seqlens_q`` / ``cu_seqlens_kv`` of its
            lengths. ``from_seqlens_and_offsets`` / ``from_segment_ids_and_pos`` (NVIDIA's
            THD): ``qkv_layout="thd"`` with q, k, v ``[batch, seqlen, heads, dim]``, each row
            holding several sequences; they run as our thd over the ``batch * seqlen`` rows
            with padded offsets (:mod:`~transformer_engine.jax.sequence_descriptor`), and the
            output is ``[batch, seqlen, heads, dim_v]`` with its padding rows 0. Not under
            context parallelism.
        max_segments_per_seq: the sequences kept per row of a packed ``sequence_descriptor``
            (NVIDIA's static capacity; None: the descriptor's width). A row with more raises
            ValueError where the descriptor's values are known while tracing; under ``jax.jit``
            the extra ones are dropped (their rows give 0).
        softmax_type: ``"vanilla"`` (or ``AttnSoftmaxType.VANILLA_SOFTMAX``) only: the
            core's fused attention takes no attention sink. The flax ``DotProductAttention``,
            ``MultiHeadAttention`` and ``TransformerLayer`` take ``"off-by-one"`` and
            ``"learnable"`` and run them in jnp.

    Example:
        >>> import jax.numpy as jnp
        >>> from transformer_engine.jax.attention import fused_attn
        >>> q = jnp.ones((1, 3, 2, 4))
        >>> fused_attn(q, q, q).shape
        (1, 3, 2, 4)
    """
    if softmax_type_of("fused_attn", softmax_type) != "vanilla":
        raise NotImplementedError(f"fused_attn: softmax_type {softmax_type_of('', softmax_type)!r} "
                                  "(attention sinks) is not implemented in the fused attention; "
                                  "the flax DotProductAttention(softmax_type=...) runs it in jnp")
    layout = qkv_layout.lower()
    if layout not in LAYOUTS:
        raise ValueError(f"fused_attn: qkv_layout must be one of {tuple(LAYOUTS)}, got "
                         f"{qkv_layout!r}")
    if attn_mask_type not in MASKS:
        raise ValueError(f"fused_attn: attn_mask_type must be one of {tuple(MASKS)}, got "
                         f"{attn_mask_type!r}")
    if sequence_descriptor is not None:
        given = [name for name, t in (("cu_seqlens_q", cu_seqlens_q),
                                      ("cu_seqlens_kv", cu_seqlens_kv),
                                      ("cu_seqlens_q_padded", cu_seqlens_q_padded),
                                      ("cu_seqlens_kv_padded", cu_seqlens_kv_padded))
                 if t is not None]
        if given:
            raise ValueError(f"fused_attn: sequence_descriptor describes the sequences in "
                             f"place of {given[0]}; pass one or the other, got both")
        if sequence_descriptor.packed:
            kw = dict(attn_mask_type=attn_mask_type, window_size=window_size,
                      scale_factor=scale_factor, dropout_probability=dropout_probability,
                      dropout_rng=dropout_rng, deterministic=deterministic,
                      context_parallel_strategy=context_parallel_strategy,
                      context_parallel_causal_load_balanced=context_parallel_causal_load_balanced,
                      context_parallel_axis=context_parallel_axis)
            return _packed_rows(q, k, v, sequence_descriptor, layout, max_segments_per_seq, kw)
        cu_seqlens_q, cu_seqlens_kv = sequence_descriptor.cu_seqlens()
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    _check(q, k, v, layout)
    padding = layout == "thd" or attn_mask_type.startswith("padding")
    if padding and (cu_seqlens_q is None or cu_seqlens_kv is None):
        raise ValueError(f"fused_attn: attn_mask_type {attn_mask_type!r} with qkv_layout "
                         f"{layout!r} needs cu_seqlens_q and cu_seqlens_kv")
    if layout == "thd" and (max_seqlen_q is None or max_seqlen_kv is None):
        raise ValueError("fused_attn: qkv_layout 'thd' needs max_seqlen_q and max_seqlen_kv")
    if not 0.0 <= dropout_probability < 1.0:
        raise ValueError(f"fused_attn: dropout_probability must be in [0, 1), got "
                         f"{dropout_probability}")
    if dropout_probability > 0.0 and dropout_rng is None:
        raise ValueError("fused_attn: dropout_probability > 0 needs dropout_rng (a PRNG key)")
    padded = (cu_seqlens_q_padded, cu_seqlens_kv_padded)
    if layout != "thd" and any(t is not None for t in padded):
        raise ValueError(f"fused_attn: cu_seqlens_q_padded / cu_seqlens_kv_padded must be None "
                         f"except for qkv_layout 'thd' (packed sequences), got qkv_layout "
                         f"{layout!r}")
    padded = tuple(None if t is None else jnp.asarray(t, jnp.int32) for t in padded)
    left, right = window_size if window_size is not None else (-1, -1)
    scale = scale_factor if scale_factor is not None else 1.0 / math.sqrt(q.shape[-1])
    empty = jnp.zeros((0,), jnp.int32)
    cu_q = jnp.asarray(cu_seqlens_q, jnp.int32) if padding else empty
    cu_kv = jnp.asarray(cu_seqlens_kv, jnp.int32) if padding else empty
    # (seed, offset) as the bytes of uint32 [4]: JAX has no int64 without x64.
    rng = (jax.random.bits(dropout_rng, (4,), jnp.uint32) if dropout_probability > 0.0
           else jnp.zeros((0,), jnp.uint32))
    params = (LAYOUTS[layout], MASKS[attn_mask_type], int(left), int(right), float(scale),
              float(dropout_probability), int(max_seqlen_q or 0), int(max_seqlen_kv or 0),
              bool(deterministic))
    cp = _context_parallel(context_parallel_axis, context_parallel_strategy,
                           bool(context_parallel_causal_load_balanced), q, k, layout,
                           attn_mask_type, window_size, dropout_probability)
    if layout == "thd":
        return _thd(q, k, v, cu_q, cu_kv, padded, rng, params, cp)
    return _attention(q, k, v, cu_q, cu_kv, rng, params, cp)


def _packed_rows(q, k, v, desc: SequenceDescriptor, layout: str,
                 max_segments: Optional[int], kw: dict) -> jax.Array:
    """NVIDIA's THD (q, k, v [batch, seqlen, heads, dim], several sequences a row, laid out
    by ``desc``) as our thd over the batch * seqlen rows with padded offsets; the output back
    in rows."""
    if layout != "thd":
        raise ValueError(f"fused_attn: a sequence_descriptor with offsets or segment ids "
                         f"(several sequences a row) needs qkv_layout 'thd', got {layout!r}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"fused_attn: {name} must be [batch, seqlen, heads, dim] with a "
                             f"packed sequence_descriptor, got shape {t.shape}")
    if k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"fused_attn: q, k, v must have one batch, and v k's seqlen, got "
                         f"shapes {q.shape}, {k.shape}, {v.shape}")
    if max_segments is not None and (isinstance(max_segments, bool)
                                     or not isinstance(max_segments, int) or max_segments < 1):
        raise ValueError(f"fused_attn: max_segments_per_seq must be a positive int or None, "
                         f"got {max_segments!r}")
    batch, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    cu_q, cu_kv, pad_q, pad_kv = thd_offsets(desc, "fused_attn", batch, sq, skv, max_segments)
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    if _context_parallel(kw["context_parallel_axis"], kw["context_parallel_strategy"],
                         bool(kw["context_parallel_causal_load_balanced"]), q, k, "thd",
                         kw["attn_mask_type"], kw["window_size"],
                         kw["dropout_probability"]) is not None:
        raise NotImplementedError("fused_attn: a packed sequence_descriptor under context "
                                  "parallelism is not implemented (NVIDIA's rows are striped "
                                  "over the devices); pass our thd packing with "
                                  "cu_seqlens_q_padded / cu_seqlens_kv_padded instead")
    o = fused_attn(q, k, v, qkv_layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                   cu_seqlens_q_padded=pad_q, cu_seqlens_kv_padded=pad_kv, max_seqlen_q=sq,
                   max_seqlen_kv=skv, **kw)
    return o.reshape(batch, sq, *o.shape[1:])


def _thd(q, k, v, cu_q, cu_kv, padded: tuple, rng, params, cp):
    """thd attention with the padded offsets ``padded`` (either may be None): split over
    the context-parallel axis, or on the padded packing."""
    rows = {"cu_seqlens_q": q.shape[0], "cu_seqlens_kv": k.shape[0]}
    if cp is not None:
        for (name, n), cu, cu_padded in zip(rows.items(), (cu_q, cu_kv), padded, strict=True):
            context_parallel_thd.check_call_offsets("fused_attn", cp[1], name, cu, cu_padded, n)
        # the calls take each side's lengths and offsets stacked: both whole on every device
        return _attention(q, k, v, jnp.stack([cu_q, padded[0]]), jnp.stack([cu_kv, padded[1]]),
                          rng, params, cp)
    for (name, n), cu, cu_padded in zip(rows.items(), (cu_q, cu_kv), padded, strict=True):
        if cu_padded is not None:
            padded_packing.check_offsets("fused_attn", name, cu, cu_padded, n)
    if padded == (None, None):
        return _attention(q, k, v, cu_q, cu_kv, rng, params, None)
    return padded_packing.attend(
        lambda q, k, v: _attention(q, k, v, cu_q, cu_kv, rng, params, None), q, k, v, cu_q,
        cu_kv, *padded)


def _context_parallel(axis: Optional[str], strategy, balanced: bool, q, k, layout: str,
                      mask: str, window, dropout: float) -> Optional[tuple]:
    """(mesh axis, its size, load balanced) when the call runs context parallel: the axis
    (the given one, or the mesh resource's cp_resource) is in the mesh in context with more
    than one device. None otherwise (nothing to split: the call runs as it is)."""
    caller = "fused_attn"
    axis = axis or get_mesh_resource().cp_resource
    if not axis:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    if axis not in mesh.axis_names:
        raise ValueError(f"{caller}: the context-parallel axis {axis!r} is not an axis of the "
                         f"mesh in context (its axes: {list(mesh.axis_names)})")
    size = int(dict(mesh.shape)[axis])
    if size == 1:
        return None
    seq = 0 if layout == "sbhd" else 1
    context_parallel.check_call(caller, layout=layout, mask=mask, window=window,
                                dropout=dropout, strategy=strategy, sq=q.shape[seq],
                                skv=k.shape[seq], size=size, balanced=balanced)
    name = context_parallel.strategy_name(strategy)
    if layout == "thd":
        name = context_parallel_thd.check_call(caller, mask, name)
    return axis, size, balanced, "ring" if name == "ring" else "all_gather"
