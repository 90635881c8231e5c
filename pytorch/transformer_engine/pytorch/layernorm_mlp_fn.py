"""The autograd function of the MLP block: norm -> FC1 -> activation -> FC2, FP8 GEMMs.

    forward   ln_out  = norm(input)                  FP8 (+ transpose), FC1's input scale
              fc1_out = ln_out @ fc1_weight^T + b1    high precision (the activation reads it)
              act_out = act(fc1_out)                 FP8 (+ transpose), FC2's input scale
              output  = act_out @ fc2_weight^T + b2
    backward  grad_output -> FP8 (+ transpose) with FC2's bias gradient, one pass
              grad_act = grad_output @ fc2_weight    FC2 dgrad, high precision; FC2 wgrad
              grad_fc1 = act'(fc1_out) * grad_act    FP8 (+ transpose) with FC1's bias
                                                     gradient, one pass: FC1's grad_output
              grad_ln  = grad_fc1 @ fc1_weight       FC1 dgrad; FC1 wgrad; norm backward

Under delayed scaling the kernels that produce a GEMM operand write it in FP8 themselves (the
norm, the activation, the activation's backward), so only fc1_out exists in high precision
between the GEMMs. Current scaling does the same for the activation and its backward, after
an amax-only pass of the same kernel gives the scale; its norm writes high precision and the
recipe's quantize follows (see layernorm_linear_fn.norm_to_fp8), as block scaling's kernels
do.
State columns (base.py): FC1 is GEMM 0, FC2 is GEMM 1.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from . import compiled_forward, compiled_grads, first_step, ops
from .first_step import step_scales
from .float8_tensor import Float8Tensor
from .layernorm_linear_fn import NormConfig, norm_backward, norm_then_gemm
from .linear_fn import (
    backward_gemms,
    fp8_gemm,
    fp8_input_operand,
    grad_to_fp8,
    update_backward,
)
from .quantization import Operand, Plan, quantize
from .release import may_release, release


def act_to_fp8(plan: Plan, h: torch.Tensor, act: str, scale: torch.Tensor, columnwise: bool,
               history: Optional[torch.Tensor], column: int) -> Operand:
    """act(h) as FC2's FP8 ``input`` operand, written by the activation's own pass. Delayed
    scaling raises the amax history's slot ``[0, column]`` in that pass (``history`` None: a
    recompute, which records nothing); current scaling takes its scale from an amax-only pass
    first (no high-precision copy of act(h) is made). Block scaling quantizes act(h)."""
    if plan.kind == "delayed":
        scale = step_scales(scale, 0, history, column, plan.fwd_dtype, plan.margin,
                            lambda gate: ops.activation_forward_fp8(
                                h, act, scale, plan.fwd_dtype, True, False, None, 0, gate)[3])
    elif plan.kind == "current":
        scale, _ = ops.activation_scale(h, act, plan.fwd_dtype, plan.force_pow2_scales,
                                        plan.amax_epsilon)
        history = None
    else:
        return quantize(plan, "input", ops.activation_forward(h, act), True, columnwise)
    data, col, sinv, _ = ops.activation_forward_fp8(h, act, scale, plan.fwd_dtype, True,
                                                    columnwise, history, column)
    return Operand(data, sinv, col, sinv, plan.fwd_dtype, plan.input_mode)


def normalized_fc1(plan: Plan, inp: torch.Tensor, w1_data, w1_sinv, b1, scales: torch.Tensor,
                   history: Optional[torch.Tensor], columnwise: bool) -> tuple:
    """FC1 on an input that is the norm's output already (the block's norm ran elsewhere:
    sequence parallelism normalizes each rank's shard, then gathers): (FC1's output [M, N],
    its input operand, an empty tensor of the input's dtype standing for the norm's input in
    the backward). A per-tensor Float8Tensor input is used as it is (its column-wise copy a
    byte transpose), a high-precision one quantized as FC1's input."""
    if isinstance(inp, Float8Tensor):
        q = fp8_input_operand(inp, columnwise)
    else:
        q = quantize(plan, "input", inp.reshape(-1, inp.shape[-1]), True, columnwise, scales,
                     0, history)
    h = fp8_gemm(q.data, q.scale_inv, w1_data, w1_sinv, plan.fwd_dtype, plan.fwd_dtype,
                 plan.input_mode, plan.weight_mode, inp.dtype, b1, False)
    return h, q, torch.empty(0, dtype=inp.dtype, device=inp.device)


