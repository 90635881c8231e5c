"""``layernorm``: LayerNorm and RMSNorm over the last axis as a ``jax.custom_vjp`` over the
core's norm kernels (one custom call forward, one backward).

The forward saves the fp32 row statistics (mu and rsigma, [M] each, M the product of the
leading dims) for the backward pass, which computes dx, dgamma and dbeta in one call. Every
statistic and output is computed in fp32 from the decoded inputs; y and dx are rounded once
to x's dtype.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from transformer_engine.jax import ops

__all__ = ["layernorm"]

_COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_NORM_TYPES = {"layernorm": ops.NormType.LAYERNORM, "rmsnorm": ops.NormType.RMSNORM}


def layernorm(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array] = None, *,
              norm_type: str = "layernorm", zero_centered_gamma: bool = False,
              epsilon: float = 1e-6) -> jax.Array:
    """Normalizes ``x`` over its last axis (size N).

    * ``"layernorm"``: ``(x - mean) / sqrt(var + epsilon) * g + beta``
    * ``"rmsnorm"``: ``x / sqrt(mean(x^2) + epsilon) * g`` (no ``beta``)

    with ``g = gamma``, or ``1 + gamma`` when ``zero_centered_gamma`` (gamma then stores
    g - 1, which keeps precision near 1 in low-precision parameters).

    Args:
        x: float32, float16 or bfloat16, rank >= 1.
        gamma: the scale, shape [N].
        beta: the shift, shape [N]; required for LayerNorm, must be None for RMSNorm.
        norm_type: ``"layernorm"`` or ``"rmsnorm"``.
        zero_centered_gamma: see above.
        epsilon: added to the variance (or mean square); >= 0.

    Returns:
        An array of x's shape and dtype. gamma and beta may be float32 or x's dtype; other
        dtypes are computed in float32 and their gradients cast back.

    Example:
        >>> import jax.numpy as jnp, transformer_engine.jax as te
        >>> te.layernorm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2)).round(3).tolist()
        [[-1.0, 1.0]]
    """
    x, g, b, kind, epsilon = norm_inputs("layernorm", x, gamma, beta, norm_type, epsilon)
    return _norm(x, g, b, kind, bool(zero_centered_gamma), epsilon)


def norm_inputs(op: str, x, gamma, beta, norm_type: str, epsilon: float):
    """Checks the norm's arguments (errors name ``op``) and returns ``(x, gamma, beta, kind,
    epsilon)``: gamma and beta in the one dtype the core takes (x's, or float32 when they
    differ from it), beta a zero-size array for RMSNorm."""
    if norm_type not in _NORM_TYPES:
        raise ValueError(f"{op}: norm_type must be 'layernorm' or 'rmsnorm', got "
                         f"{norm_type!r}")
    kind = _NORM_TYPES[norm_type]
    x, gamma = jnp.asarray(x), jnp.asarray(gamma)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have rank >= 1, got shape {x.shape}")
    if x.dtype not in _COMPUTE_DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, got {x.dtype}")
    n = x.shape[-1]
    if gamma.shape != (n,):
        raise ValueError(f"{op}: gamma must have shape ({n},) (x's last axis; x has "
                         f"shape {x.shape}), got {gamma.shape}")
    if kind == ops.NormType.LAYERNORM:
        if beta is None:
            raise ValueError(f"{op}: beta is required for norm_type='layernorm'")
        beta = jnp.asarray(beta)
        if beta.shape != (n,):
            raise ValueError(f"{op}: beta must have shape ({n},) (x's last axis; x has "
                             f"shape {x.shape}), got {beta.shape}")
    elif beta is not None:
        raise ValueError(f"{op}: beta must be None for norm_type='rmsnorm'")
    epsilon = float(epsilon)
    if not epsilon >= 0:
        raise ValueError(f"{op}: epsilon must be >= 0, got {epsilon}")
    # The core takes gamma and beta (one dtype) in x's dtype or fp32.
    weights = [gamma] + ([beta] if beta is not None else [])
    wdtype = x.dtype if all(w.dtype == x.dtype for w in weights) else jnp.dtype(jnp.float32)
    g = gamma.astype(wdtype)
    b = beta.astype(wdtype) if beta is not None else jnp.zeros((0,), wdtype)
    return x, g, b, kind, epsilon


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, gamma, beta, kind, zero_centered, epsilon):
    return _norm_fwd(x, gamma, beta, kind, zero_centered, epsilon)[0]


def _norm_fwd(x, gamma, beta, kind, zero_centered, epsilon):
    y, mu, rsigma = ops.norm_forward(x, gamma, beta, norm_type=kind, epsilon=epsilon,
                                     zero_centered_gamma=zero_centered)
    return y, (x, mu, rsigma, gamma)


def _norm_bwd(kind, zero_centered, epsilon, residuals, dy):
    x, mu, rsigma, gamma = residuals
    dx, dgamma, dbeta = ops.norm_backward(dy.astype(x.dtype), x, mu, rsigma, gamma,
                                          norm_type=kind, epsilon=epsilon,
                                          zero_centered_gamma=zero_centered)
    return dx, dgamma, dbeta


_norm.defvjp(_norm_fwd, _norm_bwd)
