"""``layernorm_mlp``: norm, first dense layer, activation, second dense layer, one
``jax.custom_vjp``.

With x viewed as [M, K], kernel_1 as [K, A * F] (A = 1, or 2 for the gated forms, whose
columns [0, F) are activated and [F, 2F) are the linear half) and kernel_2 as [F, N]::

    forward   y = norm(x);  h = y @ kernel_1 + bias_1;  a = act(h);  out = a @ kernel_2 + bias_2
    backward  da = d_out @ kernel_2^T;  d_kernel_2 = a^T @ d_out
              dh = act'(h) * da (with d_bias_1 = column sums of dh)
              dy = dh @ kernel_1^T;  d_kernel_1 = y^T @ dh;  dx = norm'(dy)

In FP8 under delayed scaling each kernel writes the next FP8 operand itself (see
``_fused``): the norm writes y, the activation writes a (row-wise and the transpose for the
second wgrad), the activation's backward writes dh with its bias gradient. Only h stays in
high precision (the activation's backward reads it). Each GEMM has its own quantizer set
(roles ``x``, ``kernel``, ``grad``); both FP8 states come back as their cotangents.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from transformer_engine.common.activation_params import check_no_params, clamped_swiglu_params
from transformer_engine.jax import _fused, ops
from transformer_engine.jax.layernorm import norm_inputs
from transformer_engine.jax.layernorm_dense import (
    check_fp8_dims,
    check_quantizer_set,
    compute_dtype,
)
from transformer_engine.jax.quantizer import QuantizerSet, plan_kind, quantize_role, updated_state
from transformer_engine.jax.sharding import token_rows

__all__ = ["layernorm_mlp", "layernorm_mlp_fp8_operands", "activation", "activation_of"]

_A = ops.Activation
# flax-style names of the activations; a gated form is (its activation, "linear").
_ACTIVATIONS = {
    ("linear",): _A.IDENTITY, ("gelu",): _A.GELU, ("relu",): _A.RELU, ("silu",): _A.SILU,
    ("swish",): _A.SILU, ("quick_gelu",): _A.QGELU, ("squared_relu",): _A.SRELU,
    ("gelu", "linear"): _A.GEGLU, ("silu", "linear"): _A.SWIGLU, ("swish", "linear"): _A.SWIGLU,
    ("relu", "linear"): _A.REGLU, ("quick_gelu", "linear"): _A.QGEGLU,
    ("squared_relu", "linear"): _A.SREGLU, ("sigmoid", "linear"): _A.GLU,
}


# NVIDIA's name of clamped SwiGLU, the one activation with parameters
# (transformer_engine.common.activation_params).
CLAMPED_SWIGLU = ("clamped_silu", "clamped_linear")


def activation_of(activations: Sequence[str], activation_params: Optional[dict] = None):
    """The core's activation of a flax-style ``activations`` tuple (``("gelu",)``,
    ``("silu", "linear")`` for SwiGLU, ...): an :class:`ops.Activation`, or for
    ``("clamped_silu", "clamped_linear")`` an :class:`ops.ClampedSwiGLU` with
    ``activation_params`` (``limit``, ``alpha``, ``glu_linear_offset``; defaults 7.0, 1.702,
    1.0), which only it takes."""
    key = tuple(a.lower() if isinstance(a, str) else a for a in activations)
    if key != CLAMPED_SWIGLU and key not in _ACTIVATIONS:
        raise ValueError("layernorm_mlp: activations must be one of "
                         f"{sorted([*_ACTIVATIONS, CLAMPED_SWIGLU])}, got "
                         f"{tuple(activations)!r}")
    try:
        if key == CLAMPED_SWIGLU:
            return ops.ClampedSwiGLU(*clamped_swiglu_params(activation_params))
        check_no_params(tuple(activations), activation_params)
    except (TypeError, ValueError) as e:
        raise type(e)(f"layernorm_mlp: {e}") from None
    return _ACTIVATIONS[key]


def _prepare(x, gamma, beta, kernels, biases, norm_type, zero_centered_gamma, epsilon,
             activations, quantizer_sets, activation_params=None, input_axes=None):
    op = "layernorm_mlp"
    act = activation_of(activations, activation_params)
    n_act = 2 if ops.is_gated(act) else 1
    try:
        k1, k2 = (jnp.asarray(k) for k in kernels)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: kernels must be a pair (kernel_1, kernel_2), got "
                        f"{type(kernels).__name__}") from None
    biases = (None, None) if biases is None else tuple(biases)
    if len(biases) != 2:
        raise TypeError(f"{op}: biases must be None or a pair (bias_1, bias_2), got "
                        f"{len(biases)} entries")
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have rank >= 1, got shape {x.shape}")
    k = x.shape[-1]
    if k1.ndim not in (2, 3) or k1.shape[0] != k or (k1.ndim == 3 and k1.shape[1] != n_act):
        raise ValueError(f"{op}: kernel_1 must have shape [{k}, {n_act} * F] or [{k}, {n_act}, "
                         f"F] (K = x's last dim, {n_act} for activations {tuple(activations)}), "
                         f"got {k1.shape}")
    f_total = math.prod(k1.shape[1:])
    if f_total % n_act:
        raise ValueError(f"{op}: kernel_1's width must be {n_act} * F for a gated activation, "
                         f"got shape {k1.shape}")
    f = f_total // n_act
    if k2.ndim != 2 or k2.shape[0] != f:
        raise ValueError(f"{op}: kernel_2 must have shape [{f}, N] (F = {f} from kernel_1 "
                         f"{k1.shape}), got {k2.shape}")
    n = k2.shape[1]
    dtype = compute_dtype(op, x, k1, k2)
    x, g, b, kind, epsilon = norm_inputs(op, x.astype(dtype), gamma, beta, norm_type, epsilon)
    if quantizer_sets is None:
        quantizer_sets = (None, None)
    if not isinstance(quantizer_sets, (tuple, list)) or len(quantizer_sets) != 2:
        raise TypeError(f"{op}: quantizer_sets must be None or a pair of QuantizerSets (one "
                        f"per GEMM), got {quantizer_sets!r}")
    q1, q2 = (check_quantizer_set(op, q) for q in quantizer_sets)
    if q1.recipe != q2.recipe:
        raise ValueError(f"{op}: both quantizer sets must have the same recipe, got "
                         f"{q1.recipe!r} and {q2.recipe!r}")
    check_fp8_dims(op, q1.recipe, K=k, F=f, N=n)
    out_biases = []
    for i, (bias, width) in enumerate(zip(biases, (f_total, n), strict=True)):
        if bias is None:
            out_biases.append(None)
            continue
        bias = jnp.asarray(bias)
        if bias.size != width or bias.shape not in ((width,), (n_act, f) if i == 0 else (n,)):
            raise ValueError(f"{op}: bias_{i + 1} must have shape ({width},)"
                             + (f" or ({n_act}, {f})" if i == 0 else "") + f", got {bias.shape}")
        out_biases.append(bias.astype(dtype).reshape(width))
    cfg = _fused.NormConfig(kind, bool(zero_centered_gamma), epsilon)
    rows, back = token_rows(x, x.ndim - 1, tuple(input_axes)[:-1] if input_axes else None)
    args = (rows, g, b, k1.astype(dtype).reshape(k, f_total), out_biases[0],
            k2.astype(dtype), out_biases[1])
    return args, cfg, act, (q1, q2), (*x.shape[:-1], n), back


def layernorm_mlp(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array],
                  kernels: Sequence[jax.Array], biases: Optional[Sequence] = None, *,
                  norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                  epsilon: float = 1e-6, activations: Sequence[str] = ("gelu",),
                  quantizer_sets: Optional[Sequence[QuantizerSet]] = None,
                  return_layernorm_output: bool = False,
                  activation_params: Optional[dict] = None,
                  norm_input_axes: Optional[Sequence[Optional[str]]] = None,
                  dot_1_input_axes: Optional[Sequence[Optional[str]]] = None,
                  dot_2_input_axes: Optional[Sequence[Optional[str]]] = None):
    """The MLP block ``act(norm(x) @ kernel_1 + bias_1) @ kernel_2 + bias_2``.

    Args:
        x: float32, float16 or bfloat16, shape [..., K].
        gamma, beta: the norm's parameters [K] (beta None for RMSNorm).
        kernels: ``(kernel_1, kernel_2)``: [K, A, F] or [K, A * F], and [F, N]; A = 2 for
            the gated forms (index 0 activated, index 1 the linear half), else 1.
        biases: None or ``(bias_1, bias_2)``, each None or [A * F] (or [A, F]) and [N].
        norm_type, zero_centered_gamma, epsilon: as for
            :func:`~transformer_engine.jax.layernorm`.
        activations: ``("gelu",)``, ``("relu",)``, ``("silu",)``, ``("quick_gelu",)``,
            ``("squared_relu",)``, ``("linear",)``, or gated ``("gelu", "linear")`` (GeGLU),
            ``("silu", "linear")`` (SwiGLU), ``("relu", "linear")`` (ReGLU),
            ``("quick_gelu", "linear")``, ``("squared_relu", "linear")``,
            ``("sigmoid", "linear")`` (GLU), ``("clamped_silu", "clamped_linear")`` (clamped
            SwiGLU, GPT-OSS's). GELU is the tanh approximation (``jax.nn.gelu``'s default).
        activation_params: clamped SwiGLU's ``{"limit": 7.0, "alpha": 1.702,
            "glu_linear_offset": 1.0}`` (the defaults; any subset); None for the others.
        quantizer_sets: None or a pair of quantizer sets (one per GEMM, the same recipe);
            None: from the enclosing autocast.
        return_layernorm_output: also return norm(x) in the compute dtype.
        norm_input_axes, dot_1_input_axes: x's logical axis names (either; NVIDIA's
            keywords), as ``input_axes`` of :func:`~transformer_engine.jax.dense`;
            ``dot_2_input_axes`` (the activation's) is accepted and follows x's tokens.

    Returns:
        ``out`` [..., N] in the promoted dtype of x and the kernels, or ``(out, norm(x))``.
        In FP8, K, F and N must be multiples of 16; the token count M (the product of x's
        leading dims) may be anything.

    Example:
        >>> import jax.numpy as jnp, transformer_engine.jax as te
        >>> out = te.layernorm_mlp(jnp.ones((2, 4)), jnp.ones(4), jnp.zeros(4),
        ...                        (jnp.ones((4, 8)), jnp.ones((8, 4))))
        >>> out.shape
        (2, 4)
    """
    del dot_2_input_axes  # the hidden activation's rows are x's
    args, cfg, act, qsets, out_shape, back = _prepare(
        x, gamma, beta, kernels, biases, norm_type, zero_centered_gamma, epsilon, activations,
        quantizer_sets, activation_params, norm_input_axes or dot_1_input_axes)
    out, ln = _layernorm_mlp(*args, cfg, act, qsets[0].recipe, bool(return_layernorm_output),
                             dict(qsets[0].state), dict(qsets[1].state))
    out = back(out).reshape(out_shape)
    if return_layernorm_output:
        return out, back(ln).reshape(jnp.shape(x))
    return out


def layernorm_mlp_fp8_operands(x, gamma, beta, kernels, biases=None, *,
                               norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                               epsilon: float = 1e-6, activations: Sequence[str] = ("gelu",),
                               quantizer_sets: Optional[Sequence[QuantizerSet]] = None,
                               activation_params: Optional[dict] = None) -> dict:
    """The forward's FP8 GEMM operands and the first GEMM's output, for comparing with
    another implementation: ``{"ln_out", "kernel_1", "act_out", "kernel_2"}`` as
    :class:`~transformer_engine.jax.ops.QuantizedTensor` (row-wise and transposed data) and
    ``"fc1_out"`` (h, high precision). Needs an FP8 recipe."""
    args, cfg, act, qsets, _, _ = _prepare(x, gamma, beta, kernels, biases, norm_type,
                                           zero_centered_gamma, epsilon, activations,
                                           quantizer_sets, activation_params)
    if qsets[0].recipe is None:
        raise ValueError("layernorm_mlp_fp8_operands: needs an FP8 recipe (quantizer_sets "
                         "with one, or an enabled fp8_autocast), got none")
    return _fp8_forward(*args, cfg, act, qsets[0].recipe, False, dict(qsets[0].state),
                        dict(qsets[1].state))[2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _layernorm_mlp(x2, gamma, beta, k1, b1, k2, b2, cfg, act, recipe, return_ln, state1,
                   state2):
    return _fwd(x2, gamma, beta, k1, b1, k2, b2, cfg, act, recipe, return_ln, state1,
                state2)[0]


def _fp8_forward(x2, gamma, beta, k1, b1, k2, b2, cfg, act, recipe, return_ln, state1, state2):
    qset1, qset2 = QuantizerSet(recipe, state1), QuantizerSet(recipe, state2)
    y, qx1, mu, rsigma = _fused.norm_quantized(x2, gamma, beta, cfg, qset1, return_ln)
    qk1 = quantize_role(k1, qset1, "kernel")
    h = _fused.forward_gemm(qx1, qk1, b1, recipe, x2.dtype)
    qx2 = _fused.activation_quantized(h, act, qset2)
    qk2 = quantize_role(k2, qset2, "kernel")
    out = _fused.forward_gemm(qx2, qk2, b2, recipe, x2.dtype)
    operands = {"ln_out": qx1, "kernel_1": qk1, "fc1_out": h, "act_out": qx2, "kernel_2": qk2}
    return out, (y, mu, rsigma), operands


def _fwd(x2, gamma, beta, k1, b1, k2, b2, cfg, act, recipe, return_ln, state1, state2):
    if recipe is None:
        y, mu, rsigma = ops.norm_forward(x2, gamma, beta, **cfg.kwargs())
        h = ops.gemm(y, k1, bias=b1)
        a = ops.activation_forward(h, act)
        out = ops.gemm(a, k2, bias=b2)
        residuals = (x2, gamma, mu, rsigma, y, k1, h, a, k2, b1, b2)
        return (out, y if return_ln else None), residuals
    out, (y, mu, rsigma), q = _fp8_forward(x2, gamma, beta, k1, b1, k2, b2, cfg, act, recipe,
                                           return_ln, state1, state2)
    saved1 = _fused.backward_operands(q["ln_out"], q["kernel_1"], recipe)
    saved2 = _fused.backward_operands(q["act_out"], q["kernel_2"], recipe)
    amaxes = ({"x": q["ln_out"].amax, "kernel": q["kernel_1"].amax},
              {"x": q["act_out"].amax, "kernel": q["kernel_2"].amax})
    residuals = (x2, gamma, mu, rsigma, q["fc1_out"], saved1, saved2, amaxes, state1, state2,
                 b1, b2)
    return (out, y if return_ln else None), residuals


def _bias_grad(d, b):
    return None if b is None else jnp.sum(d, axis=0, dtype=jnp.float32).astype(b.dtype)


def _bwd(cfg, act, recipe, return_ln, residuals, cotangents):
    d_out, d_ln = cotangents
    if recipe is None:
        x2, gamma, mu, rsigma, y, k1, h, a, k2, b1, b2 = residuals
        da = ops.gemm(d_out, k2, transpose_b=True)
        dk2 = ops.gemm(a, d_out, transpose_a=True)
        # (the bias gradient as FC2's, by XLA's reduction: without column sums to make, the
        # core's non-gated activation backward runs its flat kernel, activation_flat.cuh; the
        # GELU backward moved 3.81 TB/s that way on an H200, benchmarks/results/
        # activation_bf16.json, where the tiled kernel had moved 2.19 on an H100)
        dh, _, _ = ops.activation_backward(da, h, act)
        db1 = _bias_grad(dh, b1)
        dy = ops.gemm(dh, k1, transpose_b=True)
        dk1 = ops.gemm(y, dh, transpose_a=True)
        new1, new2, db2 = {}, {}, _bias_grad(d_out, b2)
    else:
        x2, gamma, mu, rsigma, h, saved1, saved2, amaxes, state1, state2, b1, b2 = residuals
        qset1, qset2 = QuantizerSet(recipe, state1), QuantizerSet(recipe, state2)
        qg2, db2 = _fused.grad_quantized(d_out, ops.Activation.IDENTITY, None, qset2,
                                         None if b2 is None else b2.dtype)
        da, dk2 = _fused.backward_gemms(qg2, saved2, recipe, d_out.dtype)
        qg1, db1 = _fused.grad_quantized(da, act, h, qset1, None if b1 is None else b1.dtype)
        dy, dk1 = _fused.backward_gemms(qg1, saved1, recipe, d_out.dtype)
        new1, new2 = {}, {}
        if plan_kind(recipe) == "delayed":
            new1 = updated_state(recipe, state1, {**amaxes[0], "grad": qg1.amax})
            new2 = updated_state(recipe, state2, {**amaxes[1], "grad": qg2.amax})
    if return_ln:
        dy = dy + d_ln.astype(dy.dtype)
    dx, dgamma, dbeta = ops.norm_backward(dy.astype(x2.dtype), x2, mu, rsigma, gamma,
                                          **cfg.kwargs())
    return dx, dgamma, dbeta, dk1, db1, dk2, db2, new1, new2


_layernorm_mlp.defvjp(_fwd, _bwd)


def activation(x: jax.Array, activations: Sequence[str] = ("gelu",),
               activation_params: Optional[dict] = None) -> jax.Array:
    """act(x) over the last axis with the core's kernels (gated: x = [a, b], act(a) * b),
    differentiable; the unfused middle of :func:`layernorm_mlp` (e.g. around a dropout)."""
    act = activation_of(activations, activation_params)
    x = jnp.asarray(x)
    if x.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        raise TypeError(f"activation: x must be float32, float16 or bfloat16, got {x.dtype}")
    return _activation(x, act)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _activation(x, act):
    return ops.activation_forward(x, act)


def _activation_fwd(x, act):
    return ops.activation_forward(x, act), x


def _activation_bwd(act, x, dy):
    return (ops.activation_backward(dy.astype(x.dtype), x, act)[0],)


_activation.defvjp(_activation_fwd, _activation_bwd)
