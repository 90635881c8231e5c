"""``dense``: a linear layer as a ``jax.custom_vjp`` over the core GEMM, in FP8 or not.

With ``x`` viewed as [M, K] and ``kernel`` as [K, N] (flax's [in, out] layout), the three
GEMMs are::

    forward  out[M, N] = x[M, K] @ kernel[K, N]
    dgrad    dx[M, K]  = dy[M, N] @ kernel^T
    wgrad    dk[K, N]  = x^T @ dy

FP8 GEMMs take both operands K-major (the core's transpose_a = 0, transpose_b = 1), so each
tensor is quantized once, with the fused transpose writing its column-wise copy in the same
pass: the forward GEMM reads x's row-wise data and the kernel's column-wise [N, K] copy,
dgrad reads dy's row-wise data and the kernel's row-wise [K, N] data (as [N', K'] with
N' = K), wgrad reads the column-wise copies of x [K, M] and dy [N, M]. Only x's column-wise
FP8 copy and the kernel's row-wise FP8 data are kept for the backward pass.

Without FP8 the same three GEMMs run in the inputs' dtype through the same custom call, with
the core's transpose flags instead of transposed copies.

Under ``jax.jit`` over a mesh the quantizations and GEMMs follow the shardings of ``x`` and
``kernel`` (:mod:`transformer_engine.jax.partitioning`): a kernel split along N is column
parallel, one split along K (with x split the same way) row parallel, the FP8 scales those of
the whole tensors.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from transformer_engine.common.plan import GEMM_GRANULE
from transformer_engine.jax import _fused, ops
from transformer_engine.jax._grouped_dense import grouped_dense
from transformer_engine.jax.quantizer import (
    QuantizerSet,
    make_quantizer_set,
    plan_kind,
    quantize_role,
    updated_state,
)
from transformer_engine.jax.sharding import token_rows

__all__ = ["dense", "grouped_dense"]

_COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _normalize_dims(contracting_dims, x_ndim: int, k_ndim: int):
    if contracting_dims is None:
        contracting_dims = ((x_ndim - 1,), (0,))
    try:
        x_dims, k_dims = contracting_dims
        x_dims, k_dims = tuple(int(d) for d in x_dims), tuple(int(d) for d in k_dims)
    except (TypeError, ValueError):
        raise TypeError("dense: contracting_dims must be a pair of sequences of ints "
                        f"((x dims), (kernel dims)), got {contracting_dims!r}") from None
    if len(x_dims) != len(k_dims) or not x_dims:
        raise ValueError("dense: contracting_dims must name as many x dims as kernel dims (at "
                         f"least one), got {contracting_dims!r}")
    for name, dims, ndim in (("x", x_dims, x_ndim), ("kernel", k_dims, k_ndim)):
        if any(not -ndim <= d < ndim for d in dims):
            raise ValueError(f"dense: contracting_dims of {name} must be in [-{ndim}, {ndim}) "
                             f"({name} has rank {ndim}), got {dims}")
    x_dims = tuple(d % x_ndim for d in x_dims)
    k_dims = tuple(d % k_ndim for d in k_dims)
    if len(set(x_dims)) != len(x_dims) or len(set(k_dims)) != len(k_dims):
        raise ValueError(f"dense: contracting_dims must not repeat a dim, got {contracting_dims!r}")
    return x_dims, k_dims


def dense(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array] = None,
          contracting_dims: Optional[Sequence[Sequence[int]]] = None,
          quantizer_set: Optional[QuantizerSet] = None, *,
          input_axes: Optional[Sequence[Optional[str]]] = None) -> jax.Array:
    """``x`` contracted with ``kernel`` over ``contracting_dims`` (+ ``bias``).

    Args:
        x: the input, float32, float16 or bfloat16.
        kernel: the weight; its non-contracted dims are the output features.
        bias: None or an array of the kernel's non-contracted shape (or its size).
        contracting_dims: ``((x dims), (kernel dims))``; default ``((x.ndim - 1,), (0,))``.
        quantizer_set: from :func:`~transformer_engine.jax.make_quantizer_set`; default: the
            recipe of the enclosing ``fp8_autocast`` (none: no FP8). Delayed scaling needs
            one with its state (the flax ``DenseGeneral`` manages it).
        input_axes: x's logical axis names (``("batch", "length", "embed")``, ...), or None.
            Under context parallelism they say which dim is the split sequence, so that the
            tokens become the GEMM's rows without moving (see
            :func:`~transformer_engine.jax.sharding.token_rows`).

    Returns:
        An array of shape (x's non-contracted dims, kernel's non-contracted dims) in the
        promoted dtype of ``x`` and ``kernel``. In FP8 K and N must be multiples of 16; the
        token count M (the product of x's other dims) may be anything.

    Example:
        >>> import jax.numpy as jnp, transformer_engine.jax as te
        >>> te.dense(jnp.ones((2, 4)), jnp.ones((4, 3))).tolist()
        [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    if x.ndim < 1 or kernel.ndim < 2:
        raise ValueError(f"dense: x must have rank >= 1 and kernel rank >= 2, got shapes "
                         f"{x.shape} and {kernel.shape}")
    x_dims, k_dims = _normalize_dims(contracting_dims, x.ndim, kernel.ndim)
    for xd, kd in zip(x_dims, k_dims, strict=True):
        if x.shape[xd] != kernel.shape[kd]:
            raise ValueError(f"dense: contracted dims must match, got x dim {xd} of size "
                             f"{x.shape[xd]} and kernel dim {kd} of size {kernel.shape[kd]} "
                             f"(shapes {x.shape} and {kernel.shape})")
    dtype = jnp.result_type(x, kernel)
    if dtype not in _COMPUTE_DTYPES:
        raise TypeError(f"dense: x and kernel must be float32, float16 or bfloat16, got "
                        f"{x.dtype} and {kernel.dtype}")
    if quantizer_set is None:
        quantizer_set = make_quantizer_set()
    if not isinstance(quantizer_set, QuantizerSet):
        raise TypeError(f"dense: quantizer_set must be a QuantizerSet or None, got "
                        f"{type(quantizer_set).__name__}")
    x_free = [d for d in range(x.ndim) if d not in x_dims]
    k_free = [d for d in range(kernel.ndim) if d not in k_dims]
    batch_shape = tuple(x.shape[d] for d in x_free)
    feature_shape = tuple(kernel.shape[d] for d in k_free)
    n = math.prod(feature_shape)
    k = math.prod(x.shape[d] for d in x_dims)
    # The token count M may be anything in FP8: the GEMM's operands are padded inside
    # (_fused.fp8_gemm).
    if quantizer_set.recipe is not None and (k % GEMM_GRANULE or n % GEMM_GRANULE):
        raise ValueError(
            f"dense: FP8 GEMMs need every feature dimension to be a multiple of "
            f"{GEMM_GRANULE}, got K={k}, N={n} (x shape {x.shape}, kernel shape "
            f"{kernel.shape}); pad the features or run this layer outside fp8_autocast")
    # Transposes only when the contracted dims are not already x's last / the kernel's first.
    x_perm, k_perm = (*x_free, *x_dims), (*k_dims, *k_free)
    x2 = (x if x_perm == tuple(range(x.ndim)) else jnp.transpose(x, x_perm))
    k2 = (kernel if k_perm == tuple(range(kernel.ndim)) else jnp.transpose(kernel, k_perm))
    lead_axes = [input_axes[d] for d in x_free] if input_axes else None
    x2, back = token_rows(x2.astype(dtype), len(x_free), lead_axes)
    k2 = k2.astype(dtype).reshape(k, n)
    b2 = None
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.size != n or bias.shape not in (feature_shape, (n,)):
            raise ValueError(f"dense: bias must have shape {feature_shape} (the kernel's "
                             f"non-contracted dims), got {bias.shape}")
        b2 = bias.astype(dtype).reshape(n)
    out = _dense(x2, k2, b2, quantizer_set.recipe, dict(quantizer_set.state))
    return back(out).reshape(*batch_shape, *feature_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x2, k2, b2, recipe, state):
    return _dense_fwd(x2, k2, b2, recipe, state)[0]


def _dense_fwd(x2, k2, b2, recipe, state):
    if recipe is None:
        return ops.gemm(x2, k2, bias=b2), (x2, k2, b2)
    qset = QuantizerSet(recipe, state)
    qx, qk = quantize_role(x2, qset, "x"), quantize_role(k2, qset, "kernel")
    out = _fused.forward_gemm(qx, qk, b2, recipe, x2.dtype)
    # b2 rides along only to say whether there is a bias (it is [N], cheap).
    residuals = (_fused.backward_operands(qx, qk, recipe), qx.amax, qk.amax, state, b2)
    return out, residuals


def _dense_bwd(recipe, residuals, dy):
    if recipe is None:
        x2, k2, b2 = residuals
        dx = ops.gemm(dy, k2, transpose_b=True)
        dk = ops.gemm(x2, dy, transpose_a=True)
        db = None if b2 is None else jnp.sum(dy, axis=0, dtype=jnp.float32).astype(b2.dtype)
        return dx, dk, db, {}
    saved, amax_x, amax_k, state, b2 = residuals
    # The bias gradient comes from the core's fused bias gradient + cast of dy, as in the
    # fused blocks (LayerNormDenseGeneral, LayerNormMLP) and te.Linear: a separate jnp.sum
    # adds the rows in another order and can differ from it in the last bits.
    qg, db = _fused.grad_quantized(dy, ops.Activation.IDENTITY, None,
                                   QuantizerSet(recipe, state),
                                   None if b2 is None else b2.dtype)
    dx, dk = _fused.backward_gemms(qg, saved, recipe, dy.dtype)
    new_state = {}
    if plan_kind(recipe) == "delayed":
        new_state = updated_state(recipe, state, {"x": amax_x, "kernel": amax_k, "grad": qg.amax})
    return dx, dk, db, new_state


_dense.defvjp(_dense_fwd, _dense_bwd)
