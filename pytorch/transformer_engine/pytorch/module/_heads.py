"""Splitting a projection's output features into attention heads.

A projection writes the heads of q, k and v side by side in its last dimension, in one of two
orders (``qkv_weight_interleaved``):

* concatenated: ``[q heads | k heads | v heads]`` (viewed as [parts, groups, head_dim]);
* interleaved by key/value group: for each group ``g``, ``[q heads of g | k_g | v_g]`` (viewed
  as [groups, parts, head_dim]), so that a tensor-parallel rank's slice of the features holds
  whole groups.

``parts`` counts heads per group: (heads // groups, 1, 1) for q, k, v; (1, 1) for k, v.
Query head ``n`` attends with key/value group ``n // (heads // groups)`` in both orders.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..attention_fn import _tiles
from ..float8_tensor import Float8Tensor
from ..head_views import head_views

__all__ = ["packed_views", "split_heads"]


def _join_grads(grads: list, lead: tuple, groups: int, parts: tuple, head_dim: int,
                interleaved: bool) -> torch.Tensor:
    """The inverse of head_views for the gradients: [..., F]."""
    if not interleaved or groups == 1:
        return torch.cat([g.reshape(*lead, -1) for g in grads], dim=-1)
    grouped = [g.reshape(*lead, groups, p, head_dim) for g, p in zip(grads, parts, strict=True)]
    return torch.cat(grouped, dim=-2).reshape(*lead, -1)


class _SplitHeadsFP8(torch.autograd.Function):
    """Splits a per-tensor Float8Tensor [..., F] into contiguous Float8Tensors
    [..., heads_i, head_dim] (byte copies sharing the scale); the backward joins the
    high-precision gradients."""

    @staticmethod
    def forward(ctx, x, layout: tuple):
        groups, parts, head_dim, interleaved = layout
        ctx.lead, ctx.layout, ctx.dtype = x.shape[:-1], layout, x.dtype
        pieces = head_views(x._data, groups, parts, head_dim, interleaved)
        return tuple(Float8Tensor(p.contiguous(), x._scale_inv, x._fp8_dtype, x.dtype)
                     for p in pieces)

    @staticmethod
    def backward(ctx, *grads):
        groups, parts, head_dim, interleaved = ctx.layout
        device = next((g.device for g in grads if g is not None), None)
        full = [g if g is not None else
                torch.zeros(*ctx.lead, p * groups, head_dim, dtype=ctx.dtype, device=device)
                for g, p in zip(grads, parts, strict=True)]
        return _join_grads(full, ctx.lead, groups, parts, head_dim, interleaved), None


def split_heads(x: torch.Tensor, groups: int, parts: tuple, head_dim: int,
                interleaved: bool) -> tuple:
    """x [..., sum(parts) * groups * head_dim] -> one [..., parts_i * groups, head_dim] tensor
    per part (see the module docstring for the two orders). A Float8Tensor gives
    Float8Tensors."""
    if isinstance(x, Float8Tensor):
        return _SplitHeadsFP8.apply(x, (groups, tuple(parts), head_dim, interleaved))
    return tuple(head_views(x, groups, parts, head_dim, interleaved))


@torch._dynamo.assume_constant_result
def packed_views(shape: tuple, dtype, groups: int, parts: tuple, head_dim: int,
                 interleaved: bool) -> Optional[tuple]:
    """split_heads' views of q, k, v in a fresh projection output of ``shape``, as
    (shape, stride, storage offset) each, when they tile it (what attention reads in place:
    attention_fn.packed_qkv), else None. For a traced forward, where the views' own storage
    cannot be inspected: run once at trace time, on the meta device."""
    qkv = torch.empty(shape, dtype=dtype, device="meta")
    q, k, v = split_heads(qkv, groups, parts, head_dim, interleaved)
    views = tuple((tuple(t.shape), tuple(t.stride()), t.storage_offset()) for t in (q, k, v))
    return views if _tiles(qkv, views) else None
