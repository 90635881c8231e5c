"""grouped_dense (the experts' dense layers over tokens sorted by expert) against a jnp
reference that gathers each row's kernel: output, and gradients of x, kernel and bias, under
jax.jit with the group sizes traced (new sizes, no recompile), both kernel layouts, empty
experts and rows past the groups; its errors. In FP8 (per-tensor delayed and current scaling):
each group bit for bit the core's FP8 GEMM of its slice, gradients within FP8's error of the
reference, and the delayed-scaling state update."""

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
    with pytest.raises(NotImplementedError, match=r"FP8 grouped dense layers take per-tensor "
                                                  r"scaling .* got Float8BlockScaling"):
        grouped_dense(x, kernel, sizes, quantizer_set=te.make_quantizer_set(
            recipe.Float8BlockScaling()))
    with pytest.raises(ValueError, match=r"FP8 GEMMs need K and N to be multiples of 16, got "
                                         r"K=16, N=8"):
        grouped_dense(x, kernel, sizes, quantizer_set=te.make_quantizer_set(
            recipe.Float8CurrentScaling()))
    # the sizes are device values: the core checks them when the call runs
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"group_sizes must be >= 0 and sum to at most M = 30"):
        jax.block_until_ready(grouped_dense(x, kernel, jnp.asarray([20, 20, 0, 0], jnp.int32)))


# --- FP8 -------------------------------------------------------------------------------------

FM, FK, FN = 80, 32, 48  # FP8: K and N multiples of 16, group sizes too


def _fp8_inputs(kernel_nk):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((FM, FK)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((G, FN, FK) if kernel_nk else (G, FK, FN)) * 0.2,
                         jnp.float32)
    bias = jnp.asarray(rng.standard_normal((G, FN)), jnp.float32)
    return x, kernel, bias


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel_nk", [False, True])
def test_fp8_grouped_dense_is_the_core_fp8_gemm_of_each_group(kernel_nk, out_dtype):
    """The forward, bit for bit: each group's rows through te_gemm on the same FP8 operands
    (the tokens' one scale, the kernels' one scale), the bias added as the dense layer adds
    it (in the GEMM for a 16-bit output, after it for fp32); rows past the groups are 0."""
    from transformer_engine.jax.quantizer import quantize_role

    x, kernel, bias = _fp8_inputs(kernel_nk)
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling())
    dims = ((1,), (2,)) if kernel_nk else ((1,), (1,))
    sizes = [16, 0, 32, 16]
    got = grouped_dense(x, kernel, jnp.asarray(sizes, jnp.int32), dims, bias=bias,
                        preferred_element_type=out_dtype, quantizer_set=qset)
    qx = quantize_role(x, qset, "x", columnwise=False)
    qk = quantize_role(kernel.reshape(-1, kernel.shape[-1]), qset, "kernel", columnwise=False)
    k_data = qk.data.reshape(kernel.shape)
    row = 0
    for g, rows in enumerate(sizes):
        w_nk = k_data[g] if kernel_nk else k_data[g].T
        epilogue = jnp.dtype(out_dtype) != jnp.float32
        want = te.ops.gemm(qx.data[row:row + rows], w_nk, a_scale_inv=qx.scale_inv,
                           b_scale_inv=qk.scale_inv, transpose_b=True, out_dtype=out_dtype,
                           bias=bias[g].astype(out_dtype) if epilogue else None)
        if not epilogue:
            want = want + bias[g]
        np.testing.assert_array_equal(np.asarray(got[row:row + rows], np.float32),
                                      np.asarray(want, np.float32), err_msg=f"group {g}")
        row += rows
    np.testing.assert_array_equal(np.asarray(got[row:], np.float32), 0.0)


def _rel(got, want):
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.linalg.norm(want.ravel()))


@pytest.mark.parametrize("fp8_recipe", [recipe.Float8CurrentScaling(),
                                        recipe.DelayedScaling(amax_history_len=4)],
                         ids=["current", "delayed"])
@pytest.mark.parametrize("kernel_nk", [False, True])
def test_fp8_grouped_dense_gradients_are_within_fp8_error(kernel_nk, fp8_recipe):
    """Output and the three gradients against the fp32 reference, the gradients under
    jax.jit with traced sizes (one compile for every routing). E4M3 rounds each operand by
    up to 2^-4 relative, E5M2 (the gradient, HYBRID) by 2^-3: the products' relative error
    stays well under 10% in norm (dy, through sin's derivative, carries the forward's)."""
    x, kernel, bias = _fp8_inputs(kernel_nk)
    dims = ((1,), (2,)) if kernel_nk else ((1,), (1,))
    qset = te.make_quantizer_set(fp8_recipe, te.new_fp8_state(fp8_recipe))
    traces = []

    def loss(x, kernel, bias, sizes, qset):
        traces.append(1)
        return jnp.sum(jnp.sin(grouped_dense(x, kernel, sizes, dims, bias=bias,
                                             quantizer_set=qset)))

    def ref_loss(x, kernel, bias, sizes):
        return jnp.sum(jnp.sin(_reference(x, kernel, bias, sizes, kernel_nk)))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    ref = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2)))
    for sizes in ([16, 0, 32, 16], [32, 16, 16, 16]):
        sizes = jnp.asarray(sizes, jnp.int32)
        (_, grads), (_, rgrads) = step(x, kernel, bias, sizes, qset), ref(x, kernel, bias, sizes)
        out = grouped_dense(x, kernel, sizes, dims, bias=bias, quantizer_set=qset)
        assert _rel(out, _reference(x, kernel, bias, sizes, kernel_nk)) < 0.1
        for name, got, want in zip(("dx", "dkernel", "dbias"), grads, rgrads, strict=True):
            assert _rel(got, want) < 0.1, name
    assert len(traces) == 1


def test_fp8_grouped_dense_updates_the_delayed_scaling_state():
    """The new state comes back as the quantizer set's gradient: each role's history holds
    this step's amax (x, the stacked kernels, dy) and its scale moved from 1."""
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    x, kernel, _ = _fp8_inputs(False)
    qset = te.make_quantizer_set(fp8_recipe, te.new_fp8_state(fp8_recipe))
    sizes = jnp.asarray([16, 16, 16, 16], jnp.int32)
    dy_scale = 3.0

    def loss(x, kernel, qset):
        return dy_scale * jnp.sum(grouped_dense(x, kernel, sizes, quantizer_set=qset))

    _, _, new = jax.grad(loss, argnums=(0, 1, 2))(x, kernel, qset)
    for role, amax in (("x", jnp.abs(x).max()), ("kernel", jnp.abs(kernel).max()),
                       ("grad", dy_scale)):
        history = new.state[role]["amax_history"]
        np.testing.assert_allclose(float(history.max()), float(amax), rtol=0, err_msg=role)
        assert float(new.state[role]["scale"][0]) != 1.0, role
