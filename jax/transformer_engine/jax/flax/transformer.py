"""The flax (linen) ``TransformerLayer`` (encoder or decoder block), its
``TransformerLayerType`` and the T5-style ``RelativePositionBiases``."""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import numpy as np

import jax
import jax.numpy as jnp
from transformer_engine.jax.flax._checks import check_float_dtype, check_mask, check_sizes
from transformer_engine.jax.flax.layernorm_mlp import LayerNormMLP, _plain
from transformer_engine.jax.flax.module import Initializer, LayerNorm, lora_scope
from transformer_engine.jax.flax.multi_head_attention import (
    MultiHeadAttention,
    default_kernel_init,
    token_axes,
)
from transformer_engine.jax.layernorm_mlp import activation_of
from transformer_engine.jax.sharding import W_NO_SHARD_AXES, check_supported, lays_out
from transformer_engine.jax.sharding import (
    with_sharding_constraint_by_logical_axes as constrain,
)

__all__ = ["RelativePositionBiases", "TransformerLayer", "TransformerLayerType"]


class TransformerLayerType(enum.Enum):
    """The kind of :class:`TransformerLayer`: ``ENCODER`` (self-attention and MLP) or
    ``DECODER`` (self-attention, cross-attention over the encoder's output, MLP)."""

    ENCODER = "encoder"
    DECODER = "decoder"


def relative_position_buckets(q_seqlen: int, k_seqlen: int, num_buckets: int,
                              max_distance: int, bidirectional: bool) -> np.ndarray:
    """int32 [q_seqlen, k_seqlen]: T5's bucket of each key's offset from each query.

    Half the buckets (a quarter when ``bidirectional``, per direction) hold the offsets
    0, 1, 2, ... exactly; the rest grow logarithmically up to ``max_distance``, beyond which
    every offset shares the last bucket. Unidirectional: keys after the query share bucket 0.
    """
    offset = np.arange(k_seqlen)[None, :] - np.arange(q_seqlen)[:, None]  # key - query
    distance = -offset  # > 0: the key lies before the query
    buckets = np.zeros_like(distance)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (distance < 0).astype(distance.dtype) * n
        distance = np.abs(distance)
    else:
        distance = np.maximum(distance, 0)
    exact = n // 2
    # float32 and its epsilon, as T5 computes them (log(0) never happens: those are exact).
    scaled = (np.log(distance.astype(np.float32) / exact + np.finfo(np.float32).eps)
              / np.log(max_distance / exact) * (n - exact))
    far = np.minimum(exact + scaled.astype(np.int32), n - 1)
    return (buckets + np.where(distance < exact, distance, far)).astype(np.int32)


class RelativePositionBiases(nn.Module):
    """T5-style relative position biases of the attention logits: one learned value per
    (head, bucket of the key's offset from the query).

    Parameter: ``rel_embedding`` [num_attention_heads, num_buckets].

    Attributes:
        num_buckets: how many buckets the offsets fall into.
        max_distance: offsets at or beyond it share the last bucket.
        num_attention_heads: heads of the attention that adds the bias.
        embedding_init: initializer of ``rel_embedding``.
        embedding_axes: logical axis names of ``rel_embedding`` (recorded for sharding).
        dtype: the dtype of the parameter (NVIDIA's meaning, as in every module here). The
            call has no floating-point input whose dtype the computation could follow (only
            lengths), so the bias comes out in this dtype too, as NVIDIA's does; the attention
            adds it to its fp32 logits.

    The call ``(q_seqlen, k_seqlen, bidirectional=True)`` returns the bias
    [1, num_attention_heads, q_seqlen, k_seqlen]; ``bidirectional=False`` buckets only keys
    before the query (a causal decoder).

    Example:
        >>> import jax
        >>> from transformer_engine.jax.flax import RelativePositionBiases
        >>> rpb = RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=4)
        >>> variables = rpb.init(jax.random.PRNGKey(0), 8, 8)
        >>> rpb.apply(variables, 8, 8).shape
        (1, 4, 8, 8)
    """

    num_buckets: int
    max_distance: int
    num_attention_heads: int
    embedding_init: Callable[..., jax.Array] = nn.linear.default_embed_init
    embedding_axes: Tuple[str, ...] = ("heads", "relpos_buckets")
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        check_sizes("RelativePositionBiases", num_buckets=self.num_buckets,
                    max_distance=self.max_distance,
                    num_attention_heads=self.num_attention_heads)
        check_float_dtype("RelativePositionBiases", "dtype", self.dtype)
        min_buckets = 4 if bidirectional else 2
        if self.num_buckets < min_buckets or self.max_distance <= self.num_buckets // 4:
            raise ValueError(f"RelativePositionBiases: num_buckets must be >= {min_buckets} and "
                             f"max_distance > the exact buckets, got {self.num_buckets} and "
                             f"{self.max_distance}")
        buckets = relative_position_buckets(int(q_seqlen), int(k_seqlen), self.num_buckets,
                                            self.max_distance, bidirectional)
        init = self.embedding_init
        if self.embedding_axes:
            init = nn.with_logical_partitioning(init, self.embedding_axes)
        table = self.param("rel_embedding", init, (self.num_attention_heads, self.num_buckets),
                           self.dtype)
        table = jnp.asarray(table, self.dtype)
        # A gather of [heads, q, k] (its gradient is a scatter-add into the table).
        return table[:, jnp.asarray(buckets)][None]


