"""The activation custom calls against jax.nn (values, gradients, bias gradients), their FP8
outputs against the quantization custom call and the numpy model, and the norm forward's
FP8 output against the quantization of its high-precision output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests import _reference as ref
from te_jax_tests._flax_reference import JAX_ACTIVATIONS
from te_jax_tests._tolerances import assert_close

import transformer_engine.jax as te
from transformer_engine.jax import ops

A = ops.Activation


TOL = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}


def _inputs(act, dtype, m=24, n=40, seed=0):
    k = 2 * n if ops.is_gated(act) else n
    kx, kd = jax.random.split(jax.random.PRNGKey(seed))
    x = (jax.random.normal(kx, (m, k), jnp.float32) * 2.5).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    return x, dy


# Every activation in fp32 (clamped SwiGLU, the one with parameters, has its own tests:
# test_clamped_swiglu.py); in bf16 (one rounding of the fp32 result) three of them.
CASES = ([(act, jnp.float32) for act in A if act != A.CLAMPED_SWIGLU]
         + [(act, jnp.bfloat16) for act in (A.GELU, A.SWIGLU, A.QGELU)])


@pytest.mark.parametrize("act, dtype", CASES,
                         ids=[f"{a.name.lower()}-{jnp.dtype(d).name}" for a, d in CASES])
def test_forward_backward_and_dbias_match_jax(act, dtype):
    x, dy = _inputs(act, dtype)

    @jax.jit
    def ours(x, dy):
        y, amax = ops.activation_forward(x, act, compute_amax=True)
        dx, dbias, dx_amax = ops.activation_backward(dy, x, act, dbias_dtype=jnp.float32,
                                                     compute_amax=True)
        return y, amax, dx, dbias, dx_amax

    y, amax, dx, dbias, dx_amax = ours(x, dy)
    # The reference in fp32 from the same decoded values, rounded once like the core.
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    y_ref, vjp = jax.vjp(JAX_ACTIVATIONS[act], x32)
    (dx_ref,) = vjp(dy32)
    assert y.dtype == dtype and y.shape == y_ref.shape and dx.shape == x.shape
    assert_close(y, y_ref.astype(dtype), TOL[jnp.dtype(dtype)])
    assert_close(dx, dx_ref.astype(dtype), TOL[jnp.dtype(dtype)])
    # amax and dbias are taken from the fp32 values, before the rounding to dtype.
    assert_close(amax, jnp.max(jnp.abs(y_ref)), "float32")
    assert_close(dx_amax, jnp.max(jnp.abs(dx_ref)), "float32")
    assert_close(dbias, jnp.sum(dx_ref, axis=0), "float32")


@pytest.mark.parametrize("act", [A.GELU, A.SWIGLU, A.SRELU], ids=lambda a: a.name.lower())
def test_fp8_outputs_are_the_quantization_of_the_fp32_result(act):
    x, dy = _inputs(act, jnp.float32)
    scale = jnp.array([3.0], jnp.float32)

    @jax.jit
    def f(x, dy):
        q = ops.activation_forward_fp8(x, act, scale, jnp.float8_e4m3fn)
        y = ops.activation_forward(x, act)
        g, dbias = ops.activation_backward_fp8(dy, x, act, scale, jnp.float8_e5m2,
                                               dbias_dtype=jnp.float32)
        dx, dbias_hp, _ = ops.activation_backward(dy, x, act, dbias_dtype=jnp.float32)
        return q, y, g, dbias, dx, dbias_hp

    q, y, g, dbias, dx, dbias_hp = f(x, dy)
    for qt, hp, fmt in ((q, y, "float8_e4m3"), (g, dx, "float8_e5m2")):
        expected = ref.quantize(np.asarray(hp), 3.0, fmt)
        np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8), expected.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(qt.columnwise_data).view(np.uint8),
                                      expected.T.view(np.uint8))
        assert float(qt.scale_inv[0]) == np.float32(1 / 3.0)
        assert float(qt.amax[0]) == float(np.max(np.abs(np.asarray(hp))))
    np.testing.assert_array_equal(np.asarray(dbias), np.asarray(dbias_hp))


def test_identity_backward_is_the_fused_bias_gradient_cast_and_transpose():
    dy = jax.random.normal(jax.random.PRNGKey(3), (48, 32), jnp.bfloat16)
    q, dbias = jax.jit(lambda dy: ops.activation_backward_fp8(
        dy, None, A.IDENTITY, jnp.ones((1,)), jnp.float8_e5m2, dbias_dtype=jnp.bfloat16))(dy)
    expected = ref.quantize(np.asarray(dy, np.float32), 1.0, "float8_e5m2")
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), expected.view(np.uint8))
    assert dbias.dtype == jnp.bfloat16
    assert_close(dbias, jnp.sum(dy.astype(jnp.float32), axis=0), "bfloat16")


def test_only_the_transpose_can_be_asked_for():
    x, _ = _inputs(A.RELU, jnp.float32)
    q = ops.activation_forward_fp8(x, A.RELU, jnp.ones((1,)), jnp.float8_e4m3fn, rowwise=False,
                                   compute_amax=False)
    assert q.data.size == 0 and q.amax.size == 0
    expected = ref.quantize(np.maximum(np.asarray(x), 0), 1.0, "float8_e4m3")
    np.testing.assert_array_equal(np.asarray(q.columnwise_data).view(np.uint8),
                                  expected.T.view(np.uint8))


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_norm_fp8_output_is_the_quantization_of_its_output(norm_type):
    x = jax.random.normal(jax.random.PRNGKey(0), (40, 96)) * 2 + 0.5
    gamma = 1 + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (96,))
    beta = 0.2 * jax.random.normal(jax.random.PRNGKey(2), (96,))
    kind = ops.NormType.LAYERNORM if norm_type == "layernorm" else ops.NormType.RMSNORM
    b = beta if norm_type == "layernorm" else None
    y, q, mu, rsigma = jax.jit(lambda x: ops.norm_forward_fp8(
        x, gamma, b, jnp.array([5.0]), jnp.float8_e4m3fn, norm_type=kind, write_output=True))(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(te.layernorm(x, gamma, b,
                                                                         norm_type=norm_type)))
    expected = ref.quantize(np.asarray(y), 5.0, "float8_e4m3")
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), expected.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.columnwise_data).view(np.uint8),
                                  expected.T.view(np.uint8))
    assert float(q.amax[0]) == float(np.max(np.abs(np.asarray(y))))
    assert float(q.scale_inv[0]) == np.float32(0.2)
    # Without write_output only the FP8 data comes back.
    y2, q2, _, _ = ops.norm_forward_fp8(x, gamma, b, jnp.array([5.0]), jnp.float8_e4m3fn,
                                        norm_type=kind)
    assert y2 is None
    np.testing.assert_array_equal(np.asarray(q2.data).view(np.uint8), expected.view(np.uint8))


def test_bad_activation_inputs_fail_at_trace_time():
    with pytest.raises(ValueError, match="even last dimension"):
        jax.jit(lambda x: ops.activation_forward(x, A.SWIGLU)).lower(jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="grad_output must have shape"):
        ops.activation_backward(jnp.ones((4, 4)), jnp.ones((4, 4)), A.GEGLU)
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        ops.activation_forward_fp8(jnp.ones((4, 4)), A.GELU, jnp.ones((1,)), jnp.bfloat16)
