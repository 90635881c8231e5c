"""``layernorm_dense``: LayerNorm / RMSNorm followed by a dense layer, one ``jax.custom_vjp``.

With x viewed as [M, K] and the kernel as [K, N]::

    forward   y = norm(x);  out = y @ kernel (+ bias)
    backward  dy = d_out @ kernel^T (dgrad);  d_kernel = y^T @ d_out (wgrad);  dx = norm'(dy)

In FP8 under delayed scaling the norm kernel writes y directly as the GEMM's FP8 input (its
row-wise data for the forward GEMM, its transpose for wgrad, and its amax), so y never
exists in high precision; the gradient of the output is cast to FP8 (+ transpose) with the
bias gradient in one pass. Other recipes quantize y as :func:`~transformer_engine.jax.dense`
does. The FP8 state (roles ``x``, ``kernel``, ``grad``) comes back as its cotangent.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from transformer_engine.common.plan import GEMM_GRANULE
from transformer_engine.jax import _fused, ops
from transformer_engine.jax.layernorm import norm_inputs
from transformer_engine.jax.quantizer import (
    QuantizerSet,
    make_quantizer_set,
    plan_kind,
    quantize_role,
    updated_state,
)
from transformer_engine.jax.sharding import token_rows

__all__ = ["layernorm_dense", "layernorm_dense_fp8_operands"]

_COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def check_quantizer_set(op: str, qset) -> QuantizerSet:
    if qset is None:
        qset = make_quantizer_set()
    if not isinstance(qset, QuantizerSet):
        raise TypeError(f"{op}: quantizer_set must be a QuantizerSet or None, got "
                        f"{type(qset).__name__}")
    return qset


def check_fp8_dims(op: str, recipe, **dims: int) -> None:
    """The feature dimensions of FP8 GEMMs must be multiples of the granule; the token count
    (M) may be anything, the GEMM's operands are padded inside (_fused.fp8_gemm)."""
    bad = {k: v for k, v in dims.items() if v % GEMM_GRANULE}
    if recipe is not None and bad:
        named = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise ValueError(f"{op}: FP8 GEMMs need every feature dimension to be a multiple of "
                         f"{GEMM_GRANULE}, got {named}; pad the features or run this layer "
                         "outside fp8_autocast")


def compute_dtype(op: str, *arrays):
    dtype = jnp.result_type(*arrays)
    if dtype not in _COMPUTE_DTYPES:
        raise TypeError(f"{op}: x and the kernels must be float32, float16 or bfloat16, got "
                        + ", ".join(str(a.dtype) for a in arrays))
    return dtype


def _prepare(x, gamma, beta, kernel, bias, norm_type, zero_centered_gamma, epsilon,
             quantizer_set, input_axes=None):
    op = "layernorm_dense"
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if x.ndim < 1 or kernel.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 1 and kernel rank >= 2 ([K, *features]), "
                         f"got shapes {x.shape} and {kernel.shape}")
    if kernel.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: kernel's first dim must be x's last ({x.shape[-1]}), got "
                         f"kernel shape {kernel.shape} for x shape {x.shape}")
    dtype = compute_dtype(op, x, kernel)
    x, g, b, kind, epsilon = norm_inputs(op, x.astype(dtype), gamma, beta, norm_type, epsilon)
    qset = check_quantizer_set(op, quantizer_set)
    features = kernel.shape[1:]
    k, n = x.shape[-1], math.prod(features)
    check_fp8_dims(op, qset.recipe, K=k, N=n)
    b2 = None
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape not in (features, (n,)):
            raise ValueError(f"{op}: bias must have shape {features} (the kernel's feature "
                             f"dims), got {bias.shape}")
        b2 = bias.astype(dtype).reshape(n)
    cfg = _fused.NormConfig(kind, bool(zero_centered_gamma), epsilon)
    rows, back = token_rows(x, x.ndim - 1, tuple(input_axes)[:-1] if input_axes else None)
    args = (rows, g, b, kernel.astype(dtype).reshape(k, n), b2)
    return args, cfg, qset, (*x.shape[:-1], *features), back


