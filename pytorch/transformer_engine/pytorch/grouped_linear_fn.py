"""The autograd function of te.GroupedLinear under an FP8 recipe with a plan (delayed, current
or block scaling): the groups' three GEMMs each in one grouped core call.

Group g is its own te.Linear (``gemms[g]``): its plan, FP8 state, weight copy and scales are
those that layer would use, and each group's input, weight and gradient are quantized as that
layer quantizes them: under delayed and current scaling in eager mode every group's cast of one
role in one core call (quantization.quantize_many; the gradients' where no bias gradient rides
in their pass), otherwise one call per group and role. What is grouped is the GEMMs:

    forward  out_g  = x_g @ w_g^T      one te_grouped_gemm over the groups
    dgrad    dx_g   = dy_g @ w_g       one te_grouped_gemm
    wgrad    dw_g   = dy_g^T @ x_g     one te_grouped_gemm (an empty group: dw_g = 0)

so the numbers are those of separate te.Linear layers, bit for bit (each group's GEMM is the
same core GEMM), with three core calls where the layers take 3 per group. Token counts that
are not multiples of the FP8 GEMM's granule of 16 are padded per group, as te.Linear pads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import fp8, ops
from .float8_tensor import Float8Tensor
from .linear_fn import (
    _BLOCK_OUT,
    fp8_input_operand,
    grad_to_fp8,
    pad_gemm_operands,
    update_backward,
)
from .quantization import Plan, quantize_many


class GroupMeta(NamedTuple):
    """What one group's FP8 forward and backward need of its layer (see module/base.py)."""

    plan: Plan
    scales: torch.Tensor  # forward scales (delayed scaling)
    history: Any  # forward amax history, or None (a checkpoint's recompute)
    bwd_meta: tuple  # (history, scale, scale_inv) of the backward roles
    bwd_recipe: Any  # the recipe when the backward update takes the general path
    group: Any  # the amax reduction group


class GroupedConsts(NamedTuple):
    splits: tuple  # rows of each group
    metas: tuple  # GroupMeta per group
    need_dgrad: bool
    need_wgrad: bool
    wgrad_store: Any = None  # delay_wgrad_compute: the list the wgrad GEMM is put on, else None


def _weight_grads(store, compute, groups: int):
    """The weights' gradients: ``compute()`` (one tensor stacking the groups') split per
    group, or, with a store (delay_wgrad_compute), None now and ``compute`` kept for the
    module's ``backward_dw()``."""
    if store is not None:
        store.append(compute)
        return (None,) * groups
    return torch.chunk(compute(), groups)


def _stacked_gemm(a_ops: list, b_ops: list, fmt_a: str, fmt_b: str, modes: tuple,
                  out_dtype: torch.dtype, biases, split: bool) -> torch.Tensor:
    """The groups' ``a_g @ b_g^T (+ bias_g)`` stacked by rows, each pair padded to the
    granule as te.Linear pads it (:func:`pad_gemm_operands`), the padded rows dropped.
    ``a_ops`` / ``b_ops``: (data, scale_inv) per group; ``modes``: their scaling modes. As in
    te.Linear's GEMM (linear_fn._fp8_gemm): a bias joins the epilogue of a 16-bit output and
    is added afterwards to an fp32 one, and a block-scaled GEMM, which writes fp32 or bf16
    only, writes fp32 for an fp16 output, cast after."""
    a_mode, b_mode = modes
    block = a_mode != "tensor"
    gemm_dtype = out_dtype if not block or out_dtype in _BLOCK_OUT else torch.float32
    a, a_sinv, b, b_sinv, rows, padded = [], [], [], [], [], False
    for (x, xs), (w, ws) in zip(a_ops, b_ops, strict=True):
        x, xs, w, m = pad_gemm_operands(x, xs, a_mode, w)
        a.append(x)
        a_sinv.append(xs)
        b.append(w)
        b_sinv.append(ws)
        rows.append(m)
        padded = padded or x.shape[0] != m
    fused = biases is not None and gemm_dtype in (torch.bfloat16, torch.float16)
    gemm_bias = [x if x.dtype == gemm_dtype else x.to(gemm_dtype) for x in biases] if fused \
        else []
    out = ops.grouped_gemm_fp8(a, a_sinv, fmt_a, a_mode, b, b_sinv, fmt_b, b_mode, gemm_dtype,
                               gemm_bias, split)
    if padded:
        parts = torch.split(out, [x.shape[0] for x in a])
        out = torch.cat([p[:m] for p, m in zip(parts, rows, strict=True)])
    if biases is not None and not fused:
        for part, bias in zip(torch.split(out, rows), biases, strict=True):
            part.add_(bias if bias.dtype == out.dtype else bias.to(out.dtype))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def _fp8_row_groups(inp: Float8Tensor, splits) -> list:
    """The groups' rows of a per-tensor Float8Tensor, each a Float8Tensor over its bytes."""
    data = inp._data.reshape(-1, inp.shape[-1])
    return [Float8Tensor(part, inp._scale_inv, inp._fp8_dtype, inp.dtype)
            for part in torch.split(data, list(splits))]


