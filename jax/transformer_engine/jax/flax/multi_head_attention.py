"""The flax (linen) ``MultiHeadAttention``: norm + QKV projection, rotary embedding,
dot-product attention (with a key/value cache for decoding) and the output projection."""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn

import jax
import jax.numpy as jnp
from transformer_engine.jax.attention import MASKS, fused_attn, packed_attention
from transformer_engine.jax.flax._checks import check_float_dtype, check_mask, check_sizes
from transformer_engine.jax.flax._heads_projection import HeadsProjection
from transformer_engine.jax.flax._rotary import rotary_pos_emb
from transformer_engine.jax.flax._unfused_attention import (
    allowed_keys,
    query_positions,
    unfused_attention,
)
from transformer_engine.jax.flax.attention import MASK_ALIASES, _cu_seqlens, attention_sink
from transformer_engine.jax.flax.layernorm_dense import LayerNormDenseGeneral
from transformer_engine.jax.flax.module import DenseGeneral, Initializer, check_lora, lora_scope
from transformer_engine.jax.sharding import (
    W_JOINED_AXES,
    W_NO_SHARD_AXES,
    check_supported,
    lays_out,
    tensor_parallel_size,
)
from transformer_engine.jax.sharding import (
    with_sharding_constraint_by_logical_axes as constrain,
)

__all__ = ["MultiHeadAttention"]

_BIAS_TYPES = (None, "no_bias", "pre_scale_bias", "post_scale_bias")

# qkv_layout names -> how the projections are packed: "qkv" one kernel [hidden, 3, H * D],
# "kv" a query kernel and one [hidden, 2, G * D], "none" three kernels. Inputs stay [b, s, ..]
# or [s, b, ..] by transpose_batch_sequence, as for DotProductAttention's NVIDIA names.
_PACKINGS = {"bs3hd": "qkv", "bshd_bs2hd": "kv", "bshd_bshd_bshd": "none", "bshd": "none"}


# Whether attention reads q, k and v (or k and v) in place from the fused projections' outputs
# (attention.packed_attention) rather than from copies: the same numbers (the core reads the
# same elements), without the copies out and the join of the gradients.
packed_enabled = True


def token_axes(seq_first: bool, *rest: Optional[str],
               sequence_parallel: bool = False) -> Tuple[Optional[str], ...]:
    """The logical axes of an activation: batch and length in the layout's order, then
    ``rest``; with ``sequence_parallel`` the length is sequence parallelism's split one
    (the residual stream between the blocks)."""
    length = "length_tp" if sequence_parallel else "length"
    return ((length, "batch") if seq_first else ("batch", length)) + tuple(rest)


class _Layout:
    """The logical axes of the module's parameters and activations while the mesh resource
    names axes (all empty otherwise: unannotated parameters, no constraints, as without a
    mesh). Query heads split over ``tp``; the key/value heads too when ``tp`` divides their
    count, else they are whole on every device."""

    def __init__(self, seq_first: bool, heads: int, groups: int):
        self.on = lays_out()
        tp = tensor_parallel_size()
        if self.on and tp is not None and heads % tp:
            raise ValueError(f"MultiHeadAttention: num_attention_heads ({heads}) must be a "
                             f"multiple of the tensor-parallel size ({tp}, the mesh axis of "
                             "MeshResource.tp_resource): each device takes whole heads")
        # Without a mesh in context the tp size is unknown: only plain multi-head attention
        # (groups == heads) is sure to split.
        self.kv_split = groups % tp == 0 if tp is not None else groups == heads
        # the key/value heads repeated up to the query heads before the fused attention, so
        # that they split with them (kept whole, their groups would not follow the split)
        self.repeat_kv = self.on and tp not in (None, 1) and not self.kv_split and groups > 1
        kv_heads = "kv_heads" if self.kv_split else None
        self.kv_joined = "joined_kv" if self.kv_split else None
        self.seq_first = seq_first
        self.kv_heads = kv_heads
        # the fused kernels multiply head-major only where the heads split (HeadsProjection)
        self.head_major = self.on and tp not in (None, 1)

    def __call__(self, *axes):
        return tuple(axes) if self.on else ()

    def tokens(self, *rest):
        return self(*token_axes(self.seq_first, *rest))


