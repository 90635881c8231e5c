"""layernorm and the flax LayerNorm against flax.linen.LayerNorm / RMSNorm (values and the
gradients of x, gamma and beta), under jit and grad; trace-time errors; the HLO custom calls."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._tolerances import assert_close

import transformer_engine.jax as te
from transformer_engine.common import core
from transformer_engine.jax import hlo
from transformer_engine.jax.flax import LayerNorm

EPS = 1e-6
# Hidden sizes 1, 17 (not a multiple of anything) and 1024; ranks 2 and 3.
SHAPES = [(6, 1), (2, 3, 17), (2, 4, 1024)]
TOL = {jnp.dtype(jnp.float32): "norm_float32", jnp.dtype(jnp.bfloat16): "bfloat16",
       jnp.dtype(jnp.float16): "float16"}


def _inputs(shape, dtype, seed=0):
    kx, kg, kb, kd = jax.random.split(jax.random.PRNGKey(seed), 4)
    n = shape[-1]
    x = (jax.random.normal(kx, shape, jnp.float32) * 2 + 0.5).astype(dtype)
    gamma = (1 + 0.3 * jax.random.normal(kg, (n,), jnp.float32)).astype(dtype)
    beta = (0.2 * jax.random.normal(kb, (n,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape, jnp.float32).astype(dtype)
    return x, gamma, beta, dy


def _flax_norm(norm_type, x, gamma, beta, zero_centered=False):
    """flax's layer in fp32 on the same (decoded) values."""
    scale = gamma.astype(jnp.float32) + (1.0 if zero_centered else 0.0)
    x = x.astype(jnp.float32)
    if norm_type == "layernorm":
        return nn.LayerNorm(epsilon=EPS).apply(
            {"params": {"scale": scale, "bias": beta.astype(jnp.float32)}}, x)
    return nn.RMSNorm(epsilon=EPS).apply({"params": {"scale": scale}}, x)


def _value_and_grads(fn, x, gamma, beta, dy):
    """fn's output and the gradients of <fn(x, gamma, beta), dy>, under one jit."""

    @jax.jit
    def run(x, gamma, beta, dy):
        y, vjp = jax.vjp(fn, x, gamma, beta)
        return (y, *vjp(dy.astype(y.dtype)))

    return run(x, gamma, beta, dy)


def _check(norm_type, dtype, shape, zero_centered=False):
    x, gamma, beta, dy = _inputs(shape, dtype)
    ours = _value_and_grads(
        lambda x, g, b: te.layernorm(x, g, b if norm_type == "layernorm" else None,
                                     norm_type=norm_type, zero_centered_gamma=zero_centered,
                                     epsilon=EPS), x, gamma, beta, dy)
    expected = _value_and_grads(lambda x, g, b: _flax_norm(norm_type, x, g, b, zero_centered),
                                x, gamma, beta, dy)
    assert ours[0].dtype == dtype and ours[0].shape == shape
    assert ours[1].dtype == dtype and ours[2].dtype == dtype and ours[3].dtype == dtype
    names = ("y", "dx", "dgamma", "dbeta") if norm_type == "layernorm" else ("y", "dx", "dgamma")
    for name, a, e in zip(names, ours, expected, strict=False):
        try:
            assert_close(a, e, TOL[jnp.dtype(dtype)])
        except AssertionError as err:
            raise AssertionError(f"{name} of {norm_type} {dtype.__name__} {shape}: {err}") from None
    if norm_type == "rmsnorm":
        np.testing.assert_array_equal(np.asarray(ours[3], np.float32), 0)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_matches_flax_values_and_gradients(norm_type, dtype, shape):
    _check(norm_type, dtype, shape)


@pytest.mark.parametrize("norm_type,dtype",
                         [("layernorm", jnp.float32), ("rmsnorm", jnp.bfloat16),
                          ("layernorm", jnp.float16)],
                         ids=["ln-fp32", "rms-bf16", "ln-fp16"])
def test_zero_centered_gamma(norm_type, dtype):
    _check(norm_type, dtype, (3, 5, 64), zero_centered=True)


def test_zero_centered_gamma_of_zeros_is_identity_scale():
    x, _, beta, _ = _inputs((4, 32), jnp.float32)
    plain = jax.jit(te.layernorm)(x, jnp.ones(32), beta)
    centered = jax.jit(lambda x, g, b: te.layernorm(x, g, b, zero_centered_gamma=True))(
        x, jnp.zeros(32), beta)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(centered))


def test_vmap_matches_the_batched_call():
    x, gamma, beta, _ = _inputs((3, 4, 16), jnp.float32)
    mapped = jax.jit(jax.vmap(te.layernorm, in_axes=(0, None, None)))(x, gamma, beta)
    np.testing.assert_array_equal(np.asarray(mapped), np.asarray(te.layernorm(x, gamma, beta)))


