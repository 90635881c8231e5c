"""Clamped SwiGLU (activation.h's CLAMPED_SWIGLU, the one activation with parameters) against a
float64 formula, forward and backward, on the CPU and on CUDA (bit for bit with the CPU there).

    y = g sigmoid(alpha g) * (u + linear_offset),  g = min(a, limit),  u = clamp(b, -limit, limit)

Its gradient passes at the bounds themselves and is zero beyond them, as torch.clamp's is.
FP8 outputs are checked byte for byte against the quantization of the core's own fp32 values,
as test_activation.py does for the other activations.
"""

from __future__ import annotations

import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

ACT = core.Activation.clamped_swiglu
# (limit, alpha, linear_offset): NVIDIA TE's and GPT-OSS's defaults, a small limit, and the
# offset-free form.
PARAMS = [(7.0, 1.702, 1.0), (0.75, 1.702, 1.0), (2.5, 0.5, 0.0)]
SENTINEL = 0xA5


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def expected(x, params, g=None):
    """float64 (want, bound) of the output (g None) or of grad_input [d/da, d/db]."""
    limit, alpha, offset = (float(np.float32(p)) for p in params)
    x = x.astype(np.float64)
    n = x.shape[1] // 2
    a, b = x[:, :n], x[:, n:]
    with np.errstate(all="ignore"):
        gate = np.minimum(a, limit)
        finite = np.where(np.isneginf(gate), -1e300, gate)  # f(-inf) = -0, f'(-inf) = 0
        z = alpha * finite
        s = _sigmoid(z)
        f = np.where(np.isneginf(gate), -0.0, finite * s)
        u = np.clip(b, -limit, limit) + offset
        # The core's error: a few fp32 roundings (2^-20 covers them) and exp's conditioning,
        # |z| 2^-20 on sigmoid(-z) of the sigmoid; u + offset is one more rounding.
        rel_f = 2.0**-20 * (1.0 + np.abs(z) * _sigmoid(-z)) + 2.0**-23
        tiny = 2.0**-134
        if g is None:
            return f * u, rel_f * np.abs(f * u) + tiny * np.abs(u)
        g = g.astype(np.float64)
        t1, t2 = s, alpha * finite * s * _sigmoid(-z)
        d = np.where(a > limit, 0.0, np.where(np.isneginf(gate), 0.0, t1 + t2))
        err_d = (2.0**-20 * (np.abs(t1) + np.abs(t2)) * (1.0 + np.abs(z))
                 + 2.0**-23 * np.abs(d))
        pass_b = np.where(np.abs(b) <= limit, 1.0, np.where(np.isnan(b), np.nan, 0.0))
        da, db = g * d * u, g * f * pass_b
        bound_a = err_d * np.abs(g * u) + tiny * np.abs(g)
        bound_b = rel_f * np.abs(db) + tiny * np.abs(g)
    return np.hstack([da, db]), np.hstack([bound_a, bound_b])


def run(device, x, params, g=None, fmt=None, scale=1.0, dbias=False):
    rows, cols = x.shape
    n = cols // 2 if g is None else cols
    arrays = {"amax": np.array([-7.0], np.float32)}
    if fmt is None:
        arrays["data"] = np.full((rows, n), 7, np.float32)
    else:
        arrays["scale"] = np.array([scale], np.float32)
        arrays["scale_inv"] = np.array([-1.0], np.float32)
        arrays["data"] = np.full((rows, n), SENTINEL, np.uint8)
        arrays["columnwise_data"] = np.full((n, rows), SENTINEL, np.uint8)
    on_device = {k: device.put(v) for k, v in arrays.items()}
    out = core.Tensor(dtype=None if fmt is None else getattr(core.DType, "float8_" + fmt.name),
                      **on_device)
    db = device.put(np.full((n,), 7, np.float32)) if dbias else None
    if g is None:
        core.activation_forward(ACT, device.put(x), out, params=params, stream=device.stream)
    else:
        core.activation_backward(ACT, device.put(g), device.put(x), out, dbias=db,
                                 params=params, stream=device.stream)
    got = {k: device.get(v) for k, v in on_device.items()}
    if db is not None:
        got["dbias"] = device.get(db)
    return got


