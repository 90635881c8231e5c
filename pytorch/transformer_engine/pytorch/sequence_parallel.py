"""Sequence parallelism's all-gather in FP8, for the per-tensor recipes (delayed and current
scaling).

A column-parallel layer under sequence parallelism holds its rank's shard of the tokens and
needs all of them. Gathering the shards after quantizing them moves one byte per element
instead of two (bf16), provided every rank quantizes with the same scale: the gathered bytes
are then one per-tensor FP8 tensor, the very bytes the unsplit layer would quantize (the scale
being the one the unsplit layer would take: the amax of the whole is the max of the shards').

- delayed scaling: the module's stored scale, the same on every rank when the amaxes are
  reduced over a group holding the tensor-parallel ranks (``fp8_autocast(fp8_group=...)``)
  and the recipe reduces them (``reduce_amax``); a first step, scaled from the tensor's own
  amax (first_step.py), takes the amax all-reduced over the group;
- current scaling: each rank's amax all-reduced (max) over the group, one 4-byte collective,
  then the core's scale from it.

A norm block normalizes its shard and writes it in FP8 in the same way (:func:`norm_to_fp8`;
delayed scaling in the norm kernel itself), then gathers. Gradients are high precision: the
gather's backward reduce-scatters the gradient of the gathered tensor, and the quantization
passes its gradient through (straight-through, as every FP8 cast of the modules does).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import distributed, fp8, ops
from .first_step import step_scales
from .float8_tensor import Float8Tensor
from .layernorm_linear_fn import norm_backward
from .quantization import Plan

__all__ = ["gather_fp8", "gathers_fp8", "norm_to_fp8", "quantize_shard"]

# (id(tp group), id(fp8 group)) -> (the groups, whether every rank of the first is in the
# second). The entry holds the groups, so that their ids cannot name other groups later.
_GROUP_COVERS: dict = {}


def gathers_fp8(plan: Plan, recipe: Any, tp_group: Any) -> bool:
    """Whether a sequence-parallel layer under ``plan`` gathers its input in FP8: per-tensor
    scaling whose scale every rank of ``tp_group`` shares (current scaling reduces the amax
    itself; delayed scaling needs the scales the exit update keeps equal over fp8_group). Else
    the layer gathers high precision, as the ranks' scales may differ."""
    if plan.input_mode != "tensor":
        return False
    if plan.kind == "current":
        return True
    fp8_group = fp8.STATE.group
    if plan.kind != "delayed" or fp8_group is None or not getattr(recipe, "reduce_amax", True):
        return False
    key = (id(tp_group), id(fp8_group))
    entry = _GROUP_COVERS.get(key)
    if entry is None:
        import torch.distributed as dist

        covers = set(dist.get_process_group_ranks(tp_group)) <= \
            set(dist.get_process_group_ranks(fp8_group))
        entry = _GROUP_COVERS[key] = (tp_group, fp8_group, covers)
    return entry[2]


