"""The FP8 operands of the fused blocks, each made by the kernel that computes the tensor.

Under per-tensor delayed scaling the scale is known before the tensor exists, so the kernel
that computes it writes its FP8 data (row-wise and the transpose that the wgrad GEMM reads)
and its amax in the same pass: the norm writes the first GEMM's input, the activation the
second GEMM's input, the activation's backward the gradient of the first GEMM's output (with
the bias gradient). A first step (an empty amax history) first asks the same kernel, gated
on the history, for the tensor's amax (quantizer.step_scale); the casting kernel then raises
that amax with its own, which needs no zeroed buffer. Current scaling needs the
tensor's amax before its scale, so the kernel writes the high-precision tensor and its amax,
and a quantization follows; block scaling has no fused kernel and quantizes the
high-precision tensor by blocks.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from transformer_engine.common.plan import GEMM_GRANULE
from transformer_engine.jax import ops
from transformer_engine.jax.quantizer import (
    QuantizerSet,
    _plan_of,
    quantize_role,
    role_dtype,
    role_mode,
    step_scale,
)


def fp8_bias_epilogue(dtype) -> bool:
    # The core's rule: with FP8 operands the bias has D's dtype when D is 16-bit, bf16
    # otherwise; an fp32 output adds its fp32 bias after the GEMM instead (no bf16 rounding).
    return jnp.dtype(dtype) != jnp.float32


def _scale_invs(q: ops.QuantizedTensor, mode: ops.ScalingMode):
    """(row-wise, column-wise) scale inverses: one shared [1] in TENSOR mode."""
    if mode == ops.ScalingMode.TENSOR:
        return q.scale_inv, q.scale_inv
    return q.scale_inv, q.columnwise_scale_inv


class NormConfig(NamedTuple):
    """The static part of a norm (hashable: a custom_vjp's nondiff argument)."""

    kind: ops.NormType
    zero_centered_gamma: bool
    epsilon: float

    def kwargs(self) -> dict:
        return dict(norm_type=self.kind, epsilon=self.epsilon,
                    zero_centered_gamma=self.zero_centered_gamma)


def _current_scale(amax, qset: QuantizerSet, role: str):
    plan = _plan_of(qset.recipe)
    scale, _ = ops.scale_from_amax(amax, role_dtype(qset.recipe, role),
                                   force_pow2_scales=plan.force_pow2_scales,
                                   amax_epsilon=plan.amax_epsilon)
    return scale


def norm_quantized(x2, gamma, beta, cfg: NormConfig, qset: QuantizerSet, need_output: bool):
    """The norm of ``x2`` [M, K] as the FP8 input of a GEMM (role ``x`` of ``qset``).

    Returns ``(y, q, mu, rsigma)``; y (x2's dtype) is None unless ``need_output`` (or the
    recipe needs it to quantize).
    """
    if _plan_of(qset.recipe).kind == "delayed":
        dtype = role_dtype(qset.recipe, "x")

        def amax_of(gate):
            return ops.norm_forward_fp8(x2, gamma, beta, qset.state["x"]["scale"], dtype,
                                        columnwise=False, gate=gate, **cfg.kwargs())[1].amax

        scale, first = step_scale(qset, "x", amax_of)
        return ops.norm_forward_fp8(x2, gamma, beta, scale, dtype, write_output=need_output,
                                    columnwise=True, compute_amax=True, amax_into=first,
                                    **cfg.kwargs())
    y, mu, rsigma = ops.norm_forward(x2, gamma, beta, **cfg.kwargs())
    return y, quantize_role(y, qset, "x"), mu, rsigma


def activation_quantized(h, act: ops.Activation, qset: QuantizerSet) -> ops.QuantizedTensor:
    """act(h) as the FP8 input of a GEMM (role ``x`` of ``qset``)."""
    kind = _plan_of(qset.recipe).kind
    if kind == "delayed":
        dtype = role_dtype(qset.recipe, "x")

        def amax_of(gate):
            return ops.activation_forward_fp8(h, act, qset.state["x"]["scale"], dtype,
                                              columnwise=False, gate=gate).amax

        scale, first = step_scale(qset, "x", amax_of)
        return ops.activation_forward_fp8(h, act, scale, dtype, amax_into=first)
    if kind == "current":
        # the scale from an amax-only pass, then one FP8 pass (no high-precision act(h))
        amax = ops.activation_amax(h, act)
        q = ops.activation_forward_fp8(h, act, _current_scale(amax, qset, "x"),
                                       role_dtype(qset.recipe, "x"), compute_amax=False)
        return q._replace(amax=amax)
    return quantize_role(ops.activation_forward(h, act), qset, "x")


def grad_quantized(dy, act: ops.Activation, act_input: Optional[jax.Array], qset: QuantizerSet,
                   dbias_dtype) -> tuple[ops.QuantizedTensor, Optional[jax.Array]]:
    """The gradient of a GEMM's output, ``dact(act_input) * dy`` (IDENTITY: dy itself), as
    the FP8 ``grad`` of ``qset``, with its bias gradient (``dbias_dtype``; None: none)."""
    recipe = qset.recipe
    kind = _plan_of(recipe).kind
    identity = ops.kind_of(act) == ops.Activation.IDENTITY
    if kind == "delayed":
        dtype = role_dtype(recipe, "grad")

        def amax_of(gate):
            return ops.activation_backward_fp8(dy, act_input, act, qset.state["grad"]["scale"],
                                               dtype, columnwise=False, gate=gate)[0].amax

        scale, first = step_scale(qset, "grad", amax_of)
        return ops.activation_backward_fp8(dy, act_input, act, scale, dtype,
                                           dbias_dtype=dbias_dtype, amax_into=first)
    if kind == "current":
        # the scale from dy's amax (or an amax-only pass of the activation's backward), then
        # one pass: act' * dy + bias gradient + cast + transpose (no high-precision copy)
        amax = (ops.compute_amax(dy) if identity
                else ops.activation_backward_amax(dy, act_input, act))
        q, dbias = ops.activation_backward_fp8(dy, None if identity else act_input, act,
                                               _current_scale(amax, qset, "grad"),
                                               role_dtype(recipe, "grad"),
                                               dbias_dtype=dbias_dtype, compute_amax=False)
        return q._replace(amax=amax), dbias
    if identity:  # block scaling
        g, dbias = dy, None
        if dbias_dtype is not None:
            dbias = jnp.sum(dy, axis=0, dtype=jnp.float32).astype(dbias_dtype)
    else:
        g, dbias, _ = ops.activation_backward(dy, act_input, act, dbias_dtype=dbias_dtype)
    return quantize_role(g, qset, "grad"), dbias


def fp8_gemm(a, a_si, a_mode, b, b_si, b_mode, **kwargs):
    """``a [M, K] @ b [N, K]^T`` of FP8 operands (ops.gemm's other arguments in ``kwargs``)
    for any M and K: the core's GEMM takes only multiples of the tensor cores' granule of 16.

    The feature dimensions are the layers' to keep at multiples of 16 (they refuse others);
    the token count may be anything, and it is M (forward, dgrad) or K (wgrad). The padding is
    made here, on the quantized operands, so the amaxes and scales are those of the real rows
    alone (a LayerNorm or GELU of a zero row is not zero). Padded rows of ``a`` are FP8 zeros
    with a 1x128 block scale_inv of 1 (what quantizing a zero row gives), and their output
    rows are sliced off; K is padded with zeros in both operands, adding exact zeros to every
    sum. ``b``'s rows (N) are a feature dimension and stay as they are. Each padded operand is
    one copy; the tile (128x128) and per-tensor scale_invs keep their shapes, since the number
    of 128-blocks of a dimension does not change when it is rounded up to 16."""
    m, k = a.shape
    pad_m, pad_k = -m % GEMM_GRANULE, -k % GEMM_GRANULE
    if pad_k:
        b = jnp.pad(b, ((0, 0), (0, pad_k)))
    if pad_m or pad_k:
        a = jnp.pad(a, ((0, pad_m), (0, pad_k)))
    if pad_m and ops.ScalingMode(a_mode) == ops.ScalingMode.BLOCK_1X128:
        a_si = jnp.pad(a_si, ((0, pad_m), (0, 0)), constant_values=1.0)
    out = ops.gemm(a, b, a_scale_inv=a_si, b_scale_inv=b_si, a_scaling_mode=a_mode,
                   b_scaling_mode=b_mode, transpose_b=True, **kwargs)
    return out[:m] if pad_m else out


def forward_gemm(qx: ops.QuantizedTensor, qk: ops.QuantizedTensor, bias, recipe, out_dtype):
    """out = x @ kernel (+ bias) from their FP8 operands (x row-wise, kernel column-wise)."""
    mode_x, mode_k = role_mode(recipe, "x"), role_mode(recipe, "kernel")
    x_si, _ = _scale_invs(qx, mode_x)
    _, k_col_si = _scale_invs(qk, mode_k)
    epilogue = bias is not None and fp8_bias_epilogue(out_dtype)
    out = fp8_gemm(qx.data, x_si, mode_x, qk.columnwise_data, k_col_si, mode_k,
                   bias=bias if epilogue else None, out_dtype=out_dtype)
    if bias is not None and not epilogue:
        out = out + bias
    return out


class BackwardOperands(NamedTuple):
    """What the backward GEMMs of one FP8 GEMM keep from the forward."""

    x_col: jax.Array
    x_col_si: jax.Array
    k_row: jax.Array
    k_si: jax.Array


def backward_operands(qx: ops.QuantizedTensor, qk: ops.QuantizedTensor, recipe):
    _, x_col_si = _scale_invs(qx, role_mode(recipe, "x"))
    k_si, _ = _scale_invs(qk, role_mode(recipe, "kernel"))
    return BackwardOperands(qx.columnwise_data, x_col_si, qk.data, k_si)


def backward_gemms(qg: ops.QuantizedTensor, saved: BackwardOperands, recipe, out_dtype):
    """(dgrad, wgrad) of one FP8 GEMM from the quantized gradient of its output."""
    mode_x, mode_k, mode_g = (role_mode(recipe, r) for r in ("x", "kernel", "grad"))
    g_si, g_col_si = _scale_invs(qg, mode_g)
    dx = fp8_gemm(qg.data, g_si, mode_g, saved.k_row, saved.k_si, mode_k,
                  out_dtype=out_dtype, use_split_accumulator=True)
    dk = fp8_gemm(saved.x_col, saved.x_col_si, mode_x, qg.columnwise_data, g_col_si, mode_g,
                  out_dtype=out_dtype, use_split_accumulator=True)
    return dx, dk
