"""The custom calls (transformer_engine.jax.ops) against numpy models, on jax's default device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from te_jax_tests import _reference as ref
from te_jax_tests._tolerances import assert_close

import transformer_engine.jax  # noqa: F401  (registers the targets)
from transformer_engine.jax import ops

FORMATS = {"float8_e4m3": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 48), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_quantize_with_transpose_and_amax(fmt, shape, dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 30).astype(dtype)
    x.flat[0] = 1e6  # saturates
    scale = np.float32(3.5)
    q = jax.jit(lambda x, s: ops.quantize(x, s, FORMATS[fmt], rowwise=True, columnwise=True))(
        x, jnp.array([scale]))
    expected = ref.quantize(np.asarray(x, np.float32), scale, fmt)
    np.testing.assert_array_equal(_bits(q.data), expected.view(np.uint8))
    m = int(np.prod(shape[:-1]))
    np.testing.assert_array_equal(_bits(q.columnwise_data),
                                  expected.reshape(m, shape[-1]).T.view(np.uint8))
    assert float(q.scale_inv[0]) == np.float32(1) / scale
    assert float(q.amax[0]) == np.abs(np.asarray(x, np.float32)).max()


def test_quantize_leaves_unrequested_results_empty():
    q = ops.quantize(jnp.ones((16, 32)), jnp.ones((1,)), jnp.float8_e4m3fn, rowwise=False,
                     columnwise=True, compute_amax=False)
    assert q.data.shape == (0,) and q.amax.shape == (0,) and q.columnwise_data.shape == (32, 16)


def test_dequantize_round_trip():
    x = np.linspace(-10, 10, 64, dtype=np.float32).reshape(4, 16)
    q = ops.quantize(x, jnp.array([2.0]), jnp.float8_e4m3fn)
    out = ops.dequantize(q.data, q.scale_inv, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), ref.fake_quantize(x, 2.0, "float8_e4m3"))


def test_block_quantize_matches_per_block_current_scaling():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q = ops.quantize(x, None, jnp.float8_e4m3fn, scaling_mode=ops.ScalingMode.BLOCK_1X128,
                     rowwise=True, columnwise=False, compute_amax=False)
    assert q.scale_inv.shape == (4, 2)
    for r in range(4):
        for b in range(2):
            block = x[r, 128 * b:128 * (b + 1)]
            s = ref.scale_from_amax(float(np.abs(block).max()), "float8_e4m3")
            assert float(q.scale_inv[r, b]) == np.float32(1) / np.float32(s)
            np.testing.assert_array_equal(_bits(q.data)[r, 128 * b:128 * (b + 1)],
                                          ref.quantize(block, s, "float8_e4m3").view(np.uint8))


@pytest.mark.parametrize("amax, epsilon, pow2", [(3.0, 0.0, False), (3.0, 0.0, True),
                                                 (0.0, 0.0, False), (1e-3, 0.5, False),
                                                 (float("inf"), 0.0, False),
                                                 (float("nan"), 0.0, False), (1e-30, 0.0, False)])
# No subnormal amax here: XLA's CPU runtime runs custom calls with denormals flushed to zero,
# so a subnormal amax reads as 0 (scale 1) under jax; the core's own tests cover that case.
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_compute_amax_and_scale_from_amax(amax, epsilon, pow2, fmt):
    x = jnp.array([[0.25 * amax, -amax], [amax / 2, 0.0]], jnp.float32)
    a = ops.compute_amax(x)
    if np.isnan(amax):
        assert np.isnan(float(a[0]))
    else:
        assert float(a[0]) == np.float32(amax)
    scale, scale_inv = ops.scale_from_amax(jnp.array([amax], jnp.float32), FORMATS[fmt],
                                           force_pow2_scales=pow2, amax_epsilon=epsilon)
    expected = ref.scale_from_amax(amax, fmt, epsilon, pow2)
    assert float(scale[0]) == np.float32(expected)
    assert float(scale_inv[0]) == np.float32(1) / np.float32(expected)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scaling_update_of_several_tensors(algo, margin):
    histories = [np.array([2.0, 0.5, 8.0], np.float32), np.array([0.0, 0.0, 0.0], np.float32),
                 np.array([np.inf, 1.0, 1.0], np.float32)]
    scales = [np.array([1.0], np.float32), np.array([4.0], np.float32), np.array([2.0], np.float32)]
    args = jax.device_put((histories, scales))
    h, s, si = jax.jit(lambda h, s: ops.delayed_scaling_update(h, s, jnp.float8_e4m3fn, algo=algo,
                                                              margin=margin))(*args)
    # The input arrays are untouched: the core updated XLA's copies (the aliased results).
    for a, e in zip(jax.tree.leaves(args), jax.tree.leaves((histories, scales)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), e)
    for i in range(3):
        eh, es = ref.delayed_update(histories[i], float(scales[i][0]), "float8_e4m3", margin, algo)
        np.testing.assert_array_equal(np.asarray(h[i]), eh)
        assert float(s[i][0]) == np.float32(es)
        assert float(si[i][0]) == np.float32(1) / np.float32(es)


def test_delayed_scaling_update_with_amaxes_records_each_step_amax():
    """One call, two formats: each history as if its step amax had been maxed into slot 0 (NaN
    kept) and the history updated alone with its own format."""
    histories = [np.array([3.0, 0.5, 8.0], np.float32), np.array([0.0, 1.0, 0.0], np.float32),
                 np.array([1.0, 2.0, 4.0], np.float32)]
    amaxes = [np.array([9.0], np.float32), np.array([np.nan], np.float32),
              np.array([0.5], np.float32)]
    scales = [np.array([1.0], np.float32), np.array([4.0], np.float32), np.array([2.0], np.float32)]
    dtypes = [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e5m2]
    args = jax.device_put((histories, amaxes, scales))
    h, s, si = jax.jit(lambda h, a, s: ops.delayed_scaling_update_with_amaxes(h, a, s, dtypes,
                                                                              margin=1))(*args)
    for a, e in zip(jax.tree.leaves(args), jax.tree.leaves((histories, amaxes, scales)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), e)  # the inputs are untouched
    for i, name in enumerate(["float8_e4m3", "float8_e5m2", "float8_e5m2"]):
        recorded = histories[i].copy()
        recorded[0] = np.nan if np.isnan(amaxes[i][0]) else max(recorded[0], amaxes[i][0])
        eh, es = ref.delayed_update(recorded, float(scales[i][0]), name, 1, "max")
        np.testing.assert_array_equal(np.asarray(h[i]), eh)
        assert float(s[i][0]) == np.float32(es)
        assert float(si[i][0]) == np.float32(1) / np.float32(es)
    with pytest.raises(ValueError, match="dtypes must have one entry per history"):
        ops.delayed_scaling_update_with_amaxes(histories, amaxes, scales, dtypes[:2])


@pytest.mark.parametrize("transpose_a, transpose_b", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_high_precision_gemm(transpose_a, transpose_b, dtype):
    rng = np.random.default_rng(2)
    m, k, n = 24, 40, 8
    a = rng.standard_normal((k, m) if transpose_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if transpose_b else (k, n)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    d = ops.gemm(jnp.asarray(a), jnp.asarray(b), transpose_a=transpose_a,
                 transpose_b=transpose_b, bias=jnp.asarray(bias))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    op_a, op_b = (a64.T if transpose_a else a64), (b64.T if transpose_b else b64)
    expected = op_a @ op_b + bias.astype(np.float64)
    assert d.dtype == jnp.dtype(dtype) and d.shape == (m, n)
    assert_close(np.asarray(d, np.float64), expected, dtype)


@pytest.mark.parametrize("a_fmt, b_fmt", [("float8_e4m3", "float8_e4m3"),
                                          ("float8_e5m2", "float8_e4m3"),
                                          ("float8_e4m3", "float8_e5m2")])
def test_fp8_gemm_and_output_amax(a_fmt, b_fmt):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((32, 48)).astype(np.float32)
    b = rng.standard_normal((16, 48)).astype(np.float32)
    qa = ops.quantize(a, jnp.array([8.0]), FORMATS[a_fmt])
    qb = ops.quantize(b, jnp.array([16.0]), FORMATS[b_fmt])
    d, amax = ops.gemm(qa.data, qb.data, a_scale_inv=qa.scale_inv, b_scale_inv=qb.scale_inv,
                       transpose_b=True, out_dtype=jnp.float32, compute_amax=True)
    expected = ref.fake_quantize(a, 8.0, a_fmt) @ ref.fake_quantize(b, 16.0, b_fmt).T
    assert_close(d, expected, "fp8_exact")
    assert_close(amax, [np.abs(expected).max()], "fp8_exact")


def _amax_raising_calls(x, scale, amax_into):
    """Each op that casts a tensor and gives its amax, with ``amax_into``: (name, amax)."""
    gamma, beta = jnp.ones(x.shape[-1], x.dtype), jnp.zeros(x.shape[-1], x.dtype)
    e4m3, e5m2, gelu = jnp.float8_e4m3fn, jnp.float8_e5m2, ops.Activation.GELU
    return {
        "quantize": ops.quantize(x, scale, e4m3, amax_into=amax_into).amax,
        "norm_forward_fp8": ops.norm_forward_fp8(x, gamma, beta, scale, e4m3,
                                                 amax_into=amax_into)[1].amax,
        "activation_forward_fp8": ops.activation_forward_fp8(x, gelu, scale, e4m3,
                                                             amax_into=amax_into).amax,
        "activation_backward_fp8": ops.activation_backward_fp8(x, x, gelu, scale, e5m2,
                                                               amax_into=amax_into)[0].amax,
    }


@pytest.mark.parametrize("given", [0.0, 0.5, 1e6, np.nan], ids=["zero", "below", "above", "nan"])
def test_amax_into_raises_the_given_amax(given):
    """amax_into gives max(amax_into, the call's amax), NaN kept, under jit (where the
    argument's buffer is the result's) and eagerly; the casts themselves are unchanged."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 48)), jnp.bfloat16)
    scale = jnp.array([2.0], jnp.float32)
    own = _amax_raising_calls(x, scale, None)
    given = jnp.array([given], jnp.float32)
    for raised in (_amax_raising_calls(x, scale, given),
                   jax.jit(lambda a: _amax_raising_calls(x, scale, a))(given)):
        for name, amax in raised.items():
            want = np.nan if np.isnan(given[0]) else max(float(given[0]), float(own[name][0]))
            np.testing.assert_array_equal(np.asarray(amax), np.float32([want]), err_msg=name)
    q0 = ops.quantize(x, scale, jnp.float8_e4m3fn)
    q1 = ops.quantize(x, scale, jnp.float8_e4m3fn, amax_into=jnp.array([9.0], jnp.float32))
    np.testing.assert_array_equal(np.asarray(q0.data, np.float32), np.asarray(q1.data, np.float32))


