"""grouped_dense (the experts' dense layers over tokens sorted by expert) against a jnp
reference that gathers each row's kernel: output, and gradients of x, kernel and bias, under
jax.jit with the group sizes traced (new sizes, no recompile), both kernel layouts, empty
experts and rows past the groups; its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.dense import grouped_dense

M, K, N, G = 30, 16, 8, 4


def _reference(x, kernel, bias, sizes, kernel_nk):
    owner = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")
    valid = owner < kernel.shape[0]
    w = kernel[jnp.minimum(owner, kernel.shape[0] - 1)]
    out = jnp.einsum("mk,mnk->mn" if kernel_nk else "mk,mkn->mn", x, w,
                     precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        out = out + bias[jnp.minimum(owner, kernel.shape[0] - 1)]
    return jnp.where(valid[:, None], out, 0.0)


def _inputs(kernel_nk, dtype=jnp.float32):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    kernel = jnp.asarray(rng.standard_normal((G, N, K) if kernel_nk else (G, K, N)), dtype)
    bias = jnp.asarray(rng.standard_normal((G, N)), dtype)
    return x, kernel, bias


@pytest.mark.parametrize("kernel_nk", [False, True])
def test_grouped_dense_and_its_gradients_equal_a_gathered_reference(kernel_nk):
    x, kernel, bias = _inputs(kernel_nk)
    dims = ((1,), (2,)) if kernel_nk else ((1,), (1,))
    traces = []

    def loss(x, kernel, bias, sizes):
        traces.append(1)
        return jnp.sum(jnp.sin(grouped_dense(x, kernel, sizes, dims, bias=bias)))

    def ref_loss(x, kernel, bias, sizes):
        return jnp.sum(jnp.sin(_reference(x, kernel, bias, sizes, kernel_nk)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    ref = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2)))
    for sizes in ([10, 0, 15, 5], [0, 30, 0, 0], [3, 4, 5, 6]):  # the last: rows past groups
        sizes = jnp.asarray(sizes, jnp.int32)
        (v, grads), (rv, rgrads) = step(x, kernel, bias, sizes), ref(x, kernel, bias, sizes)
        np.testing.assert_allclose(v, rv, rtol=1e-5)
        for got, want in zip(grads, rgrads, strict=True):
            # fp32 sums of up to 30 terms in another order
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(traces) == 1  # the sizes are traced: one compile for every routing


def test_grouped_dense_without_bias_in_bf16_with_an_fp32_output():
    x, kernel, _ = _inputs(False, jnp.bfloat16)
    sizes = jnp.asarray([8, 8, 8, 6], jnp.int32)
    out = grouped_dense(x, kernel, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    want = _reference(x.astype(jnp.float32), kernel.astype(jnp.float32), None, sizes, False)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_grouped_dense_errors_name_the_argument():
    x, kernel, bias = _inputs(False)
    sizes = jnp.asarray([10, 0, 15, 5], jnp.int32)
    with pytest.raises(ValueError, match=r"grouped_dense: contracting_dims must be"):
        grouped_dense(x, kernel, sizes, ((0,), (1,)))
    with pytest.raises(ValueError, match=r"group_sizes must be an integer \[G\] with G = 4"):
        grouped_dense(x, kernel, sizes[:3])
    with pytest.raises(ValueError, match=r"bias must be \[G, N\] = \[4, 8\]"):
        grouped_dense(x, kernel, sizes, bias=bias[:, :4])
    with pytest.raises(NotImplementedError, match="group_offset"):
        grouped_dense(x, kernel, sizes, group_offset=1)
    with pytest.raises(NotImplementedError, match="FP8 grouped dense layers"):
        grouped_dense(x, kernel, sizes, quantizer_set=te.make_quantizer_set(
            recipe.Float8CurrentScaling()))
    # the sizes are device values: the core checks them when the call runs
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"group_sizes must be >= 0 and sum to at most M = 30"):
        jax.block_until_ready(grouped_dense(x, kernel, jnp.asarray([20, 20, 0, 0], jnp.int32)))
