"""``grouped_dense``: the dense layers of a mixture-of-experts block, one kernel per expert,
over the tokens sorted by expert (NVIDIA's ``transformer_engine.jax.dense.grouped_dense``).

``out[rows of g] = x[rows of g] @ kernel[g] (+ bias[g])``, the rows of group g being the
``group_sizes[g]`` rows that follow those of the groups before it. The sizes are a device
array (traced under ``jax.jit``), so the routing may change every step without a recompile.
The forward, the input gradient and the kernels' gradients are one core call each
(``te_grouped_gemm_ragged``); the bias gradient sums each group's rows.

In FP8 (a ``quantizer_set`` with a delayed or current scaling recipe) the tokens, the stacked
kernels and the output gradient are each quantized with one per-tensor scale, and the core's
FP8 grouped GEMMs run on them: the kernels' FP8 bytes are transposed per group for the
forward (FP8 GEMMs read both operands K-major), and the weight gradients are computed from
the row-wise FP8 tokens and gradient (the core transposes each group's rows). Group sizes
must then be multiples of 16 (te_gemm's FP8 rule, checked on the device).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from transformer_engine.common.plan import GEMM_GRANULE
from transformer_engine.jax import ops
from transformer_engine.jax._fused import fp8_bias_epilogue
from transformer_engine.jax.quantizer import (
    QuantizerSet,
    plan_kind,
    quantize_role,
    updated_state,
)

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
        quantizer_set: None (no FP8) or a set from
            :func:`~transformer_engine.jax.make_quantizer_set` with a delayed or current
            scaling recipe (per-tensor scales: one for the tokens, one for all the kernels,
            one for the output gradient); block-scaled recipes raise NotImplementedError.
            With delayed scaling the new FP8 state comes back as the gradient of the set's
            state, as for :func:`~transformer_engine.jax.dense`.

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
    recipe = None if quantizer_set is None else quantizer_set.recipe
    if recipe is not None and plan_kind(recipe) not in ("delayed", "current"):
        raise NotImplementedError(f"{op}: FP8 grouped dense layers take per-tensor scaling "
                                  f"(a delayed or current scaling recipe), got {recipe!r}; pass "
                                  "a quantizer_set of one of those, or None for the inputs' "
                                  "dtype")
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
    if recipe is not None and (x.shape[1] % GEMM_GRANULE or n % GEMM_GRANULE):
        raise ValueError(f"{op}: FP8 GEMMs need K and N to be multiples of {GEMM_GRANULE}, got "
                         f"K={x.shape[1]}, N={n}; pad the features or pass no FP8 "
                         "quantizer_set")
    out_dtype = jnp.dtype(preferred_element_type or dtype)
    args = (x.astype(dtype), kernel.astype(dtype), group_sizes.astype(jnp.int32), bias)
    if recipe is None:
        return _grouped(*args, (kernel_nk, out_dtype))
    return _grouped_fp8(*args, dict(quantizer_set.state), (kernel_nk, out_dtype, recipe, dtype))


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
    return dx, dk, None, None if bias is None else _dbias(dy, sizes, bias)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


# --- FP8 ------------------------------------------------------------------------------------


def _k_major(data, kernel_nk: bool, want_nk: bool):
    """A kernel's FP8 bytes with each group as [N, K] (``want_nk``) or [K, N]."""
    return data if kernel_nk == want_nk else jnp.swapaxes(data, 1, 2)


def _owner(sizes, rows: int):
    """Each row's group; rows past the groups get G (one past the last)."""
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right")


def _dbias(dy, sizes, bias):
    """Each group's sum of its rows of dy (rows past the groups dropped)."""
    groups = sizes.shape[0]
    return jax.ops.segment_sum(dy.astype(jnp.float32), _owner(sizes, dy.shape[0]),
                               num_segments=groups + 1)[:groups].astype(bias.dtype)


def _rows_bias(bias, sizes, rows: int):
    """[rows, N]: each row its group's bias, 0 past the groups."""
    padded = jnp.concatenate([bias, jnp.zeros((1, bias.shape[1]), bias.dtype)])
    return padded[_owner(sizes, rows)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_fp8(x, kernel, sizes, bias, state, cfg):
    return _grouped_fp8_fwd(x, kernel, sizes, bias, state, cfg)[0]


def _grouped_fp8_fwd(x, kernel, sizes, bias, state, cfg):
    kernel_nk, out_dtype, recipe, _ = cfg
    qset = QuantizerSet(recipe, state)
    qx = quantize_role(x, qset, "x", columnwise=False)
    qk = quantize_role(kernel.reshape(-1, kernel.shape[-1]), qset, "kernel", columnwise=False)
    k_data = qk.data.reshape(kernel.shape)
    # The core adds a bias of D's dtype to a 16-bit D; an fp32 D gets its fp32 bias after.
    epilogue = bias is not None and fp8_bias_epilogue(out_dtype)
    out = ops.grouped_gemm(qx.data, _k_major(k_data, kernel_nk, True), sizes, transpose_b=True,
                           bias=bias.astype(out_dtype) if epilogue else None,
                           out_dtype=out_dtype, a_scale_inv=qx.scale_inv,
                           b_scale_inv=qk.scale_inv)
    if bias is not None and not epilogue:
        out = out + _rows_bias(bias, sizes, out.shape[0]).astype(out_dtype)
    residuals = (qx.data, qx.scale_inv, qx.amax, k_data, qk.scale_inv, qk.amax, sizes, state,
                 bias)
    return out, residuals


def _grouped_fp8_bwd(cfg, residuals, dy):
    kernel_nk, _, recipe, dtype = cfg
    x_data, x_si, amax_x, k_data, k_si, amax_k, sizes, state, bias = residuals
    qg = quantize_role(dy.astype(dtype), QuantizerSet(recipe, state), "grad", columnwise=False)
    # dgrad: dx[rows g] = dy[rows g] @ kernel[g]^T, the kernel read [K, N] per group (N-major)
    dx = ops.grouped_gemm(qg.data, _k_major(k_data, kernel_nk, False), sizes, transpose_b=True,
                          out_dtype=dtype, a_scale_inv=qg.scale_inv, b_scale_inv=k_si,
                          use_split_accumulator=True)
    # wgrad from the row-wise FP8 tokens and gradient: [G, K, N] = x^T dy or [G, N, K] = dy^T x
    if kernel_nk:
        dk = ops.grouped_gemm(qg.data, x_data, sizes, transpose_a=True, out_dtype=jnp.float32,
                              a_scale_inv=qg.scale_inv, b_scale_inv=x_si,
                              use_split_accumulator=True)
    else:
        dk = ops.grouped_gemm(x_data, qg.data, sizes, transpose_a=True, out_dtype=jnp.float32,
                              a_scale_inv=x_si, b_scale_inv=qg.scale_inv,
                              use_split_accumulator=True)
    dbias = None if bias is None else _dbias(dy, sizes, bias)
    new_state = {}
    if plan_kind(recipe) == "delayed":
        new_state = updated_state(recipe, state, {"x": amax_x, "kernel": amax_k, "grad": qg.amax})
    return dx, dk.astype(dtype), None, dbias, new_state


_grouped_fp8.defvjp(_grouped_fp8_fwd, _grouped_fp8_bwd)
