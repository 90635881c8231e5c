"""The flax (linen) ``DotProductAttention``, over
:func:`transformer_engine.jax.attention.fused_attn`."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn

import jax
import jax.numpy as jnp
from transformer_engine.jax._attention_types import softmax_type_of
from transformer_engine.jax.attention import SequenceDescriptor, fused_attn
from transformer_engine.jax.flax._checks import check_float_dtype, check_mask, check_sizes
from transformer_engine.jax.flax._unfused_attention import (
    allowed_keys,
    query_positions,
    unfused_attention,
)
from transformer_engine.jax.padded_packing import cumulative
from transformer_engine.jax.sharding import check_supported

__all__ = ["DotProductAttention"]

# NVIDIA's attn_mask_type spelling of our "padding_causal".
MASK_ALIASES = {"causal_padding": "padding_causal"}

# NVIDIA's qkv_layout names -> (our layout of each of q, k, v; what is packed: "qkv" means
# query holds q, k, v on axis -3 ([.., 3, h, d]); "kv" means key holds k, v).
_NVIDIA_LAYOUTS = {"bshd_bshd_bshd": ("bshd", None), "bs3hd": ("bshd", "qkv"),
                   "bshd_bs2hd": ("bshd", "kv"), "thd_thd_thd": ("thd", None),
                   "t3hd": ("thd", "qkv"), "thd_t2hd": ("thd", "kv")}


def _layout(qkv_layout: str, transpose_batch_sequence: bool) -> tuple[str, Optional[str]]:
    """(our layout, what is packed) of a qkv_layout, ours or NVIDIA's name."""
    name = str(getattr(qkv_layout, "value", qkv_layout)).lower()
    layout, packed = _NVIDIA_LAYOUTS.get(name, (name, None))
    if layout == "bshd" and transpose_batch_sequence:
        layout = "sbhd"
    return layout, packed


def _unpack(x: jax.Array, n: int, name: str, rank: int) -> list[jax.Array]:
    """The n tensors packed on axis -3 of x ([.., n, heads, head_dim]), of rank ``rank``."""
    if x.ndim != rank or x.shape[-3] != n:
        packed = "[t, " if rank == 4 else "[b, s, "
        raise ValueError(f"DotProductAttention: a packed {name} must have shape {packed}{n}, "
                         f"heads, head_dim], got {x.shape}")
    return [x[..., i, :, :] for i in range(n)]


_BIAS_TYPES = (None, "no_bias", "pre_scale_bias", "post_scale_bias")


def _padding_mask(cu_q: jax.Array, cu_kv: jax.Array, sq: int, skv: int) -> jax.Array:
    """bool [batch, 1, sq, skv], True = masked: the keys or queries past each sequence's
    length (cumulative lengths cu_q, cu_kv), padding at the end as the fused path reads it."""
    len_q, len_kv = jnp.diff(cu_q), jnp.diff(cu_kv)
    q_ok = jnp.arange(sq)[None, :] < len_q[:, None]
    k_ok = jnp.arange(skv)[None, :] < len_kv[:, None]
    return ~(q_ok[:, None, :, None] & k_ok[:, None, None, :])


def _descriptor(desc, mask, cu_q, cu_kv, layout: str) -> tuple:
    """(packed descriptor or None, mask, cu_seqlens_q, cu_seqlens_kv) of the call's arguments.
    NVIDIA's newer call names its fourth argument ``sequence_descriptor`` and takes a mask
    array or a :class:`SequenceDescriptor` there, so either may come as ``mask`` or as
    ``sequence_descriptor``; a descriptor of lengths only becomes the cu_seqlens."""
    name = "DotProductAttention"
    if mask is not None and desc is not None:
        raise ValueError(f"{name}: mask and sequence_descriptor must not both be given (the "
                         "fourth argument is either)")
    given = desc if desc is not None else mask
    if not isinstance(given, SequenceDescriptor):
        return None, given, cu_q, cu_kv
    if cu_q is not None or cu_kv is not None:
        raise ValueError(f"{name}: a SequenceDescriptor describes the sequences in place of "
                         "cu_seqlens_q / cu_seqlens_kv; pass one or the other, got both")
    if not given.packed:
        return None, None, *given.cu_seqlens()
    if layout != "thd":
        raise ValueError(f"{name}: a SequenceDescriptor with offsets or segment ids (several "
                         f"sequences a row) needs a thd qkv_layout ('thd_thd_thd', 't3hd', "
                         f"'thd_t2hd'), got {layout!r}")
    return given, None, None, None


