"""The autograd function of LayerNorm (or RMSNorm) followed by an FP8 linear layer.

    forward   ln_out = norm(input)                 written as FP8 (row-wise and column-wise)
              output = ln_out @ weight^T + bias     FP8 GEMM
    backward  grad_output quantized (row-wise for dgrad, column-wise for wgrad)
              grad_ln_out = grad_output @ weight   FP8 dgrad, high precision
              grad_weight = grad_output^T @ ln_out FP8 wgrad
              grad_input, grad_gamma, grad_beta = norm_backward(grad_ln_out)

The point of the fusion is the forward: under delayed scaling the norm kernel writes the GEMM's
FP8 input and its transpose (for wgrad) in its own pass with the module's input scale, so the
high-precision ln_out never goes to memory. What the backward keeps is the norm's input and
statistics (for the norm backward) and the FP8 column-wise ln_out (for wgrad).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from . import compiled_forward, compiled_grads, ops
from .first_step import step_scales
from .linear_fn import backward_gemms, fp8_gemm, fp8_output, grad_to_fp8, update_backward
from .quantization import Operand, Plan, quantize


class NormConfig(NamedTuple):
    """The norm of a fused block, as plain values (a constant for torch.compile)."""

    norm: str  # "layernorm" / "rmsnorm"
    eps: float
    zero_centered_gamma: bool
    return_ln_out: bool


def norm_to_fp8(plan: Plan, x: torch.Tensor, gamma, beta, cfg: NormConfig, scale: torch.Tensor,
                columnwise: bool, history: Optional[torch.Tensor], column: int
                ) -> tuple[Operand, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """norm(x) as the FP8 ``input`` operand of the GEMM that follows: (operand, ln_out in x's
    dtype when cfg.return_ln_out else None, mu, rsigma). Delayed scaling raises the amax
    history's slot ``[0, column]`` in the same pass (``history`` None: a checkpoint's
    recompute, which records nothing).

    Delayed scaling knows the scale before the pass, so the norm kernel writes FP8 directly.
    Current scaling needs the amax of the very values being written, known only once the
    whole output exists, and block scaling computes a scale per block after reading it; a
    fused kernel would have to keep the tensor somewhere and read it again either way, so for
    them the norm writes high precision and the existing quantize reads it back.
    """
    if plan.kind == "delayed":
        scale = step_scales(scale, 0, history, column, plan.fwd_dtype, plan.margin,
                            lambda gate: ops.norm_forward_fp8(
                                x, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma,
                                scale, plan.fwd_dtype, False, False, None, 0, gate)[4])
        y, data, col, sinv, _, mu, rsigma = ops.norm_forward_fp8(
            x, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma, scale, plan.fwd_dtype,
            columnwise, cfg.return_ln_out, history, column)
        op = Operand(data, sinv, col, sinv, plan.fwd_dtype, plan.input_mode)
        return op, (y if cfg.return_ln_out else None), mu, rsigma
    y, mu, rsigma = ops.norm_forward(x, gamma, beta, cfg.norm, cfg.eps, cfg.zero_centered_gamma)
    op = quantize(plan, "input", y, True, columnwise)
    return op, (y if cfg.return_ln_out else None), mu, rsigma


def norm_then_gemm(plan: Plan, cfg: NormConfig, x: torch.Tensor, gamma, beta, w_data, w_sinv,
                   bias, scales: torch.Tensor, history: Optional[torch.Tensor],
                   columnwise: bool) -> tuple:
    """norm(x) written as the FP8 input of the GEMM after it, then ``@ w^T (+ bias)`` in x's
    dtype: (output [M, N], the norm output's operand, ln_out or None, mu, rsigma, x as the
    backward keeps it). One compiled operator call where compiled_forward.usable says so (and
    no ln_out is asked for), else norm_to_fp8 and fp8_gemm: the same bits."""
    if not cfg.return_ln_out and compiled_forward.usable(plan, x, (gamma, beta, w_data, w_sinv),
                                                         bias, history):
        x = x.contiguous()
        out, q, mu, rsigma = compiled_forward.norm_linear(
            plan, cfg, x, gamma, beta, w_data, w_sinv, bias, scales, history, columnwise)
        return out, q, None, mu, rsigma, x
    q, ln_out, mu, rsigma = norm_to_fp8(plan, x, gamma, beta, cfg, scales[0:1], columnwise,
                                        history, 0)
    out = fp8_gemm(q.data, q.scale_inv, w_data, w_sinv, plan.fwd_dtype, plan.fwd_dtype,
                   plan.input_mode, plan.weight_mode, x.dtype, bias, False)
    return out, q, ln_out, mu, rsigma, x


def norm_backward(cfg: NormConfig, d_ln: torch.Tensor, x, mu, rsigma, gamma, has_beta: bool):
    """(grad_input, grad_gamma, grad_beta or None) of the block's norm."""
    dx, dgamma, dbeta = ops.norm_backward(d_ln.to(x.dtype).contiguous(), x, mu, rsigma, gamma,
                                          cfg.norm, cfg.zero_centered_gamma)
    return dx, dgamma, dbeta if has_beta else None


