"""MultiheadAttention: the attention block of a transformer layer.

    hidden -> [norm ->] QKV projection -> [RoPE ->] [KV cache ->] DotProductAttention -> output
    projection

Under ``fp8_autocast`` with ``fp8_dpa=True`` attention runs in FP8; with ``fp8_mha=True`` too,
the block keeps its activations in FP8 between the three steps: the QKV GEMM writes E4M3
directly (its epilogue casts with the projection's output scale), attention reads those bytes
and writes o in E4M3, and the output projection's GEMM reads o as it is. That saves the casts
of q, k, v to FP8 and of o back (each a read and a write of the tensor), which is where FP8
attention inside a model pays. The gradients cross the same boundaries in high precision.

RoPE rotates q and k in high precision (a rotation of E4M3 values would round again), so with
``rotary_pos_emb`` (or a KV cache, which stores high precision) the QKV GEMM writes its usual
high-precision output and attention quantizes q, k, v itself; o still leaves in FP8.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Union

import torch

from .. import attention_bias, distributed, fp8, layer_block, padded_packing
from ..checkpoint import checkpoint
from ..float8_tensor import to_high_precision
from ..rope import apply_rotary_pos_emb
from ._checks import check_device, check_params_dtype, check_sizes
from ._deferred_init import DeferredInit
from ._heads import packed_views, split_heads
from ._main_grad import route_tree
from .attention import DotProductAttention, _runs_fp8
from .base import set_group_of_children
from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .linear import Linear, _default_device, check_unsupported

__all__ = ["MultiheadAttention"]

QK_NORMS = (None, "L2Normalization", "RMSNorm", "LayerNorm")
# NVIDIA TE's default weight initialization of the attention and MLP blocks.
DEFAULT_INIT_STD = 0.023


def default_init_method(weight: torch.Tensor) -> None:
    """N(0, 0.023^2), the default of te.MultiheadAttention and te.TransformerLayer."""
    torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def refuse_unsupported(op: str, **given) -> None:
    """NotImplementedError naming the first feature given a value other than its default."""
    defaults = {"ub_overlap_ag": False, "ub_overlap_rs": False, "ub_overlap_rs_dgrad": False,
                "ub_bulk_dgrad": False, "ub_bulk_wgrad": False, "ub_tp_comm_overlap": False}
    for arg, value in given.items():
        if value != defaults[arg]:
            raise NotImplementedError(f"{op}: userbuffers communication overlap is not "
                                      f"implemented yet; {arg} must be "
                                      f"{defaults[arg]!r}, got {value!r}")


def zero_biases(module: torch.nn.Module) -> None:
    """Biases start at 0 (as in NVIDIA TE's blocks; the norms' already do)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()


# Whether a traced step of the modules reads q, k, v in place from the QKV output (the views
# given to the attention: _packed). On an H100 (torch 2.11) 70e8ec9's views, as_strided of a
# slice of the QKV output, gave a compiled FP8 first step other outputs than eager and garbage
# input gradients: Inductor most likely dropped the slice's storage offset. The views are now
# made with view and split ops (head_views.py), and with them the compiled first step gives
# the eager bits there, in place or copied (benchmarks/compiled_first_step_probe.py;
# benchmarks/results/compiled_first_step_probe_9938805_h100.txt). Off: q, k, v copied dense.
traced_in_place = True


