"""``grouped_dense``: the dense layers of a mixture-of-experts block, one kernel per expert,
over the tokens sorted by expert (NVIDIA's ``transformer_engine.jax.dense.grouped_dense``).

``out[rows of g] = x[rows of g] @ kernel[g] (+ bias[g])``, the rows of group g being the
``group_sizes[g]`` rows that follow those of the groups before it. The sizes are a device
array (traced under ``jax.jit``), so the routing may change every step without a recompile.
The forward, the input gradient and the kernels' gradients are one core call each
(``te_grouped_gemm_ragged``); the bias gradient sums each group's rows.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from transformer_engine.jax import ops
from transformer_engine.jax.quantizer import QuantizerSet

__all__ = ["grouped_dense"]

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def grouped_dense(x: jax.Array, kernel: jax.Array, group_sizes: jax.Array,
                  contracting_dims: Sequence[Sequence[int]] = ((1,), (1,)),
                  bias: Optional[jax.Array] = None, precision=None,
                  preferred_element_type=None, group_offset=None,
                  quantizer_set: Optional[QuantizerSet] = None) -> jax.Array:
    """The groups' dense layers over their stacked rows.

    Args:
        x: [M, K], the groups' rows one after the other (rows past the sizes' sum give zero
            rows of the output and no gradient).
        kernel: [G, K, N] (``contracting_dims=((1,), (1,))``, the default) or [G, N, K]
            (``((1,), (2,))``).
        group_sizes: int [G], each >= 0, summing to at most M.
        bias: None or [G, N].
        precision: accepted and ignored (the core accumulates in fp32).
        preferred_element_type: the output dtype (default x's); float32 keeps the fp32 sums.
        group_offset: NVIDIA's expert-parallel offset: None only.
        quantizer_set: None or a set without a recipe. FP8 grouped layers are not
            implemented here (NotImplementedError); NVIDIA's default, no quantization, is
            what runs.

    Returns:
        [M, N] in ``preferred_element_type`` (default: x's dtype).

    Example:
        >>> import jax.numpy as jnp
        >>> from transformer_engine.jax.dense import grouped_dense
        >>> out = grouped_dense(jnp.ones((5, 4)), jnp.ones((2, 4, 3)), jnp.array([2, 3]))
        >>> out.shape
        (5, 3)
    """
    del precision
    op = "grouped_dense"
    if group_offset is not None:
        raise NotImplementedError(f"{op}: group_offset (expert parallelism) is not implemented; "
                                  f"pass None, got {group_offset!r}")
    if quantizer_set is not None and getattr(quantizer_set, "recipe", None) is not None:
        raise NotImplementedError(f"{op}: FP8 grouped dense layers (a quantizer_set with recipe "
                                  f"{quantizer_set.recipe!r}) are not implemented; pass None for "
                                  "the inputs' dtype")
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    group_sizes = jnp.asarray(group_sizes)
    dims = tuple(tuple(int(d) for d in side) for side in contracting_dims)
    if dims not in (((1,), (1,)), ((1,), (2,))):
        raise ValueError(f"{op}: contracting_dims must be ((1,), (1,)) (kernel [G, K, N]) or "
                         f"((1,), (2,)) (kernel [G, N, K]), got {contracting_dims!r}")
    kernel_nk = dims[1] == (2,)
    if x.ndim != 2 or kernel.ndim != 3:
        raise ValueError(f"{op}: x must be [M, K] and kernel [G, K, N] or [G, N, K], got shapes "
                         f"{x.shape} and {kernel.shape}")
    k_of_kernel = kernel.shape[2] if kernel_nk else kernel.shape[1]
    if x.shape[1] != k_of_kernel:
        raise ValueError(f"{op}: x's K = {x.shape[1]} must match the kernel's contracted dim "
                         f"(shape {kernel.shape}, contracting_dims {dims})")
    if group_sizes.ndim != 1 or group_sizes.shape[0] != kernel.shape[0] or \
            not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{op}: group_sizes must be an integer [G] with G = {kernel.shape[0]} "
                         f"(the kernel's groups), got {group_sizes.dtype} {group_sizes.shape}")
    dtype = jnp.result_type(x, kernel)
    if dtype not in _DTYPES:
        raise TypeError(f"{op}: x and kernel must be float32, float16 or bfloat16, got "
                        f"{x.dtype} and {kernel.dtype}")
    n = kernel.shape[1] if kernel_nk else kernel.shape[2]
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (kernel.shape[0], n):
            raise ValueError(f"{op}: bias must be [G, N] = [{kernel.shape[0]}, {n}], got "
                             f"{bias.shape}")
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    return _grouped(x.astype(dtype), kernel.astype(dtype), group_sizes.astype(jnp.int32), bias,
                    (kernel_nk, out_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped(x, kernel, sizes, bias, cfg):
    return _grouped_fwd(x, kernel, sizes, bias, cfg)[0]


def _gemm_bias(bias, out_dtype, x_dtype):
    """The bias in the dtype the core's epilogue takes (D's, or the operands' for fp32 D)."""
    if bias is None:
        return None
    want = x_dtype if out_dtype == jnp.dtype(jnp.float32) and x_dtype != out_dtype else out_dtype
    return bias.astype(want)


def _grouped_fwd(x, kernel, sizes, bias, cfg):
    kernel_nk, out_dtype = cfg
    out = ops.grouped_gemm(x, kernel, sizes, transpose_b=kernel_nk,
                           bias=_gemm_bias(bias, out_dtype, x.dtype), out_dtype=out_dtype)
    return out, (x, kernel, sizes, bias)


def _grouped_bwd(cfg, residuals, dy):
    kernel_nk, _ = cfg
    x, kernel, sizes, bias = residuals
    dy = dy.astype(x.dtype)
    # dgrad: dx[rows g] = dy[rows g] @ kernel[g]^T (the kernel read transposed)
    dx = ops.grouped_gemm(dy, kernel, sizes, transpose_b=not kernel_nk)
    # wgrad: the kernel's own layout, [G, K, N] = x^T dy or [G, N, K] = dy^T x, per group
    dk = (ops.grouped_gemm(dy, x, sizes, transpose_a=True) if kernel_nk
          else ops.grouped_gemm(x, dy, sizes, transpose_a=True)).astype(kernel.dtype)
    dbias = None
    if bias is not None:
        groups = sizes.shape[0]
        # each row's group (rows past the groups: an extra one, dropped)
        owner = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(dy.shape[0]), side="right")
        dbias = jax.ops.segment_sum(dy.astype(jnp.float32), owner,
                                    num_segments=groups + 1)[:groups].astype(bias.dtype)
    return dx, dk, None, dbias


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