class TransformerLayer(nn.Module):
    """One Transformer block: self-attention (and, in a decoder, cross-attention over the
    encoder's output), then the MLP, each with its residual connection; pre-norm by default.

    Built from :class:`MultiHeadAttention` (the norm fused with the QKV projection),
    :class:`LayerNormMLP` and, with ``output_layernorm``, :class:`LayerNorm`; every GEMM runs
    in FP8 inside ``fp8_autocast`` with its state in ``fp8_metas``. Submodules:
    ``relpos_bias`` (with the default relative embedding), ``attention`` (encoder) or
    ``self_attention`` and ``encoder_decoder_attention`` (decoder), ``mlp``,
    ``output_layernorm``.

    ``output_layernorm=True`` (post-norm) drops the norm before self-attention and norms the
    block's output instead; the MLP keeps its norm. With
    ``apply_residual_connection_post_layernorm`` each residual connection adds the normed input
    of its block rather than the block's input.

    Attributes:
        hidden_size: the model width (the inputs' last axis).
        mlp_hidden_size: the MLP's inner width.
        num_attention_heads: H; the head dim is hidden_size / H.
        num_gqa_groups: key/value heads (GQA); default H.
        layernorm_type, layernorm_epsilon, zero_centered_gamma: the norms.
        hidden_dropout, hidden_dropout_dims: dropout of each block's output (the dims
            share a mask).
        attention_dropout: dropout of the attention weights.
        intermediate_dropout, intermediate_dropout_dims: dropout inside the MLP.
        dropout_rng_name: the rng stream of every dropout of the layer.
        mha_kernel_init: initializer of the attention projections (default
            variance_scaling(1, fan_in, normal)).
        mlp_kernel_init: initializer of the MLP's kernels (default variance_scaling(1, fan_in,
            truncated_normal)).
        mlp_activations: the MLP's activations (see :class:`LayerNormMLP`).
        mlp_activation_params: the MLP's ``activation_params`` (clamped SwiGLU's, with
            ``mlp_activations=("clamped_silu", "clamped_linear")``; see LayerNormMLP).
        use_bias, bias_init: biases of every projection.
        apply_residual_connection_post_layernorm: residuals from the normed inputs.
        output_layernorm: post-norm (see above).
        float32_attention_logits: the jnp attention path computes the logits from fp32.
        layer_type: :class:`TransformerLayerType`.
        self_attn_mask_type: mask of the self-attention (see
            :class:`MultiHeadAttention`); the cross-attention uses ``"padding"``.
        self_attn_bias_type: bias type of the self-attention.
        enable_relative_embedding: add relative position biases to the self-attention's
            logits (then the attention runs in jnp: the fused kernel takes no bias).
        relative_embedding: the module that makes them; default
            ``RelativePositionBiases(32, 128, H, variance_scaling(1, fan_avg, uniform))``.
        enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: RoPE (see
            :class:`MultiHeadAttention`).
        low_rank_adaptation_scope, low_rank_adaptation_dim, low_rank_adaptation_alpha:
            LoRA (see :class:`MultiHeadAttention`); scopes covering ``"mlp"`` put it on both
            of the MLP's dense layers (see :class:`LayerNormMLP`).
        dtype: the dtype of the parameters (the computation runs in the inputs' dtype).
        drop_path: stochastic depth: drop each sample's block output with this probability.
        fuse_qkv_params: one kernel for Q, K, V (see :class:`MultiHeadAttention`).
        transpose_batch_sequence: inputs are [seqlen, batch, hidden].
        enable_sequence_parallel: under a mesh with ``MeshResource.tpsp_resource``, the
            residual stream between the blocks is split along the sequence over that axis
            (``SEQLEN_TP_AXES``): gathered before each block's GEMMs, scattered after them.

    Under ``jax.jit`` over a mesh with a ``MeshResource`` the attention blocks are laid out as
    :class:`MultiHeadAttention` lays them out (tp: QKV column parallel over the heads, output
    projection row parallel) and the MLP as FC1 column / FC2 row parallel; fsdp splits the
    kernels' ``"embed"`` axis and the batch; cp splits the sequence (the attentions run
    context parallel, see :mod:`transformer_engine.jax.context_parallel`); tpsp is tensor
    parallelism over its axis and, with ``enable_sequence_parallel``, sequence parallelism
    of the residual stream.
        scale_attn_logits, scaled_query_init: see :class:`MultiHeadAttention`.
        window_size: (left, right) sliding window of the attentions.
        softmax_type: of the attentions (attention sinks; see :class:`MultiHeadAttention`).

    The call ``(inputs, encoded=None, attention_mask=None, encoder_decoder_mask=None,
    deterministic=False, decode=False, max_decode_length=None)`` returns the block's output
    in the inputs' shape and dtype. The masks are True where masked. ``decode=True`` runs the
    self-attention from its key/value cache (see :class:`MultiHeadAttention`); encoder layers
    may decode too (a causal GPT block). With relative embedding, ``max_decode_length`` is
    the cache's length.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import TransformerLayer
        >>> layer = TransformerLayer(hidden_size=64, mlp_hidden_size=128, num_attention_heads=4,
        ...                          enable_relative_embedding=False, enable_rotary_pos_emb=True)
        >>> x = jnp.ones((2, 16, 64))
        >>> variables = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
        >>> layer.apply(variables, x, deterministic=True).shape
        (2, 16, 64)
    """

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: Optional[int] = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.1
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Optional[Initializer] = None
    mlp_kernel_init: Optional[Initializer] = None
    mlp_activations: Sequence[str] = ("relu",)
    mlp_activation_params: Optional[dict] = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: Optional[str] = None
    enable_relative_embedding: bool = True
    relative_embedding: Optional[nn.Module] = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: Tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None
    dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: Optional[Tuple[int, int]] = None
    softmax_type: Any = "vanilla"

    def _check(self, inputs, encoded):
        name = "TransformerLayer"
        if not isinstance(self.layer_type, TransformerLayerType):
            raise TypeError(f"{name}: layer_type must be a TransformerLayerType, got "
                            f"{self.layer_type!r}")
        check_sizes(name, hidden_size=self.hidden_size, mlp_hidden_size=self.mlp_hidden_size,
                    num_attention_heads=self.num_attention_heads)
        if self.num_gqa_groups is not None:
            check_sizes(name, num_gqa_groups=self.num_gqa_groups)
        check_float_dtype(name, "dtype", self.dtype)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{name}: hidden_size must be a multiple of num_attention_heads, "
                             f"got {self.hidden_size} and {self.num_attention_heads}")
        if inputs.ndim != 3 or inputs.shape[-1] != self.hidden_size:
            raise ValueError(f"{name}: inputs must be [batch, seqlen, hidden_size="
                             f"{self.hidden_size}] (or [seqlen, batch, ..]), got {inputs.shape}")
        if self.layer_type == TransformerLayerType.DECODER and encoded is None:
            raise ValueError(f"{name}: a DECODER layer needs encoded (the encoder's output)")
        for rate_name in ("hidden_dropout", "attention_dropout", "intermediate_dropout",
                          "drop_path"):
            rate = getattr(self, rate_name)
            if not 0.0 <= rate < 1.0:
                raise ValueError(f"{name}: {rate_name} must be in [0, 1), got {rate}")
        for dim_name in ("hidden_dropout_dims", "intermediate_dropout_dims"):
            dims = tuple(getattr(self, dim_name))
            if any(not -3 <= d < 3 for d in dims):
                raise ValueError(f"{name}: {dim_name} must be axes of a rank-3 tensor, got "
                                 f"{dims}")
        params = self.mlp_activation_params
        try:
            activation_of(tuple(self.mlp_activations),
                          None if params is None else _plain(params))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}: mlp_activations / mlp_activation_params: "
                          f"{str(e).removeprefix('layernorm_mlp: ')}") from None

    def _attention(self, name: str, mask_type: str, bias_type: Optional[str],
                   input_layernorm: bool) -> MultiHeadAttention:
        kernel_init = self.mha_kernel_init or default_kernel_init()
        return MultiHeadAttention(
            head_dim=self.hidden_size // self.num_attention_heads,
            num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
            input_layernorm=input_layernorm, layernorm_type=self.layernorm_type,
            layernorm_epsilon=self.layernorm_epsilon,
            return_layernorm_output=self.apply_residual_connection_post_layernorm,
            zero_centered_gamma=self.zero_centered_gamma, kernel_init=kernel_init,
            use_bias=self.use_bias, bias_init=self.bias_init, attn_mask_type=mask_type,
            attn_bias_type=bias_type, enable_rotary_pos_emb=self.enable_rotary_pos_emb,
            rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
            low_rank_adaptation_scope=self.low_rank_adaptation_scope,
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha, dtype=self.dtype,
            fuse_qkv_params=self.fuse_qkv_params,
            transpose_batch_sequence=self.transpose_batch_sequence,
            enable_sequence_parallel=self.enable_sequence_parallel,
            scale_attn_logits=self.scale_attn_logits, scaled_query_init=self.scaled_query_init,
            float32_logits=self.float32_attention_logits, window_size=self.window_size,
            softmax_type=self.softmax_type, name=name)

    def _dropout(self, x, rate, dims, deterministic):
        if rate == 0.0:
            return x
        dims = tuple(d % x.ndim for d in dims)
        return nn.Dropout(rate=rate, broadcast_dims=dims,
                          rng_collection=self.dropout_rng_name)(x, deterministic=deterministic)

    def _block_output(self, y, deterministic):
        """The hidden dropout of a block's output, then drop-path (one draw per sample)."""
        y = self._dropout(y, self.hidden_dropout, self.hidden_dropout_dims, deterministic)
        if self.drop_path > 0.0:
            batch_axis = 1 if self.transpose_batch_sequence else 0
            others = tuple(d for d in range(y.ndim) if d != batch_axis)
            y = self._dropout(y, self.drop_path, others, deterministic)
        return y

    def _relative_bias(self, inputs, decode, max_decode_length):
        if not self.enable_relative_embedding:
            return None
        rel_emb = self.relative_embedding
        if rel_emb is None:
            rel_emb = RelativePositionBiases(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads,
                dtype=self.dtype, name="relpos_bias",
                embedding_init=nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"))
        seq_axis = 0 if self.transpose_batch_sequence else 1
        length = inputs.shape[seq_axis]
        if decode and max_decode_length:
            length = int(max_decode_length)
        return rel_emb(length, length, self.layer_type == TransformerLayerType.ENCODER)

    @nn.compact
    def __call__(self, inputs: jax.Array, encoded: Optional[jax.Array] = None,
                 attention_mask: Optional[jax.Array] = None,
                 encoder_decoder_mask: Optional[jax.Array] = None, deterministic: bool = False,
                 decode: bool = False, max_decode_length: Optional[int] = None) -> jax.Array:
        check_supported("TransformerLayer")
        inputs = jnp.asarray(inputs)
        self._check(inputs, encoded)
        on = lays_out()

        def axes(*names):  # logical axes while the mesh resource names axes, else none
            return tuple(names) if on else ()

        tokens = axes(*token_axes(self.transpose_batch_sequence, "embed"))
        # The residual stream: under sequence parallelism (and a tpsp_resource) split along
        # the sequence between the blocks, gathered where a block's GEMMs read it and
        # scattered back after its row-parallel output.
        stream = tokens
        if self.enable_sequence_parallel:
            stream = axes(*token_axes(self.transpose_batch_sequence, "embed",
                                      sequence_parallel=True))
        inputs = constrain(inputs, stream)

        def to_stream(t):  # (only under sequence parallelism: elsewhere XLA picks freely)
            return constrain(t, stream) if stream != tokens else t

        if not decode:  # decoding reads them against the cache (MultiHeadAttention checks)
            s_axis = 0 if self.transpose_batch_sequence else 1
            batch, s = inputs.shape[1 - s_axis], inputs.shape[s_axis]
            for arg, m, skv in (("attention_mask", attention_mask, s),
                                ("encoder_decoder_mask", encoder_decoder_mask,
                                 None if encoded is None else jnp.shape(encoded)[s_axis])):
                if m is not None and skv is not None:
                    check_mask("TransformerLayer", m, (batch, 1, s, skv), arg)
        decoder = self.layer_type == TransformerLayerType.DECODER
        bias = self._relative_bias(inputs, decode, max_decode_length)
        post_ln = self.apply_residual_connection_post_layernorm

        attn_name = "self_attention" if decoder else "attention"
        attn = self._attention(attn_name, self.self_attn_mask_type, self.self_attn_bias_type,
                               input_layernorm=not self.output_layernorm)
        # While decoding, this call's tokens start at the self-attention's cache index (the
        # cross-attention's queries rotate at those positions too).
        offset = None
        if decode:
            offset = self.variables.get("cache", {}).get(attn_name, {}).get("cache_index")
        x, ln_out = attn(inputs, inputs, attention_mask, bias, decode=decode,
                         deterministic=deterministic)
        x = to_stream(self._block_output(x, deterministic) + (ln_out if post_ln else inputs))

        if decoder:
            cross = self._attention("encoder_decoder_attention", "padding", "no_bias",
                                    input_layernorm=True)
            if encoder_decoder_mask is None:
                # No mask: every key is valid (the padding mask's lengths are the full ones).
                sq = x.shape[0 if self.transpose_batch_sequence else 1]
                skv = encoded.shape[0 if self.transpose_batch_sequence else 1]
                batch = x.shape[1 if self.transpose_batch_sequence else 0]
                encoder_decoder_mask = jnp.zeros((batch, 1, sq, skv), bool)
            encoded = constrain(jnp.asarray(encoded, x.dtype), tokens)
            y, ln_out = cross(x, encoded, encoder_decoder_mask,
                              deterministic=deterministic, query_position_offset=offset)
            x = to_stream(self._dropout(y, self.hidden_dropout, self.hidden_dropout_dims,
                                        deterministic) + (ln_out if post_ln else x))

        # FC1 column parallel, FC2 row parallel under tp (the activation stays split).
        hidden = axes(*token_axes(self.transpose_batch_sequence, "mlp"))
        mlp = LayerNormMLP(
            intermediate_dim=self.mlp_hidden_size, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            activations=tuple(self.mlp_activations), use_bias=self.use_bias,
            activation_params=self.mlp_activation_params,
            kernel_init=self.mlp_kernel_init or nn.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal"),
            bias_init=self.bias_init, return_layernorm_output=post_ln,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            intermediate_dropout_rng_name=self.dropout_rng_name, dtype=self.dtype,
            enable_low_rank_adaptation=lora_scope("TransformerLayer",
                                                  self.low_rank_adaptation_scope)[2],
            low_rank_adaptation_dim=self.low_rank_adaptation_dim,
            low_rank_adaptation_alpha=self.low_rank_adaptation_alpha,
            kernel_axes_1=axes("embed", "act", "mlp"), kernel_axes_2=axes("mlp", "embed"),
            bias_axes_1=axes("act", "mlp"), bias_axes_2=axes(W_NO_SHARD_AXES),
            scale_axes=axes(W_NO_SHARD_AXES), ln_bias_axes=axes(W_NO_SHARD_AXES),
            layernorm_input_axes=stream, dot_1_input_axes=tokens, dot_2_input_axes=hidden,
            name="mlp")
        z, ln_out = mlp(x, deterministic=deterministic)
        residual = ln_out if post_ln else x
        z = to_stream(self._block_output(z, deterministic) + residual)

        if self.output_layernorm:
            z = LayerNorm(epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                          zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype,
                          name="output_layernorm")(z)
        return z.astype(inputs.dtype)
