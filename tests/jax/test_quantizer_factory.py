"""NVIDIA's quantizer objects (transformer_engine.jax.quantize.QuantizerFactory and friends):
the FP8 bytes they make against the core's quantize with the scale each mode implies, the
delayed-scaling update against the recipe's rule, and the quantizer sets against the recipes'
own sets in te.dense, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import ops
from transformer_engine.jax.quantize import (
    QuantizeLayout,
    QuantizerFactory,
    ScalingMode,
    noop_quantizer_set,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
X = jax.random.normal(jax.random.PRNGKey(0), (2, 48, 256)) * 3.0
# Values far below the scale's amax land among FP8's subnormals: absolute error up to half
# their spacing (E4M3: 2^-10 of the amax's 448), 2^-17 of the amax covers it.
ATOL = float(jnp.abs(X).max()) * 2.0**-17


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_current_scaling_quantizer_is_the_core_quantize_with_the_amax_scale(dtype):
    q = QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, q_dtype=dtype)
    t = q.quantize(X)
    x2 = X.reshape(96, 256)
    scale, scale_inv = ops.scale_from_amax(ops.compute_amax(x2), dtype)
    want = ops.quantize(x2, scale, dtype, rowwise=True, columnwise=True)
    np.testing.assert_array_equal(_bits(t.data), _bits(want.data.reshape(X.shape)))
    np.testing.assert_array_equal(_bits(t.colwise_data), _bits(want.columnwise_data))
    np.testing.assert_array_equal(np.asarray(t.scale_inv), np.asarray(scale_inv))
    assert t.dequantize().shape == X.shape and t.dequantize().dtype == X.dtype
    # One FP8 rounding of each value (2^-4 / 2^-3 relative): the same values both ways.
    eps = 2.0**-4 if dtype == E4M3 else 2.0**-3
    np.testing.assert_allclose(t.dequantize(), X, rtol=eps, atol=ATOL)
    col = q.quantize(X, is_rowwise=False)
    assert col.data is None
    np.testing.assert_array_equal(np.asarray(col.dequantize()), np.asarray(t.dequantize()))


def test_delayed_quantizer_uses_its_scale_and_its_update_follows_the_recipe():
    q = QuantizerFactory.create(scaling_mode=ScalingMode.DELAYED_TENSOR_SCALING, q_dtype=E4M3,
                                amax_history_len=4, margin=1)
    assert float(q.scale[0]) == 1.0 and q.amax_history.shape == (4,)
    t = q.quantize(X)
    want = ops.quantize(X.reshape(96, 256), jnp.ones((1,), jnp.float32), E4M3)
    np.testing.assert_array_equal(_bits(t.data), _bits(want.data.reshape(X.shape)))
    amax = float(jnp.abs(X).max())
    assert float(t.amax[0]) == amax
    q2 = q.update(t.amax)
    # The recipe's rule: 448 / max(history) / 2^margin (the core's update; rolled history).
    assert float(q2.scale[0]) == pytest.approx(448.0 / amax / 2.0, rel=1e-6)
    assert float(jnp.max(q2.amax_history)) == amax
    t2 = jax.jit(lambda q, x: q.quantize(x))(q2, X)  # quantizers are pytrees
    np.testing.assert_allclose(float(t2.scale_inv[0]), 1.0 / float(q2.scale[0]), rtol=1e-6)
    cur = QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, q_dtype=E4M3)
    assert cur.update(t.amax) is cur


@pytest.mark.parametrize("mode", [ScalingMode.BLOCK_1X128_SCALING,
                                  ScalingMode.BLOCK_128X128_SCALING,
                                  ScalingMode.MXFP8_1D_SCALING])
def test_block_quantizers_are_the_core_block_quantize(mode):
    q = QuantizerFactory.create(scaling_mode=mode, q_dtype=E4M3,
                                q_layout=QuantizeLayout.ROWWISE_COLWISE)
    t = q.quantize(X)
    want = ops.quantize(X.reshape(96, 256), None, E4M3, scaling_mode=mode.core_mode,
                        rowwise=True, columnwise=True)
    np.testing.assert_array_equal(_bits(t.data), _bits(want.data.reshape(X.shape)))
    np.testing.assert_array_equal(_bits(t.colwise_data), _bits(want.columnwise_data))
    for copy in (t, q.quantize(X, is_rowwise=False)):
        np.testing.assert_allclose(copy.dequantize(), X, rtol=2.0**-4, atol=ATOL)


def test_flatten_axis_picks_the_matrix_view():
    q = QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING, q_dtype=E4M3,
                                q_layout=QuantizeLayout.COLWISE)
    t = q.quantize(X, flatten_axis=1)  # [2, 48 * 256]: the transpose is [48 * 256, 2]
    assert t.data is None and t.colwise_data.shape == (48 * 256, 2)
    np.testing.assert_allclose(t.dequantize(), X, rtol=2.0**-4, atol=ATOL)
    with pytest.raises(ValueError, match="flatten_axis must split x's dims into two non-empty"):
        q.quantize(X, flatten_axis=0)


@pytest.mark.parametrize("mode, cls", [
    (ScalingMode.CURRENT_TENSOR_SCALING, recipe.Float8CurrentScaling),
    (ScalingMode.DELAYED_TENSOR_SCALING, recipe.DelayedScaling),
    (ScalingMode.BLOCK_1X128_SCALING, recipe.Float8BlockScaling),
])
def test_quantizer_sets_are_the_recipes_sets_in_dense(mode, cls):
    qset = QuantizerFactory.create_set(scaling_mode=mode, fwd_dtype=E4M3, bwd_dtype=E5M2)
    assert isinstance(qset.recipe, cls) and qset.recipe.fp8_format == recipe.Format.HYBRID
    kernel = jax.random.normal(jax.random.PRNGKey(1), (256, 128)) * 0.05
    r = cls(fp8_format=recipe.Format.HYBRID)
    mine = te.make_quantizer_set(r, te.new_fp8_state(r), use_autocast=False)

    def loss(qs, x, k):
        return jnp.sum(te.dense(x, k, quantizer_set=qs) ** 2)

    got = jax.grad(loss, argnums=(1, 2))(qset, X, kernel)
    want = jax.grad(loss, argnums=(1, 2))(mine, X, kernel)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    e4m3 = QuantizerFactory.create_set(scaling_mode=mode, fwd_dtype=E4M3, bwd_dtype=E4M3)
    assert e4m3.recipe.fp8_format == recipe.Format.E4M3
    pair = QuantizerFactory.create_set(n_quantizer_sets=2, scaling_mode=mode)
    assert len(pair) == 2 and pair[0].recipe == qset.recipe


def test_sets_without_a_mode_follow_the_autocast():
    assert QuantizerFactory.create_set().recipe is None
    assert noop_quantizer_set.recipe is None
    assert QuantizerFactory.create_set(scaling_mode=ScalingMode.NO_SCALING).recipe is None
    r = recipe.Float8CurrentScaling()
    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        assert QuantizerFactory.create_set().recipe == r
    assert QuantizerFactory.create_set(fp8_recipe=r).recipe == r
    assert QuantizerFactory.create(scaling_mode=ScalingMode.NO_SCALING) is None


@pytest.mark.parametrize("call, error, message", [
    (lambda: QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING,
                                     q_dtype=E4M3, n_groups=4),
     NotImplementedError, r"QuantizerFactory.create: n_groups=4: grouped quantizers"),
    (lambda: QuantizerFactory.create(scaling_mode=ScalingMode.NVFP4_1D_SCALING, q_dtype=E4M3),
     NotImplementedError, r"QuantizerFactory.create: NVFP4_1D_SCALING \(FP4 data\)"),
    (lambda: QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING,
                                     q_dtype=jnp.bfloat16),
     TypeError, r"QuantizerFactory.create: q_dtype must be jnp.float8_e4m3fn or "
                r"jnp.float8_e5m2, got dtype\(bfloat16\)"),
    (lambda: QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING,
                                     q_dtype=E4M3, margin=1),
     TypeError, r"QuantizerFactory.create: \['margin'\] belong to delayed scaling"),
    (lambda: QuantizerFactory.create_set(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING,
                                         fwd_dtype=E5M2, bwd_dtype=E5M2),
     ValueError, r"QuantizerFactory.create_set: \(fwd_dtype, bwd_dtype\) must be \(e4m3, "
                 r"e4m3\) or \(e4m3, e5m2\)"),
    (lambda: QuantizerFactory.create_set(scaling_mode="nope"),
     TypeError, r"QuantizerFactory.create_set: scaling_mode must be a ScalingMode"),
    (lambda: QuantizerFactory.create_set(quantize_meta_set=None),
     TypeError, r"QuantizerFactory.create_set: unexpected keywords \['quantize_meta_set'\]"),
])
def test_bad_arguments_are_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