# The size of FC1's output (bytes) from which the backward takes its memory-lean order:
# FC2's wgrad before its dgrad, and the FP8 gradient of FC1's output written row-wise, then
# transposed (two more launches than the fused order, which is kept for small blocks, where
# the launches cost more than the memory is worth). At seq 2048 x batch 8 x ffn 16384 in bf16
# (512 MiB) it lowers the backward's peak by about 4 x tokens x ffn bytes.
LEAN_BYTES = 128 * 2**20


def large_block(tokens: int, ffn: int, dtype: torch.dtype) -> bool:
    """Whether FC1's output ([tokens, ffn] of ``dtype``) is large enough for the memory-lean
    order (LEAN_BYTES), which then also makes the weights' column-wise FP8 copies in the
    backward (late_weight_columns)."""
    return tokens * ffn * dtype.itemsize >= LEAN_BYTES


# The lean order under delayed scaling makes FC1's FP8 gradient in this many chunks of rows:
# FC2's dgrad of a chunk, then the activation's backward of that chunk writing its FP8 rows,
# so the activation's gradient in high precision (2 x tokens x ffn bytes in bf16) exists one
# chunk at a time instead of beside FC1's output and the whole FP8 gradient (the backward's
# peak). Delayed scaling alone: its scale is known before the gradient exists (current
# scaling needs the whole gradient's amax first).
LEAN_CHUNKS = 8


def chunkable(plan: Plan, history: Optional[torch.Tensor]) -> bool:
    """Whether FC1's FP8 gradient may be made chunk by chunk (LEAN_CHUNKS): delayed scaling
    past its first step (whose scale comes from the whole gradient's amax)."""
    return plan.kind == "delayed" and not first_step.waits(history, 0)


