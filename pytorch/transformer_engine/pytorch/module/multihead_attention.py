"""MultiheadAttention: the attention block of a transformer layer.

    hidden -> [norm ->] QKV projection -> DotProductAttention -> output projection

Under ``fp8_autocast`` with ``fp8_dpa=True`` attention runs in FP8; with ``fp8_mha=True`` too,
the block keeps its activations in FP8 between the three steps: the QKV GEMM writes E4M3
directly (its epilogue casts with the projection's output scale), attention reads those bytes
and writes o in E4M3, and the output projection's GEMM reads o as it is. That saves the casts
of q, k, v to FP8 and of o back (each a read and a write of the tensor), which is where FP8
attention inside a model pays. The gradients cross the same boundaries in high precision.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from .. import fp8
from ..float8_tensor import Float8Tensor
from .attention import DotProductAttention, _runs_fp8
from .layernorm_linear import LayerNormLinear
from .linear import Linear, _default_device, check_unsupported

__all__ = ["MultiheadAttention"]


class _SplitHeadsFP8(torch.autograd.Function):
    """Splits a Float8Tensor [..., sum(sizes)] along its last dimension into contiguous
    Float8Tensors [..., heads_i, head_dim] (byte copies sharing the scale); the backward
    concatenates the high-precision gradients."""

    @staticmethod
    def forward(ctx, x, sizes: tuple, heads: tuple, head_dim: int):
        lead = x.shape[:-1]
        parts = torch.split(x._data, list(sizes), dim=-1)
        ctx.lead, ctx.sizes, ctx.dtype = lead, sizes, x.dtype
        return tuple(Float8Tensor(p.contiguous().view(*lead, h, head_dim), x._scale_inv,
                                  x._fp8_dtype, x.dtype)
                     for p, h in zip(parts, heads, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        device = next((g.device for g in grads if g is not None), None)
        flat = [g.reshape(*ctx.lead, size) if g is not None
                else torch.zeros(*ctx.lead, size, dtype=ctx.dtype, device=device)
                for g, size in zip(grads, ctx.sizes, strict=True)]
        return torch.cat(flat, dim=-1), None, None, None


def _split_heads(x: torch.Tensor, heads: tuple, head_dim: int) -> tuple:
    """x [..., sum(heads) * head_dim] -> one [..., heads_i, head_dim] tensor per entry."""
    sizes = tuple(h * head_dim for h in heads)
    if isinstance(x, Float8Tensor):
        return _SplitHeadsFP8.apply(x, sizes, heads, head_dim)
    lead = x.shape[:-1]
    return tuple(p.view(*lead, h, head_dim)
                 for p, h in zip(torch.split(x, list(sizes), dim=-1), heads, strict=True))


class MultiheadAttention(torch.nn.Module):
    """Self- or cross-attention with its projections, in FP8 under :func:`fp8_autocast`.

    Args:
        hidden_size: features of the input and of the output.
        num_attention_heads: query heads.
        kv_channels: head dim (default hidden_size // num_attention_heads).
        attention_dropout: dropout probability of the attention weights (training only).
        layernorm_epsilon: eps of the input norm.
        init_method: initializes the query/key/value weights (default: nn.Linear's).
        output_layer_init_method: initializes the output projection's weight.
        layer_number: kept for API compatibility.
        attn_mask_type, window_size, qkv_format, attention_backend: as DotProductAttention
            (``qkv_format`` is the layout of ``hidden_states``: ``"sbhd"`` [s, b, hidden],
            ``"bshd"`` [b, s, hidden] or ``"thd"`` [tokens, hidden]).
        num_gqa_groups: key/value heads (GQA; 1 is MQA); default num_attention_heads.
        return_layernorm_output: also return the input norm's output (with input_layernorm).
        input_layernorm: normalize the input before the query (and key/value) projection.
        attention_type: ``"self"`` (q, k, v from hidden_states) or ``"cross"`` (q from
            hidden_states, k and v from ``encoder_output``).
        zero_centered_gamma, normalization: of the input norm (``"LayerNorm"``/``"RMSNorm"``).
        bias: learn biases in the projections.
        return_bias: return the output projection's bias instead of adding it.
        params_dtype, device: of the parameters (and of the FP8 state).
        tp_group, tp_size, sequence_parallel, fuse_wgrad_accumulation: as te.Linear (only
            ``tp_size=1``).

    The query/key/value projection of self-attention is one GEMM whose output features are
    [q heads | k heads | v heads] (num_attention_heads + 2 * num_gqa_groups heads); cross
    attention has a query projection and a key/value projection ([k heads | v heads]).

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
                 window_size: Optional[tuple[int, int]] = None,
                 num_gqa_groups: Optional[int] = None, return_layernorm_output: bool = False,
                 input_layernorm: bool = False, attention_type: str = "self",
                 zero_centered_gamma: bool = False, bias: bool = True,
                 normalization: str = "LayerNorm", qkv_format: str = "sbhd",
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device: Union[torch.device, str, None] = None, tp_group=None,
                 tp_size: int = 1, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False,
                 attention_backend: Optional[str] = None) -> None:
        super().__init__()
        name = "te.MultiheadAttention"
        check_unsupported(tp_group, tp_size, None, sequence_parallel, fuse_wgrad_accumulation,
                          name)
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{name}: attention_type must be 'self' or 'cross', got "
                             f"{attention_type!r}")
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(f"{name}: hidden_size ({hidden_size}) must be a multiple of "
                                 f"num_attention_heads ({num_attention_heads}), or give "
                                 "kv_channels")
            kv_channels = hidden_size // num_attention_heads
        groups = num_gqa_groups if num_gqa_groups is not None else num_attention_heads
        if return_layernorm_output and not input_layernorm:
            raise ValueError(f"{name}: return_layernorm_output needs input_layernorm=True")
        device = _default_device(device)
        self.hidden_size, self.head_dim = int(hidden_size), int(kv_channels)
        self.num_attention_heads, self.num_gqa_groups = int(num_attention_heads), int(groups)
        self.attention_type, self.qkv_format = attention_type, qkv_format
        self.input_layernorm = input_layernorm
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        common = dict(bias=bias, params_dtype=params_dtype, device=device)
        q_features = self.num_attention_heads * self.head_dim
        kv_features = 2 * self.num_gqa_groups * self.head_dim
        # Self-attention projects q, k, v in one GEMM; cross attention q and (k, v) apart.
        first = q_features + (kv_features if attention_type == "self" else 0)
        if input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size, first, layernorm_epsilon, normalization=normalization,
                zero_centered_gamma=zero_centered_gamma,
                return_layernorm_output=return_layernorm_output, init_method=init_method,
                **common)
        else:
            self.qkv = Linear(hidden_size, first, init_method=init_method, **common)
        if attention_type == "cross":
            self.key_value = Linear(hidden_size, kv_features, init_method=init_method, **common)
        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups=groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format,
            attn_mask_type=attn_mask_type, window_size=window_size, layer_number=layer_number,
            attention_type=attention_type, attention_backend=attention_backend, device=device)
        self.proj = Linear(q_features, hidden_size, init_method=output_layer_init_method,
                           return_bias=return_bias, **common)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output=None,
                attn_mask_type: Optional[str] = None, window_size=None,
                is_first_microbatch: Optional[bool] = None, cu_seqlens_q=None,
                cu_seqlens_kv=None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None):
        """``hidden_states`` in ``qkv_format``'s layout -> the same shape (then the bias when
        return_bias, then the norm's output when return_layernorm_output). The mask and
        sequence arguments are DotProductAttention's; ``encoder_output`` is the key/value
        source of cross attention."""
        if hidden_states.dim() == 0 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"te.MultiheadAttention: hidden_states must have hidden_size="
                             f"{self.hidden_size} as its last dimension, got shape "
                             f"{list(hidden_states.shape)}")
        if self.attention_type == "cross" and encoder_output is None:
            raise ValueError("te.MultiheadAttention: cross attention needs encoder_output")
        state = fp8.STATE
        fp8_mha = bool(state.enabled and _runs_fp8(state.recipe) and state.recipe.fp8_mha)
        first = self.layernorm_qkv if self.input_layernorm else self.qkv
        projected = first(hidden_states, is_first_microbatch, fp8_output=fp8_mha)
        ln_out = None
        if self.return_layernorm_output:
            projected, ln_out = projected
        h, g, d = self.num_attention_heads, self.num_gqa_groups, self.head_dim
        if self.attention_type == "self":
            q, k, v = _split_heads(projected, (h, g, g), d)
        else:
            (q,) = _split_heads(projected, (h,), d)
            kv = self.key_value(encoder_output, is_first_microbatch, fp8_output=fp8_mha)
            k, v = _split_heads(kv, (g, g), d)
        o = self.core_attention(q, k, v, attention_mask=attention_mask,
                                attn_mask_type=attn_mask_type, window_size=window_size,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                                max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv)
        out = self.proj(o, is_first_microbatch)
        result = out if isinstance(out, tuple) else (out,)
        if ln_out is not None:
            result = result + (ln_out,)
        return result if len(result) > 1 else result[0]