def _cu_seqlens(valid: jax.Array) -> jax.Array:
    """int32 [batch + 1] cumulative lengths of a [batch, seqlen] validity mask."""
    return cumulative(valid.sum(axis=-1).astype(jnp.int32))


class DotProductAttention(nn.Module):
    """Multi-head dot-product attention of projected heads (no parameters).

    Attributes:
        head_dim: head dim of q and k.
        num_attention_heads: query heads.
        num_gqa_groups: key/value heads (GQA; 1 is MQA); default num_attention_heads.
        attn_mask_type: one of :data:`transformer_engine.jax.attention.MASKS`, or NVIDIA's
            ``"causal_padding"`` (= ``"padding_causal"``).
        attention_dropout: dropout probability of the attention weights; draws from the
            ``'dropout'`` rng stream unless ``deterministic``.
        transpose_batch_sequence: inputs are [seqlen, batch, ...] (the ``sbhd`` layout).
        qkv_layout: ``"bshd"`` / ``"sbhd"`` (separate q, k, v) or ``"thd"`` (packed, with
            cu_seqlens passed to the call); ``transpose_batch_sequence`` turns bshd into sbhd.
            NVIDIA's names are accepted too: ``"bshd_bshd_bshd"`` (= bshd), ``"bs3hd"``
            (query is q, k, v packed, [b, s, 3, h, d]; key and value are ignored),
            ``"bshd_bs2hd"`` (key is k, v packed, [b, s, 2, h, d]; value is ignored),
            ``"thd_thd_thd"`` (= thd), ``"t3hd"`` and ``"thd_t2hd"`` (thd, packed likewise),
            and the ``QKVLayout`` members.
        scale_factor: default 1 / sqrt(head_dim).
        window_size: (left, right) sliding window, -1 an unbounded side.
        attn_bias_type: ``"no_bias"``, ``"pre_scale_bias"`` (softmax((q k^T + bias) *
            scale)) or ``"post_scale_bias"`` (softmax(q k^T * scale + bias)); None:
            post_scale_bias when the call gets a ``bias``, else no_bias (NVIDIA's rule). The
            core's fused attention takes no bias, so with one the attention runs in jnp (as
            :class:`MultiHeadAttention` does: logits and softmax in fp32); not for ``thd``.
        dtype: the dtype of the parameters (NVIDIA's signature; the module has none, and the
            computation follows the inputs): checked only.
        dropout_rng_name: the rng stream that attention dropout draws from.
        float32_logits: the jnp path (with a bias) computes the logits from fp32 q and k;
            the fused path always accumulates them in fp32.
        max_segments_per_seq: with a packed ``sequence_descriptor`` (NVIDIA's ``thd``), the
            sequences kept per row (NVIDIA's static capacity; see
            :func:`~transformer_engine.jax.attention.fused_attn`); unused with cu_seqlens.
        context_parallel_axis: the mesh axis the sequences are split over (``""``: the mesh
            resource's ``cp_resource``). Under ``jax.jit`` over a mesh where it has more than
            one device the fused attention runs context parallel (see
            :mod:`transformer_engine.jax.context_parallel`).
        context_parallel_causal_load_balanced: the inputs come in the order of
            :func:`~transformer_engine.jax.attention.reorder_causal_load_balancing` for that
            axis's size (and the output goes out in it). Not with a bias.
        context_parallel_strategy: ``"DEFAULT"`` / ``"ALL_GATHER"`` (gather k and v) or
            ``"RING"`` (pass them round the devices); any case, or
            :class:`~transformer_engine.jax.attention.CPStrategy`.
        context_checkpoint_name: NVIDIA's remat name of the context: recorded only.
        softmax_type: ``"vanilla"``; ``"off-by-one"`` or ``"learnable"`` (or the
            :class:`~transformer_engine.jax.attention.AttnSoftmaxType` members) add an
            attention sink: each row's softmax denominator gets ``exp(0)``, or ``exp(s_h)``
            with the parameter ``softmax_offset`` [heads] (fp32, starting at 0, logical axis
            ``"heads"``). The fused attention takes no sink, so with one the attention runs
            in jnp (as with a bias); not for ``thd`` or context parallelism.

    The call takes ``mask`` [batch, 1, sq, skv] (True = masked) for the padding masks: the
    lengths are the rows and columns that are not fully masked. In its place (the fourth
    argument, as in NVIDIA's newer call, or ``sequence_descriptor=``) it takes a
    :class:`~transformer_engine.jax.attention.SequenceDescriptor`: ``from_seqlens`` gives
    the lengths; ``from_seqlens_and_offsets`` / ``from_segment_ids_and_pos`` with a thd
    layout is NVIDIA's THD: query, key, value [b, s, heads, head_dim] ([s, b, ...] with
    ``transpose_batch_sequence``), several sequences a row. Our thd ([t, heads, head_dim])
    takes ``cu_seqlens_q`` / ``cu_seqlens_kv`` and, with padding between the sequences or
    under context parallelism, ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded``
    (:func:`~transformer_engine.jax.attention.fused_attn`). It returns q's layout, heads
    kept apart as NVIDIA's module returns them: [b, s, heads, head_dim_v] (``sbhd``:
    [s, b, ...]; our ``thd``: [t, heads, head_dim_v]). Merge them with ``reshape`` before an
    output projection.

    Under ``jax.jit`` over a mesh the fused call keeps q, k and v split as they come on their
    batch and heads (see :func:`~transformer_engine.jax.attention.fused_attn`), and on their
    sequence over the context-parallel axis.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import DotProductAttention
        >>> attn = DotProductAttention(head_dim=8, num_attention_heads=2)
        >>> q = jnp.ones((1, 4, 2, 8))
        >>> attn.apply({}, q, q, q).shape
        (1, 4, 2, 8)
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attn_mask_type: str = "causal"
    attention_dropout: float = 0.0
    transpose_batch_sequence: bool = False
    qkv_layout: str = "bshd_bshd_bshd"  # NVIDIA's name of our "bshd"
    scale_factor: Optional[float] = None
    window_size: Optional[tuple[int, int]] = None
    attn_bias_type: Optional[str] = None
    dtype: Any = jnp.float32
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    max_segments_per_seq: int = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_checkpoint_name: str = "context"
    context_parallel_strategy: Any = "DEFAULT"
    softmax_type: Any = "vanilla"

    def _check_keywords(self, bias, layout) -> str:
        """The bias type after NVIDIA's default rule, with the keywords checked."""
        name = "DotProductAttention"
        check_float_dtype(name, "dtype", self.dtype)
        check_sizes(name, max_segments_per_seq=self.max_segments_per_seq)
        bias_type = getattr(self.attn_bias_type, "value", self.attn_bias_type)
        if bias_type not in _BIAS_TYPES:
            raise ValueError(f"{name}: attn_bias_type must be one of {_BIAS_TYPES}, got "
                             f"{self.attn_bias_type!r}")
        if bias_type is None:
            bias_type = "no_bias" if bias is None else "post_scale_bias"
        if bias is not None and bias_type == "no_bias":
            raise ValueError(f"{name}: a bias was given but attn_bias_type is 'no_bias'")
        if bias is None and bias_type != "no_bias":
            raise ValueError(f"{name}: attn_bias_type {bias_type!r} needs the call's bias "
                             "[1 or batch, heads, sq, skv]")
        if bias is not None and self.context_parallel_causal_load_balanced:
            raise NotImplementedError(f"{name}: a bias with context_parallel_causal_load_balanced "
                                      "is not implemented (the biased attention runs in jnp, "
                                      "which does not undo the load-balanced order)")
        if bias is not None and layout == "thd":
            raise NotImplementedError(f"{name}: attn_bias_type {bias_type!r} (a bias) is not "
                                      "implemented for the thd layouts: the core's fused "
                                      "attention takes no bias; use a bshd or sbhd layout")
        return bias_type

    @nn.compact
    def __call__(self, query: jax.Array, key: Optional[jax.Array] = None,
                 value: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                 bias: Optional[jax.Array] = None, *, deterministic: bool = False,
                 sequence_descriptor: Optional[SequenceDescriptor] = None,
                 cu_seqlens_q: Optional[jax.Array] = None,
                 cu_seqlens_kv: Optional[jax.Array] = None,
                 cu_seqlens_q_padded: Optional[jax.Array] = None,
                 cu_seqlens_kv_padded: Optional[jax.Array] = None,
                 max_seqlen_q: Optional[int] = None,
                 max_seqlen_kv: Optional[int] = None) -> jax.Array:
        check_supported("DotProductAttention")
        layout, packed = _layout(self.qkv_layout, self.transpose_batch_sequence)
        bias_type = self._check_keywords(bias, layout)
        sequence_descriptor, mask, cu_seqlens_q, cu_seqlens_kv = _descriptor(
            sequence_descriptor, mask, cu_seqlens_q, cu_seqlens_kv, layout)
        padded = (cu_seqlens_q_padded, cu_seqlens_kv_padded)
        if layout != "thd" and any(t is not None for t in padded):
            raise ValueError(f"DotProductAttention: cu_seqlens_q_padded / cu_seqlens_kv_padded "
                             f"must be None except for the thd layouts, got qkv_layout "
                             f"{self.qkv_layout!r}")
        # NVIDIA's THD keeps the [b, s, ...] rows (our thd: [t, ...])
        rank = 4 if layout != "thd" or sequence_descriptor is not None else 3
        if packed == "qkv":
            query, key, value = _unpack(jnp.asarray(query), 3, "query", rank + 1)
        elif packed == "kv":
            if key is None:
                raise ValueError("DotProductAttention: qkv_layout 'bshd_bs2hd' / 'thd_t2hd' "
                                 "needs key, k and v packed [.., 2, heads, head_dim]")
            key, value = _unpack(jnp.asarray(key), 2, "key", rank + 1)
        if key is None or value is None:
            raise ValueError(f"DotProductAttention: qkv_layout {self.qkv_layout!r} needs query, "
                             "key and value (a packed layout: 'bs3hd', 'bshd_bs2hd', ...)")
        mask_type = MASK_ALIASES.get(self.attn_mask_type, self.attn_mask_type)
        check_sizes("DotProductAttention", head_dim=self.head_dim,
                    num_attention_heads=self.num_attention_heads)
        if self.num_gqa_groups is not None:
            check_sizes("DotProductAttention", num_gqa_groups=self.num_gqa_groups)
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"DotProductAttention: attention_dropout must be in [0, 1), got "
                             f"{self.attention_dropout}")
        if self.window_size is not None and any(w < -1 for w in self.window_size):
            raise ValueError(f"DotProductAttention: window_size must be (left, right) with each "
                             f">= -1 (-1: unbounded), got {self.window_size}")
        groups = self.num_gqa_groups or self.num_attention_heads
        if query.ndim != rank or key.ndim != query.ndim:
            raise ValueError(f"DotProductAttention: query and key must have rank {rank} for "
                             f"qkv_layout {self.qkv_layout!r}, got shapes {query.shape} and "
                             f"{key.shape}")
        if query.shape[-2] != self.num_attention_heads or key.shape[-2] != groups:
            raise ValueError(f"DotProductAttention: query/key heads must be "
                             f"{self.num_attention_heads}/{groups}, got {query.shape[-2]}/"
                             f"{key.shape[-2]}")
        if query.shape[-1] != self.head_dim:
            raise ValueError(f"DotProductAttention: head dim must be {self.head_dim}, got "
                             f"{query.shape[-1]}")
        padding = mask_type.startswith("padding")
        if padding and layout != "thd" and cu_seqlens_q is None:
            if mask is None:
                raise ValueError(f"DotProductAttention: attn_mask_type {mask_type!r} "
                                 "needs mask [batch, 1, sq, skv] or cu_seqlens_q/cu_seqlens_kv")
            seq = 0 if layout == "sbhd" else 1
            mask = check_mask("DotProductAttention", mask,
                              (query.shape[1 - seq], 1, query.shape[seq], key.shape[seq]))
            allowed = ~mask.astype(bool)[:, 0]
            cu_seqlens_q = _cu_seqlens(allowed.any(axis=-1))
            cu_seqlens_kv = _cu_seqlens(allowed.any(axis=-2))
        dropout = 0.0 if deterministic else self.attention_dropout
        rng = self.make_rng(self.dropout_rng_name) if dropout > 0.0 else None
        sink = attention_sink(self, "DotProductAttention", self.softmax_type,
                              self.num_attention_heads)
        if sink is not None and (layout == "thd" or self.context_parallel_causal_load_balanced):
            raise NotImplementedError("DotProductAttention: softmax_type "
                                      f"{softmax_type_of('', self.softmax_type)!r} (attention "
                                      "sinks) runs in jnp, which takes neither the thd layouts "
                                      "nor the load-balanced context-parallel order")
        if bias is not None or sink is not None:
            return self._in_jnp(query, key, value, mask, bias, bias_type, mask_type, layout,
                                cu_seqlens_q, cu_seqlens_kv, dropout, rng, sink)
        # NVIDIA's THD with transpose_batch_sequence: [s, b, ...] rows, as its module takes them
        seq_first = sequence_descriptor is not None and self.transpose_batch_sequence
        if seq_first:
            query, key, value = (jnp.swapaxes(t, 0, 1) for t in (query, key, value))
        o = fused_attn(query, key, value, qkv_layout=layout, attn_mask_type=mask_type,
                       window_size=self.window_size, scale_factor=self.scale_factor,
                       dropout_probability=dropout, dropout_rng=rng, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
                       cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q,
                       max_seqlen_kv=max_seqlen_kv,
                       context_parallel_strategy=self.context_parallel_strategy,
                       context_parallel_causal_load_balanced=(
                           self.context_parallel_causal_load_balanced),
                       context_parallel_axis=self.context_parallel_axis or None,
                       sequence_descriptor=sequence_descriptor,
                       max_segments_per_seq=self.max_segments_per_seq)
        return jnp.swapaxes(o, 0, 1) if seq_first else o

    def _in_jnp(self, q, k, v, mask, bias, bias_type, mask_type, layout, cu_q, cu_kv,
                dropout, rng, sink):
        """Attention with an additive bias or a sink, in jnp (the fused kernel takes
        neither)."""
        seq = 0 if layout == "sbhd" else 1
        batch, sq, skv = q.shape[1 - seq], q.shape[seq], k.shape[seq]
        bias = None if bias is None else jnp.asarray(bias)
        if bias is not None and (bias.ndim != 4 or bias.shape[0] not in (1, batch)
                                 or bias.shape[1:] != (self.num_attention_heads, sq, skv)):
            raise ValueError(f"DotProductAttention: bias must have shape [1 or {batch}, "
                             f"{self.num_attention_heads}, {sq}, {skv}] ([1 or batch, heads, "
                             f"sq, skv]), got {list(bias.shape)}")
        if mask_type.startswith("padding") and cu_q is not None:
            mask = _padding_mask(cu_q, cu_kv if cu_kv is not None else cu_q, sq, skv)
        scale = self.scale_factor
        if scale is None:
            scale = 1.0 / float(self.head_dim) ** 0.5
        q_pos = query_positions(mask_type, sq, skv, mask)
        allowed = allowed_keys(mask_type, q_pos, jnp.arange(skv), self.window_size, mask)
        return unfused_attention(q, k, v, allowed, scale=scale, bias=bias, bias_type=bias_type,
                                 dropout_rate=dropout, dropout_rng=rng,
                                 float32_logits=self.float32_logits, seq_first=seq == 0,
                                 sink=sink)


def attention_sink(module: nn.Module, op: str, softmax_type, heads: int) -> Optional[jax.Array]:
    """The sink logits [heads] (fp32) of ``softmax_type``, made in ``module`` (a compact
    method's): None for vanilla, zeros for off-by-one, the parameter ``softmax_offset``
    (starting at 0, logical axis ``"heads"``) for learnable."""
    kind = softmax_type_of(op, softmax_type)
    if kind == "vanilla":
        return None
    if kind == "off-by-one":
        return jnp.zeros((heads,), jnp.float32)
    init = nn.with_logical_partitioning(nn.initializers.zeros, ("heads",))
    return module.param("softmax_offset", init, (heads,), jnp.float32)
