"""The autograd function of an FP8 linear layer: three FP8 GEMMs through the core.

    forward  output      = input @ weight^T        A = input (row-wise),  B = weight (row-wise)
    dgrad    grad_input  = grad_output @ weight    A = grad_output,       B = weight column-wise
    wgrad    grad_weight = grad_output^T @ input   A = grad_output col.,  B = input column-wise

Every GEMM is "TN" (both operands K-major), so the backward reads the column-wise copies that
quantization wrote in the same pass as the row-wise data; the input is saved for the backward
as its FP8 column-wise copy only. The weight arrives already quantized (the module caches it
per step or microbatch); the input and grad_output are quantized here.

FP8 between layers (attention's fp8_mha): an input that arrives as a per-tensor
:class:`Float8Tensor` in the forward format is used as it is (its column-wise copy is a byte
transpose), and the output can leave as one (:func:`fp8_output`). Gradients cross such a
boundary in high precision.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

from transformer_engine.common.plan import GEMM_GRANULE

from . import compiled_grads, fp8, ops
from .first_step import step_scales
from .float8_tensor import Float8Tensor
from .quantization import Operand, Plan, quantize, record_amax
from .release import release

# The block-scaled GEMM writes fp32 or bf16 only (gemm.h).
_BLOCK_OUT = (torch.float32, torch.bfloat16)


def pad_gemm_operands(a, a_sinv, a_mode: str, b, repeat_rows: bool = False):
    """The FP8 operands of ``a [M, K] @ b [N, K]^T`` with M and K raised to multiples of the
    tensor cores' granule of 16 (the core's GEMM takes no other shape): (a, a_sinv, b, M).

    The feature dimensions are the modules' to keep at multiples of 16 (they refuse others);
    the token count may be anything, and it is M (forward, dgrad) or K (wgrad). The padding is
    made here, on the quantized operands, so the amaxes and scales are those of the real rows
    alone (a LayerNorm or GELU of a zero row is not zero). Padded rows of ``a`` are FP8 zeros
    (byte 0 is +0) with a 1x128 block scale_inv of 1 (what quantizing a zero row gives), or
    with ``repeat_rows`` (per-tensor only) copies of its last row; the caller slices their
    output rows off. K is padded with zeros in both operands, adding exact zeros to every
    sum. ``b``'s rows (N) are a feature dimension and stay as they are. Each padded operand
    is one copy; the tile (128x128) and per-tensor scale_invs keep their shapes, since the
    number of 128-blocks of a dimension does not change when it is rounded up to 16."""
    m, k = a.shape
    pad_m, pad_k = -m % GEMM_GRANULE, -k % GEMM_GRANULE
    if pad_k:
        b = F.pad(b, (0, pad_k))
    if pad_m and repeat_rows:
        a = torch.cat([a, a[-1:].expand(pad_m, -1)])
        pad_m = 0
    if pad_m or pad_k:
        a = F.pad(a, (0, pad_k, 0, pad_m))
    if pad_m and a_mode == "block_1x128":
        a_sinv = F.pad(a_sinv, (0, 0, 0, pad_m), value=1.0)
    return a, a_sinv, b, m


def fp8_gemm(a, a_sinv, b, b_sinv, a_dtype: str, b_dtype: str, a_mode: str, b_mode: str,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor], split: bool) -> torch.Tensor:
    """``a @ b^T (+ bias)`` in out_dtype. With a bf16/fp16 output the bias rides in the GEMM's
    epilogue in that dtype; with an fp32 output the epilogue would take only a bf16 bias
    (cuBLASLt's rule for FP8 operands, gemm.h), so the bias is added afterwards in fp32.
    Any M and K: the operands are padded to the GEMM's granule (pad_gemm_operands)."""
    a, a_sinv, b, m = pad_gemm_operands(a, a_sinv, a_mode, b)
    out = _fp8_gemm(a, a_sinv, b, b_sinv, a_dtype, b_dtype, a_mode, b_mode, out_dtype, bias,
                    split)
    if out.shape[0] == m:
        return out
    # A copy, not a view: the autograd functions return this tensor, and autograd forbids
    # in-place ops on views that a custom function returns.
    return out[:m].clone()


def _fp8_gemm(a, a_sinv, b, b_sinv, a_dtype: str, b_dtype: str, a_mode: str, b_mode: str,
              out_dtype: torch.dtype, bias: Optional[torch.Tensor], split: bool) -> torch.Tensor:
    block = a_mode != "tensor"
    gemm_dtype = out_dtype if not block or out_dtype in _BLOCK_OUT else torch.float32
    fused = bias is not None and gemm_dtype in (torch.bfloat16, torch.float16)
    # Casts only where the dtype differs: even a no-op .to() costs ~1 us of host time.
    if fused and bias.dtype != gemm_dtype:
        bias = bias.to(gemm_dtype)
    out = ops.gemm_fp8(a, a_sinv, a_dtype, a_mode, b, b_sinv, b_dtype, b_mode, gemm_dtype,
                       bias if fused else None, split)
    if bias is not None and not fused:
        out = out + (bias if bias.dtype == out.dtype else bias.to(out.dtype))
    return out if out.dtype == out_dtype else out.to(out_dtype)


def fp8_output(plan: Plan, a: Operand, w_data, w_scale_inv, bias: Optional[torch.Tensor],
               out_meta: tuple, shape, dtype: torch.dtype) -> Float8Tensor:
    """The forward GEMM ``a @ w^T (+ bias)`` as a per-tensor Float8Tensor of ``shape`` in the
    forward format, presenting ``dtype``, for a consumer that takes FP8 (attention under
    fp8_mha). Delayed scaling: the GEMM's epilogue casts with ``out_meta = (scales, history)``
    column 0 and the amax of the result raises ``history[0, 0]`` (None: a checkpoint's
    recompute records nothing). Current scaling needs the result's amax before its cast, so
    the GEMM writes high precision and quantize_current reads it back."""
    fmt = plan.fwd_dtype
    if plan.kind == "delayed":
        scales, history = out_meta
        if bias is not None and bias.dtype != torch.bfloat16:
            bias = bias.to(torch.bfloat16)  # cuBLASLt takes only a bf16 bias with an FP8 D
        # A zero row's output would be the bias, which the epilogue's amax would count: the
        # padding repeats the last real row, whose output is a real one.
        a_data, _, w_data, m = pad_gemm_operands(a.data, a.scale_inv, "tensor", w_data, True)
        data, scale_inv, amax = ops.gemm_fp8_to_fp8(a_data, a.scale_inv, fmt, w_data,
                                                    w_scale_inv, fmt, fmt, scales, 0, bias,
                                                    False)
        data = data[:m]
        if history is not None:
            record_amax(history, 0, amax)
    else:
        y = fp8_gemm(a.data, a.scale_inv, w_data, w_scale_inv, fmt, fmt, "tensor", "tensor",
                     dtype, bias, False)
        data, _, _, scale_inv, _ = ops.quantize_current(y, fmt, True, False,
                                                        plan.force_pow2_scales,
                                                        plan.amax_epsilon)
    return Float8Tensor(data.view(shape), scale_inv, fmt, dtype)


def fp8_input_operand(inp: Float8Tensor, columnwise: bool) -> Operand:
    """The GEMM input operand of an input already in FP8 (per tensor): its bytes as [M, K] and,
    for wgrad, their transpose (a byte transpose keeps the per-tensor scale)."""
    data = inp._data.reshape(-1, inp.shape[-1])
    col = ops.transpose(data) if columnwise else data.new_empty(0)
    return Operand(data, inp._scale_inv, col, inp._scale_inv, inp._fp8_dtype, "tensor")


def takes_fp8_input(inp: torch.Tensor, plan: Plan) -> bool:
    """Whether an FP8 forward under ``plan`` can use ``inp``'s bytes as its input operand."""
    return (isinstance(inp, Float8Tensor) and inp._scaling_mode == "tensor"
            and plan.input_mode == "tensor" and inp._fp8_dtype == plan.fwd_dtype)


class LinearConsts(NamedTuple):
    """The non-tensor arguments of Fp8LinearFunction (one argument: each costs host time)."""

    plan: Plan
    recipe: Any  # the recipe when the backward update takes the general path, else None
    group: Any  # the amax reduction group, or None
    need_dgrad: bool
    need_wgrad: bool
    out_meta: Optional[tuple]  # None: a high-precision output; else what fp8_output needs
    wgrad_store: Optional[list] = None  # delay_wgrad_compute: where the wgrad GEMM goes


class Fp8LinearFunction(torch.autograd.Function):
    """``output = input @ weight^T + bias`` with FP8 operands (see the module docstring).

    Forward arguments: input [..., K]; weight [N, K] (only its dtype and autograd identity are
    used, its FP8 copy comes as w_data [N, K], w_scale_inv, w_col [K, N], w_col_scale_inv,
    None when it is w_scale_inv); bias [N] or None; the delayed-scaling buffers of the
    forward (history, None in a checkpoint's recompute, and scales) and, as one tuple, of the
    backward (history, scale, scale_inv); ``cfg``: the plan; for the backward scale update,
    the recipe when it holds user callables or amaxes are reduced over a group (else None)
    and the group; whether dgrad and wgrad are needed; None for a high-precision output, or
    what :func:`fp8_output` needs for an FP8 one. (Tuples, because every argument of apply
    costs host time, and these need no autograd edge.) ``inp`` may be a Float8Tensor that
    :func:`takes_fp8_input`.
    """

    @staticmethod
    def forward(ctx, inp, weight, bias, w_data, w_scale_inv, w_col, w_col_scale_inv,
                history_fwd, scale_fwd, bwd_meta: tuple, cfg: LinearConsts):
        plan, recipe, group, need_dgrad, need_wgrad, out_meta, _ = cfg
        if isinstance(inp, Float8Tensor):
            q_in = fp8_input_operand(inp, need_wgrad)
        else:
            x = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
            # history_fwd None: a checkpoint's recompute, which records no amax
            q_in = quantize(plan, "input", x, True, need_wgrad, scale_fwd, 0, history_fwd)
        out_shape = (*inp.shape[:-1], w_data.shape[0])
        if out_meta is not None:
            out = fp8_output(plan, q_in, w_data, w_scale_inv, bias, out_meta, out_shape,
                             inp.dtype)
        else:
            out = fp8_gemm(q_in.data, q_in.scale_inv, w_data, w_scale_inv, plan.fwd_dtype,
                           plan.fwd_dtype, plan.input_mode, plan.weight_mode, inp.dtype, bias,
                           False)
        # The FP8 column-wise input is all the backward keeps of the activation.
        if w_col_scale_inv is None:  # per-tensor: shared with the row-wise copy
            w_col_scale_inv = w_scale_inv
        ctx.save_for_backward(q_in.columnwise, q_in.columnwise_scale_inv, w_col,
                              w_col_scale_inv)
        # Attributes, not saved tensors: the backward updates them in place, and a second
        # forward's backward must not trip over the version counter of the first.
        ctx.bwd_meta = bwd_meta
        ctx.plan, ctx.recipe, ctx.group = plan, recipe, group
        ctx.wgrad_store = cfg.wgrad_store
        ctx.need = (need_dgrad, need_wgrad, bias is not None)
        ctx.dtypes = (inp.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.input_shape = inp.shape
        # A high-precision output leaves as the matrix [M, N]; the caller gives it the input's
        # leading dimensions with a view outside this function, which in-place ops may then
        # modify (autograd forbids them on views a custom function returns).
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grads = linear_backward(grad_output, ctx.saved_tensors, ctx.plan, ctx.bwd_meta,
                                ctx.recipe, ctx.group, ctx.need, ctx.dtypes, ctx.input_shape,
                                ctx.wgrad_store)
        return grads + (None,) * 8


def linear_backward(grad_output: torch.Tensor, saved, plan: Plan, bwd_meta: tuple, recipe: Any,
                    group: Any, need: tuple, dtypes: tuple, input_shape,
                    wgrad_store: Optional[list] = None) -> tuple:
    """(grad_input, grad_weight, grad_bias) of an FP8 linear layer, each None where not
    needed: the backward of Fp8LinearFunction and of the compiled forward (fast_linear.py).
    ``saved``: the forward's (column-wise input, its scale_inv, column-wise weight, its
    scale_inv); ``need``: (dgrad, wgrad, bias); ``dtypes``: of input, weight and bias;
    ``wgrad_store``: delay_wgrad_compute's list, which takes the wgrad GEMM (grad_weight is
    then None)."""
    in_col, in_col_sinv, w_col, w_col_sinv = saved
    need_dgrad, need_wgrad, has_bias = need
    in_dtype, w_dtype, b_dtype = dtypes
    g = grad_output if grad_output.dim() == 2 else \
        grad_output.reshape(-1, grad_output.shape[-1])
    g = g.contiguous()
    grad_input = grad_weight = grad_bias = None
    history, scale, _ = bwd_meta
    if (need_dgrad or need_wgrad) and wgrad_store is None and compiled_grads.usable(
            plan, recipe, history, g.shape[0], g, *saved):
        grad_input, grad_weight, grad_bias = compiled_grads.linear_grads(
            g, None, "identity", saved, plan, bwd_meta, 0, True, need, dtypes)
        if grad_input is not None and len(input_shape) != 2:
            grad_input = grad_input.view(input_shape)
        return grad_input, grad_weight, grad_bias
    q_g, dbias = grad_to_fp8(plan, g, g, "identity", scale, 0, need_dgrad, need_wgrad,
                             has_bias, history)
    if q_g is not None:
        if plan.kind == "delayed":
            update_backward(bwd_meta, plan, recipe, group)
        grad_input, grad_weight = backward_gemms(plan, q_g, w_col, w_col_sinv, in_col,
                                                 in_col_sinv, in_dtype, w_dtype, need_dgrad,
                                                 need_wgrad, wgrad_store)
        if grad_input is not None and len(input_shape) != 2:
            grad_input = grad_input.view(input_shape)
    if has_bias:
        grad_bias = dbias if b_dtype == torch.float32 else dbias.to(b_dtype)
    return grad_input, grad_weight, grad_bias


def grad_to_fp8(plan: Plan, dy: torch.Tensor, h: torch.Tensor, act: str,
                scales: torch.Tensor, column: int, rowwise: bool, columnwise: bool,
                with_dbias: bool, history: torch.Tensor, free: bool = False,
                transpose_after: bool = False):
    """``act'(h) * dy`` as a GEMM's FP8 ``grad_output`` with the fp32 column sums of the
    unquantized values (the bias gradient): (operand or None when no GEMM needs it, dbias or
    None). Delayed scaling uses ``scales[column]`` and raises ``history[0, column]``.

    ``act="identity"`` (h = dy) is a linear layer's grad_output: with a bias, "bias gradient +
    cast + transpose" is one pass over dy (the core's activation backward of identity)
    instead of a quantize and a column sum that read dy twice (current scaling takes dy's
    amax and scale first).

    ``free`` (an activation's): dy and h are the caller's own and read here for the last time,
    so they are freed once the activation's backward has read them (release.py), before the
    quantization of its result (block scaling) allocates the FP8 copies. With
    ``transpose_after`` too, the one pass of delayed and current scaling writes only the
    row-wise bytes and the column-wise ones are their transpose, made once dy and h are gone
    (a lower peak for one more launch)."""
    identity = act == "identity"
    if not (rowwise or columnwise):  # no GEMM needs it: only the bias gradient, if any
        if identity:
            return None, dy.sum(0, dtype=torch.float32) if with_dbias else None
        _, dbias = ops.activation_backward(dy, h, act, with_dbias)
        return None, dbias if with_dbias else None
    if plan.kind in ("delayed", "current") and not (identity and not with_dbias):
        # One pass: act' * dy (+ the bias gradient) + cast + transpose. Delayed scaling casts
        # with its stored scale and raises the history's slot; current scaling takes the
        # scale from the values' own amax first (an amax-only pass; for identity, dy's amax),
        # so no high-precision copy of the gradient is made. The bias gradient is the core's
        # column sum, as in the JAX layers, not torch's (whose order of the additions differs
        # in the last bits).
        if plan.kind == "delayed":
            scales = step_scales(scales, column, history, column, plan.bwd_dtype, plan.margin,
                                 lambda gate: ops.activation_backward_fp8(
                                     dy, h, act, scales[column:column + 1], plan.bwd_dtype,
                                     True, False, False, None, 0, gate)[3])
            scale, where = scales[column:column + 1], column
        else:
            pow2, eps = plan.force_pow2_scales, plan.amax_epsilon
            scale, _ = (ops.current_scale(dy, plan.bwd_dtype, pow2, eps) if identity else
                        ops.activation_backward_scale(dy, h, act, plan.bwd_dtype, pow2, eps))
            history, where = None, 0
        # transpose_after: the row-wise bytes first, dy and h freed, then the transpose, so
        # that the column-wise bytes never coexist with dy and h (the same bytes as one pass).
        split = transpose_after and rowwise and columnwise
        data, col, sinv, _, dbias = ops.activation_backward_fp8(
            dy, h, act, scale, plan.bwd_dtype, rowwise, columnwise and not split, with_dbias,
            history, where)
        if free:
            release(dy, h)
        if split:
            col = ops.transpose(data)
        op = Operand(data, sinv, col, sinv, plan.bwd_dtype, plan.grad_mode)
        return op, dbias if with_dbias else None
    if identity:
        dh, dbias = dy, dy.sum(0, dtype=torch.float32) if with_dbias else None
    else:
        dh, dbias = ops.activation_backward(dy, h, act, with_dbias)
        if free:
            release(dy, h)
    op = quantize(plan, "grad_output", dh, rowwise, columnwise, scales, column, history)
    return op, dbias if with_dbias else None


def backward_gemms(plan: Plan, q_g, w_col, w_col_sinv, in_col, in_col_sinv,
                   in_dtype: torch.dtype, w_dtype: torch.dtype, need_dgrad: bool,
                   need_wgrad: bool, wgrad_store: Optional[list] = None):
    """dgrad (from q_g's row-wise data) and wgrad (from its column-wise data) of one linear
    layer with the FP8 grad_output ``q_g``: (grad_input [M, K] or None, grad_weight [N, K] or
    None). With ``wgrad_store`` (delay_wgrad_compute) the wgrad GEMM goes on it, holding the
    column-wise operands only, and grad_weight is None."""
    if wgrad_store is not None and need_wgrad:
        col = Operand(None, None, q_g.columnwise, q_g.columnwise_scale_inv, q_g.fp8_dtype,
                      q_g.mode)
        wgrad_store.append(lambda: backward_gemms(plan, col, None, None, in_col, in_col_sinv,
                                                  in_dtype, w_dtype, False, True)[1])
        need_wgrad = False
    grad_input = grad_weight = None
    if need_dgrad:
        grad_input = fp8_gemm(q_g.data, q_g.scale_inv, w_col, w_col_sinv, plan.bwd_dtype,
                              plan.fwd_dtype, plan.grad_mode, plan.weight_mode, in_dtype, None,
                              True)
    if need_wgrad:
        grad_weight = fp8_gemm(q_g.columnwise, q_g.columnwise_scale_inv, in_col, in_col_sinv,
                               plan.bwd_dtype, plan.fwd_dtype, plan.grad_mode, plan.input_mode,
                               w_dtype, None, True)
    return grad_input, grad_weight


def update_backward(bwd_meta: tuple, plan: Plan, recipe: Any, group: Any) -> None:
    """Delayed scaling: the grad_output scales for the next step, right after this step's
    amaxes were recorded. The core call covers the one module (all its GEMMs); user callables
    or an amax group take the general path."""
    history, scale, scale_inv = bwd_meta
    if recipe is not None:
        fp8.update_backward_scales(bwd_meta, recipe, group)
        return
    fp8.scale_update([history], [scale], [scale_inv], plan.bwd_dtype, plan.algo, plan.margin)