def chunked_fc1_grad(plan: Plan, q_g2: Operand, w2_col, w2_col_sinv, h: torch.Tensor, act: str,
                     scale: torch.Tensor, history: torch.Tensor, with_dbias: bool,
                     columnwise: bool) -> tuple:
    """FC1's FP8 grad_output ``act'(h) * (grad_output @ fc2_weight)`` made LEAN_CHUNKS rows at
    a time (see LEAN_CHUNKS), cast with the stored scale ``scale[0]``, the amax raised in
    ``history[0, 0]`` (the max over the chunks: the whole tensor's), h freed once read: (the
    operand, its column-wise bytes the transpose of the row-wise ones; dbias, the sum of the
    chunks' fp32 column sums, or None). The FP8 bytes are those of the one-pass order; the
    bias gradient's additions are grouped by chunk."""
    m, f = h.shape
    data = h.new_empty((m, f), dtype=torch.uint8)
    rows = -(-m // LEAN_CHUNKS)
    rows = -(-rows // 128) * 128  # whole FP8 GEMM tiles
    dbias = sinv = None
    for r0 in range(0, m, rows):
        r1 = min(m, r0 + rows)
        grad_act = fp8_gemm(q_g2.data[r0:r1], q_g2.scale_inv, w2_col, w2_col_sinv,
                            plan.bwd_dtype, plan.fwd_dtype, plan.grad_mode, plan.weight_mode,
                            h.dtype, None, True)
        # (the chunk's FP8 rows straight into their place in the whole)
        sinv, _, part_dbias = ops.activation.activation_backward_fp8_into(
            data[r0:r1], grad_act, h[r0:r1], act, scale[0:1], plan.bwd_dtype, with_dbias,
            history, 0)
        del grad_act
        if with_dbias:
            dbias = part_dbias if dbias is None else dbias + part_dbias
    release(h)
    col = ops.transpose(data) if columnwise else None
    return Operand(data, sinv, col, sinv, plan.bwd_dtype, plan.grad_mode), dbias


def late_weight_columns(plan: Plan, weight: torch.Tensor, scales: Optional[torch.Tensor],
                        column: int) -> tuple:
    """The column-wise FP8 copy of a weight whose forward made the row-wise one alone: for
    large blocks (lean) the forward leaves out the weights' column-wise copies, which the
    backward alone reads, so they sit in neither the forward's peak nor the saved tensors; the
    backward quantizes the weight again for them. Delayed scaling quantizes with the scale the
    forward used (``scales``: the stored scales as the forward read them, since the autocast's
    update may have written new ones since; the amax is not recorded again); current and block
    scaling compute theirs from the weight again, the same value. The same bytes as a copy
    made beside the row-wise one: (data, scale_inv)."""
    q = quantize(plan, "weight", weight.detach(), False, True, scales, column, None)
    return q.columnwise, q.columnwise_scale_inv


class MlpConsts(NamedTuple):
    """The non-tensor arguments of Fp8LayerNormMLPFunction (one argument: each costs host
    time)."""

    plan: Plan
    recipe: Any  # the recipe when the backward update takes the general path, else None
    group: Any  # the amax reduction group, or None
    cfg: Optional[NormConfig]  # None: the input is the norm's output (normalized_fc1)
    act: str
    need: tuple  # (dgrad, FC1's wgrad, FC2's wgrad, FC1's backward at all)
    own_weights: bool  # the weights' FP8 copies were made for this forward alone
    # delay_wgrad_compute: the lists FC1's and FC2's wgrad GEMMs go on, else None
    wgrad_stores: Optional[tuple] = None
    # the weights' column-wise copies are the backward's to make (late_weight_columns), with
    # these stored scales under delayed scaling (a copy of them as the forward read them)
    late_columns: bool = False
    late_scales: Optional[torch.Tensor] = None


class Fp8LayerNormMLPFunction(torch.autograd.Function):
    """The MLP block with FP8 GEMMs (see the module docstring).

    Forward arguments: input [..., H]; gamma, beta (None for RMSNorm); per GEMM (FC1 then
    FC2): the weight (autograd identity and dtype), the bias or None, and the weight's FP8
    copy (data, scale_inv, column-wise data, column-wise scale_inv or None when per-tensor);
    the delayed-scaling buffers of the forward (history, None in a checkpoint's recompute, and
    scales) and, as one tuple, of the backward (history, scale, scale_inv); ``consts``: the
    plan, the recipe (general backward update), the amax group, the NormConfig, the
    activation and ``need``: whether the norm's inputs, FC1's parameters (weight), FC2's
    weight need gradients and whether anything before FC2 does; whether the weights' FP8
    copies were made for this forward alone (the backward may free them; not a cache's, nor
    a Float8Tensor parameter's). Returns the output, and ln_out too when cfg.return_ln_out.
    With no NormConfig the input is the norm's output already (a per-tensor Float8Tensor or
    high precision; sequence parallelism normalizes each rank's shard before its gather):
    gamma and beta are None, and the input's gradient is that of the norm's output.
    (Tuples: every argument of apply costs host time.)
    """

    @staticmethod
    def forward(ctx, inp, gamma, beta, w1, b1, w1_data, w1_sinv, w1_col, w1_col_sinv, w2, b2,
                w2_data, w2_sinv, w2_col, w2_col_sinv, history_fwd, scale_fwd, bwd_meta: tuple,
                consts: MlpConsts):
        plan, recipe, group, cfg, act, need, own_weights, stores, late, late_scales = consts
        need_dgrad, need_wgrad1, need_wgrad2, _ = need
        if cfg is None:  # inp is the norm's output (sequence parallelism's gathered one)
            h, q1, x = normalized_fc1(plan, inp, w1_data, w1_sinv, b1, scale_fwd, history_fwd,
                                      need_wgrad1)
            ln_out = mu = rsigma = None
        else:
            x = inp.reshape(-1, inp.shape[-1])
            h, q1, ln_out, mu, rsigma, x = norm_then_gemm(plan, cfg, x, gamma, beta, w1_data,
                                                          w1_sinv, b1, scale_fwd, history_fwd,
                                                          need_wgrad1)
        # Only FC1's wgrad reads ln_out again (column-wise): its row-wise bytes go before the
        # activation allocates FC2's input. So do FC1's weight's row-wise bytes where they were
        # made for this forward alone (the backward reads its column-wise copy): they would
        # otherwise sit in the forward's peak, at FC2's GEMM.
        ln_col, ln_col_sinv = q1.columnwise, q1.columnwise_scale_inv
        del q1
        drop_weights = own_weights and not torch.compiler.is_compiling()
        if drop_weights:
            release(w1_data)
        # (the compiled operator takes an activation's code, not its parameters)
        if not ops.activation.has_params(act) and compiled_forward.usable(
                plan, h, (w2_data, w2_sinv), b2, history_fwd):
            # the activation writing FC2's FP8 input, then FC2, in one call
            out, q2 = compiled_forward.act_linear(plan, act, h, w2_data, w2_sinv, b2, scale_fwd,
                                                  history_fwd, need_wgrad2)
        else:
            q2 = act_to_fp8(plan, h, act, scale_fwd[2:3], need_wgrad2, history_fwd, 2)
            out = fp8_gemm(q2.data, q2.scale_inv, w2_data, w2_sinv, plan.fwd_dtype,
                           plan.fwd_dtype, plan.input_mode, plan.weight_mode, inp.dtype, b2,
                           False)
        if drop_weights:
            release(w2_data)
        # per-tensor: the column-wise copies share the row-wise scale_inv
        w1_col_sinv = w1_sinv if w1_col_sinv is None else w1_col_sinv
        w2_col_sinv = w2_sinv if w2_col_sinv is None else w2_col_sinv
        if late:  # the weights themselves, for their column-wise copies (late_weight_columns)
            w1_col, w2_col, w1_col_sinv, w2_col_sinv = w1, w2, None, None
        ctx.save_for_backward(x, mu, rsigma, gamma, ln_col, ln_col_sinv, w1_col, w1_col_sinv,
                              h, q2.columnwise, q2.columnwise_scale_inv, w2_col, w2_col_sinv)
        ctx.late, ctx.late_scales = late, late_scales
        ctx.bwd_meta = bwd_meta
        ctx.plan, ctx.recipe, ctx.group, ctx.cfg, ctx.act = plan, recipe, group, cfg, act
        ctx.need, ctx.own_weights, ctx.wgrad_stores = need, own_weights, stores
        ctx.has = (beta is not None, b1 is not None, b2 is not None)
        ctx.dtypes = (w1.dtype, None if b1 is None else b1.dtype, w2.dtype,
                      None if b2 is None else b2.dtype)
        ctx.input_shape = inp.shape
        # [M, N] and [M, K]: the module gives them inp's leading dimensions (with_leading_dims)
        if cfg is not None and cfg.return_ln_out:
            return out, ln_out
        return out

    @staticmethod
    def backward(ctx, grad_output, grad_ln_out=None):
        (x, mu, rsigma, gamma, ln_col, ln_col_sinv, w1_col, w1_col_sinv, h, a_col, a_col_sinv,
         w2_col, w2_col_sinv) = ctx.saved_tensors
        plan, cfg = ctx.plan, ctx.cfg
        need_dgrad, need_wgrad1, need_wgrad2, need_fc1 = ctx.need
        has_beta, has_b1, has_b2 = ctx.has
        w1_dtype, b1_dtype, w2_dtype, b2_dtype = ctx.dtypes
        history, scale, _ = ctx.bwd_meta
        w1 = None
        if ctx.late:  # the forward saved the weights: their column-wise copies are made here
            w1, w2 = w1_col, w2_col
            w2_col, w2_col_sinv = late_weight_columns(plan, w2, ctx.late_scales, 3) \
                if need_fc1 else (None, None)
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_w1 = grad_b1 = grad_w2 = grad_b2 = dx = dgamma = dbeta = None
        # The node keeps what it saved until it returns; what it made itself goes as soon as
        # it has been read for the last time (release.py), or the peak of this backward would
        # hold FC2's operands while FC1's gradient is made. The weights' FP8 copies go too
        # when they were made for this forward alone (not a cache's).
        # delay_wgrad_compute: the wgrad GEMMs go on these lists with their operands, which
        # must then stay (no early release, no memory-lean order, no compiled call)
        store1, store2 = ctx.wgrad_stores or (None, None)
        free = may_release() and store1 is None
        # FC2: its grad_output with its bias gradient in one pass (backward column 1), then
        # its GEMMs: one compiled call where compiled_grads.usable says so. (FC1's backward
        # stays in the steps below: they free FC1's output and its gradient as soon as the
        # activation's backward has read them, which one call could not: its peak would be
        # higher.) `recorded`: whether an amax went into the backward history (delayed only).
        delayed = plan.kind == "delayed"
        grad_act = dbias2 = q_g1 = dbias1 = None
        fc2 = (a_col, a_col_sinv, w2_col, w2_col_sinv)
        lean = free and need_fc1 and large_block(h.shape[0], h.shape[1], h.dtype)
        if lean:
            # The memory-lean order, for large activations (LEAN_BYTES): FC2's wgrad first, so
            # that FC2's saved input goes before its dgrad allocates the activation's
            # gradient; one compiled call could not free it in between.
            q_g2, dbias2 = grad_to_fp8(plan, g, g, "identity", scale, 1, True, need_wgrad2,
                                       has_b2, history)
            recorded = delayed
            _, grad_w2 = backward_gemms(plan, q_g2, w2_col, w2_col_sinv, a_col, a_col_sinv,
                                        h.dtype, w2_dtype, False, need_wgrad2)
            release(a_col, q_g2.columnwise)
            if chunkable(plan, history) and (need_dgrad or need_wgrad1):
                # FC2's dgrad and the activation's backward chunk by chunk (LEAN_CHUNKS)
                q_g1, dbias1 = chunked_fc1_grad(plan, q_g2, w2_col, w2_col_sinv, h, ctx.act,
                                                scale, history, has_b1, need_wgrad1)
            else:
                grad_act, _ = backward_gemms(plan, q_g2, w2_col, w2_col_sinv, a_col,
                                             a_col_sinv, h.dtype, w2_dtype, True, False)
            del q_g2
        elif (need_fc1 or need_wgrad2) and store2 is None and compiled_grads.usable(
                plan, ctx.recipe, history, g.shape[0], g, *fc2):
            grad_act, grad_w2, grad_b2 = compiled_grads.linear_grads(
                g, None, "identity", fc2, plan, ctx.bwd_meta, 1, False,
                (need_fc1, need_wgrad2, has_b2), (h.dtype, w2_dtype, b2_dtype))
            recorded = delayed
        else:
            q_g2, dbias2 = grad_to_fp8(plan, g, g, "identity", scale, 1, need_fc1, need_wgrad2,
                                       has_b2, history)
            recorded = delayed and q_g2 is not None
            if q_g2 is not None:
                grad_act, grad_w2 = backward_gemms(plan, q_g2, w2_col, w2_col_sinv, a_col,
                                                   a_col_sinv, h.dtype, w2_dtype, need_fc1,
                                                   need_wgrad2, store2)
                del q_g2
        if free:
            release(a_col, w2_col if ctx.own_weights else None)
        if need_fc1:
            if q_g1 is None and grad_act is not None:
                # FC1: d act + d bias + cast + transpose in one pass (backward column 0); it
                # frees grad_act and h once read
                q_g1, dbias1 = grad_to_fp8(plan, grad_act, h, ctx.act, scale, 0, need_dgrad,
                                           need_wgrad1, has_b1, history, free, lean)
                del grad_act
            recorded = recorded or (delayed and q_g1 is not None)
            if q_g1 is not None:
                if w1 is not None:  # (late: FC1's copy only now, with FC1's output gone)
                    w1_col, w1_col_sinv = late_weight_columns(plan, w1, ctx.late_scales, 1) \
                        if need_dgrad else (None, None)
                d_ln, grad_w1 = backward_gemms(plan, q_g1, w1_col, w1_col_sinv, ln_col,
                                               ln_col_sinv, x.dtype, w1_dtype, need_dgrad,
                                               need_wgrad1, store1)
                del q_g1, w1_col
            if has_b1:
                grad_b1 = dbias1.to(b1_dtype)
        if recorded:  # delayed scaling: one update of both columns, after both were recorded
            update_backward(ctx.bwd_meta, plan, ctx.recipe, ctx.group)
        if need_dgrad:
            if cfg is None:  # the input was the norm's output: its gradient is the input's
                dx = d_ln.view(ctx.input_shape)
            else:
                if grad_ln_out is not None:
                    d_ln = d_ln + grad_ln_out.reshape(d_ln.shape).to(d_ln.dtype)
                dx, dgamma, dbeta = norm_backward(cfg, d_ln, x, mu, rsigma, gamma, has_beta)
                dx = dx.view(ctx.input_shape)
        if dbias2 is not None:
            grad_b2 = dbias2.to(b2_dtype)
        return (dx, dgamma, dbeta, grad_w1, grad_b1, None, None, None, None, grad_w2, grad_b2) \
            + (None,) * 8