class NormLinearConsts(NamedTuple):
    """The non-tensor arguments of Fp8LayerNormLinearFunction (one argument: each costs host
    time)."""

    plan: Plan
    recipe: Any  # the recipe when the backward update takes the general path, else None
    group: Any  # the amax reduction group, or None
    cfg: NormConfig
    need_dgrad: bool
    need_wgrad: bool
    out_meta: Optional[tuple]  # None: a high-precision output; else what fp8_output needs
    wgrad_store: Optional[list] = None  # delay_wgrad_compute: where the wgrad GEMM goes


class Fp8LayerNormLinearFunction(torch.autograd.Function):
    """``norm(input) @ weight^T + bias`` with FP8 GEMMs (see the module docstring).

    Forward arguments: input [..., K]; the norm's gamma [K] and beta [K] (None for RMSNorm);
    weight [N, K] (its autograd identity and dtype; its FP8 copy comes as w_data [N, K],
    w_scale_inv, w_col [K, N], w_col_scale_inv or None when it is w_scale_inv); bias [N] or
    None; the delayed-scaling buffers of the forward (history, None in a checkpoint's
    recompute, and scales) and, as one tuple, of the backward (history, scale, scale_inv);
    ``consts``: the plan, the recipe (when the backward update takes the general path), the
    amax group, the NormConfig, whether the norm's inputs and the weight need gradients, and
    None or what an FP8 output needs (linear_fn.fp8_output). Returns the output, and ln_out
    too when cfg.return_ln_out. (Tuples: every argument of
    apply costs host time, and these need no autograd edge.)
    """

    @staticmethod
    def forward(ctx, inp, gamma, beta, weight, bias, w_data, w_scale_inv, w_col, w_col_scale_inv,
                history_fwd, scale_fwd, bwd_meta: tuple, consts: NormLinearConsts):
        plan, recipe, group, cfg, need_dgrad, need_wgrad, out_meta, store = consts
        k = inp.shape[-1]
        x = inp.reshape(-1, k)
        if out_meta is None:  # [M, N]: the module gives it inp's leading dimensions
            out, q, ln_out, mu, rsigma, x = norm_then_gemm(plan, cfg, x, gamma, beta, w_data,
                                                           w_scale_inv, bias, scale_fwd,
                                                           history_fwd, need_wgrad)
        else:
            q, ln_out, mu, rsigma = norm_to_fp8(plan, x, gamma, beta, cfg, scale_fwd[0:1],
                                                need_wgrad, history_fwd, 0)
            out = fp8_output(plan, q, w_data, w_scale_inv, bias, out_meta,
                             (*inp.shape[:-1], w_data.shape[0]), inp.dtype)
        if w_col_scale_inv is None:  # per-tensor: shared with the row-wise copy
            w_col_scale_inv = w_scale_inv
        ctx.save_for_backward(x, mu, rsigma, gamma, q.columnwise, q.columnwise_scale_inv, w_col,
                              w_col_scale_inv)
        ctx.bwd_meta = bwd_meta
        ctx.plan, ctx.recipe, ctx.group, ctx.cfg = plan, recipe, group, cfg
        ctx.wgrad_store = store
        ctx.need = (need_dgrad, need_wgrad, beta is not None, bias is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.input_shape = inp.shape
        if cfg.return_ln_out:
            return out, ln_out  # [M, K] (the module views it as inp's shape)
        return out

    @staticmethod
    def backward(ctx, grad_output, grad_ln_out=None):
        x, mu, rsigma, gamma, in_col, in_col_sinv, w_col, w_col_sinv = ctx.saved_tensors
        plan, cfg = ctx.plan, ctx.cfg
        need_dgrad, need_wgrad, has_beta, has_bias = ctx.need
        w_dtype, b_dtype = ctx.dtypes
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        d_ln = grad_weight = grad_bias = None
        dx = dgamma = dbeta = None
        history, scale, _ = ctx.bwd_meta
        saved = (in_col, in_col_sinv, w_col, w_col_sinv)
        if (need_dgrad or need_wgrad) and ctx.wgrad_store is None and compiled_grads.usable(
                plan, ctx.recipe, history, g.shape[0], g, *saved):
            # the cast of grad_output, the scale update and both GEMMs in one call
            d_ln, grad_weight, grad_bias = compiled_grads.linear_grads(
                g, None, "identity", saved, plan, ctx.bwd_meta, 0, True,
                (need_dgrad, need_wgrad, has_bias), (x.dtype, w_dtype, b_dtype))
        else:
            q_g, dbias = grad_to_fp8(plan, g, g, "identity", scale, 0, need_dgrad, need_wgrad,
                                     has_bias, history)
            if q_g is not None:
                if plan.kind == "delayed":
                    update_backward(ctx.bwd_meta, plan, ctx.recipe, ctx.group)
                d_ln, grad_weight = backward_gemms(plan, q_g, w_col, w_col_sinv, in_col,
                                                   in_col_sinv, x.dtype, w_dtype, need_dgrad,
                                                   need_wgrad, ctx.wgrad_store)
                del q_g  # the FP8 grad_output (both copies) goes before the norm's backward
            if has_bias:
                grad_bias = dbias.to(b_dtype)
        if need_dgrad:
            if grad_ln_out is not None:  # ln_out was returned and used: its gradient joins
                d_ln = d_ln + grad_ln_out.reshape(d_ln.shape).to(d_ln.dtype)
            dx, dgamma, dbeta = norm_backward(cfg, d_ln, x, mu, rsigma, gamma, has_beta)
            dx = dx.view(ctx.input_shape)
        return (dx, dgamma, dbeta, grad_weight, grad_bias) + (None,) * 8