def _update_groups(metas) -> None:
    """Each group's backward scale update after its grad_output cast (update_backward): the
    core's updates of all groups in one call, the general path (user callables, amax groups)
    group by group."""
    core_path = [m for m in metas if m.bwd_recipe is None]
    for m in metas:
        if m.bwd_recipe is not None:
            update_backward(m.bwd_meta, m.plan, m.bwd_recipe, m.group)
    if core_path:
        plan = core_path[0].plan
        fp8.scale_update([m.bwd_meta[0] for m in core_path], [m.bwd_meta[1] for m in core_path],
                         [m.bwd_meta[2] for m in core_path], plan.bwd_dtype, plan.algo,
                         plan.margin)


class GroupedFp8Function(torch.autograd.Function):
    """``out[rows of g] = x[rows of g] @ weight_g^T (+ bias_g)`` (see the module docstring).

    Arguments: the input [M, K] (the groups' rows back to back; or a per-tensor Float8Tensor
    in the forward format, whose bytes are the groups' operands as they are); ``cfg``; the
    weights' FP8 copies (one Operand per group, quantized by their layers); then the weights
    and the biases (none, or one per group) as tensors, so that autograd reaches them."""

    @staticmethod
    def forward(ctx, inp, cfg: GroupedConsts, w_ops: tuple, *params):
        groups = len(cfg.splits)
        weights, biases = params[:groups], params[groups:] or None
        if isinstance(inp, Float8Tensor):  # FP8 dispatch (moe_permute of FP8 tokens)
            q_in = [fp8_input_operand(part, cfg.need_wgrad)
                    for part in _fp8_row_groups(inp, cfg.splits)]
        else:
            parts = torch.split(inp, list(cfg.splits))
            q_in = quantize_many(cfg.metas[0].plan, "input", parts, True, cfg.need_wgrad,
                                   [(m.scales, m.history) for m in cfg.metas], 0)
        plan = cfg.metas[0].plan
        fmt = plan.fwd_dtype
        out = _stacked_gemm([(q.data, q.scale_inv) for q in q_in],
                            [(w.data, w.scale_inv) for w in w_ops], fmt, fmt,
                            (plan.input_mode, plan.weight_mode), inp.dtype, biases, False)
        ctx.save_for_backward(*(q.columnwise for q in q_in),
                              *(q.columnwise_scale_inv for q in q_in),
                              *(w.columnwise for w in w_ops),
                              *(w.columnwise_scale_inv for w in w_ops))
        ctx.cfg = cfg
        ctx.dtypes = (inp.dtype, weights[0].dtype, None if biases is None else biases[0].dtype)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        cfg = ctx.cfg
        groups = len(cfg.splits)
        saved = ctx.saved_tensors
        in_col, in_sinv = saved[:groups], saved[groups:2 * groups]
        w_col, w_sinv = saved[2 * groups:3 * groups], saved[3 * groups:]
        in_dtype, w_dtype, b_dtype = ctx.dtypes
        has_bias = b_dtype is not None
        parts = torch.split(grad_output.contiguous(), list(cfg.splits))
        plan = cfg.metas[0].plan
        if not has_bias and (cfg.need_dgrad or cfg.need_wgrad):
            # (grad_to_fp8's cast without a bias gradient, every group's in one call)
            q_g = quantize_many(plan, "grad_output", parts, cfg.need_dgrad, cfg.need_wgrad,
                                  [(m.bwd_meta[1], m.bwd_meta[0]) for m in cfg.metas], 0)
            dbias = [None] * groups
        else:
            q_g, dbias = [], []
            for meta, dy in zip(cfg.metas, parts, strict=True):
                _, scale, _ = meta.bwd_meta
                q, db = grad_to_fp8(meta.plan, dy, dy, "identity", scale, 0, cfg.need_dgrad,
                                    cfg.need_wgrad, has_bias, meta.bwd_meta[0])
                q_g.append(q)
                dbias.append(db)
        if plan.kind == "delayed" and q_g[0] is not None:
            _update_groups(cfg.metas)
        grad_input = grad_weights = None
        if cfg.need_dgrad:
            grad_input = _stacked_gemm([(q.data, q.scale_inv) for q in q_g],
                                       list(zip(w_col, w_sinv, strict=True)), plan.bwd_dtype,
                                       plan.fwd_dtype, (plan.grad_mode, plan.weight_mode),
                                       in_dtype, None, True)
        if cfg.need_wgrad:
            def wgrad():
                return _stacked_gemm([(q.columnwise, q.columnwise_scale_inv) for q in q_g],
                                     list(zip(in_col, in_sinv, strict=True)), plan.bwd_dtype,
                                     plan.fwd_dtype, (plan.grad_mode, plan.input_mode),
                                     w_dtype, None, True)

            grad_weights = _weight_grads(cfg.wgrad_store, wgrad, groups)
        grad_biases = ()
        if has_bias:
            grad_biases = tuple(db if b_dtype == torch.float32 else db.to(b_dtype)
                                for db in dbias)
        return (grad_input, None, None, *(grad_weights or (None,) * groups), *grad_biases)