class MultiheadAttention(DeferredInit, torch.nn.Module):
    """Self- or cross-attention with its projections, in FP8 under :func:`fp8_autocast`.

    Args (in NVIDIA Transformer Engine's order):
        hidden_size: features of the input and of the output.
        num_attention_heads: query heads.
        kv_channels: head dim (default hidden_size // num_attention_heads).
        attention_dropout: dropout probability of the attention weights (training only).
        layernorm_epsilon: eps of the input norm.
        init_method: initializes the query/key/value weights in place (default
            N(0, 0.023^2)); output_layer_init_method likewise the output projection's.
            Biases start at 0.
        layer_number: this block's key in an InferenceParams cache (default 1).
        attn_mask_type, window_size: as DotProductAttention (forward may override them).
        tp_group, tp_size, set_parallel_mode: tensor parallelism over ``tp_group`` (with
            ``set_parallel_mode=True``): each rank holds num_gqa_groups / tp_size key/value
            groups and their query heads (QKV projection column-parallel) and its slice of
            the output projection (row-parallel); the output is whole on every rank.
        sequence_parallel: with tensor parallelism, hidden_states and the output are this
            rank's shard of the first dimension (docs/distributed.md).
        get_rng_state_tracker: attention dropout runs in its ``fork()`` (Megatron-LM's
            per-rank stream) unless the block is sequence parallel, as in NVIDIA TE.
        fuse_wgrad_accumulation: every projection's weight gradient goes into its
            ``main_grad`` (see module/_main_grad.py).
        num_gqa_groups: key/value heads (GQA; 1 is MQA); default num_attention_heads.
        params_dtype, device: of the parameters (device default: the current CUDA device when
            there is one, else the CPU).
        return_bias: return the output projection's bias instead of adding it.
        return_layernorm_output: also return the input norm's output (with input_layernorm).
        input_layernorm: normalize the input before the query (and key/value) projection.
        attention_type: ``"self"`` or ``"cross"`` (k and v from ``encoder_output``).
        fuse_qkv_params: one weight for q, k, v (``layernorm_qkv.weight``); else separate
            ``query_weight``, ``key_weight``, ``value_weight`` (cross attention: ``query_weight``
            of ``layernorm_query``, ``key_weight`` / ``value_weight`` of ``key_value``).
        zero_centered_gamma, normalization: of the input norm (``"LayerNorm"``/``"RMSNorm"``).
        qkv_weight_interleaved: with fuse_qkv_params, the fused weight's rows hold, per
            key/value group, that group's query heads, then its key and value heads (see
            ``_heads.py``); False (forced without fuse_qkv_params): [q | k | v].
        rotary_pos_interleaved: RoPE pairs features (2i, 2i + 1) instead of (i, i + d/2).
        qk_norm_type, qk_norm_eps, qk_norm_before_rope: normalize each head of q and k
            (``"L2Normalization"`` x / sqrt(sum x^2 + eps), ``"RMSNorm"`` or ``"LayerNorm"``
            with learned weights ``q_norm`` / ``k_norm``) after RoPE, or before it.
        softmax_type: as DotProductAttention's (attention sinks; its ``softmax_offset`` is
            ``core_attention.softmax_offset``, this rank's heads under tensor parallelism).
        ub_*: accepted at their defaults (other values raise NotImplementedError);
            seq_length, micro_batch_size, name: accepted, unused.
        bias: learn biases in the projections.
        qkv_format: layout of ``hidden_states``: ``"sbhd"`` [s, b, hidden], ``"bshd"``
            [b, s, hidden] or ``"thd"`` [tokens, hidden].
        attention_backend: as DotProductAttention (keyword only).

    Example:
        >>> mha = te.MultiheadAttention(1024, 16, attention_dropout=0.0)  # doctest: +SKIP
        >>> x = torch.randn(512, 2, 1024, device=mha.proj.weight.device)  # doctest: +SKIP
        >>> recipe = DelayedScaling(fp8_dpa=True, fp8_mha=True)  # doctest: +SKIP
        >>> with te.fp8_autocast(fp8_recipe=recipe):  # doctest: +SKIP
        ...     y = mha(x)
    """

    def __init__(self, hidden_size: int, num_attention_heads: int,
                 kv_channels: Optional[int] = None, attention_dropout: float = 0.1,
                 layernorm_epsilon: float = 1e-5,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 output_layer_init_method: Optional[Callable[[torch.Tensor], None]] = None,
                 layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size: Optional[tuple[int, int]] = None, tp_group=None,
                 tp_size: int = 1, num_gqa_groups: Optional[int] = None,
                 fuse_wgrad_accumulation: bool = False,
                 get_rng_state_tracker: Optional[Callable] = None,
                 sequence_parallel: bool = False, params_dtype: Optional[torch.dtype] = None,
                 return_bias: bool = False, return_layernorm_output: bool = False,
                 input_layernorm: bool = False, attention_type: str = "self",
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False,
                 zero_centered_gamma: bool = False, qkv_weight_interleaved: bool = True,
                 rotary_pos_interleaved: bool = False, ub_overlap_ag: bool = False,
                 ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False, bias: bool = True,
                 normalization: str = "LayerNorm",
                 device: Union[torch.device, str, None] = None, qkv_format: str = "sbhd",
                 name: Optional[str] = None, qk_norm_type: Optional[str] = None,
                 qk_norm_eps: float = 1e-6, qk_norm_before_rope: bool = False,
                 seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 softmax_type: str = "vanilla", *,
                 attention_backend: Optional[str] = None) -> None:
        super().__init__()
        op = "te.MultiheadAttention"
        tp = self._check_tensor_parallel(op, tp_group, tp_size, set_parallel_mode,
                                         num_attention_heads, num_gqa_groups, qk_norm_type,
                                         fuse_qkv_params, qkv_weight_interleaved)
        check_unsupported(None, 1, None, False, fuse_wgrad_accumulation, op)
        # every GEMM weight of the blocks: into main_grad (module/_main_grad.py)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        refuse_unsupported(op, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
                           ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad,
                           ub_bulk_wgrad=ub_bulk_wgrad)
        check_sizes(op, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        optional = {"kv_channels": kv_channels, "num_gqa_groups": num_gqa_groups}
        check_sizes(op, **{k: v for k, v in optional.items() if v is not None})
        check_params_dtype(op, params_dtype)
        if qk_norm_type not in QK_NORMS:
            raise ValueError(f"{op}: qk_norm_type must be one of {QK_NORMS}, got "
                             f"{qk_norm_type!r}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{op}: attention_type must be 'self' or 'cross', got "
                             f"{attention_type!r}")
        if layer_number is not None and (not isinstance(layer_number, int) or layer_number < 1):
            raise ValueError(f"{op}: layer_number must be None or a positive int, got "
                             f"{layer_number!r}")
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(f"{op}: hidden_size ({hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({num_attention_heads}), or give "
                                 "kv_channels")
            kv_channels = hidden_size // num_attention_heads
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        if groups <= 0 or num_attention_heads % groups:
            raise ValueError(f"{op}: num_attention_heads ({num_attention_heads}) must be a "
                             f"multiple of num_gqa_groups ({groups})")
        if return_layernorm_output and not input_layernorm:
            raise ValueError(f"{op}: return_layernorm_output needs input_layernorm=True")
        device = _default_device(device)
        init_method = init_method or default_init_method
        output_layer_init_method = output_layer_init_method or default_init_method
        self.hidden_size, self.head_dim = int(hidden_size), int(kv_channels)
        self.hidden_size_per_attention_head = self.head_dim
        self.num_attention_heads, self.num_gqa_groups = int(num_attention_heads), int(groups)
        self.attention_type, self.qkv_format = attention_type, qkv_format
        self.attn_mask_type, self.window_size = attn_mask_type, window_size
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm, self.name = input_layernorm, name
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_qkv_params = fuse_qkv_params
        # Separate weights are always [q | k | v] (NVIDIA TE forces this too).
        self.qkv_weight_interleaved = bool(qkv_weight_interleaved and fuse_qkv_params)
        self.rotary_pos_interleaved = rotary_pos_interleaved
        self.get_rng_state_tracker = get_rng_state_tracker
        self.set_parallel_mode = set_parallel_mode
        # Tensor parallelism: each rank holds num_gqa_groups / tp key/value groups with their
        # query heads (the QKV projection column-parallel, whole groups per rank: _heads.py)
        # and its slice of the output projection's input features (row-parallel).
        self.tp_size = tp
        self.sequence_parallel = bool(sequence_parallel) and tp > 1
        self.num_attention_heads_per_partition = self.num_attention_heads // tp
        self._local_groups = self.num_gqa_groups // tp
        self._attention_dropout = float(attention_dropout)
        common = dict(bias=bias, params_dtype=params_dtype, device=device)
        parallel = dict(tp_group=tp_group, tp_size=tp, sequence_parallel=self.sequence_parallel)
        column = dict(parallel, parallel_mode="column") if tp > 1 else {}
        row = dict(parallel, parallel_mode="row") if tp > 1 else {}
        hq, hkv = self.num_attention_heads * self.head_dim, self.num_gqa_groups * self.head_dim
        norm = dict(normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                    return_layernorm_output=return_layernorm_output)
        if attention_type == "self":
            qkv_split = None if fuse_qkv_params else OrderedDict(
                (("query", hq), ("key", hkv), ("value", hkv)))
            if input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    hidden_size, hq + 2 * hkv, layernorm_epsilon, init_method=init_method,
                    parameters_split=qkv_split, **norm, **common, **column)
            else:
                self.qkv = Linear(hidden_size, hq + 2 * hkv, init_method=init_method,
                                  parameters_split=qkv_split, **common, **column)
        else:
            if input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size, hq, layernorm_epsilon, init_method=init_method,
                    parameters_split=None if fuse_qkv_params else ("query",), **norm, **common,
                    **column)
            else:
                self.query_layer = Linear(hidden_size, hq, init_method=init_method, **common,
                                          **column)
            self.key_value = Linear(hidden_size, 2 * hkv, init_method=init_method,
                                    parameters_split=None if fuse_qkv_params else
                                    ("key", "value"), **common, **column)
        self.core_attention = DotProductAttention(
            self.num_attention_heads_per_partition, kv_channels,
            num_gqa_groups=self._local_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, window_size=window_size,
            layer_number=self.layer_number, attention_type=attention_type,
            softmax_type=softmax_type, attention_backend=attention_backend, device=device,
            # its dropout forks the tracker's stream (DotProductAttention's rule, NVIDIA's)
            sequence_parallel=self.sequence_parallel, get_rng_state_tracker=get_rng_state_tracker)
        self.proj = Linear(hq, hidden_size, init_method=output_layer_init_method,
                           return_bias=return_bias, **common, **row)
        zero_biases(self)
        self.qk_norm_type, self.qk_norm_eps = qk_norm_type, float(qk_norm_eps)
        self.qk_norm_before_rope = qk_norm_before_rope
        if qk_norm_type in ("RMSNorm", "LayerNorm"):  # over each head's features
            norm = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
            self.q_norm = norm(self.head_dim, qk_norm_eps, device=device)
            self.k_norm = norm(self.head_dim, qk_norm_eps, device=device)
        # The name of the projection that reads hidden_states (a name: a second attribute
        # holding the module would register it twice, under two state-dict prefixes).
        self._first = (("layernorm_qkv", "layernorm_query") if input_layernorm else
                       ("qkv", "query_layer"))[attention_type == "cross"]
        hpg = self.num_attention_heads // self.num_gqa_groups
        self._parts = (hpg, 1, 1) if attention_type == "self" else (hpg,)

    def _check_bias(self, cache, fp8_mha: bool) -> None:
        """An attention bias goes to DotProductAttention's unfused path; refused where this
        module would attend otherwise."""
        where = ("a KV cache (inference_params)" if cache is not None
                 else "tensor parallelism (the bias would be the whole block's heads)"
                 if self._local_groups != self.num_gqa_groups
                 else "FP8 attention (fp8_mha)" if fp8_mha else None)
        if where is not None:
            raise NotImplementedError(f"te.MultiheadAttention: an attention bias with {where} "
                                      "is not implemented")

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output=None,
                attn_mask_type: Optional[str] = None, window_size=None,
                is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None,
                rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None, cu_seqlens_q=None,
                cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                fast_zero_fill: bool = True, pad_between_seqs: Optional[bool] = None):
        """``hidden_states`` in ``qkv_format``'s layout -> the same shape (then the bias when
        return_bias, then the norm's output when return_layernorm_output).

        The mask and sequence arguments are DotProductAttention's; ``encoder_output`` is the
        key/value source of cross attention. ``rotary_pos_emb``: RoPE angles
        ([s, 1, 1, rot_dim] float32, or a (query, key) pair of them) applied to q and k.
        ``inference_params``: a :class:`InferenceParams` KV cache (self-attention).
        ``checkpoint_core_attention``: recompute attention in the backward instead of keeping
        its activations. ``core_attention_bias_type`` with ``core_attention_bias`` or
        ``alibi_slopes``: DotProductAttention's additive bias. ``cu_seqlens_q_padded`` /
        ``cu_seqlens_kv_padded`` (thd): where each sequence starts in the tensor when there is
        padding between them (RoPE then counts positions from there). ``fast_zero_fill`` is
        accepted (padded rows are always written as zeros)."""
        if self.fuse_wgrad_accumulation:
            route_tree(self)
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"te.MultiheadAttention: hidden_states must have hidden_size="
                             f"{self.hidden_size} as its last dimension, got shape "
                             f"{list(hidden_states.shape)}")
        check_device("te.MultiheadAttention", "hidden_states", hidden_states,
                     self.proj._parameters["weight"])
        if self.attention_type == "cross" and encoder_output is None:
            raise ValueError("te.MultiheadAttention: cross attention needs encoder_output")
        if (attention_mask is None and encoder_output is None and window_size is None
                and attn_mask_type in (None, self.attn_mask_type) and is_first_microbatch is None
                and not checkpoint_core_attention and inference_params is None
                and core_attention_bias_type == "no_bias" and core_attention_bias is None
                and alibi_slopes is None and cu_seqlens_q is None and cu_seqlens_kv is None
                and cu_seqlens_q_padded is None and cu_seqlens_kv_padded is None
                and max_seqlen_q is None and max_seqlen_kv is None and pad_between_seqs is None):
            # the step as one node, where it can (layer_block.py)
            out = layer_block.attention_forward(self, hidden_states, rotary_pos_emb)
            if out is not None:
                return out
        padded = padded_packing.forward_args("te.MultiheadAttention", pad_between_seqs,
                                             cu_seqlens_q_padded, cu_seqlens_kv_padded,
                                             self.qkv_format)
        if padded is not None and inference_params is not None:
            raise NotImplementedError("te.MultiheadAttention: padding between packed sequences "
                                      "(cu_seqlens_*_padded) with inference_params is not "
                                      "implemented; a packed KV-cache step takes its tokens "
                                      "back to back")
        biased = attention_bias.check_type("te.MultiheadAttention", core_attention_bias_type,
                                           core_attention_bias, alibi_slopes)
        mask = attn_mask_type or self.attn_mask_type
        window = window_size if window_size is not None else self.window_size
        cache = inference_params if self.attention_type == "self" else None
        state = fp8.STATE
        fp8_mha = bool(state.enabled and _runs_fp8(state.recipe) and state.recipe.fp8_mha)
        # RoPE, q/k norms and the cache take high precision: the QKV GEMM then writes its
        # usual output.
        qkv_fp8 = (fp8_mha and rotary_pos_emb is None and cache is None
                   and self.qk_norm_type is None)
        projected = self._modules[self._first](hidden_states, is_first_microbatch,
                                               fp8_output=qkv_fp8)
        ln_out = None
        if self.return_layernorm_output:
            projected, ln_out = projected
        g, d = self._local_groups, self.head_dim
        if self.attention_type == "self":
            q, k, v = split_heads(projected, g, self._parts, d, self.qkv_weight_interleaved)
        else:
            (q,) = split_heads(projected, g, self._parts, d, False)
            kv = self.key_value(encoder_output, is_first_microbatch, fp8_output=qkv_fp8)
            k, v = split_heads(kv, g, (1, 1), d, self.qkv_weight_interleaved)
        layout = self.qkv_format
        if cache is not None and layout == "thd":
            cache._check_packed(hidden_states.shape[0])
        elif cache is not None:
            batch, seq = (1, 0) if layout == "sbhd" else (0, 1)
            cache._check_input(hidden_states.shape[batch], hidden_states.shape[seq])
        norm_qk = self.qk_norm_type is not None
        if norm_qk and self.qk_norm_before_rope:
            q, k = self._norm_qk(q, k)
        if rotary_pos_emb is not None:
            bounds = (cu_seqlens_q, cu_seqlens_kv)
            if padded is not None:  # positions count from where each sequence starts
                bounds = tuple(cu if pad is None else pad
                               for cu, pad in zip(bounds, padded, strict=True))
            q, k = self._rope(q, k, rotary_pos_emb, cache, *bounds)
        if norm_qk and not self.qk_norm_before_rope:
            q, k = self._norm_qk(q, k)
        attend = dict(attention_mask=attention_mask, attn_mask_type=mask, window_size=window,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                      max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        if padded is not None:
            attend.update(cu_seqlens_q_padded=padded[0], cu_seqlens_kv_padded=padded[1])
        if biased:
            self._check_bias(cache, fp8_mha)
            attend.update(core_attention_bias_type=core_attention_bias_type,
                          core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes)
        unpack = None
        if cache is not None:
            q, k, v, layout, unpack = self._cached(cache, q, k, v, mask, attend)
        recompute = fp8.RECOMPUTE
        # Inside a checkpoint of the whole layer attention is recomputed already (and
        # checkpoints do not nest).
        if (checkpoint_core_attention and torch.is_grad_enabled()
                and recompute.recording is None and not recompute.replaying):
            o = checkpoint(self.core_attention, q, k, v, qkv_format=layout,
                           get_rng_state_tracker=self.get_rng_state_tracker, **attend)
        else:
            if (traced_in_place and torch.compiler.is_compiling()
                    and self.attention_type == "self" and rotary_pos_emb is None
                    and not norm_qk and cache is None):
                attend["_packed"] = self._packed(projected)
            o = self.core_attention(q, k, v, qkv_format=layout, **attend)
        if unpack is not None:  # a cached packed step attended as padded bshd
            o = unpack(to_high_precision(o))
        elif layout != self.qkv_format:  # a cached sbhd step attended in bshd
            o = to_high_precision(o).transpose(0, 1).contiguous()
        out = self.proj(o, is_first_microbatch)
        if ln_out is None:
            return out
        return (*out, ln_out) if isinstance(out, tuple) else (out, ln_out)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Splits the sequence over ``cp_group`` (DotProductAttention's): hidden_states and
        the output are this rank's two chunks of the sequence (context_parallel.py), and
        rotary angles given for the whole sequence are taken at the chunks' positions."""
        self.core_attention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
                                                       cp_comm_type)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Supplies the tensor-parallel group of a block built with ``set_parallel_mode=True``,
        ``tp_size`` > 1 and no ``tp_group`` (NVIDIA's way): its projections keep this rank's
        slices (te.Linear.set_tensor_parallel_group)."""
        set_group_of_children(self, tp_group)

    @staticmethod
    def _check_tensor_parallel(op, tp_group, tp_size, set_parallel_mode, heads, groups,
                               qk_norm_type, fuse_qkv_params, interleaved) -> int:
        """The number of ranks the block is split over (1: not split), after the checks that
        tensor parallelism adds."""
        tp = distributed.check_tensor_parallel(op, tp_group, tp_size,
                                               "column" if set_parallel_mode else None)
        if tp_size > 1 and not set_parallel_mode:
            raise NotImplementedError(
                f"{op}: tp_size={tp_size} needs set_parallel_mode=True (the QKV projection "
                "column-parallel, the output projection row-parallel); a block replicated on "
                "every rank of a group is not implemented")
        if tp == 1:
            return 1
        groups = heads if groups is None else groups
        for name, value in (("num_attention_heads", heads), ("num_gqa_groups", groups)):
            distributed.check_divisible(op, name, value, tp)
        if qk_norm_type in ("RMSNorm", "LayerNorm"):
            raise NotImplementedError(
                f"{op}: qk_norm_type={qk_norm_type!r} with tensor parallelism is not "
                "implemented (its weights would get a share of their gradient on each rank); "
                "use 'L2Normalization' or None")
        if fuse_qkv_params and not interleaved:
            raise NotImplementedError(
                f"{op}: fuse_qkv_params=True with qkv_weight_interleaved=False and tensor "
                "parallelism is not implemented (a rank's rows of [q | k | v] would not hold "
                "whole key/value groups); use qkv_weight_interleaved=True")
        return tp

    def _packed(self, projected) -> Optional[tuple]:
        """(projected, the views of q, k, v in it, head_views' arguments that make them) for a
        traced step whose q, k, v are split_heads' views of the plain QKV output
        ``projected``: attention then reads them in place and writes their gradients into one
        gradient of it (attention_fn's packed path, which in eager finds the views itself
        from their storage; a trace cannot look there). None where the views do not tile
        it."""
        if type(projected) is not torch.Tensor or self.core_attention._cp is not None:
            return None
        split = (self._local_groups, tuple(self._parts), self.head_dim,
                 self.qkv_weight_interleaved)
        views = packed_views(tuple(projected.shape), projected.dtype, *split)
        return None if views is None else (projected, views, split)

    def _norm_qk(self, q, k):
        """qk_norm_type over each head's features of q and k."""
        if self.qk_norm_type == "L2Normalization":
            return _l2_normalize(q, self.qk_norm_eps), _l2_normalize(k, self.qk_norm_eps)
        return self.q_norm(to_high_precision(q)), self.k_norm(to_high_precision(k))

    def _rope(self, q, k, rotary_pos_emb, cache, cu_seqlens_q, cu_seqlens_kv):
        """q and k rotated at their positions (after the cached tokens, with a cache)."""
        q_freqs, k_freqs = (rotary_pos_emb if isinstance(rotary_pos_emb, tuple)
                            else (rotary_pos_emb, rotary_pos_emb))
        q, k = to_high_precision(q), to_high_precision(k)
        start = None
        if cache is not None and self.qkv_format == "thd":
            cu_seqlens_q, start = cache._packed_rope(q.device)
            cu_seqlens_kv = cu_seqlens_q
        elif cache is not None:
            start, offset = cache._rope_positions(q.device)
            if offset:
                seq = q.shape[0] if self.qkv_format == "sbhd" else q.shape[1]
                q_freqs, k_freqs = (f[offset:offset + seq] for f in (q_freqs, k_freqs))
        cp = self.core_attention._cp  # this rank's chunks of the sequence: their angles
        kw = dict(tensor_format=self.qkv_format, interleaved=self.rotary_pos_interleaved,
                  fused=True, start_positions=start, cp_size=1 if cp is None else cp.size,
                  cp_rank=0 if cp is None else cp.rank)
        return (apply_rotary_pos_emb(q, q_freqs, cu_seqlens=cu_seqlens_q, **kw),
                apply_rotary_pos_emb(k, k_freqs, cu_seqlens=cu_seqlens_kv, **kw))

    def _cached(self, cache, q, k, v, mask: str, attend: dict):
        """Appends k, v to the cache; q and the cached k, v in the layout attention runs in,
        with ``attend`` set for attending over the cache, and for a packed (thd) step the
        function that packs the output again (else None)."""
        q, k, v = (to_high_precision(t) for t in (q, k, v))
        unpack = None
        if self.qkv_format == "thd":
            q, keys, values, mask, lens, unpack = cache._append_packed(
                self.layer_number, self, q, k, v, mask)
        else:
            if self.qkv_format == "sbhd":  # the cache is bshd
                q, k, v = (t.transpose(0, 1) for t in (q, k, v))
            keys, values, mask, lens = cache._append(self.layer_number, self, k, v, mask)
        cu_q, cu_kv, max_q, max_kv = lens
        attend.update(attn_mask_type=mask, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                      max_seqlen_q=max_q, max_seqlen_kv=max_kv, attention_mask=None)
        return q, keys, values, "bshd", unpack


def _l2_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, computed in fp32."""
    x = to_high_precision(x)
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)
