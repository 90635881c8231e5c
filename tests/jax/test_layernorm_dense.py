"""layernorm_dense and LayerNormDenseGeneral against flax (LayerNorm / RMSNorm + Dense) in
fp32, values and gradients; FP8 against numpy models and fp32 for every recipe; the HLO;
trace-time errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests import _reference as ref
from te_jax_tests._flax_reference import EPS, flax_norm
from te_jax_tests._tolerances import assert_close, assert_relative_max_error

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import hlo
from transformer_engine.jax.flax import LayerNormDenseGeneral

M, K, N = 32, 64, 48
RECIPES = [recipe.DelayedScaling(amax_history_len=4), recipe.Float8CurrentScaling(),
           recipe.Float8BlockScaling()]
RECIPE_IDS = ["delayed", "current", "block"]


def _inputs(seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = (jax.random.normal(ks[0], (2, M // 2, K)) * 2 + 0.5).astype(dtype)
    gamma = 1 + 0.2 * jax.random.normal(ks[1], (K,))
    beta = 0.2 * jax.random.normal(ks[2], (K,))
    kernel = jax.random.normal(ks[3], (K, N)) / np.sqrt(K)
    bias = 0.5 * jax.random.normal(ks[4], (N,))
    dy = jax.random.normal(ks[5], (2, M // 2, N))
    return x, gamma, beta, kernel, bias, dy


def _reference(norm_type, zero_centered, use_bias):
    dense = nn.Dense(N, use_bias=use_bias)

    def f(x, gamma, beta, kernel, bias):
        y = flax_norm(norm_type, x, gamma, beta, zero_centered)
        params = {"kernel": kernel, "bias": bias} if use_bias else {"kernel": kernel}
        return dense.apply({"params": params}, y), y

    return f


@pytest.mark.parametrize("norm_type, zero_centered, use_bias", [
    ("layernorm", False, True), ("rmsnorm", False, False), ("layernorm", True, False),
    ("rmsnorm", True, True)])
def test_matches_flax_values_and_gradients(norm_type, zero_centered, use_bias):
    x, gamma, beta, kernel, bias, dy = _inputs()
    ln = norm_type == "layernorm"

    def ours(x, gamma, beta, kernel, bias):
        return te.layernorm_dense(x, gamma, beta if ln else None, kernel,
                                  bias if use_bias else None, norm_type=norm_type,
                                  zero_centered_gamma=zero_centered, epsilon=EPS,
                                  return_layernorm_output=True)

    # Both outputs get a cotangent: the norm's output feeds the gradient too.
    dln = jax.random.normal(jax.random.PRNGKey(7), x.shape)
    out, vjp = jax.vjp(jax.jit(ours), x, gamma, beta, kernel, bias)
    expected, vjp_ref = jax.vjp(jax.jit(_reference(norm_type, zero_centered, use_bias)),
                                x, gamma, beta, kernel, bias)
    assert out[0].shape == (2, M // 2, N) and out[1].shape == x.shape
    assert_close(out[0], expected[0], "float32")
    assert_close(out[1], expected[1], "norm_float32")
    names = ("dx", "dgamma", "dbeta", "dkernel", "dbias")
    for name, a, e in zip(names, vjp((dy, dln)), vjp_ref((dy, dln)), strict=True):
        if (name == "dbeta" and not ln) or (name == "dbias" and not use_bias):
            continue
        try:
            assert_close(a, e, "float32")
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def test_module_matches_flax_and_computes_in_its_dtype():
    x, *_ = _inputs()
    layer = LayerNormDenseGeneral(features=N, use_bias=True, layernorm_type="rmsnorm")
    variables = layer.init(jax.random.PRNGKey(1), x)
    p = variables["params"]
    assert set(p) == {"scale", "kernel", "bias"} and p["kernel"].shape == (K, N)

    def theirs(p, x):
        y = flax_norm("rmsnorm", x, p["scale"], None)
        return y @ p["kernel"] + p["bias"]

    def loss(fn):
        return lambda p, x: jnp.sum(jnp.sin(fn(p, x)))

    ours = jax.jit(jax.value_and_grad(loss(lambda p, x: layer.apply({"params": p}, x)[0]),
                                      argnums=(0, 1)))(p, x)
    expected = jax.jit(jax.value_and_grad(loss(theirs), argnums=(0, 1)))(p, x)
    for a, e in zip(jax.tree.leaves(ours), jax.tree.leaves(expected), strict=True):
        assert_close(a, e, "float32")
    # dtype is the parameters' (NVIDIA's meaning); the outputs follow the input's dtype.
    bf16 = LayerNormDenseGeneral(features=(4, 12), return_layernorm_output=True)
    v = bf16.init(jax.random.PRNGKey(0), x)
    out, ln = bf16.apply(v, x.astype(jnp.bfloat16))
    assert out.shape == (2, M // 2, 4, 12) and out.dtype == jnp.bfloat16
    assert ln.dtype == jnp.bfloat16 and v["params"]["kernel"].dtype == jnp.float32
    bf16_params = LayerNormDenseGeneral(features=N, dtype=jnp.bfloat16)
    vb = bf16_params.init(jax.random.PRNGKey(0), x)
    assert {a.dtype for a in jax.tree.leaves(vb)} == {jnp.dtype(jnp.bfloat16)}
    assert bf16_params.apply(vb, x)[0].dtype == jnp.float32
    with pytest.raises(TypeError, match="param_dtype, its former name"):
        LayerNormDenseGeneral(features=N, dtype=jnp.bfloat16, param_dtype=jnp.float32).init(
            jax.random.PRNGKey(0), x)
    _, no_ln = layer.apply({"params": p}, x)
    assert no_ln is None  # NVIDIA's (out, ln_out) pair, ln_out None unless asked for
    plain = LayerNormDenseGeneral(features=N, enable_layernorm=False, axis=(-2, -1))
    assert set(plain.init(jax.random.PRNGKey(0), x)["params"]) == {"kernel"}


def test_delayed_fp8_forward_and_operands_equal_the_numpy_model():
    x, gamma, beta, kernel, bias, _ = _inputs()
    r = recipe.DelayedScaling(amax_history_len=2)
    state = te.new_fp8_state(r)
    state["x"]["scale"] = jnp.array([8.0])
    state["kernel"]["scale"] = jnp.array([64.0])
    for role in ("x", "kernel"):  # a history from an earlier step: the stored scales apply
        state[role]["amax_history"] = jnp.array([0.0, 1.0])
    qset = te.make_quantizer_set(r, state)
    out = jax.jit(lambda *a: te.layernorm_dense(*a, quantizer_set=qset))(x, gamma, beta, kernel,
                                                                        bias)
    q = te.layernorm_dense_fp8_operands(x, gamma, beta, kernel, bias, quantizer_set=qset)
    # The norm's FP8 output is the quantization of the norm (bit for bit), with its transpose.
    y = np.asarray(te.layernorm(x, gamma, beta, epsilon=EPS)).reshape(M, K)
    expected = ref.quantize(y, 8.0, "float8_e4m3")
    np.testing.assert_array_equal(np.asarray(q["ln_out"].data).view(np.uint8),
                                  expected.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q["ln_out"].columnwise_data).view(np.uint8),
                                  expected.T.view(np.uint8))
    assert float(q["ln_out"].amax[0]) == float(np.abs(y).max())
    e_out = (ref.fake_quantize(y, 8.0, "float8_e4m3")
             @ ref.fake_quantize(kernel, 64.0, "float8_e4m3")) + np.asarray(bias)
    assert_close(np.asarray(out).reshape(M, N), e_out, "fp8_exact")


@pytest.mark.parametrize("fp8_recipe", RECIPES, ids=RECIPE_IDS)
def test_fp8_module_is_close_to_fp32(fp8_recipe):
    x, *_ = _inputs()
    layer = LayerNormDenseGeneral(features=N, use_bias=True)
    params = layer.init(jax.random.PRNGKey(4), x)["params"]
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(4), x)
    state = {k: v for k, v in variables.items() if k != "params"}
    assert set(state) == ({"fp8_metas"} if fp8_recipe.delayed() else set())

    def loss(p, s, x, fp8):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            out, _ = layer.apply({"params": p, **s}, x)
        return jnp.sum(jnp.sin(out)), out

    (_, out), g = jax.jit(jax.value_and_grad(lambda p, s, x: loss(p, s, x, True),
                                             argnums=(0, 2), has_aux=True))(params, state, x)
    (_, out_ref), g_ref = jax.jit(jax.value_and_grad(lambda p, x: loss(p, {}, x, False),
                                                     argnums=(0, 1), has_aux=True))(params, x)
    assert_relative_max_error(out, out_ref, "fp8_forward_vs_fp32")
    for a, e in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert_relative_max_error(a, e, "fp8_backward_vs_fp32")


def test_fp8_metas_follow_the_recipe_over_steps():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=3, margin=1)
    x0, gamma, beta, kernel0, _, _ = _inputs()
    layer = LayerNormDenseGeneral(features=N)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(1), x0)
    params, metas = dict(variables["params"]), variables["fp8_metas"]
    assert sorted(metas) == sorted(f"{r}_{k}" for r in ("x", "kernel", "grad")
                                   for k in ("scale", "amax_history"))

    def loss(p, metas, x, c):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out, _ = layer.apply({"params": p, "fp8_metas": metas}, x)
        return jnp.sum(out * c), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    model = {r: (np.zeros(3, np.float32), 1.0) for r in ("x", "kernel", "grad")}
    fmts = {"x": "float8_e4m3", "kernel": "float8_e4m3", "grad": "float8_e5m2"}
    for t in range(4):
        x = x0 * (1.0 + 2.0 * t)
        params["kernel"] = kernel0 * (1.0 + 0.5 * (t % 3))
        c = jax.random.normal(jax.random.PRNGKey(10 + t), (2, M // 2, N)) * 10.0 ** (t - 2)
        (_, out), (_, new_metas) = step(params, metas, x, c)
        y = np.asarray(te.layernorm(x, params["scale"], params["ln_bias"], epsilon=EPS))
        amaxes = {"x": np.abs(y).max(), "kernel": np.abs(params["kernel"]).max(),
                  "grad": np.abs(c).max()}
        used = {r: ref.step_scale(model[r][0], model[r][1], amaxes[r], fmts[r],
                                  fp8_recipe.margin) for r in model}
        expected_out = (ref.fake_quantize(y.reshape(M, K), used["x"], "float8_e4m3")
                        @ ref.fake_quantize(params["kernel"], used["kernel"], "float8_e4m3"))
        assert_close(np.asarray(out).reshape(M, N), expected_out, "fp8_exact")
        for r in model:
            history = model[r][0].copy()
            history[0] = amaxes[r]
            model[r] = ref.delayed_update(history, model[r][1], fmts[r], fp8_recipe.margin)
            np.testing.assert_array_equal(np.asarray(new_metas[f"{r}_amax_history"]), model[r][0])
            np.testing.assert_allclose(float(new_metas[f"{r}_scale"][0]), model[r][1], rtol=1e-6)
        metas = new_metas


def test_hlo_the_norm_writes_the_fp8_input():
    x, *_ = _inputs()
    layer = LayerNormDenseGeneral(features=N, use_bias=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        variables = layer.init(jax.random.PRNGKey(1), x)

        def loss(v, x):
            return jnp.sum(jnp.sin(layer.apply(v, x)[0]))

        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).compile().as_text()
    counts = hlo.target_counts(text)
    assert hlo.count_fp8_gemms(text) == 3
    # Each delayed-scaling cast comes with its first-step twin: the same op gated on the
    # role's history (one early return once the history holds an amax) and one scale call.
    assert counts["te_quantize_ffi"] == 1  # the kernel only: the norm writes x's FP8 data
    # (the call with dbias under its own target, left out of XLA's CUDA graphs; its gated
    # twin writes no dbias)
    assert counts["te_norm_forward_ffi"] == 2 and counts["te_activation_backward_ffi"] == 1
    assert counts["te_activation_backward_dbias_ffi"] == 1
    assert counts["te_compute_amax_ffi"] == 1  # the kernel's first-step amax


def test_bad_inputs_fail_at_trace_time():
    x, gamma, beta, kernel, bias, _ = _inputs()
    f = te.layernorm_dense
    with pytest.raises(ValueError, match="kernel's first dim must be x's last"):
        f(x, gamma, beta, kernel[:32])
    with pytest.raises(ValueError, match="bias must have shape"):
        f(x, gamma, beta, kernel, bias[:8])
    with pytest.raises(ValueError, match=r"layernorm_dense: gamma must have shape \(64,\)"):
        f(x, gamma[:8], beta, kernel)
    with pytest.raises(ValueError, match="layernorm_dense: beta must be None"):
        f(x, gamma, beta, kernel, norm_type="rmsnorm")
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        f(x.astype(jnp.int32), gamma, beta, kernel.astype(jnp.int32))
    with pytest.raises(TypeError, match="quantizer_set must be a QuantizerSet"):
        f(x, gamma, beta, kernel, quantizer_set="fp8")
    qset = te.make_quantizer_set(recipe.Float8CurrentScaling())
    with pytest.raises(ValueError, match="multiple of 16.*N=40"):
        jax.jit(lambda x, k: f(x, gamma, beta, k, quantizer_set=qset)).lower(x, kernel[:, :40])
    with pytest.raises(ValueError, match="needs an FP8 recipe"):
        te.layernorm_dense_fp8_operands(x, gamma, beta, kernel)
    with pytest.raises(ValueError, match="axis must be the last axis"):
        LayerNormDenseGeneral(features=8, axis=0).init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="layernorm_type must be"):
        LayerNormDenseGeneral(features=8, layernorm_type="batchnorm").init(
            jax.random.PRNGKey(0), x)