def test_float32_weights_with_bfloat16_input():
    x, gamma, beta, dy = _inputs((8, 48), jnp.bfloat16)
    g32, b32 = gamma.astype(jnp.float32), beta.astype(jnp.float32)
    y, dx, dg, db = _value_and_grads(lambda x, g, b: te.layernorm(x, g, b, epsilon=EPS),
                                     x, g32, b32, dy)
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16
    assert dg.dtype == jnp.float32 and db.dtype == jnp.float32
    expected = _value_and_grads(lambda x, g, b: _flax_norm("layernorm", x, g, b), x, g32, b32, dy)
    for a, e in zip((y, dx), expected[:2], strict=True):
        assert_close(a, e, "bfloat16")
    for a, e in zip((dg, db), expected[2:], strict=True):
        assert_close(a, e, "norm_float32")


def test_flax_module_params_and_values():
    x, _, _, _ = _inputs((2, 3, 40), jnp.float32)
    layer = LayerNorm(epsilon=EPS)
    variables = layer.init(jax.random.PRNGKey(0), x)
    params = variables["params"]
    assert set(params) == {"scale", "ln_bias"}
    np.testing.assert_array_equal(np.asarray(params["scale"]), 1)
    np.testing.assert_array_equal(np.asarray(params["ln_bias"]), 0)
    params = {"scale": jnp.linspace(0.5, 1.5, 40), "ln_bias": jnp.linspace(-1, 1, 40)}
    out = jax.jit(layer.apply)({"params": params}, x)
    expected = jax.jit(nn.LayerNorm(epsilon=EPS).apply)(
        {"params": {"scale": params["scale"], "bias": params["ln_bias"]}}, x)
    assert_close(out, expected, "norm_float32")
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x) ** 2)))(params)
    expected_grads = jax.jit(jax.grad(lambda p: jnp.sum(nn.LayerNorm(epsilon=EPS).apply(
        {"params": {"scale": p["scale"], "bias": p["ln_bias"]}}, x) ** 2)))(params)
    assert_close(grads["scale"], expected_grads["scale"], "norm_float32")
    assert_close(grads["ln_bias"], expected_grads["ln_bias"], "norm_float32")


def test_flax_module_rmsnorm_zero_centered_bf16():
    x, _, _, _ = _inputs((4, 24), jnp.float32)
    layer = LayerNorm(epsilon=EPS, layernorm_type="rmsnorm", zero_centered_gamma=True)
    variables = layer.init(jax.random.PRNGKey(0), x)
    assert set(variables["params"]) == {"scale"}
    assert variables["params"]["scale"].dtype == jnp.float32  # dtype: the parameters'
    np.testing.assert_array_equal(np.asarray(variables["params"]["scale"]), 0)
    assert jax.jit(layer.apply)(variables, x).dtype == jnp.float32  # the input's dtype
    out = jax.jit(layer.apply)(variables, x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    expected = jax.jit(nn.RMSNorm(epsilon=EPS).apply)({"params": {"scale": jnp.ones(24)}},
                                                      x.astype(jnp.bfloat16).astype(jnp.float32))
    assert_close(out, expected, "bfloat16")


def test_hlo_holds_the_norm_custom_calls():
    x, gamma, beta, _ = _inputs((4, 32), jnp.float32)
    loss = jax.grad(lambda x, g, b: jnp.sum(te.layernorm(x, g, b) ** 2), argnums=(0, 1, 2))
    text = jax.jit(loss).lower(x, gamma, beta).compile().as_text()
    counts = hlo.target_counts(text)
    assert counts["te_norm_forward_ffi"] == 1 and counts["te_norm_backward_ffi"] == 1
    # The backward's CUDA workspace is a result of the call, sized by the core.
    ws = core().norm_backward_workspace_size(4, 32)
    backward = [line for line in text.splitlines() if '"te_norm_backward_ffi"' in line]
    assert len(backward) == 1 and f"u8[{ws}]" in backward[0]


@pytest.mark.parametrize("bad", [(31,), (32, 1), ()], ids=["short", "rank2", "scalar"])
def test_bad_gamma_shape_fails_at_trace_time(bad):
    x = jnp.ones((4, 32))
    with pytest.raises(ValueError, match=r"gamma must have shape \(32,\)"):
        jax.jit(te.layernorm).lower(x, jnp.ones(bad), jnp.zeros(32))


def test_argument_errors():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="beta is required"):
        te.layernorm(x, jnp.ones(8))
    with pytest.raises(ValueError, match="beta must be None"):
        te.layernorm(x, jnp.ones(8), jnp.zeros(8), norm_type="rmsnorm")
    with pytest.raises(ValueError, match=r"beta must have shape \(8,\)"):
        te.layernorm(x, jnp.ones(8), jnp.zeros(9))
    with pytest.raises(ValueError, match="norm_type must be"):
        te.layernorm(x, jnp.ones(8), jnp.zeros(8), norm_type="batchnorm")
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        te.layernorm(jnp.ones((4, 8), jnp.int32), jnp.ones(8), jnp.zeros(8))
    with pytest.raises(ValueError, match="layernorm_type must be"):
        LayerNorm(layernorm_type="batchnorm").init(jax.random.PRNGKey(0), x)
