"""Additive attention biases by NVIDIA's names (``core_attention_bias_type``), as one tensor
added to the attention scores.

    "pre_scale_bias"   softmax(scale * (q k^T + bias))
    "post_scale_bias"  softmax(scale * q k^T + bias)
    "alibi"            softmax(scale * q k^T + alibi), alibi[b, h, i, j] =
                       -slopes[b, h] * |j - (i + offset)|

ALiBi's distance is measured between the key's position and the query's position, aligned as
NVIDIA's modules align it: to the start of the key sequence under the top-left causal masks
("causal", "padding_causal"; offset 0), else to its end (offset skv - sq, the alignment of a
KV cache or of cross attention). For sq == skv both are |j - i|.

The core's fused attention takes no bias (attention.h), so a call with one runs on the unfused
path (torch matmuls around the core's scaled softmax), on any device, in high precision; the
bias gets its gradient there when it requires one.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")


class Bias(NamedTuple):
    """A checked bias: the tensor to add, broadcastable to [b, h, sq, skv], and whether it is
    added before the softmax scale (``pre_scale``) or after it."""

    tensor: torch.Tensor
    pre_scale: bool


def check_type(op: str, bias_type, bias, alibi_slopes) -> bool:
    """Whether a bias is asked for; raises for an unknown type or arguments that contradict it
    (a bias tensor without a bias type, slopes without "alibi", and the reverse)."""
    if bias_type not in BIAS_TYPES:
        raise ValueError(f"{op}: core_attention_bias_type must be one of {BIAS_TYPES}, got "
                         f"{bias_type!r}")
    if bias_type in ("pre_scale_bias", "post_scale_bias") and bias is None:
        raise ValueError(f"{op}: core_attention_bias_type={bias_type!r} needs "
                         "core_attention_bias, got None")
    if bias_type not in ("pre_scale_bias", "post_scale_bias") and bias is not None:
        raise ValueError(f"{op}: core_attention_bias is given, so core_attention_bias_type must "
                         f"be 'pre_scale_bias' or 'post_scale_bias', got {bias_type!r}")
    if bias_type == "alibi" and alibi_slopes is None:
        raise ValueError(f"{op}: core_attention_bias_type='alibi' needs alibi_slopes [heads] "
                         "or [batch, heads], got None")
    if bias_type != "alibi" and alibi_slopes is not None:
        raise ValueError(f"{op}: alibi_slopes is given, so core_attention_bias_type must be "
                         f"'alibi', got {bias_type!r}")
    return bias_type != "no_bias"


def resolve(op: str, bias_type: str, bias: Optional[torch.Tensor],
            alibi_slopes: Optional[torch.Tensor], batch: int, heads: int, sq: int, skv: int,
            mask: str, like: torch.Tensor) -> Bias:
    """The bias of a call that asks for one (check_type said so), checked against the
    attention's shape [batch, heads, sq, skv] and ``like``'s device; ``mask`` (the attention
    mask type) decides ALiBi's alignment."""
    if bias_type == "alibi":
        slopes = alibi_slopes
        if (not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point()
                or slopes.shape not in ((heads,), (batch, heads))):
            raise ValueError(f"{op}: alibi_slopes must be a float tensor [{heads}] or "
                             f"[{batch}, {heads}], got "
                             f"{_described(slopes)}")
        _same_device(op, "alibi_slopes", slopes, like)
        offset = 0 if mask in ("causal", "padding_causal") else skv - sq
        i = torch.arange(sq, device=like.device).view(sq, 1) + offset
        j = torch.arange(skv, device=like.device).view(1, skv)
        distance = (j - i).abs().to(torch.float32)  # [sq, skv]
        tensor = -slopes.to(torch.float32).reshape(-1, heads, 1, 1) * distance
        return Bias(tensor, False)
    if (not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or bias.dim() != 4
            or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, heads)
            or tuple(bias.shape[2:]) != (sq, skv)):
        raise ValueError(f"{op}: core_attention_bias must be a float tensor [{batch} or 1, "
                         f"{heads} or 1, {sq}, {skv}] (batch, heads, sq, skv), got "
                         f"{_described(bias)}")
    _same_device(op, "core_attention_bias", bias, like)
    return Bias(bias, bias_type == "pre_scale_bias")


def add(scores: torch.Tensor, bias: Bias, softmax_scale: float) -> tuple[torch.Tensor, float]:
    """(scores with the bias added, in fp32, and the softmax scale still to apply)."""
    scores = scores.float()
    if bias.pre_scale:
        return scores + bias.tensor.float(), softmax_scale
    return scores * softmax_scale + bias.tensor.float(), 1.0


def _same_device(op: str, name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.device != like.device:
        raise ValueError(f"{op}: {name} must be on the query's device ({like.device}), got "
                         f"{t.device}")


def _described(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {list(t.shape)}"
    return type(t).__name__