class GroupedHpFunction(torch.autograd.Function):
    """``out[rows of g] = x[rows of g] @ weight_g^T (+ bias_g)`` in high precision (the
    inputs' dtype, fp32 accumulation): the forward, dgrad and wgrad GEMMs of every group each
    in one grouped core call (ops.grouped_gemm). Arguments: the input [M, K], the rows of each
    group, then the weights (already in the input's dtype) and the biases (none, or one per
    group)."""

    @staticmethod
    def forward(ctx, inp, splits: tuple, wgrad_store, *params):
        groups = len(splits)
        weights, biases = params[:groups], params[groups:] or None
        parts = list(torch.split(inp, list(splits)))
        out = ops.grouped_gemm(parts, list(weights), False, True,
                               [] if biases is None else
                               [b if b.dtype == inp.dtype else b.to(inp.dtype) for b in biases])
        ctx.save_for_backward(inp, *weights)
        ctx.splits, ctx.has_bias, ctx.wgrad_store = splits, biases is not None, wgrad_store
        ctx.bias_dtypes = None if biases is None else [b.dtype for b in biases]
        return out

    @staticmethod
    def backward(ctx, grad_output):
        inp, *weights = ctx.saved_tensors
        splits = list(ctx.splits)
        dy = grad_output.contiguous()
        dys = list(torch.split(dy, splits))
        need_input, need_weights = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        grad_input = grad_weights = None
        if need_input:  # dx_g = dy_g @ w_g (w_g [N, K] read as it is)
            grad_input = ops.grouped_gemm(dys, list(weights), False, False, [])
        if need_weights:  # dw_g = dy_g^T @ x_g
            def wgrad():
                return ops.grouped_gemm(dys, list(torch.split(inp, splits)), True, False, [])

            grad_weights = _weight_grads(ctx.wgrad_store, wgrad, len(splits))
        grad_biases = ()
        if ctx.has_bias:
            grad_biases = tuple(part.sum(0).to(dt) for part, dt in zip(dys, ctx.bias_dtypes,
                                                                        strict=True))
        return (grad_input, None, None, *(grad_weights or (None,) * len(splits)),
                *grad_biases)
