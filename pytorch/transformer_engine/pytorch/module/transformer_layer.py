"""``te.TransformerLayer``: attention block, (cross-attention block,) MLP block, residuals.

    pre-norm (default):  x = x + drop(attn(norm(x)));  [x = x + drop(xattn(norm(x), enc))];
                         x = x + drop(mlp(norm(x)))

The norms live inside the blocks (te.MultiheadAttention's ``input_layernorm``,
te.LayerNormMLP's norm), so under ``fp8_autocast`` each norm writes the FP8 input of the GEMM
after it, attention stays in FP8 under ``fp8_mha``, and the MLP's activation writes FC2's FP8
input: the layer itself adds only the residual additions (and dropout) in high precision.
The blocks add their output biases in the GEMMs' epilogues; ``drop(h + bias)`` is the same
whether the bias was added there or after.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from .. import layer_block
from ..dropout_add_fn import dropout_add, fuses
from ._checks import check_device, check_params_dtype, check_sizes
from ._deferred_init import DeferredInit
from ._main_grad import route_tree
from .base import set_group_of_children
from .layernorm import LayerNorm, RMSNorm
from .layernorm_mlp import LayerNormMLP, activation_spec
from .linear import _default_device, check_unsupported
from .multihead_attention import MultiheadAttention, default_init_method, refuse_unsupported

__all__ = ["TransformerLayer"]

_LAYER_TYPES = ("encoder", "decoder")
_FORMATS = ("sbhd", "bshd", "thd")


class TransformerLayer(DeferredInit, torch.nn.Module):
    """A transformer layer with NVIDIA Transformer Engine's arguments (same names, order and
    defaults), in FP8 under :func:`fp8_autocast`.

    Args:
        hidden_size, ffn_hidden_size, num_attention_heads: the model's sizes.
        num_gqa_groups: key/value heads (GQA; 1 is MQA); default num_attention_heads.
        layernorm_epsilon: eps of every norm.
        hidden_dropout: dropout of each block's output before its residual addition.
        attention_dropout: dropout of the attention weights.
        init_method, output_layer_init_method: initialize the QKV and FC1 weights resp. the
            output projection's and FC2's in place; default N(0, 0.023^2). Biases start at 0.
        layer_number: the layer's key in an :class:`InferenceParams` cache (give every layer
            of a model its own, 1, 2, ...).
        kv_channels: head dim (default hidden_size // num_attention_heads).
        self_attn_mask_type, window_size: the self-attention mask (forward may override):
            ``causal`` (default), ``padding``, ``no_mask``, ``arbitrary``, ``padding_causal``,
            ``causal_bottom_right``, ``padding_causal_bottom_right``; sliding window.
        enc_dec_attn_mask_type, enc_dec_window_size: the same for cross attention.
        tp_group, tp_size, set_parallel_mode, sequence_parallel, get_rng_state_tracker:
            tensor parallelism (with ``set_parallel_mode=True``): the attention blocks split
            their heads and the MLP its hidden features over ``tp_group``, as
            te.MultiheadAttention and te.LayerNormMLP do; with ``sequence_parallel`` the
            layer's input and output are this rank's shard of the first dimension
            (docs/distributed.md). ``get_rng_state_tracker``'s ``fork()`` holds the attention
            dropout of a split layer (and the recompute of ``checkpoint_core_attention``).
        fuse_wgrad_accumulation: every GEMM weight's gradient goes into its ``main_grad``
            (Megatron-LM's buffers; see module/_main_grad.py).
        ub_*: communication overlap; accepted for compatibility, anything but their defaults
            raises NotImplementedError.
        params_dtype, device: of the parameters (device default: the current CUDA device when
            there is one, else the CPU).
        seq_length, micro_batch_size, name: accepted; unused.
        apply_residual_connection_post_layernorm: residuals taken from the norms' outputs
            instead of their inputs.
        output_layernorm: no norm before attention; a norm after the last residual (post-norm,
            BERT); the MLP keeps its own norm, as in NVIDIA TE.
        parallel_attention_mlp: ``x + drop(attn(norm1(x)) + mlp(norm2(x)))`` (Falcon).
        layer_type: ``"encoder"``, or ``"decoder"`` with a cross-attention block on
            ``encoder_output`` after self-attention.
        drop_path_rate: stochastic depth: in training, the output of self-attention and of
            the MLP is dropped for a whole sample (batch entry) with this probability, else
            scaled by 1 / (1 - rate). A decoder's cross-attention takes the hidden dropout
            only, as in NVIDIA TE (its PyTorch and its Flax layer alike).
        fuse_qkv_params, qkv_weight_interleaved: the QKV weight as one parameter, in group
            order (see te.MultiheadAttention); default separate query/key/value weights.
        zero_centered_gamma, normalization (``"LayerNorm"`` / ``"RMSNorm"``), bias,
            activation (every one of te.LayerNormMLP), activation_params (keyword only;
            clamped_swiglu's, as te.LayerNormMLP): of the blocks.
        attn_input_format: ``"sbhd"`` ([s, b, hidden], default), ``"bshd"``, or ``"thd"``
            ([tokens, hidden], sequences packed back to back; forward takes cu_seqlens_q /
            cu_seqlens_kv and max_seqlen_q / max_seqlen_kv).
        rotary_pos_interleaved, qk_norm_type, qk_norm_eps, qk_norm_before_rope, softmax_type,
            attention_backend: keyword only; as te.MultiheadAttention.

    Parameters are named as in NVIDIA TE: ``self_attention.layernorm_qkv.query_weight``,
    ``self_attention.proj.weight``, ``inter_attention.layernorm_query...``,
    ``inter_attention.key_value...``, ``layernorm_mlp.fc1_weight``, ``layernorm.weight``.

    Example:
        >>> layer = te.TransformerLayer(1024, 4096, 16, attn_input_format="bshd")  # doctest: +SKIP
        >>> x = torch.randn(2, 512, 1024, device="cuda")  # doctest: +SKIP
        >>> freqs = te.RotaryPositionEmbedding(64)(512).cuda()  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = layer(x, rotary_pos_emb=freqs)
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5,
                 hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 init_method: Optional[Callable] = None,
                 output_layer_init_method: Optional[Callable] = None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal",
                 window_size: Optional[tuple[int, int]] = None,
                 enc_dec_attn_mask_type: str = "no_mask",
                 enc_dec_window_size: Optional[tuple[int, int]] = None, tp_group=None,
                 tp_size: int = 1, params_dtype: Optional[torch.dtype] = None,
                 get_rng_state_tracker: Optional[Callable] = None,
                 fuse_wgrad_accumulation: bool = False, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None, sequence_parallel: bool = False,
                 apply_residual_connection_post_layernorm: bool = False,
                 output_layernorm: bool = False, parallel_attention_mlp: bool = False,
                 layer_type: str = "encoder", drop_path_rate: float = 0.0,
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 ub_tp_comm_overlap: bool = False, ub_overlap_ag: bool = True,
                 ub_overlap_rs: bool = True, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = True, ub_bulk_wgrad: bool = True, bias: bool = True,
                 activation: str = "gelu", normalization: str = "LayerNorm",
                 device: Union[torch.device, str, None] = None, attn_input_format: str = "sbhd",
                 name: Optional[str] = None, *, rotary_pos_interleaved: bool = False,
                 qk_norm_type: Optional[str] = None, qk_norm_eps: float = 1e-6,
                 qk_norm_before_rope: bool = False, softmax_type: str = "vanilla",
                 attention_backend: Optional[str] = None,
                 activation_params: Optional[dict] = None) -> None:
        super().__init__()
        op = "te.TransformerLayer"
        # The blocks split themselves; the layer's checks first, in the layer's name.
        MultiheadAttention._check_tensor_parallel(
            op, tp_group, tp_size, set_parallel_mode, num_attention_heads, num_gqa_groups,
            qk_norm_type, fuse_qkv_params, qkv_weight_interleaved)
        check_unsupported(None, 1, None, False, fuse_wgrad_accumulation, op)
        # every GEMM weight of the blocks: into main_grad (module/_main_grad.py)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        # The ub_* switches only act with ub_tp_comm_overlap (their defaults are True).
        refuse_unsupported(op, ub_tp_comm_overlap=ub_tp_comm_overlap)
        check_sizes(op, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size,
                    num_attention_heads=num_attention_heads)
        optional = {"kv_channels": kv_channels, "num_gqa_groups": num_gqa_groups}
        check_sizes(op, **{k: v for k, v in optional.items() if v is not None})
        check_params_dtype(op, params_dtype)
        activation_spec(op, activation, activation_params)
        _check_args(op, layer_type, attn_input_format, hidden_dropout, drop_path_rate,
                    parallel_attention_mlp, apply_residual_connection_post_layernorm,
                    output_layernorm, normalization)
        device = _default_device(device)
        init_method = init_method or default_init_method
        output_layer_init_method = output_layer_init_method or default_init_method
        self.layer_type, self.layer_number = layer_type, layer_number
        self.self_attn_mask_type, self.window_size = self_attn_mask_type, window_size
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.hidden_dropout, self.drop_path_rate = float(hidden_dropout), float(drop_path_rate)
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.output_layernorm = output_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.attn_input_format, self.name = attn_input_format, name
        self.kv_channels = kv_channels or hidden_size // num_attention_heads
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.get_rng_state_tracker = get_rng_state_tracker
        post = apply_residual_connection_post_layernorm
        attention = dict(
            layer_number=layer_number, num_gqa_groups=num_gqa_groups, params_dtype=params_dtype,
            get_rng_state_tracker=get_rng_state_tracker, set_parallel_mode=set_parallel_mode,
            tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
            fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved, bias=bias,
            normalization=normalization, device=device, qkv_format=attn_input_format,
            rotary_pos_interleaved=rotary_pos_interleaved, qk_norm_type=qk_norm_type,
            qk_norm_eps=qk_norm_eps, qk_norm_before_rope=qk_norm_before_rope,
            softmax_type=softmax_type, attention_backend=attention_backend)
        args = (hidden_size, num_attention_heads, self.kv_channels, attention_dropout,
                layernorm_epsilon, init_method, output_layer_init_method)
        self.self_attention = MultiheadAttention(
            *args, attn_mask_type=self_attn_mask_type, window_size=window_size,
            input_layernorm=not output_layernorm, attention_type="self",
            return_layernorm_output=post and not output_layernorm,
            name=None if name is None else name + ".self_attention", **attention)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *args, attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                input_layernorm=True, attention_type="cross", return_layernorm_output=post,
                name=None if name is None else name + ".inter_attention", **attention)
        self.layernorm_mlp = LayerNormMLP(
            hidden_size, ffn_hidden_size, layernorm_epsilon, bias=bias, normalization=normalization,
            activation=activation, activation_params=activation_params,
            zero_centered_gamma=zero_centered_gamma, return_layernorm_output=post,
            params_dtype=params_dtype, device=device,
            init_method=init_method, output_layer_init_method=output_layer_init_method,
            set_parallel_mode=set_parallel_mode, tp_group=tp_group, tp_size=tp_size,
            sequence_parallel=sequence_parallel,
            name=None if name is None else name + ".layernorm_mlp")
        with torch.no_grad():  # NVIDIA TE's MLP biases start at 0 too
            for p in (self.layernorm_mlp.fc1_bias, self.layernorm_mlp.fc2_bias):
                if p is not None:
                    p.zero_()
        if output_layernorm:
            norm = LayerNorm if normalization == "LayerNorm" else RMSNorm
            # (on a sequence shard under sequence parallelism: marked for the caller's sum)
            self.layernorm = norm(hidden_size, layernorm_epsilon,
                                  sequence_parallel=self.self_attention.sequence_parallel,
                                  zero_centered_gamma=zero_centered_gamma,
                                  params_dtype=params_dtype, device=device)
        # Stochastic depth drops whole samples: the batch dimension of the layout.
        self._batch_dim = 1 if attn_input_format == "sbhd" else 0

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supplies the tensor-parallel group of a layer built with ``set_parallel_mode=True``,
        ``tp_size`` > 1 and no ``tp_group`` (NVIDIA's way): its blocks keep this rank's
        slices (te.Linear.set_tensor_parallel_group). A layer that is not split takes None or
        a group of one rank."""
        set_group_of_children(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Splits the sequence over ``cp_group`` in the attention blocks
        (te.MultiheadAttention's): the layer's input and output are this rank's two chunks of
        the sequence (context_parallel.py)."""
        for name in ("self_attention", "inter_attention"):
            if name in self._modules:
                self._modules[name].set_context_parallel_group(cp_group, cp_global_ranks,
                                                               cp_stream, cp_comm_type)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None,
                self_attn_mask_type: Optional[str] = None, window_size=None,
                encoder_output: Optional[torch.Tensor] = None, enc_dec_attn_mask=None,
                enc_dec_attn_mask_type: Optional[str] = None, enc_dec_window_size=None,
                is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None, cu_seqlens_q=None,
                cu_seqlens_kv=None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, fast_zero_fill: bool = True,
                pad_between_seqs: Optional[bool] = None, *, cu_seqlens_q_padded=None,
                cu_seqlens_kv_padded=None) -> torch.Tensor:
        """``hidden_states`` [s, b, hidden] (sbhd) or [b, s, hidden] (bshd) -> the same shape.

        ``attention_mask``: bool, True = masked: [b, 1, 1, s] for the padding masks,
        broadcastable to [b, heads, s_q, s_kv] for ``arbitrary``; unused by the others.
        ``encoder_output`` / ``enc_dec_attn_mask`` (a (q, kv) pair of padding masks): the
        decoder's cross attention. ``rotary_pos_emb``: RoPE angles (te.RotaryPositionEmbedding)
        for self-attention. ``inference_params``: a KV cache (te.InferenceParams). The other
        arguments are te.MultiheadAttention's."""
        if self.fuse_wgrad_accumulation:
            route_tree(self)
        hidden = self.layernorm_mlp.hidden_size
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != hidden:
            raise ValueError(f"te.TransformerLayer: hidden_states must have hidden_size="
                             f"{hidden} as its last dimension, got shape "
                             f"{list(hidden_states.shape)}")
        check_device("te.TransformerLayer", "hidden_states", hidden_states,
                     self.layernorm_mlp.layer_norm_weight)
        if (attention_mask is None and self_attn_mask_type in (None, self.self_attn_mask_type)
                and window_size is None and encoder_output is None and enc_dec_attn_mask is None
                and is_first_microbatch is None and not checkpoint_core_attention
                and inference_params is None and core_attention_bias_type == "no_bias"
                and core_attention_bias is None
                and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_kv is None
                and max_seqlen_q is None and max_seqlen_kv is None and pad_between_seqs is None
                and cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None):
            # the step as one node, where it can
            out = layer_block.forward(self, hidden_states, rotary_pos_emb)
            if out is not None:
                return out
        device_type = "cuda" if hidden_states.is_cuda else hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))
        x = hidden_states.contiguous()
        attn_out = self.self_attention(
            x, attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type or self.self_attn_mask_type,
            window_size=window_size if window_size is not None else self.window_size,
            is_first_microbatch=is_first_microbatch,
            checkpoint_core_attention=checkpoint_core_attention,
            inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            fast_zero_fill=fast_zero_fill, pad_between_seqs=pad_between_seqs)
        if self.parallel_attention_mlp:
            return self._residual(attn_out + self.layernorm_mlp(x, is_first_microbatch), x)
        residual = x
        if isinstance(attn_out, tuple):  # post-norm residual: the norm's output
            attn_out, residual = attn_out
        x = self._residual(attn_out, residual)
        if self.layer_type == "decoder":
            if encoder_output is None:
                raise ValueError("te.TransformerLayer: layer_type 'decoder' needs "
                                 "encoder_output")
            inter = self.inter_attention(
                x, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                attn_mask_type=enc_dec_attn_mask_type or self.enc_dec_attn_mask_type,
                window_size=(enc_dec_window_size if enc_dec_window_size is not None
                             else self.enc_dec_window_size),
                is_first_microbatch=is_first_microbatch,
                checkpoint_core_attention=checkpoint_core_attention,
                core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                fast_zero_fill=fast_zero_fill)
            residual = x
            if isinstance(inter, tuple):
                inter, residual = inter
            x = self._residual(inter, residual, drop_path=False)
        mlp_out = self.layernorm_mlp(x, is_first_microbatch)
        residual = x
        if isinstance(mlp_out, tuple):
            mlp_out, residual = mlp_out
        out = self._residual(mlp_out, residual)
        if self.output_layernorm:
            out = self.layernorm(out)
        return out

    def _residual(self, h: torch.Tensor, residual: torch.Tensor,
                  drop_path: bool = True) -> torch.Tensor:
        """residual + drop_path(dropout(h)) (without ``drop_path``: residual + dropout(h));
        both are identities outside training."""
        if self.training:
            with_path = drop_path and self.drop_path_rate > 0.0
            if self.hidden_dropout > 0.0 and not with_path and fuses(h, residual):
                return dropout_add(h, residual, self.hidden_dropout)  # one kernel each way
            if self.hidden_dropout > 0.0:
                h = F.dropout(h, self.hidden_dropout, True)
            if with_path:
                keep = 1.0 - self.drop_path_rate
                shape = [1] * h.dim()
                shape[self._batch_dim] = h.shape[self._batch_dim]
                mask = torch.empty(shape, dtype=h.dtype, device=h.device).bernoulli_(keep)
                h = h * (mask / keep)
        return residual + h