def layernorm_dense(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array],
                    kernel: jax.Array, bias: Optional[jax.Array] = None, *,
                    norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                    epsilon: float = 1e-6, quantizer_set: Optional[QuantizerSet] = None,
                    return_layernorm_output: bool = False,
                    layernorm_input_axes: Optional[Sequence[Optional[str]]] = None,
                    dot_input_axes: Optional[Sequence[Optional[str]]] = None):
    """``norm(x) @ kernel (+ bias)``, the norm over x's last axis (size K).

    Args:
        x: float32, float16 or bfloat16, shape [..., K].
        gamma, beta: the norm's scale and shift, [K] (beta None for RMSNorm); see
            :func:`~transformer_engine.jax.layernorm` for their dtypes and
            ``zero_centered_gamma``.
        kernel: [K, *features] (flax's [in, out] layout).
        bias: None or an array of shape ``features``.
        norm_type: ``"layernorm"`` or ``"rmsnorm"``.
        epsilon: added to the variance (or mean square).
        quantizer_set: as for :func:`~transformer_engine.jax.dense` (default: the enclosing
            autocast's recipe; delayed scaling needs one with its state).
        return_layernorm_output: also return norm(x) in the compute dtype (in FP8 the norm
            kernel then writes it beside the FP8 operand, from the same fp32 values).
        layernorm_input_axes, dot_input_axes: x's logical axis names (either; NVIDIA's
            keywords), as ``input_axes`` of :func:`~transformer_engine.jax.dense`.

    Returns:
        ``out`` of shape [..., *features] in the promoted dtype of x and kernel, or
        ``(out, norm(x))``. In FP8, K and N must be multiples of 16; the token count M (the
        product of x's leading dims) may be anything.

    Example:
        >>> import jax.numpy as jnp, transformer_engine.jax as te
        >>> out = te.layernorm_dense(jnp.ones((2, 4)), jnp.ones(4), jnp.zeros(4), jnp.ones((4, 3)))
        >>> out.shape
        (2, 3)
    """
    args, cfg, qset, out_shape, back = _prepare(x, gamma, beta, kernel, bias, norm_type,
                                                zero_centered_gamma, epsilon, quantizer_set,
                                                layernorm_input_axes or dot_input_axes)
    out, ln = _layernorm_dense(*args, cfg, qset.recipe, bool(return_layernorm_output),
                               dict(qset.state))
    out = back(out).reshape(out_shape)
    if return_layernorm_output:
        return out, back(ln).reshape(jnp.shape(x))
    return out


def layernorm_dense_fp8_operands(x, gamma, beta, kernel, bias=None, *,
                                 norm_type: str = "layernorm", zero_centered_gamma: bool = False,
                                 epsilon: float = 1e-6,
                                 quantizer_set: Optional[QuantizerSet] = None) -> dict:
    """The FP8 operands that :func:`layernorm_dense`'s forward GEMM reads, for comparing
    with another implementation: ``{"ln_out": QuantizedTensor [M, K] (and its transpose),
    "kernel": QuantizedTensor [K, N] (and its transpose [N, K])}``. Needs an FP8 recipe."""
    args, cfg, qset, _, _ = _prepare(x, gamma, beta, kernel, bias, norm_type,
                                     zero_centered_gamma, epsilon, quantizer_set)
    if qset.recipe is None:
        raise ValueError("layernorm_dense_fp8_operands: needs an FP8 recipe (a quantizer_set "
                         "with one, or an enabled fp8_autocast), got none")
    return _fp8_forward(*args, cfg, qset.recipe, False, dict(qset.state))[2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _layernorm_dense(x2, gamma, beta, k2, b2, cfg, recipe, return_ln, state):
    return _fwd(x2, gamma, beta, k2, b2, cfg, recipe, return_ln, state)[0]


def _fp8_forward(x2, gamma, beta, k2, b2, cfg, recipe, return_ln, state):
    qset = QuantizerSet(recipe, state)
    y, qx, mu, rsigma = _fused.norm_quantized(x2, gamma, beta, cfg, qset, return_ln)
    qk = quantize_role(k2, qset, "kernel")
    out = _fused.forward_gemm(qx, qk, b2, recipe, x2.dtype)
    return out, (y, mu, rsigma), {"ln_out": qx, "kernel": qk}


def _fwd(x2, gamma, beta, k2, b2, cfg, recipe, return_ln, state):
    if recipe is None:
        y, mu, rsigma = ops.norm_forward(x2, gamma, beta, **cfg.kwargs())
        out = ops.gemm(y, k2, bias=b2)
        return (out, y if return_ln else None), (x2, gamma, mu, rsigma, y, k2, b2)
    out, (y, mu, rsigma), q = _fp8_forward(x2, gamma, beta, k2, b2, cfg, recipe, return_ln,
                                           state)
    saved = _fused.backward_operands(q["ln_out"], q["kernel"], recipe)
    amaxes = {"x": q["ln_out"].amax, "kernel": q["kernel"].amax}
    return (out, y if return_ln else None), (x2, gamma, mu, rsigma, saved, amaxes, state, b2)


def _bwd(cfg, recipe, return_ln, residuals, cotangents):
    d_out, d_ln = cotangents
    if recipe is None:
        x2, gamma, mu, rsigma, y, k2, b2 = residuals
        dy = ops.gemm(d_out, k2, transpose_b=True)
        dk = ops.gemm(y, d_out, transpose_a=True)
        db = None if b2 is None else jnp.sum(d_out, axis=0, dtype=jnp.float32).astype(b2.dtype)
        new_state = {}
    else:
        x2, gamma, mu, rsigma, saved, amaxes, state, b2 = residuals
        qset = QuantizerSet(recipe, state)
        qg, db = _fused.grad_quantized(d_out, ops.Activation.IDENTITY, None, qset,
                                       None if b2 is None else b2.dtype)
        dy, dk = _fused.backward_gemms(qg, saved, recipe, d_out.dtype)
        new_state = {}
        if plan_kind(recipe) == "delayed":
            new_state = updated_state(recipe, state, {**amaxes, "grad": qg.amax})
    if return_ln:
        dy = dy + d_ln.astype(dy.dtype)
    dx, dgamma, dbeta = ops.norm_backward(dy.astype(x2.dtype), x2, mu, rsigma, gamma,
                                          **cfg.kwargs())
    return dx, dgamma, dbeta, dk, db, new_state


_layernorm_dense.defvjp(_fwd, _bwd)