def test_amax_into_leaves_its_argument_as_it_was():
    given = jnp.array([0.25], jnp.float32)
    x = jnp.full((16, 16), 3.0, jnp.float32)
    amax = jax.jit(lambda a: ops.quantize(x, jnp.ones(1, jnp.float32), jnp.float8_e4m3fn,
                                          amax_into=a).amax)(given)
    assert float(amax[0]) == 3.0 and float(given[0]) == 0.25


def test_amax_into_is_checked_at_trace_time():
    x, scale = jnp.ones((16, 16)), jnp.ones((1,))
    with pytest.raises(ValueError, match="quantize: amax_into needs compute_amax=True"):
        ops.quantize(x, scale, jnp.float8_e4m3fn, compute_amax=False, amax_into=jnp.zeros(1))
    with pytest.raises(ValueError, match=r"activation_forward: amax_into must be a \[1\]"):
        ops.activation_forward_fp8(x, ops.Activation.GELU, scale, jnp.float8_e4m3fn,
                                   amax_into=jnp.zeros(2))


def test_core_errors_reach_python_with_the_core_message():
    # An FP8 GEMM with M = 8: the core's check (not ours) rejects it at run time.
    q = ops.quantize(jnp.ones((8, 16)), jnp.ones((1,)), jnp.float8_e4m3fn)
    qb = ops.quantize(jnp.ones((16, 16)), jnp.ones((1,)), jnp.float8_e4m3fn)
    with pytest.raises(Exception, match="multiple of 16"):
        jax.block_until_ready(ops.gemm(q.data, qb.data, a_scale_inv=q.scale_inv,
                                       b_scale_inv=qb.scale_inv, transpose_b=True,
                                       out_dtype=jnp.float32))


def test_gemm_shape_mismatch_is_caught_at_trace_time():
    with pytest.raises(ValueError, match="contraction dimensions"):
        jax.jit(lambda a, b: ops.gemm(a, b)).lower(jnp.ones((4, 8)), jnp.ones((6, 4)))


def test_a_missing_extension_gives_an_import_error_that_says_how_to_install(monkeypatch):
    import sys

    from transformer_engine.jax import _native

    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.delattr(transformer_engine.jax, "_te_jax")
    monkeypatch.setitem(sys.modules, "transformer_engine.jax._te_jax", None)
    with pytest.raises(ImportError, match="Install the wheel 'transformer-engine-jax'"):
        _native.load()


def test_every_target_is_registered_for_cpu_and_cuda():
    from transformer_engine.jax import _native

    registrations = _native.load().registrations()
    assert set(registrations) == set(_native.TARGETS.values())
    assert all(set(p) == {"cpu", "CUDA"} for p in registrations.values())
