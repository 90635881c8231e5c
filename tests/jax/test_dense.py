"""dense and DenseGeneral against flax.linen (values and gradients), FP8 against numpy models,
transformations (jit, grad, vmap, donation), trace-time errors, and the HLO they compile to."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from te_jax_tests import _reference as ref
from te_jax_tests._tolerances import assert_close, assert_relative_max_error

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import hlo
from transformer_engine.jax.flax import DenseGeneral

M, K, N = 32, 48, 64


def _inputs(dtype=jnp.float32, seed=0):
    kx, kw, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (2, M // 2, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
    b = jax.random.normal(kb, (N,), jnp.float32).astype(dtype)
    return x, w, b


def _loss(layer_out):
    # A loss that needs the whole output (every GEMM of the backward pass survives).
    return jnp.sum(jnp.sin(layer_out.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_matches_flax_dense(dtype, use_bias):
    x, w, b = _inputs(jnp.dtype(dtype))
    params = {"kernel": w, "bias": b} if use_bias else {"kernel": w}
    flax_dense = nn.Dense(N, use_bias=use_bias, dtype=dtype, param_dtype=dtype)
    # One output cotangent for both, so that the gradients compare the backward GEMMs alone
    # (not one ulp of difference in the forward output, amplified by a loss).
    dy = jax.random.normal(jax.random.PRNGKey(9), (2, M // 2, N)).astype(dtype)

    def ours(x, p):
        return te.dense(x, p["kernel"], p.get("bias"))

    def theirs(x, p):
        return flax_dense.apply({"params": p}, x)

    out, vjp_ours = jax.vjp(jax.jit(ours), x, params)
    expected, vjp_theirs = jax.vjp(theirs, x, params)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (2, M // 2, N)
    assert_close(out, expected, dtype)
    # The gradients against float64 products of the same values: flax's bias gradient in
    # float16 sums the tokens in float16 (3 ulps off the exact sum were seen), ours in fp32.
    x64, w64, dy64 = (np.asarray(t, np.float64).reshape(-1, t.shape[-1]) for t in (x, w, dy))
    exact = {"kernel": x64.T @ dy64, "bias": dy64.sum(axis=0)}
    grad_x, grad_params = vjp_ours(dy)
    _, theirs_params = vjp_theirs(dy)
    assert grad_x.dtype == x.dtype
    assert_close(grad_x, (dy64 @ w64.T).reshape(x.shape), dtype)
    for name, grad in grad_params.items():
        assert grad.dtype == theirs_params[name].dtype
        assert_close(grad, exact[name], dtype)


def test_dense_gradients_by_finite_differences():
    x, w, b = _inputs()
    x, w, b = x[:1, :4, :16], w[:16, :8], b[:8]
    check_grads(lambda x, w, b: jnp.sin(te.dense(x, w, b)), (x, w, b), order=1, modes=["rev"],
                atol=2e-2, rtol=2e-2, eps=1e-2)


def test_dense_general_matches_flax_dense_general_over_two_axes():
    x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 6, 16))
    ours = DenseGeneral(features=(4, 8), axis=(-2, -1))
    theirs = nn.DenseGeneral(features=(4, 8), axis=(-2, -1))
    variables = ours.init(jax.random.PRNGKey(2), x)
    assert variables["params"]["kernel"].shape == (6, 16, 4, 8)
    assert set(variables) == {"params"}  # no FP8 state outside autocast
    np.testing.assert_array_equal(variables["params"]["kernel"],
                                  theirs.init(jax.random.PRNGKey(2), x)["params"]["kernel"])
    assert_close(ours.apply(variables, x), theirs.apply(variables, x), "float32")
    g_ours = jax.grad(lambda p: _loss(ours.apply({"params": p}, x)))(variables["params"])
    g_theirs = jax.grad(lambda p: _loss(theirs.apply({"params": p}, x)))(variables["params"])
    for a, e in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_theirs), strict=True):
        assert_close(a, e, "float32")


def test_dense_general_dtype_is_the_parameters_and_computes_in_the_inputs():
    # NVIDIA's meaning: dtype makes the parameters; the computation follows the input.
    x = jax.random.normal(jax.random.PRNGKey(1), (16, 32))
    layer = DenseGeneral(features=16, dtype=jnp.bfloat16)
    variables = layer.init(jax.random.PRNGKey(0), x)
    assert {v.dtype for v in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}
    out = layer.apply(variables, x)
    assert out.dtype == jnp.float32
    kernel = variables["params"]["kernel"].astype(jnp.float32)
    assert_close(out, x @ kernel, "float32")  # fp32 math on the bf16 values
    fp32_params = DenseGeneral(features=16)
    v32 = fp32_params.init(jax.random.PRNGKey(0), x)
    assert fp32_params.apply(v32, x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    int_out = fp32_params.apply(v32, jnp.ones((16, 32), jnp.int32))  # cast to the params'
    assert int_out.dtype == jnp.float32
    # The former meaning (dtype: computation, param_dtype: parameters) fails loudly.
    with pytest.raises(TypeError, match="dtype is the parameters' dtype"):
        DenseGeneral(features=16, dtype=jnp.bfloat16, param_dtype=jnp.float32).init(
            jax.random.PRNGKey(0), x)
    same = DenseGeneral(features=16, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert same.init(jax.random.PRNGKey(0), x)["params"]["kernel"].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_kernels_are_drawn_in_float32(dtype):
    # The float32 draw rounded to the parameters' dtype (flax draws in that dtype, which in
    # bf16 leaves 128 distinct values: module.py's _as_matrix_init says why that hurts FP8).
    x = jnp.ones((4, 64))
    half = DenseGeneral(features=256, dtype=dtype).init(jax.random.PRNGKey(0), x)
    full = DenseGeneral(features=256).init(jax.random.PRNGKey(0), x)
    kernel = half["params"]["kernel"]
    assert kernel.dtype == dtype
    rounded = full["params"]["kernel"].astype(dtype)
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(rounded))
    assert len(np.unique(np.asarray(kernel, np.float32))) > 1000


def test_dense_general_records_logical_axes():
    layer = DenseGeneral(features=32, kernel_axes=("embed", "mlp"), bias_axes=("mlp",))
    variables = layer.init(jax.random.PRNGKey(0), jnp.ones((16, 64)))
    specs = nn.get_partition_spec(variables)["params"]
    assert tuple(specs["kernel"]) == ("embed", "mlp") and tuple(specs["bias"]) == ("mlp",)
    assert layer.apply(variables, jnp.ones((16, 64))).shape == (16, 32)


def _current_scaling_reference(x, w, dy):
    """fp64 results of the three GEMMs on the FP8 values that current scaling makes."""
    x2 = np.asarray(x, np.float32).reshape(-1, K)
    w2 = np.asarray(w, np.float32)
    sx = ref.scale_from_amax(float(np.abs(x2).max()), "float8_e4m3")
    sw = ref.scale_from_amax(float(np.abs(w2).max()), "float8_e4m3")
    sg = ref.scale_from_amax(float(np.abs(dy).max()), "float8_e5m2")
    fx, fw = ref.fake_quantize(x2, sx, "float8_e4m3"), ref.fake_quantize(w2, sw, "float8_e4m3")
    fg = ref.fake_quantize(dy, sg, "float8_e5m2")
    return fx @ fw, fg @ fw.T, fx.T @ fg


def test_fp8_current_scaling_gemms_equal_the_numpy_model():
    x, w, _ = _inputs()
    dy = np.asarray(jax.random.normal(jax.random.PRNGKey(5), (M, N)), np.float32)
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling())

    def f(x, w):
        return te.dense(x, w, quantizer_set=qset).reshape(M, N)

    out, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(jnp.asarray(dy))
    e_out, e_dx, e_dw = _current_scaling_reference(x, w, dy)
    assert_close(out, e_out, "fp8_exact")
    assert_close(np.asarray(dx).reshape(M, K), e_dx, "fp8_exact")
    assert_close(dw, e_dw, "fp8_exact")


@pytest.mark.parametrize("fp8_recipe", [
    recipe.DelayedScaling(amax_history_len=4),
    recipe.DelayedScaling(fp8_format=recipe.Format.E4M3, amax_history_len=2),
    recipe.Float8CurrentScaling(),
    recipe.Float8BlockScaling(),
], ids=["delayed-hybrid", "delayed-e4m3", "current", "block"])
def test_fp8_dense_general_is_close_to_fp32(fp8_recipe):
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 64, 128))
    layer = DenseGeneral(features=128)
    params = layer.init(jax.random.PRNGKey(4), x)["params"]
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(4), x)
    state = {k: v for k, v in variables.items() if k != "params"}
    assert set(state) == ({"fp8_metas"} if fp8_recipe.delayed() else set())

    def fp8_loss(p, s):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            return _loss(layer.apply({"params": p, **s}, x))

    def fp32_loss(p):
        return _loss(layer.apply({"params": p}, x))

    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        out = layer.apply({"params": params, **state}, x)
    assert_relative_max_error(out, layer.apply({"params": params}, x), "fp8_forward_vs_fp32")
    (g, _) = jax.jit(jax.grad(fp8_loss, argnums=(0, 1)))(params, state)
    g_ref = jax.grad(fp32_loss)(params)
    for a, e in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert_relative_max_error(a, e, "fp8_backward_vs_fp32")


def test_value_and_grad_jit_vmap_and_donation():
    x, w, b = _inputs()

    def loss(w, b, x):
        return _loss(te.dense(x, w, b))

    expected = jax.value_and_grad(lambda w, b: _loss(x @ w + b), argnums=(0, 1))(w, b)
    # The parameters' buffers are donated to their gradients (same shapes).
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), donate_argnums=(0, 1))
    value, (gw, gb) = step(jnp.array(w), jnp.array(b), x)
    assert_close(value, expected[0], "float32")
    assert_close(gw, expected[1][0], "float32")
    # vmap over a batch of inputs (the kernel shared): the same as one call on the whole batch.
    batched = jax.vmap(lambda xi: te.dense(xi, w, b))(x)
    assert_close(batched, te.dense(x, w, b), "float32")
    g_batched = jax.grad(lambda w: _loss(jax.vmap(lambda xi: te.dense(xi, w, b))(x)))(w)
    assert_close(g_batched, expected[1][0], "float32")


def test_fp8_under_vmap_with_current_scaling():
    x, w, _ = _inputs()
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling())
    out = jax.vmap(lambda xi: te.dense(xi, w, quantizer_set=qset))(x)
    # Each mapped call quantizes its own slice with its own amax.
    for i in range(x.shape[0]):
        assert_close(out[i], te.dense(x[i], w, quantizer_set=qset), "fp8_exact")


@pytest.mark.parametrize("x_shape, w_shape, dims, fp8, exc, match", [
    ((), (4, 4), None, False, ValueError, "rank"),
    ((4, 8), (8,), None, False, ValueError, "rank"),
    ((4, 8), (6, 4), None, False, ValueError, "contracted dims must match"),
    ((4, 8), (8, 4), ((2,), (0,)), False, ValueError, "contracting_dims of x"),
    ((4, 8), (8, 4), ((1, 0), (0,)), False, ValueError, "as many x dims"),
    ((8, 32), (32, 40), None, True, ValueError, "multiple of 16.*N=40"),  # any token count
    ((32, 24), (24, 32), None, True, ValueError, "multiple of 16.*K=24"),
])
def test_bad_inputs_fail_at_trace_time(x_shape, w_shape, dims, fp8, exc, match):
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling() if fp8 else None)
    f = jax.jit(lambda x, w: te.dense(x, w, contracting_dims=dims, quantizer_set=qset))
    with pytest.raises(exc, match=match):
        f.lower(jnp.ones(x_shape), jnp.ones(w_shape))


def test_other_trace_time_errors():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        te.dense(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 4), jnp.int32))
    with pytest.raises(ValueError, match="bias must have shape"):
        te.dense(jnp.ones((4, 8)), jnp.ones((8, 4)), jnp.ones((5,)))
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        with pytest.raises(ValueError, match="DelayedScaling needs the FP8 state"):
            te.dense(jnp.ones((16, 16)), jnp.ones((16, 16)))
    with pytest.raises(NotImplementedError, match="MXFP8"):
        te.make_quantizer_set(recipe.MXFP8BlockScaling())
    layer = DenseGeneral(features=16)
    variables = layer.init(jax.random.PRNGKey(0), jnp.ones((16, 16)))
    with te.fp8_autocast(enabled=True):
        with pytest.raises(ValueError, match="no 'x_scale'"):
            layer.apply(variables, jnp.ones((16, 16)))


def _compiled(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_hlo_holds_our_custom_calls():
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
    layer = DenseGeneral(features=32)
    fp8_recipe = recipe.DelayedScaling(amax_history_len=8)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(1), x)
        params, state = variables["params"], {"fp8_metas": variables["fp8_metas"]}

        def loss(p, s, x):
            return _loss(layer.apply({"params": p, **s}, x))

        text = _compiled(jax.grad(loss, argnums=(0, 1, 2)), params, state, x)
    counts = hlo.target_counts(text)
    # x and kernel; dy is cast by the core's activation backward of the identity, which
    # writes the bias gradient in the same pass.
    # Each delayed-scaling cast comes with its first-step twin: the same op gated on the
    # role's history (one early return once the history holds an amax); the scale of that
    # step is jnp, which XLA fuses.
    # (the call with dbias under its own target, left out of XLA's CUDA graphs; its gated
    # twin writes no dbias)
    assert counts["te_quantize_ffi"] == 2 and counts["te_activation_backward_ffi"] == 1
    assert counts["te_activation_backward_dbias_ffi"] == 1
    assert counts["te_compute_amax_ffi"] == 2  # the first-step amaxes of x and kernel
    assert counts["te_delayed_scaling_update_ffi"] == 1  # the step's update: every role
    # Each cast raises its first-step twin's amax in that buffer (no zeroed amax of its own).
    casts = r'custom_call_target="te_(quantize|activation_backward(_dbias)?)_ffi"'
    raising = [line for line in text.splitlines()
               if re.search(casts, line)
               and "output_to_operand_aliasing" in line]
    assert len(raising) == 3, raising
    assert hlo.count_fp8_gemms(text) == 3  # forward, dgrad, wgrad
    # Without autocast: the same three GEMMs in fp32 through our target, no XLA dot.
    text = _compiled(jax.grad(lambda p, x: _loss(layer.apply({"params": p}, x)), argnums=(0, 1)),
                     params, x)
    assert hlo.target_counts(text)["te_gemm_ffi"] == 3 and hlo.count_fp8_gemms(text) == 0
    assert " dot(" not in text


@pytest.mark.cuda
def test_cuda_dense_matches_the_cpu_path():
    x, w, b = _inputs()
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling())

    def f(x, w, b):
        return te.dense(x, w, b, quantizer_set=qset)

    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    out_gpu = jax.jit(f)(*jax.device_put((x, w, b), gpu))
    out_cpu = jax.jit(f)(*jax.device_put((x, w, b), cpu))
    assert_close(np.asarray(out_gpu), np.asarray(out_cpu), "fp8_cuda_vs_cpu")
    text = jax.jit(f).lower(*jax.device_put((x, w, b), gpu)).compile().as_text()
    assert hlo.count_fp8_gemms(text) == 1