def inputs(seed, rows=144, n=136, limit=7.0):
    """a and b spread around the clamps (both signs, within and beyond), some exactly at them."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3 * limit, 3 * limit, size=(rows, 2 * n)).astype(np.float32)
    x.flat[::17] = np.float32(limit)
    x.flat[5::23] = -np.float32(limit)
    g = rng.standard_normal((rows, n)).astype(np.float32)
    return x, g


def assert_close(got, want, bound, what):
    got = got.astype(np.float64).reshape(want.shape)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN")
    fin = ~np.isnan(want)
    bad = np.flatnonzero(np.abs(got[fin] - want[fin]) > bound[fin])
    assert bad.size == 0, (f"{what}: {bad.size} out of bounds, first got {got[fin][bad[0]]!r} "
                           f"want {want[fin][bad[0]]!r}")


def check_cuda_matches_cpu(device, got, again):
    if device.is_cuda:
        on_cpu = again(device.cpu)
        for name in got:
            ref.assert_same_bits(got[name], on_cpu[name], f"{name}, CUDA vs CPU")


@pytest.mark.parametrize("params", PARAMS, ids=str)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_values_against_float64(device, direction, params):
    x, g = inputs(1, limit=params[0])
    g = g if direction == "backward" else None

    def again(d):
        return run(d, x, params, g, dbias=g is not None)

    got = again(device)
    want, bound = expected(x, params, g)
    assert_close(got["data"], want, bound, f"{direction} {params}")
    ref.assert_float_equal(got["amax"], np.array([ref.amax(got["data"])]), "amax")
    if g is not None:  # the bias gradient sums the fp32 values (order: test_activation.py)
        sums = got["data"].astype(np.float64).sum(0)
        slack = 144 * 2.0**-23 * np.abs(got["data"].astype(np.float64)).sum(0)
        assert np.all(np.abs(got["dbias"] - sums) <= slack)
    check_cuda_matches_cpu(device, got, again)


def test_gradient_is_zero_beyond_the_clamps_and_passes_at_them(cpu):
    limit = 0.75
    a = np.array([[0.5, 0.75, 0.7500001, 3.0]], np.float32)
    b = np.array([[-0.75, 0.75, -0.7500001, 9.0]], np.float32)
    x = np.hstack([a, b])
    g = np.ones((1, 4), np.float32)
    grad = run(cpu, x, (limit, 1.702, 1.0), g)["data"][0]
    da, db = grad[:4], grad[4:]
    assert da[0] != 0 and da[1] != 0 and da[2] == 0 and da[3] == 0
    assert db[0] != 0 and db[1] != 0 and db[2] == 0 and db[3] == 0
    # Beyond the clamps the forward is that of the bounds.
    y = run(cpu, x, (limit, 1.702, 1.0))["data"][0]
    at_bounds = run(cpu, np.hstack([np.minimum(a, limit), np.clip(b, -limit, limit)]),
                    (limit, 1.702, 1.0))["data"][0]
    ref.assert_same_bits(y, at_bounds, "forward beyond the clamps")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_fp8_outputs_equal_quantize_of_fp32(device, direction):
    fmt = ref.E4M3 if direction == "forward" else ref.E5M2
    params = PARAMS[0]
    x, g = inputs(3)
    g = g if direction == "backward" else None
    wide = run(device.cpu, x, params, g, dbias=g is not None)
    scale = np.float32(fmt.max / ref.amax(wide["data"]) * 1.3)

    def again(d):
        return run(d, x, params, g, fmt=fmt, scale=scale, dbias=g is not None)

    got = again(device)
    want = ref.quantize_tensor(wide["data"], scale, fmt)
    ref.assert_fp8_equal(got["data"], want["data"], fmt, "data")
    ref.assert_fp8_equal(got["columnwise_data"], want["columnwise_data"], fmt, "columnwise")
    ref.assert_float_equal(got["amax"], np.array([want["amax"]]), "amax")
    if g is not None:
        ref.assert_float_equal(got["dbias"], wide["dbias"], "dbias")
    check_cuda_matches_cpu(device, got, again)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_nan_and_inf(device, direction):
    """NaN in a or b gives NaN (both halves of the gradient); infinities are clamped."""
    special = np.array([np.nan, np.inf, -np.inf, 0.0, 7.0, -7.0, 3.4e38, -3.4e38, 1.0],
                       np.float32)
    a, b = np.meshgrid(special, special)
    x = np.hstack([a.reshape(1, -1), b.reshape(1, -1)])
    g = np.ones((1, a.size), np.float32) if direction == "backward" else None

    def again(d):
        return run(d, x, PARAMS[0], g)

    got = again(device)["data"].astype(np.float64)
    want, bound = expected(x, PARAMS[0], g)
    assert_close(got, want, bound, direction)
    nan_in = (np.isnan(a) | np.isnan(b)).reshape(-1)
    halves = [got[0, : a.size], got[0, a.size:]] if g is not None else [got[0]]
    for h in halves:
        assert np.all(np.isnan(h[nan_in])) and np.all(np.isfinite(h[~nan_in]))
    check_cuda_matches_cpu(device, again(device), again)


def test_parameters_are_required_and_checked(cpu):
    x = np.ones((2, 8), np.float32)
    out = np.full((2, 4), 7.0, np.float32)
    with pytest.raises(ValueError, match="activation_forward: params must be set for "
                                         "clamped_swiglu, got NULL"):
        core.activation_forward(ACT, x, out)
    for bad, field in [((0.0, 1.0, 1.0), "limit"), ((np.inf, 1.0, 1.0), "limit"),
                       ((7.0, -1.0, 1.0), "alpha"), ((7.0, np.nan, 1.0), "alpha")]:
        with pytest.raises(ValueError, match=f"activation_forward: params.{field} must be "
                                             "finite and > 0 for clamped_swiglu"):
            core.activation_forward(ACT, x, out, params=bad)
    with pytest.raises(ValueError, match="activation_backward: params.linear_offset must be "
                                         "finite for clamped_swiglu, got inf"):
        core.activation_backward(ACT, np.ones((2, 4), np.float32), x, np.zeros_like(x),
                                 params=(7.0, 1.0, np.inf))
    np.testing.assert_array_equal(out, 7.0)
    # The other activations ignore parameters.
    y = np.zeros((2, 4), np.float32)
    core.activation_forward(core.Activation.swiglu, x, y, params=(7.0, 1.0, 1.0))
    assert np.all(y > 0)