def _group_amax(amax: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    amax = amax.reshape(1).clone()  # the collective writes in place
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _group_scale(plan: Plan, y: torch.Tensor, group: Any) -> torch.Tensor:
    """Current scaling's scale of the tensor whose shards the ranks of ``group`` hold: the
    core's scale of the amax all-reduced (max) over the group (the scale of a one-element
    tensor holding it: the same call quantize_current makes, so the same bits)."""
    amax = _group_amax(ops.amax(y), group)
    scale, _ = ops.current_scale(amax.view(1, 1), plan.fwd_dtype, plan.force_pow2_scales,
                                 plan.amax_epsilon)
    return scale


def _quantize_rows(plan: Plan, x: torch.Tensor, scales: torch.Tensor,
                   history: Optional[torch.Tensor], group: Any):
    """(data, scale_inv) of the matrix ``x`` (this rank's rows) in the forward format, with
    the scale shared by the ranks of ``group``; delayed scaling records x's amax in
    ``history[0, 0]`` (the exit update reduces it over fp8_group)."""
    if plan.kind == "delayed":
        scales = step_scales(scales, 0, history, 0, plan.fwd_dtype, plan.margin,
                             lambda gate: _group_amax(ops.amax(x, gate), group))
        data, _, scale_inv = ops.quantize_delayed(x, scales, 0, history, plan.fwd_dtype, True,
                                                  False)
        return data, scale_inv
    data, _, scale_inv, _ = ops.quantize(x, _group_scale(plan, x, group), plan.fwd_dtype,
                                         True, False)
    return data, scale_inv


class _QuantizeShard(torch.autograd.Function):
    """This rank's shard as a per-tensor Float8Tensor with the group's shared scale; the
    gradient passes through."""

    @staticmethod
    def forward(ctx, x, plan: Plan, scales, history, group):
        data, scale_inv = _quantize_rows(plan, x.reshape(-1, x.shape[-1]), scales, history,
                                         group)
        return Float8Tensor(data.view(x.shape), scale_inv, plan.fwd_dtype, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None


def quantize_shard(x: torch.Tensor, plan: Plan, scales: torch.Tensor,
                   history: Optional[torch.Tensor], group: Any) -> Float8Tensor:
    """``x`` (this rank's shard) in FP8 with the scale every rank of ``group`` shares (the
    module's ``scales[0]`` under delayed scaling, recording the amax in ``history``; the
    group's amax under current scaling). Differentiable (straight-through)."""
    return _QuantizeShard.apply(x, plan, scales, history, group)


class _GatherFp8(torch.autograd.Function):
    """All-gather of a per-tensor Float8Tensor's bytes along dimension 0; reduce-scatter of
    the (high-precision) gradient."""

    @staticmethod
    def forward(ctx, shard: Float8Tensor, group):
        ctx.group = group
        data = distributed.gather_first_dim(shard._data, group)
        return Float8Tensor(data, shard._scale_inv, shard._fp8_dtype, shard.dtype)

    @staticmethod
    def backward(ctx, grad):
        return distributed.reduce_scatter_first_dim(grad, ctx.group, "sequence parallelism"), \
            None


def gather_fp8(shard: Float8Tensor, group: Any) -> Float8Tensor:
    """Every rank's shard (quantized with one shared scale) concatenated along dimension 0:
    the FP8 bytes move, one per element. The gradient is reduce-scattered back."""
    if not isinstance(shard, Float8Tensor) or shard._scaling_mode != "tensor":
        raise TypeError(f"sequence parallelism: gather_fp8 takes a per-tensor Float8Tensor, "
                        f"got {type(shard).__name__}")
    return _GatherFp8.apply(shard, group)


class _NormToFp8(torch.autograd.Function):
    """The norm of this rank's rows written as FP8 with the group's shared scale (and in high
    precision too with cfg.return_ln_out); the backward is the norm's, from the gradient of
    the FP8 output (plus that of the high-precision one)."""

    @staticmethod
    def forward(ctx, x, gamma, beta, cfg, plan: Plan, scales, history, group):
        m = x.reshape(-1, x.shape[-1])
        if plan.kind == "delayed":  # the kernel writes FP8 with the module's scale
            scale = step_scales(scales[0:1], 0, history, 0, plan.fwd_dtype, plan.margin,
                                lambda gate: _group_amax(ops.norm_forward_fp8(
                                    m, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma,
                                    scales[0:1], plan.fwd_dtype, False, False, None, 0,
                                    gate)[4], group))
            y, data, _, scale_inv, _, mu, rsigma = ops.norm_forward_fp8(
                m, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma, scale,
                plan.fwd_dtype, False, cfg.return_ln_out, history, 0)
        else:  # current scaling: the scale needs the whole output's amax first
            y, mu, rsigma = ops.norm_forward(m, gamma, beta, cfg.norm, cfg.eps,
                                             cfg.zero_centered_gamma)
            data, _, scale_inv, _ = ops.quantize(y, _group_scale(plan, y, group),
                                                 plan.fwd_dtype, True, False)
        ctx.save_for_backward(m, mu, rsigma, gamma)
        ctx.cfg, ctx.has_beta, ctx.shape = cfg, beta is not None, x.shape
        q = Float8Tensor(data.view(x.shape), scale_inv, plan.fwd_dtype, x.dtype)
        if cfg.return_ln_out:
            return q, y.view(x.shape)
        return q

    @staticmethod
    def backward(ctx, grad, grad_ln_out=None):
        m, mu, rsigma, gamma = ctx.saved_tensors
        d = grad.reshape(m.shape)
        if grad_ln_out is not None:
            d = d + grad_ln_out.reshape(m.shape).to(d.dtype)
        dx, dgamma, dbeta = norm_backward(ctx.cfg, d, m, mu, rsigma, gamma, ctx.has_beta)
        return dx.view(ctx.shape), dgamma, dbeta, None, None, None, None, None


def norm_to_fp8(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], cfg,
                plan: Plan, scales: torch.Tensor, history: Optional[torch.Tensor], group: Any):
    """The norm (``cfg``: a NormConfig) of this rank's shard ``x`` as a Float8Tensor with the
    scale the ranks of ``group`` share (delayed scaling records its amax in ``history[0, 0]``),
    and with ``cfg.return_ln_out`` also in x's dtype: (fp8, ln_out or None)."""
    out = _NormToFp8.apply(x, gamma, beta, cfg, plan, scales, history, group)
    return out if cfg.return_ln_out else (out, None)