def default_kernel_init(dtype=jnp.float32) -> Initializer:
    """variance_scaling(1.0, 'fan_in', 'normal'): the projections' default initializer."""
    return nn.initializers.variance_scaling(1.0, "fan_in", "normal", dtype=dtype)


def _stacked_init(inits: Sequence[Initializer]) -> Initializer:
    """The initializer of a kernel ``[K, n, N]`` whose part i has ``inits[i]`` (each sees its
    own [K, N] matrix, so fan-in and fan-out are those of one projection). The dense modules
    call it with the flattened ``[K, n * N]`` matrix."""

    def init(key, shape, dtype=jnp.float32):
        n = len(inits)
        k_in, width = math.prod(shape[:-1]) // (n if len(shape) == 3 else 1), shape[-1]
        part = (k_in, width if len(shape) == 3 else width // n)
        keys = jax.random.split(key, n)
        mats = [f(kk, part, dtype) for f, kk in zip(inits, keys, strict=True)]
        return jnp.stack(mats, axis=-2).reshape(shape)

    return init


class MultiHeadAttention(nn.Module):
    """Multi-head attention: [norm ->] Q, K, V projections -> [rotary embedding ->]
    dot-product attention -> output projection. The GEMMs run in FP8 inside
    ``fp8_autocast``, each keeping its FP8 state in the ``fp8_metas`` collection of its
    submodule.

    Submodules (and so the parameter tree): self-attention with ``fuse_qkv_params`` and
    no GQA has one ``qkv`` (:class:`LayerNormDenseGeneral`, kernel ``[hidden, 3, H * D]``);
    otherwise ``query`` (:class:`LayerNormDenseGeneral`) and either ``kv`` (kernel
    ``[hidden, 2, G * D]``, with ``fuse_qkv_params``) or ``key`` and ``value``
    (:class:`DenseGeneral`); then ``out`` (:class:`DenseGeneral`). In self-attention (the
    call's ``inputs_q is inputs_kv``) K and V project the normed input; in cross-attention
    they project ``inputs_kv`` as given.

    Attention runs fused (:func:`~transformer_engine.jax.fused_attn`) unless it gets a
    ``bias`` or decodes from the cache: then it runs in jnp (logits accumulated in fp32,
    softmax in fp32), as fused_attn has no bias input.

    Attributes:
        head_dim: D, the size of each head.
        num_attention_heads: H, the query heads.
        num_gqa_groups: G, the key/value heads (GQA; 1 is MQA); default H.
        attention_dropout: dropout of the attention weights.
        dropout_rng_name: the rng stream that dropout draws from.
        input_layernorm: norm the input before the QKV projection.
        layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
        layernorm_epsilon: added to the variance.
        return_layernorm_output: also return the normed input (else None as second output).
        zero_centered_gamma: the norm's ``scale`` stores g - 1.
        kernel_init: initializer of the projections (default variance_scaling(1, fan_in,
            normal)).
        use_bias: biases on the projections.
        bias_init: initializer of those biases.
        attn_mask_type: ``"no_mask"``, ``"padding"``, ``"causal"``, ``"padding_causal"``
            (alias ``"causal_padding"``), ``"causal_bottom_right"`` or
            ``"padding_causal_bottom_right"``. The call's ``mask`` is used only by the
            padding masks (the fused path reads each row's and column's unmasked length from
            it: padding at the end of each sequence).
        attn_bias_type: ``"no_bias"``, ``"pre_scale_bias"`` (softmax((qk + bias) * scale))
            or ``"post_scale_bias"`` (softmax(qk * scale + bias)); None: post_scale_bias
            when a bias is given.
        enable_rotary_pos_emb: rotate the projected queries and keys (RoPE).
        rotary_pos_emb_windows: (min, max) timescales: pair i turns at position / (min *
            (max / min) ** (2i / D)).
        rotary_pos_emb_group_method: ``"consecutive"`` pairs features (2i, 2i + 1);
            ``"alternate"`` pairs i with i + D / 2.
        low_rank_adaptation_scope: LoRA on the projections (NVIDIA's scopes): ``"none"``,
            ``"all"``, ``"qkv_proj"``, ``"output_proj"``, ``"exclude_qkv_proj"``,
            ``"exclude_output_proj"``, ``"mlp"`` / ``"exclude_mlp"`` (the MLP is
            :class:`TransformerLayer`'s). Each covered projection gains ``lora_a_kernel`` and
            ``lora_b_kernel`` (see :class:`DenseGeneral`; a fused kernel gets one pair per
            part: ``qkv``'s A is [hidden, 3, r]).
        low_rank_adaptation_dim, low_rank_adaptation_alpha: the rank r and alpha (scale
            alpha / r; 1 when alpha is None).
        dtype: the dtype of the parameters (the computation runs in the inputs' dtype).
        fuse_qkv_params: one kernel for Q, K, V (self-attention) or K, V (cross, GQA).
        qkv_layout: (ours; NVIDIA's module derives it from ``fuse_qkv_params``) the packing of
            the projections by NVIDIA's layout name: ``"bs3hd"`` (one ``qkv`` kernel:
            self-attention without GQA only), ``"bshd_bs2hd"`` (``query`` and a ``kv``
            kernel), ``"bshd_bshd_bshd"`` (``query``, ``key``, ``value``), or the
            ``QKVLayout`` members. The packing changes the parameter tree, not the numbers.
            None: from ``fuse_qkv_params``. A packed layout with ``fuse_qkv_params=False`` is
            an error (they disagree); the thd layouts are refused (the inputs are padded).
        transpose_batch_sequence: inputs are [seqlen, batch, hidden] (else [batch, seqlen,
            hidden]).
        enable_sequence_parallel: recorded only (sequence parallelism is not implemented).
        scale_attn_logits: scale the logits by 1 / sqrt(D); False: no scale (the default;
            ``scaled_query_init`` puts the factor into the query kernel's initial values).
        scaled_query_init: divide the query kernel's initial values by sqrt(D).
        float32_logits: the jnp path computes the logits from fp32 q and k.
        window_size: (left, right) sliding window, -1 an unbounded side.
        softmax_type: as :class:`DotProductAttention`'s (attention sinks, in jnp; the
            parameter ``softmax_offset`` [H] for ``"learnable"``).
        num_heads, dropout_rate, output_layernorm, apply_residual_connection_post_layernorm,
            fuse_qkv: deprecated spellings (``num_heads`` and ``dropout_rate`` replace
            ``num_attention_heads`` and ``attention_dropout``).

    The call ``(inputs_q, inputs_kv, mask=None, bias=None, *, decode=False,
    deterministic=False)`` returns ``(out, ln_out)``: out in inputs_q's shape and dtype,
    ln_out the normed input with ``return_layernorm_output`` (else None). ``mask``
    [batch, 1, sq, skv] is True where masked; ``bias`` [1 or batch, H, sq, skv].

    Under ``jax.jit`` over a mesh with a ``MeshResource`` naming its axes (dp, tp, fsdp) the
    parameters carry NVIDIA's logical axes (``qkv`` kernel ``("embed", "joined",
    "joined_kv")``, ``query`` ``("embed", "joined_kv")``, ``out`` ``("joined_kv", "embed")``;
    unannotated without a ``MeshResource``): the QKV projection is column parallel over the
    heads (the fused kernels multiply head-major, see :class:`HeadsProjection`), each device
    attends its own heads and batch rows, and the output projection is row parallel. The key /
    value heads split when tp divides ``num_gqa_groups``, else they are whole and repeated up
    to the query heads before the fused attention; ``num_attention_heads`` must be a multiple
    of tp. Under fsdp the kernels' ``"embed"`` axis is split and gathered before each GEMM.
    Keep the batch first (``transpose_batch_sequence=False``) when it is split: the GEMMs
    flatten [seq, batch] otherwise, and a split batch is gathered around them.

    Decoding: ``init`` (or a first apply with ``mutable=["cache"]``) with ``decode=True`` and
    inputs of the longest length L makes the ``cache`` collection (``cached_key``,
    ``cached_value`` of L positions, ``cache_index``); each later call with ``decode=True``
    appends its tokens at ``cache_index`` (rotated at their positions) and attends to the
    cache so far. A ``bias`` for those calls covers all L rows (the call takes its rows).
    ``query_position_offset`` (keyword, not in NVIDIA's signature) is the RoPE position of
    the first query outside the cache (a decoder's cross-attention while decoding: its
    queries sit at the self-attention's cache index; keys stay at 0, 1, ...).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import MultiHeadAttention
        >>> mha = MultiHeadAttention(head_dim=16, num_attention_heads=4,
        ...                          transpose_batch_sequence=False)
        >>> x = jnp.ones((2, 8, 64))
        >>> variables = mha.init(jax.random.PRNGKey(0), x, x)
        >>> out, _ = mha.apply(variables, x, x, deterministic=True)
        >>> out.shape
        (2, 8, 64)
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: Optional[int] = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Optional[Initializer] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    attn_mask_type: str = "causal"
    attn_bias_type: Optional[str] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = True
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: Optional[Tuple[int, int]] = None
    qkv_layout: Optional[str] = None
    softmax_type: Any = "vanilla"
    # Deprecated spellings.
    num_heads: Optional[int] = None
    dropout_rate: Optional[float] = None
    output_layernorm: Optional[bool] = None
    apply_residual_connection_post_layernorm: Optional[bool] = None
    fuse_qkv: Optional[bool] = None

    def _settings(self):
        """(heads, groups, dropout, mask type), after the deprecated spellings, checked."""
        name = "MultiHeadAttention"
        for old, new in (("num_heads", "num_attention_heads"),
                         ("dropout_rate", "attention_dropout"),
                         ("apply_residual_connection_post_layernorm", "return_layernorm_output"),
                         ("fuse_qkv", "fuse_qkv_params")):
            if getattr(self, old) is not None:
                warnings.warn(f"{name}.{old} is deprecated; use {new}", DeprecationWarning,
                              stacklevel=3)
        if self.output_layernorm is not None:
            raise ValueError(f"{name}: output_layernorm must be None (use input_layernorm), "
                             f"got {self.output_layernorm!r}")
        heads = self.num_heads if self.num_heads is not None else self.num_attention_heads
        dropout = self.dropout_rate if self.dropout_rate is not None else self.attention_dropout
        groups = self.num_gqa_groups if self.num_gqa_groups is not None else heads
        check_sizes(name, head_dim=self.head_dim, num_attention_heads=heads,
                    num_gqa_groups=groups)
        check_float_dtype(name, "dtype", self.dtype)
        if heads % groups:
            raise ValueError(f"{name}: head_dim, num_attention_heads and num_gqa_groups must be "
                             f"positive with num_gqa_groups dividing num_attention_heads, got "
                             f"{self.head_dim}, {heads}, {groups}")
        mask_type = MASK_ALIASES.get(self.attn_mask_type, self.attn_mask_type)
        if mask_type not in MASKS:
            raise ValueError(f"{name}: attn_mask_type must be one of {(*MASKS, 'causal_padding')}"
                             f", got {self.attn_mask_type!r}")
        if self.attn_bias_type not in _BIAS_TYPES:
            raise ValueError(f"{name}: attn_bias_type must be one of {_BIAS_TYPES}, got "
                             f"{self.attn_bias_type!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{name}: attention_dropout must be in [0, 1), got {dropout}")
        check_lora(name, any(lora_scope(name, self.low_rank_adaptation_scope)),
                   self.low_rank_adaptation_dim, self.low_rank_adaptation_alpha)
        return heads, groups, dropout, mask_type

    @nn.compact
    def __call__(self, inputs_q: jax.Array, inputs_kv: jax.Array,
                 mask: Optional[jax.Array] = None, bias: Optional[jax.Array] = None, *,
                 decode: bool = False, deterministic: bool = False,
                 query_position_offset: Optional[jax.Array] = None):
        check_supported("MultiHeadAttention")
        heads, groups, dropout, mask_type = self._settings()
        layout = _Layout(self.transpose_batch_sequence, heads, groups)
        name = "MultiHeadAttention"
        is_self = inputs_q is inputs_kv
        inputs_q, inputs_kv = jnp.asarray(inputs_q), jnp.asarray(inputs_kv)
        if inputs_q.ndim != 3 or inputs_kv.ndim != 3:
            raise ValueError(f"{name}: inputs_q and inputs_kv must have rank 3, got shapes "
                             f"{inputs_q.shape} and {inputs_kv.shape}")
        if inputs_q.dtype != inputs_kv.dtype:
            raise TypeError(f"{name}: inputs_q and inputs_kv must have the same dtype, got "
                            f"{inputs_q.dtype} and {inputs_kv.dtype}")
        if mask is not None:  # every path reads it [batch, 1, sq, skv] (decoding: the cache's)
            s_axis = 0 if self.transpose_batch_sequence else 1
            shape = None if decode else (inputs_q.shape[1 - s_axis], 1, inputs_q.shape[s_axis],
                                         inputs_kv.shape[s_axis])
            mask = check_mask(name, mask, shape)
        if self.window_size is not None and any(w < -1 for w in self.window_size):
            raise ValueError(f"{name}: window_size must be (left, right) with each >= -1 "
                             f"(-1: unbounded), got {self.window_size}")
        bias_type = self.attn_bias_type or ("post_scale_bias" if bias is not None else "no_bias")
        if bias is not None and bias_type == "no_bias":
            raise ValueError(f"{name}: a bias was given but attn_bias_type is 'no_bias'")
        d = self.head_dim
        q, k, v, ln_out, packed = self._project(inputs_q, inputs_kv, is_self, heads, groups,
                                                layout)
        seq_axis = 0 if self.transpose_batch_sequence else 1
        cache = self._cache(k, v) if decode else None
        start = cache["index"] if cache is not None else None
        if self.enable_rotary_pos_emb:
            rope = dict(windows=self.rotary_pos_emb_windows,
                        group_method=self.rotary_pos_emb_group_method,
                        transpose_batch_sequence=self.transpose_batch_sequence)
            q_offset = start
            if q_offset is None:
                q_offset = 0 if query_position_offset is None else query_position_offset
            q = rotary_pos_emb(q, offset=q_offset, **rope)
            k = rotary_pos_emb(k, offset=start if start is not None else 0, **rope)
            packed = None  # (the projections' outputs no longer hold the rotated q and k)
        scale = 1.0 / math.sqrt(d) if self.scale_attn_logits else 1.0
        rate = 0.0 if deterministic else dropout
        rng = self.make_rng(self.dropout_rng_name) if rate > 0.0 else None
        sink = attention_sink(self, name, self.softmax_type, heads)
        if cache is not None:
            k, v, q_pos, k_pos, k_valid = self._update_cache(cache, q, k, v, seq_axis)
            length = cache["length"]
            if bias is not None:
                if bias.ndim != 4 or bias.shape[-1] != length or bias.shape[-2] != length:
                    raise ValueError(f"{name}: when decoding, bias must be [1 or batch, heads, "
                                     f"{length}, {length}] (the cache's length), got "
                                     f"{bias.shape}")
                bias = jax.lax.dynamic_slice_in_dim(bias, start, q.shape[seq_axis], axis=2)
            allowed = allowed_keys(mask_type, q_pos, k_pos, self.window_size, mask, k_valid)
            x = unfused_attention(q, k, v, allowed, scale=scale, bias=bias, bias_type=bias_type,
                                  dropout_rate=rate, dropout_rng=rng,
                                  float32_logits=self.float32_logits,
                                  seq_first=self.transpose_batch_sequence, sink=sink)
        elif bias is not None or sink is not None:  # (the fused attention takes neither)
            sq, skv = q.shape[seq_axis], k.shape[seq_axis]
            q_pos = query_positions(mask_type, sq, skv, mask)
            allowed = allowed_keys(mask_type, q_pos, jnp.arange(skv), self.window_size, mask)
            x = unfused_attention(q, k, v, allowed, scale=scale, bias=bias, bias_type=bias_type,
                                  dropout_rate=rate, dropout_rng=rng,
                                  float32_logits=self.float32_logits,
                                  seq_first=self.transpose_batch_sequence, sink=sink)
        else:
            if layout.repeat_kv:
                k, v = (constrain(jnp.repeat(t, heads // groups, axis=2),
                                  layout.tokens("heads", "head_dim")) for t in (k, v))
            x = self._fused(q, k, v, mask, mask_type, scale, rate, rng, packed)
        x = x.reshape(*x.shape[:2], heads * d)
        # Row parallel under tp: each device's heads meet their rows of the kernel, and the
        # partial outputs are summed.
        out = DenseGeneral(features=inputs_q.shape[-1], axis=-1, use_bias=self.use_bias,
                           kernel_init=self._kernel_init(), bias_init=self.bias_init,
                           dtype=self.dtype, kernel_axes=layout("joined_kv", "embed"),
                           bias_axes=layout(W_NO_SHARD_AXES),
                           input_axes=layout.tokens("joined_kv"), name="out",
                           **self._lora(1))(x)
        return out.astype(inputs_q.dtype), ln_out

    def _lora(self, part: int) -> dict:
        """The LoRA keywords of a projection: part 0 the QKV ones, 1 the output one."""
        on = lora_scope("MultiHeadAttention", self.low_rank_adaptation_scope)[part]
        return dict(enable_low_rank_adaptation=on,
                    low_rank_adaptation_dim=self.low_rank_adaptation_dim,
                    low_rank_adaptation_alpha=self.low_rank_adaptation_alpha)

    def _kernel_init(self) -> Initializer:
        return self.kernel_init if self.kernel_init is not None else default_kernel_init()

    def _project(self, inputs_q, inputs_kv, is_self, heads, groups, layout):
        """q [.., .., H, D], k and v [.., .., G, D], the normed input (or None), and what
        attention.packed_attention reads them from in place: (the QKV projection's output
        [.., .., 3, H, D], None) or (q, the KV projection's output [.., .., 2, G, D]); None
        with separate K and V projections, or head-major under tensor parallelism.

        Column parallel under tp: each device computes its own heads of q, k and v (the
        fused kernels multiply head-major, see :class:`HeadsProjection`)."""
        d, dtype = self.head_dim, inputs_q.dtype
        kernel_init = self._kernel_init()
        depth = math.sqrt(d) if self.scaled_query_init else 1.0

        def query_init(key, shape, dt=jnp.float32):
            return kernel_init(key, shape, dt) / jnp.asarray(depth, dt)

        # The submodules' dtype is their parameters' (NVIDIA's meaning), as is ours; they
        # compute in the inputs' dtype.
        common = dict(use_bias=self.use_bias, bias_init=self.bias_init, dtype=self.dtype,
                      **self._lora(0))
        norm = dict(enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
                    epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
                    scale_axes=layout(W_NO_SHARD_AXES), ln_bias_axes=layout(W_NO_SHARD_AXES),
                    **common)
        fused = dict(kernel_axes=layout("embed", W_JOINED_AXES, "joined_kv"),
                     bias_axes=layout(W_JOINED_AXES, "joined_kv"))
        kv_fused = dict(kernel_axes=layout("embed", W_JOINED_AXES, layout.kv_joined),
                        bias_axes=layout(W_JOINED_AXES, layout.kv_joined))
        separate = dict(kernel_axes=layout("embed", "joined_kv"), bias_axes=layout("joined_kv"))
        kv_separate = dict(kernel_axes=layout("embed", layout.kv_joined),
                           bias_axes=layout(layout.kv_joined))
        tokens = layout.tokens("embed")
        want_ln = self.return_layernorm_output
        packing = self._packing(is_self, heads, groups)
        packed_qkv = packed_kv = None  # (the fused projections' outputs, as they lie)
        if packing == "qkv":
            qkv, ln_out = HeadsProjection(
                parts=3, heads=heads, head_dim=d, return_layernorm_output=want_ln,
                kernel_init=_stacked_init([query_init, kernel_init, kernel_init]),
                input_axes=tokens, head_major=layout.head_major, head_axis="heads", name="qkv",
                **fused, **norm)(inputs_q)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
            # (the projection's output as it lies, [.., 3, heads, head_dim]: the swap undoes
            # HeadsProjection's head-major view, so XLA makes no copy of it)
            packed_qkv = None if layout.head_major else jnp.swapaxes(qkv, -3, -2).astype(dtype)
        else:
            q, ln_out = LayerNormDenseGeneral(features=heads * d, return_layernorm_output=True,
                                              kernel_init=query_init, layernorm_input_axes=tokens,
                                              dot_input_axes=tokens, name="query",
                                              **separate, **norm)(inputs_q)
            kv_in = ln_out if is_self else inputs_kv
            ln_out = ln_out if want_ln else None
            if packing == "kv":
                kv, _ = HeadsProjection(
                    parts=2, heads=groups, head_dim=d, enable_layernorm=False,
                    kernel_init=_stacked_init([kernel_init, kernel_init]), input_axes=tokens,
                    head_major=layout.head_major, head_axis=layout.kv_heads, name="kv",
                    **kv_fused, **common)(kv_in)
                k, v = kv[..., 0, :], kv[..., 1, :]
                packed_kv = None if layout.head_major else jnp.swapaxes(kv, -3, -2).astype(dtype)
            else:
                k = DenseGeneral(features=groups * d, axis=-1, kernel_init=kernel_init,
                                 input_axes=tokens, name="key", **kv_separate, **common)(kv_in)
                v = DenseGeneral(features=groups * d, axis=-1, kernel_init=kernel_init,
                                 input_axes=tokens, name="value", **kv_separate, **common)(kv_in)
        q = constrain(q.reshape(*q.shape[:2], heads, d).astype(dtype),
                      layout.tokens("heads", "head_dim"))
        k, v = (constrain(t.reshape(*t.shape[:2], groups, d).astype(dtype),
                          layout.tokens(layout.kv_heads, "head_dim")) for t in (k, v))
        packed = ((packed_qkv, None) if packed_qkv is not None
                  else (q, packed_kv) if packed_kv is not None else None)
        return q, k, v, ln_out, packed

    def _packing(self, is_self, heads, groups) -> str:
        """"qkv", "kv" or "none": how the Q, K, V projections are packed (see qkv_layout)."""
        name = "MultiHeadAttention"
        fuse = self.fuse_qkv if self.fuse_qkv is not None else self.fuse_qkv_params
        if self.qkv_layout is None:
            if fuse and is_self and groups == heads:
                return "qkv"
            return "kv" if fuse else "none"
        layout = str(getattr(self.qkv_layout, "value", self.qkv_layout)).lower()
        if layout not in _PACKINGS:
            raise ValueError(f"{name}: qkv_layout must be None or one of {tuple(_PACKINGS)} "
                             f"(the thd layouts need unpadded inputs, which this module does "
                             f"not take), got {self.qkv_layout!r}")
        packing = _PACKINGS[layout]
        if packing != "none" and not fuse:
            raise ValueError(f"{name}: qkv_layout {layout!r} packs the projections but "
                             f"fuse_qkv_params is False; pass one of them")
        if packing == "qkv" and not (is_self and groups == heads):
            raise ValueError(f"{name}: qkv_layout 'bs3hd' needs self-attention (inputs_q is "
                             f"inputs_kv) and num_gqa_groups == num_attention_heads, got "
                             f"{'self' if is_self else 'cross'}-attention with {heads} heads "
                             f"and {groups} groups; use 'bshd_bs2hd' or 'bshd_bshd_bshd'")
        return packing

    def _cache(self, k, v) -> Optional[dict]:
        """The cache's variables, made (zero) at the first decode call; None at that call
        (it attends over its own tokens as a full forward does)."""
        initialized = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialized:
            return None
        seq_axis = 0 if self.transpose_batch_sequence else 1
        return dict(key=cached_key, value=cached_value, index_var=index,
                    index=index.value.astype(jnp.int32),
                    length=cached_key.value.shape[seq_axis])

    def _update_cache(self, cache, q, k, v, seq_axis):
        cached = cache["key"].value
        n, length = k.shape[seq_axis], cache["length"]
        other = tuple(s for i, s in enumerate(cached.shape) if i != seq_axis)
        if tuple(s for i, s in enumerate(k.shape) if i != seq_axis) != other or n > length:
            raise ValueError(f"MultiHeadAttention: decoding needs keys of shape {cached.shape} "
                             f"with at most {length} positions (the cache's), got {k.shape}")
        cur = cache["index"]
        k = jax.lax.dynamic_update_slice_in_dim(cached, k.astype(cached.dtype), cur, seq_axis)
        v = jax.lax.dynamic_update_slice_in_dim(cache["value"].value,
                                                v.astype(cached.dtype), cur, seq_axis)
        cache["key"].value, cache["value"].value = k, v
        cache["index_var"].value = cur + n
        k_pos = jnp.arange(length)
        return k, v, cur + jnp.arange(q.shape[seq_axis]), k_pos, k_pos < cur + n

    def _fused(self, q, k, v, mask, mask_type, scale, rate, rng, packed=None):
        """The fused attention; with ``packed`` (_project's), q, k, v read in place from the
        projections' outputs where packed_attention can, else from the copies."""
        layout = "sbhd" if self.transpose_batch_sequence else "bshd"
        if packed is not None and packed_enabled:
            x = packed_attention(*packed, qkv_layout=layout, attn_mask_type=mask_type,
                                 window_size=self.window_size, scale_factor=scale,
                                 dropout_probability=rate, dropout_rng=rng)
            if x is not None:
                return x
        cu_q = cu_kv = None
        if mask_type.startswith("padding"):
            if mask is None:
                raise ValueError(f"MultiHeadAttention: attn_mask_type {mask_type!r} needs a "
                                 "mask [batch, 1, sq, skv] (True = masked)")
            mask = jnp.asarray(mask)
            sq, skv = q.shape[1 - self.transpose_batch_sequence], k.shape[
                1 - self.transpose_batch_sequence]
            if mask.ndim != 4 or mask.shape[-2:] != (sq, skv):
                raise ValueError(f"MultiHeadAttention: mask must be [batch, 1, {sq}, {skv}] "
                                 f"(queries, keys of this call), got {mask.shape}")
            allowed = ~mask.astype(bool)[:, 0]
            cu_q, cu_kv = _cu_seqlens(allowed.any(axis=-1)), _cu_seqlens(allowed.any(axis=-2))
        return fused_attn(q, k, v, qkv_layout=layout, attn_mask_type=mask_type,
                          window_size=self.window_size, scale_factor=scale,
                          dropout_probability=rate, dropout_rng=rng, cu_seqlens_q=cu_q,
                          cu_seqlens_kv=cu_kv)