def _check_args(op: str, layer_type: str, fmt: str, hidden_dropout: float,
                drop_path_rate: float, parallel: bool, post: bool, output_layernorm: bool,
                normalization: str) -> None:
    if layer_type not in _LAYER_TYPES:
        raise ValueError(f"{op}: layer_type must be one of {_LAYER_TYPES}, got {layer_type!r}")
    if fmt not in _FORMATS:
        raise ValueError(f"{op}: attn_input_format must be one of {_FORMATS}, got {fmt!r}")
    for arg, value in (("hidden_dropout", hidden_dropout), ("drop_path_rate", drop_path_rate)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{op}: {arg} must be in [0, 1), got {value}")
    if fmt == "thd" and drop_path_rate > 0.0:
        raise ValueError(f"{op}: drop_path_rate must be 0 with attn_input_format 'thd' (a "
                         f"sample is a packed sequence, not a dimension), got {drop_path_rate}")
    if normalization not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"{op}: normalization must be 'LayerNorm' or 'RMSNorm', got "
                         f"{normalization!r}")
    if parallel and (layer_type != "encoder" or post or output_layernorm):
        raise ValueError(f"{op}: parallel_attention_mlp=True needs layer_type='encoder', "
                         "apply_residual_connection_post_layernorm=False and "
                         f"output_layernorm=False, got {layer_type!r}, {post}, "
                         f"{output_layernorm}")
