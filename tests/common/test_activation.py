"""Fused activations (activation.h) against float64 numpy formulas, forward and backward.

High-precision outputs are compared with the float64 value of the formula within the bounds
of ``BOUNDS`` below. Everything the core quantizes is compared bit for bit: FP8 bytes, amax and
scale_inv against ``_reference.quantize_tensor`` of the core's own fp32 activation (its
high-precision path), and dbias against a float32 numpy replica of the documented summation
order. Each case runs on the CPU and on CUDA; on CUDA every output must also equal the CPU's
bit for bit (activation.h: the two paths compute the same bits).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

ACTS = ["identity", "gelu", "relu", "silu", "qgelu", "srelu", "geglu", "swiglu", "reglu",
        "qgeglu", "sreglu", "glu"]
# A gated activation's function of a ("sigmoid": GLU's gate, not an activation of its own).
GATED = {"geglu": "gelu", "swiglu": "silu", "reglu": "relu", "qgeglu": "qgelu",
         "sreglu": "srelu", "glu": "sigmoid"}
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Output shapes [..., N]; a gated input is [..., 2N]. (144, 136) has partial tiles and is on
# the CUDA fast path; (17, 33) and (2, 3, 40) take its masked path.
SHAPES = [(1, 1), (3, 5), (17, 33), (2, 3, 40), (128, 256), (144, 136), (0, 16)]
SENTINEL = 0xA5


# ---------------------------------------------------------------- error bounds (the one table)


@dataclasses.dataclass(frozen=True)
class Bounds:
    # The core evaluates each function with a handful of correctly rounded fp32 operations and
    # its own exp (<= 1.2 ulp over the whole range, measured): 16 half-ulps (2^-24 each) of the
    # magnitude covers them with room. Derivatives are sums of two terms of either sign, so the
    # magnitude is the sum of the terms' magnitudes (cancellation near a zero of the derivative
    # is the formula's conditioning, not the core's error).
    fp32_eval: float = 2.0**-20
    # exp(z) turns the absolute rounding error of its fp32 argument z (a few roundings of size
    # |z| 2^-24, and the fp32 rounding of GELU's constants) into relative error |z| 2^-24 each:
    # GELU measured 2.5 ulp per unit of |z|; 8 ulp per unit gives room. Applies only where exp
    # matters: to sigmoid(z), scaled by sigmoid(-z).
    exp_argument: float = 2.0**-20
    # Results below the normal range keep fewer bits: the absolute error of a subnormal sigmoid
    # (2^-149) times the factors it meets (|x| and GELU's z' up to ~2^11).
    tiny: float = 2.0**-134
    # Any fp32 rounding in the subnormal range errs by up to 2^-150 absolute, whatever the
    # magnitudes of the factors: a few of them.
    subnormal: float = 2.0**-147


BOUNDS = Bounds()
# The output's own rounding to nearest: half an ulp relative, and half its smallest subnormal.
OUTPUT_ROUNDING = {
    "float32": (0.0, 0.0),
    "float16": (2.0**-11, 2.0**-25),
    "bfloat16": (2.0**-8, 2.0**-134),
}


# ---------------------------------------------------------------- float64 formulas

C2 = 2.0 * np.sqrt(2.0 / np.pi)  # GELU's tanh form as x sigmoid(2u), 2u = C2 (x + A x^3)
A = 0.044715


def _sigmoid(z):
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def formula(act: str, x: np.ndarray):
    """float64 (f, t1, t2, z): f(x), f'(x) = t1 + t2, and the argument z of exp (0 if none).
    Infinite inputs take the functions' limits."""
    x = np.asarray(x, np.float64)
    inf = np.isinf(x)
    xf = np.where(inf, 0.0, x)
    zero = np.zeros_like(xf)
    if act == "identity":
        f, t1, t2, z = xf, np.ones_like(xf), zero, zero
    elif act in ("relu", "srelu"):
        r = np.where(xf > 0, xf, np.where(np.isnan(xf), np.nan, 0.0))  # NaN stays NaN
        step = np.where(np.isnan(xf), np.nan, (xf > 0) * 1.0)
        f, t1, t2, z = (r, step, zero, zero) if act == "relu" else (r * r, 2 * r, zero, zero)
    elif act == "sigmoid":
        z = xf
        s = _sigmoid(z)
        f, t1, t2 = s, s * _sigmoid(-z), zero
    else:
        if act == "gelu":
            z, dz = C2 * (xf + A * xf**3), C2 * (1 + 3 * A * xf * xf)
        else:
            k = 1.0 if act == "silu" else 1.702
            z, dz = k * xf, k
        s = _sigmoid(z)
        f, t1, t2 = xf * s, s, xf * s * _sigmoid(-z) * dz
    limit_f = np.where(x > 0, np.inf, -np.inf if act == "identity" else 0.0)
    limit_d = np.where(x > 0, np.inf if act == "srelu" else 1.0, 1.0 if act == "identity" else 0.0)
    if act == "sigmoid":  # bounded: 1 and 0 at the ends, flat there
        limit_f, limit_d = np.where(x > 0, 1.0, 0.0), np.zeros_like(xf)
    f = np.where(inf, limit_f, f)
    t1 = np.where(inf, limit_d, t1)
    t2 = np.where(inf, 0.0, t2)
    z = np.where(inf, 0.0, z)
    return f, t1, t2, z


def _eval_error(act, x):
    """(f, f', relative bound of f, absolute bound of f') for an input x."""
    f, t1, t2, z = formula(act, x)
    az = np.abs(z)
    rel_f = BOUNDS.fp32_eval + BOUNDS.exp_argument * az * _sigmoid(-z)
    err_d = BOUNDS.fp32_eval * (np.abs(t1) + np.abs(t2)) + BOUNDS.exp_argument * az * (
        np.abs(t1) * _sigmoid(-z) + np.abs(t2)
    )
    if act == "sigmoid":  # s (1 - s): exp's argument error lands on the smaller factor itself
        err_d = (BOUNDS.fp32_eval + BOUNDS.exp_argument * az) * np.abs(t1)
    return f, t1 + t2, rel_f, err_d


def expected(act, direction, x, g=None):
    """float64 (want, bound) of the activation output (forward) or grad_input (backward)."""
    x = ref.matrix(ref.as_float32(x)).astype(np.float64)
    with np.errstate(all="ignore"):
        if act in GATED:
            n = x.shape[1] // 2
            a, b = x[:, :n], x[:, n:]
            f, d, rel_f, err_d = _eval_error(GATED[act], a)
            if direction == "forward":
                return f * b, rel_f * np.abs(f * b) + (BOUNDS.tiny + BOUNDS.subnormal) * np.abs(b)
            g = ref.matrix(ref.as_float32(g)).astype(np.float64)
            da, db = g * b * d, g * f
            bound_a = (
                err_d * np.abs(g * b) + BOUNDS.tiny * np.abs(g * b) + BOUNDS.subnormal * np.abs(b)
            )
            bound_b = rel_f * np.abs(db) + BOUNDS.tiny * np.abs(g)
            return np.hstack([da, db]), np.hstack([bound_a, bound_b])
        f, d, rel_f, err_d = _eval_error(act, x)
        if direction == "forward":
            return f, rel_f * np.abs(f) + BOUNDS.tiny
        g = ref.matrix(ref.as_float32(g)).astype(np.float64)
        return g * d, err_d * np.abs(g) + BOUNDS.tiny * np.abs(g)


def assert_close(got, want, bound, out_dtype, what):
    """got (any float dtype) within bound of the float64 want, after the output's rounding;
    NaN where want is NaN, and the same infinity where want rounds to one."""
    got = np.asarray(got).astype(np.float64).reshape(want.shape)
    rel, absolute = OUTPUT_ROUNDING[out_dtype]
    with np.errstate(all="ignore"):
        want_out = want.astype(DTYPES[out_dtype]).astype(np.float64)
        np.testing.assert_array_equal(
            np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions"
        )
        inf = np.isinf(want_out)
        np.testing.assert_array_equal(got[inf], want_out[inf], err_msg=f"{what}: infinities")
        fin = ~inf & ~np.isnan(want)
        err = np.abs(got[fin] - want[fin])
        allowed = bound[fin] + rel * np.abs(want[fin]) + absolute + BOUNDS.subnormal
    bad = np.flatnonzero(err > allowed)
    assert bad.size == 0, (
        f"{what}: {bad.size} values out of bounds, first: got {got[fin][bad[0]]!r}, "
        f"want {want[fin][bad[0]]!r}, bound {allowed[bad[0]]!r}"
    )


# ---------------------------------------------------------------- running the core


def activation(name):
    return getattr(core.Activation, name)


def input_shape(act, shape):
    return (*shape[:-1], 2 * shape[-1]) if act in GATED else tuple(shape)


def random_values(rng, shape, dtype, low=-2.0, high=1.5):
    """Both signs, magnitudes 10^low .. 10^high (around the activations' bends), exact in dtype."""
    x = rng.choice([-1.0, 1.0], size=shape) * 10.0 ** rng.uniform(low, high, size=shape)
    return x.astype(np.float32).astype(dtype)


def fp8_dtype(fmt):
    return getattr(core.DType, "float8_" + fmt.name)


def run(
    device,
    act,
    direction,
    x,
    g=None,
    out_dtype="float32",
    fmt=None,
    scale=1.0,
    layout="both",
    dbias_dtype=None,
):
    """One call on device into fresh sentinel-filled outputs; returns every output as numpy."""
    rows, cols = ref.matrix(x).shape
    if direction == "forward" and act in GATED:
        cols //= 2
    arrays = {}
    if fmt is None:
        arrays["data"] = np.full((rows, cols), 7, DTYPES[out_dtype])
        arrays["amax"] = np.array([-7.0], np.float32)
    else:
        arrays["scale"] = np.array([scale], np.float32)
        arrays["scale_inv"] = np.array([-1.0], np.float32)
        arrays["amax"] = np.array([-7.0], np.float32)
        if layout in ("rowwise", "both"):
            arrays["data"] = np.full((rows, cols), SENTINEL, np.uint8)
        if layout in ("columnwise", "both"):
            arrays["columnwise_data"] = np.full((cols, rows), SENTINEL, np.uint8)
    on_device = {k: device.put(v) for k, v in arrays.items()}
    out = core.Tensor(dtype=None if fmt is None else fp8_dtype(fmt), **on_device)
    dbias = None
    if dbias_dtype is not None:
        dbias = device.put(np.full((cols,), 7, DTYPES[dbias_dtype]))
    if direction == "forward":
        core.activation_forward(activation(act), device.put(x), out, stream=device.stream)
    else:
        core.activation_backward(
            activation(act), device.put(g), device.put(x), out, dbias=dbias, stream=device.stream
        )
    got = {k: device.get(v) for k, v in on_device.items()}
    if dbias is not None:
        got["dbias"] = device.get(dbias)
    return got


def check_cuda_matches_cpu(device, got, again):
    if device.is_cuda:
        on_cpu = again(device.cpu)
        for name in got:
            ref.assert_same_bits(got[name], on_cpu[name], f"{name}, CUDA vs CPU")


def make_inputs(act, direction, shape, dtype, seed):
    rng = np.random.default_rng([seed, ACTS.index(act), *shape])
    x = random_values(rng, input_shape(act, shape), DTYPES[dtype])
    g = random_values(rng, shape, DTYPES[dtype], -1.0, 1.0) if direction == "backward" else None
    return x, g


def dbias_in_documented_order(v: np.ndarray) -> np.ndarray:
    """Column sums of a float32 [M, K] matrix in activation.h's order, in float32: runs of 8
    rows in row order, the 16 runs of each 128-row chunk in order, then the chunks in order."""
    m, k = v.shape
    t = -(-m // 128)
    padded = np.zeros((t * 128, k), np.float32)  # +0 padding changes no sum (none is -0)
    padded[:m] = v
    blocks = padded.reshape(t, 16, 8, k)
    runs = np.zeros((t, 16, k), np.float32)
    for i in range(8):
        runs = runs + blocks[:, :, i, :]
    chunks = np.zeros((t, k), np.float32)
    for r in range(16):
        chunks = chunks + runs[:, r, :]
    total = np.zeros((k,), np.float32)
    for c in range(t):
        total = total + chunks[c]
    return total


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ACTS)
def test_values_against_float64(device, act, direction, in_dtype, shape):
    """fp32 output (and amax, dbias) of every activation, forward and backward."""
    x, g = make_inputs(act, direction, shape, in_dtype, 1)
    with_dbias = "float32" if direction == "backward" else None

    def again(d):
        return run(d, act, direction, x, g, dbias_dtype=with_dbias)

    got = again(device)
    want, bound = expected(act, direction, x, g)
    assert_close(got["data"], want, bound, "float32", f"{act} {direction}")
    ref.assert_float_equal(got["amax"], np.array([ref.amax(got["data"])]), "amax")
    if with_dbias:
        ref.assert_float_equal(got["dbias"], dbias_in_documented_order(got["data"]), "dbias order")
        m = got["data"].shape[0]
        # And the sum itself: recursive summation errs by at most m 2^-24 sum |v|.
        sums = np.sum(got["data"].astype(np.float64), axis=0)
        slack = m * 2.0**-23 * np.sum(np.abs(got["data"].astype(np.float64)), axis=0)
        assert np.all(np.abs(got["dbias"] - sums) <= slack)
    check_cuda_matches_cpu(device, got, again)


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ACTS)
def test_half_precision_outputs(device, act, direction, out_dtype):
    """16-bit output and dbias are the fp32 values rounded to nearest even."""
    x, g = make_inputs(act, direction, (144, 24), "bfloat16", 2)
    dbias_dtype = out_dtype if direction == "backward" else None

    def again(d):
        return run(d, act, direction, x, g, out_dtype=out_dtype, dbias_dtype=dbias_dtype)

    got = again(device)
    wide = run(device.cpu, act, direction, x, g, dbias_dtype="float32" if dbias_dtype else None)
    want, bound = expected(act, direction, x, g)
    assert_close(got["data"], want, bound, out_dtype, f"{act} {direction} {out_dtype}")
    with np.errstate(over="ignore"):
        ref.assert_float_equal(
            got["data"], wide["data"].astype(DTYPES[out_dtype]), "data = fp32 rounded"
        )
        if dbias_dtype:
            ref.assert_float_equal(
                got["dbias"], wide["dbias"].astype(DTYPES[out_dtype]), "dbias rounded"
            )
    ref.assert_float_equal(got["amax"], wide["amax"], "amax of the fp32 values")
    check_cuda_matches_cpu(device, got, again)


FP8_SHAPES = [(1, 1), (17, 33), (2, 3, 40), (144, 136), (0, 16), (16, 0)]


@pytest.mark.parametrize("layout", ["rowwise", "columnwise", "both"])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ACTS)
def test_fp8_outputs_equal_quantize_of_fp32(device, act, direction, shape, layout):
    """FP8 bytes, transpose, amax and scale_inv equal the reference quantization of the core's
    own fp32 values, bit for bit; dbias is that of the fp32 path."""
    fmt = ref.E4M3 if direction == "forward" else ref.E5M2
    x, g = make_inputs(act, direction, shape, "bfloat16", 3)
    with_dbias = "float32" if direction == "backward" else None
    wide = run(device.cpu, act, direction, x, g, dbias_dtype=with_dbias)
    a = ref.amax(wide["data"])
    scale = np.float32(fmt.max / a * 1.3) if a > 0 and np.isfinite(a) else np.float32(0.75)

    def again(d):
        return run(
            d, act, direction, x, g, fmt=fmt, scale=scale, layout=layout, dbias_dtype=with_dbias
        )

    got = again(device)
    want = ref.quantize_tensor(wide["data"], scale, fmt)
    if "data" in got:
        ref.assert_fp8_equal(got["data"], want["data"], fmt, "data")
    if "columnwise_data" in got:
        ref.assert_fp8_equal(
            got["columnwise_data"], want["columnwise_data"], fmt, "columnwise_data"
        )
    ref.assert_float_equal(got["scale_inv"], np.array([want["scale_inv"]]), "scale_inv")
    ref.assert_float_equal(got["amax"], np.array([want["amax"]]), "amax")
    if with_dbias:
        ref.assert_float_equal(got["dbias"], wide["dbias"], "dbias")
    check_cuda_matches_cpu(device, got, again)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ACTS)
def test_large_and_tiny_magnitudes(device, act, direction):
    """fp32 inputs from fp32 denormals to FLT_MAX, both signs, and gradients likewise."""
    rng = np.random.default_rng(ACTS.index(act))
    shape = (16, 64)
    x = random_values(rng, input_shape(act, shape), np.float32, -44, 38)
    if act in GATED:  # b moderate: a product of three extremes over- or underflows in fp32
        x[:, shape[1] :] = random_values(rng, shape, np.float32, -3, 3)
    if act == "sreglu":  # relu(a)^2 is an fp32 value of its own (activation.h): |a| < 2^63
        x[:, : shape[1]] = np.clip(x[:, : shape[1]], -1e18, 1e18)
    g = random_values(rng, shape, np.float32, -10, 10) if direction == "backward" else None

    def again(d):
        return run(d, act, direction, x, g)

    got = again(device)
    want, bound = expected(act, direction, x, g)
    assert_close(got["data"], want, bound, "float32", f"{act} {direction}")
    check_cuda_matches_cpu(device, got, again)


SPECIAL = np.array(
    [
        np.nan,
        np.inf,
        -np.inf,
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        3.4e38,
        -3.4e38,
        1e30,
        -1e30,
        20.5,
        -20.5,
        88.8,
        -88.8,
        104.5,
        -104.5,
        1e-20,
        -1e-20,
        -0.75,
        1.0,
        -1.0,
    ],
    np.float32,
)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ACTS)
def test_nan_and_inf(device, act, direction):
    """NaN in gives NaN out; infinities give the limits; finite inputs never give NaN."""
    n = SPECIAL.size
    x = SPECIAL.reshape(1, n)
    if act in GATED:  # every special value as a, and as b with a = 1.5
        x = np.hstack(
            [
                np.concatenate([SPECIAL, np.full(n, 1.5, np.float32)]).reshape(1, -1),
                np.concatenate([np.full(n, 1.5, np.float32), SPECIAL]).reshape(1, -1),
            ]
        )
    g = np.full((1, x.shape[1] // (2 if act in GATED else 1)), 1.5, np.float32)
    g = g if direction == "backward" else None

    def again(d):
        return run(d, act, direction, x, g)

    got = again(device)
    want, bound = expected(act, direction, x, g)
    assert_close(got["data"], want, bound, "float32", f"{act} {direction}")
    nan = np.isnan(got["data"])
    assert np.all(got["data"].view(np.uint32)[nan] == 0x7FC00000), "NaN must be 0x7FC00000"
    if act not in GATED and not (act == "identity" and direction == "backward"):
        np.testing.assert_array_equal(nan.ravel(), np.isnan(SPECIAL))
    assert np.isnan(got["amax"][0]) == nan.any()
    check_cuda_matches_cpu(device, got, again)


# Fast path on CUDA (rows % 16 == 0, columns % 8 == 0), a few 8x8 patches per tile row.
FP8_SPECIAL_SHAPE = (32, 48)


def _with_specials(rng, x, dtype):
    """x with SPECIAL's values scattered over two rows (so that most patches hold none); in
    float16 the largest become infinities."""
    x = x.copy()
    for row in (3, 20):
        cols = rng.choice(x.shape[1], size=SPECIAL.size, replace=False)
        with np.errstate(over="ignore"):
            x[row, cols] = SPECIAL.astype(dtype)
    return x


@pytest.mark.parametrize("shape", [(32, 64), (17, 40)], ids=["fast", "masked"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ["identity", "gelu", "swiglu"])
def test_high_precision_outputs_with_nan_and_extremes(device, act, direction, out_dtype, shape):
    """High-precision outputs of NaNs (both signs, any payload), infinities, subnormals and
    values that round to the 16-bit formats' limits, beside rows without any: each value the
    fp32 one rounded to nearest even, each NaN the reference's one pattern (0x7FC00000 fp32,
    0x7FC0 bf16, 0x7E00 fp16), on CUDA in the flat kernel (non-gated, no dbias: 16-bit vectors
    converted by the hardware, NaN patterns put back), the tiled kernel's fast path (swiglu)
    and its masked path."""
    rng = np.random.default_rng([7, ACTS.index(act), *shape])
    x = random_values(rng, input_shape(act, shape), np.float32)
    specials = np.concatenate([
        SPECIAL,
        np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFF812345], np.uint32).view(np.float32),
        np.array([65519.0, 65520.0, -65520.0, 6e-8, 3e-8, -2.9e-8, 1e-39, -1e-39,
                  3.3961776e38, 3.3961778e38], np.float32),
    ])
    # Specials in the first rows only, so that later rows of the same patches and whole
    # patches elsewhere hold none.
    flat = x.reshape(-1)
    flat[: specials.size] = specials
    g = None
    if direction == "backward":
        g = random_values(rng, shape, np.float32, -1.0, 1.0)
        g.reshape(-1)[-specials.size:] = specials  # and in the incoming gradient

    def again(d):
        return run(d, act, direction, x, g, out_dtype=out_dtype)

    got = again(device)
    wide = run(device.cpu, act, direction, x, g)
    with np.errstate(over="ignore", invalid="ignore"):
        ref.assert_float_equal(got["data"], wide["data"].astype(DTYPES[out_dtype]),
                               "data = fp32 rounded")
    bits = got["data"].view(np.uint32 if out_dtype == "float32" else np.uint16)
    nan = np.isnan(got["data"].astype(np.float32))
    assert nan.any()
    pattern = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}[out_dtype]
    assert np.all(bits[nan] == pattern), "NaN pattern"
    np.testing.assert_array_equal(nan, np.isnan(wide["data"]))
    check_cuda_matches_cpu(device, got, again)


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ["identity", "gelu", "srelu", "swiglu"])
def test_fp8_outputs_with_nan_and_inf(device, act, direction, in_dtype):
    """FP8 bytes (both layouts), amax and dbias of inputs holding NaN, infinities and extremes,
    for every input dtype: each NaN is the one NaN byte, patches without NaN beside patches
    with one are untouched, and all equal the reference quantization of the fp32 values."""
    fmt = ref.E4M3 if direction == "forward" else ref.E5M2
    rng = np.random.default_rng([ACTS.index(act), list(DTYPES).index(in_dtype)])
    x, g = make_inputs(act, direction, FP8_SPECIAL_SHAPE, in_dtype, 4)
    x = _with_specials(rng, x, DTYPES[in_dtype])
    if g is not None:
        g = _with_specials(rng, g, DTYPES[in_dtype])
    with_dbias = "float32" if direction == "backward" else None
    wide = run(device.cpu, act, direction, x, g, dbias_dtype=with_dbias)
    scale = np.float32(1.5)

    def again(d):
        return run(d, act, direction, x, g, fmt=fmt, scale=scale, dbias_dtype=with_dbias)

    got = again(device)
    want = ref.quantize_tensor(wide["data"], scale, fmt)
    ref.assert_fp8_equal(got["data"], want["data"], fmt, "data")
    ref.assert_fp8_equal(got["columnwise_data"], want["columnwise_data"], fmt, "columnwise_data")
    ref.assert_float_equal(got["amax"], np.array([want["amax"]]), "amax")
    if with_dbias:
        ref.assert_float_equal(got["dbias"], wide["dbias"], "dbias")
    check_cuda_matches_cpu(device, got, again)


@pytest.mark.parametrize("scale", [0.0, np.inf, np.nan], ids=["zero", "inf", "nan"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_fp8_outputs_with_degenerate_scales(device, direction, scale):
    """A scale of 0, inf or NaN makes NaN codes out of numbers (inf * 0, 0 * inf, x * NaN):
    they too are the one NaN byte, and scale_inv is 1 / scale."""
    fmt = ref.E4M3 if direction == "forward" else ref.E5M2
    x, g = make_inputs("gelu", direction, FP8_SPECIAL_SHAPE, "bfloat16", 5)
    x = x.copy()
    x[1, :4] = np.array([np.inf, 0.0, -np.inf, 30.0], np.float32).astype(ml_dtypes.bfloat16)
    scale = np.float32(scale)

    def again(d):
        return run(d, "gelu", direction, x, g, fmt=fmt, scale=scale)

    got = again(device)
    wide = run(device.cpu, "gelu", direction, x, g)
    with np.errstate(divide="ignore"):
        want = ref.quantize_tensor(wide["data"], scale, fmt)
    ref.assert_fp8_equal(got["data"], want["data"], fmt, "data")
    ref.assert_fp8_equal(got["columnwise_data"], want["columnwise_data"], fmt, "columnwise_data")
    ref.assert_float_equal(got["scale_inv"], np.array([want["scale_inv"]]), "scale_inv")
    check_cuda_matches_cpu(device, got, again)


def test_identity_backward_needs_no_input(device):
    """IDENTITY backward is dbias + cast (+ transpose) of grad_output; input may be None."""
    rng = np.random.default_rng(5)
    g = random_values(rng, (144, 40), ml_dtypes.bfloat16, -1, 1)
    fmt, scale = ref.E5M2, np.float32(2.0)
    out = {
        "data": device.put(np.zeros((144, 40), np.uint8)),
        "columnwise_data": device.put(np.zeros((40, 144), np.uint8)),
        "scale": device.put(np.array([scale], np.float32)),
        "scale_inv": device.put(np.zeros(1, np.float32)),
        "amax": device.put(np.zeros(1, np.float32)),
    }
    dbias = device.put(np.zeros(40, np.float32))
    core.activation_backward(
        core.Activation.identity,
        device.put(g),
        None,
        core.Tensor(dtype=fp8_dtype(fmt), **out),
        dbias=dbias,
        stream=device.stream,
    )
    want = ref.quantize_tensor(g, scale, fmt)
    for name in ("data", "columnwise_data"):
        ref.assert_fp8_equal(device.get(out[name]), want[name], fmt, name)
    ref.assert_float_equal(device.get(dbias), dbias_in_documented_order(ref.as_float32(g)), "dbias")


def test_known_values(cpu):
    """A few values worked out independently (torch's tanh GELU, SiLU at 1, ...)."""
    x = np.array([[1.0, -1.0, 2.0, 0.0]], np.float32)
    want = {
        "gelu": [0.8411920070648193, -0.15880800783634186, 1.9545977115631104, 0.0],
        "silu": [0.7310585975646973, -0.2689414322376251, 1.7615941762924194, 0.0],
        "relu": [1.0, 0.0, 2.0, 0.0],
        "srelu": [1.0, 0.0, 4.0, 0.0],
        "qgelu": [
            1 / (1 + np.exp(-1.702)),
            -1 / (1 + np.exp(1.702)),
            2 / (1 + np.exp(-3.404)),
            0.0,
        ],
    }
    for act, values in want.items():
        got = run(cpu, act, "forward", x)["data"]
        np.testing.assert_allclose(got.ravel(), values, rtol=2e-7, atol=0, err_msg=act)


# ---------------------------------------------------------------- errors


def _fp8_out(device, shape, **extra):
    arrays = {
        "data": np.full(shape, SENTINEL, np.uint8),
        "scale": np.ones(1, np.float32),
        "scale_inv": np.full(1, -1.0, np.float32),
    }
    arrays.update(extra)
    return {k: device.put(v) for k, v in arrays.items()}


def test_errors_name_op_and_argument_and_write_nothing(cpu):
    x = np.ones((3, 10), np.float32)
    out = cpu.put(np.full((3, 4), 7.0, np.float32))
    with pytest.raises(
        ValueError,
        match=r"activation_forward: output.data must have shape \[3, 5\], "
        r"got float32 \[3, 4\] on cpu",
    ):
        core.activation_forward(core.Activation.geglu, x, out)
    with pytest.raises(
        ValueError,
        match="activation_forward: input.data must have an even last "
        "dimension .* for swiglu, got float32 \\[3, 9\\]",
    ):
        core.activation_forward(core.Activation.swiglu, np.ones((3, 9), np.float32), out)
    np.testing.assert_array_equal(out, 7.0)
    arrays = _fp8_out(cpu, (3, 10))
    del arrays["scale"]
    with pytest.raises(ValueError, match="activation_forward: output.scale must be set"):
        core.activation_forward(
            core.Activation.gelu, x, core.Tensor(dtype=core.DType.float8_e4m3, **arrays)
        )
    assert np.all(arrays["data"] == SENTINEL) and arrays["scale_inv"][0] == -1.0
    with pytest.raises(
        ValueError, match="output.columnwise_data must be unset when output.data is high"
    ):
        core.activation_forward(
            core.Activation.gelu,
            x,
            core.Tensor(np.zeros((3, 10), np.float32), columnwise_data=np.zeros((10, 3), np.uint8)),
        )
    with pytest.raises(RuntimeError, match="output must have scaling mode tensor, got block_1x128"):
        core.activation_forward(
            core.Activation.gelu,
            x,
            core.Tensor(
                np.zeros((3, 10), np.uint8),
                dtype=core.DType.float8_e4m3,
                scaling_mode=core.ScalingMode.block_1x128,
            ),
        )
    with pytest.raises(ValueError, match="must not overlap the input input.data"):
        core.activation_forward(core.Activation.relu, x, x)


def test_backward_errors(cpu):
    g = np.ones((4, 6), np.float32)
    x = np.ones((4, 12), np.float32)
    gi = np.full((4, 12), 7.0, np.float32)
    with pytest.raises(
        TypeError, match=r"activation_backward: input.data must be float16, got float32 \[4, 12\]"
    ):
        core.activation_backward(core.Activation.geglu, g.astype(np.float16), x, gi)
    with pytest.raises(
        ValueError,
        match=r"activation_backward: dbias.data must have shape \[12\], got float32 \[6\]",
    ):
        core.activation_backward(core.Activation.geglu, g, x, gi, dbias=np.zeros(6, np.float32))
    with pytest.raises(
        ValueError, match="activation_backward: input must be a tensor handle, got NULL"
    ):
        core.activation_backward(core.Activation.gelu, g, None, np.zeros((4, 6), np.float32))
    with pytest.raises(
        ValueError, match=r"grad_input.data must have shape \[4, 12\], got float32 \[4, 6\]"
    ):
        core.activation_backward(core.Activation.swiglu, g, x, np.zeros((4, 6), np.float32))
    with pytest.raises(ValueError, match="must not overlap dbias.data"):
        core.activation_backward(core.Activation.geglu, g, x, gi, dbias=gi.reshape(-1)[:12])
    np.testing.assert_array_equal(gi, 7.0)


def test_activation_enum_names():
    # (clamped_swiglu, the one with parameters, has its own tests: test_clamped_swiglu.py)
    assert [a.name for a in core.Activation] == [*ACTS, "clamped_swiglu"]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2048, 2304), (2047, 2300)], ids=["fast", "masked"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ["gelu", "swiglu", "identity"])
def test_many_tiles_per_block_on_cuda(cuda_device, act, direction, shape):
    """More tiles than the one-wave grid has blocks, so each block strides over several (the
    shapes above are single-tile per block): every output still equals the CPU's bits."""
    x, g = make_inputs(act, direction, shape, "bfloat16", 7)
    fmt = ref.E4M3 if direction == "forward" else ref.E5M2
    with_dbias = "float32" if direction == "backward" else None

    def again(d):
        return run(d, act, direction, x, g, fmt=fmt, scale=np.float32(1.5), dbias_dtype=with_dbias)

    got = again(cuda_device)
    check_cuda_matches_cpu(cuda_device, got, again)


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ["gelu", "silu", "relu", "identity"])
def test_flat_kernel_strides_on_cuda(cuda_device, act, direction, out_dtype):
    """The flat kernel (non-gated, high precision, no dbias) over more element groups than its
    one-wave grid takes at once, the last stride partial: every output (and the amax) equals
    the CPU's bits."""
    x, g = make_inputs(act, direction, (2048, 2312), "bfloat16", 11)

    def again(d):
        return run(d, act, direction, x, g, out_dtype=out_dtype)

    got = again(cuda_device)
    check_cuda_matches_cpu(cuda_device, got, again)


@pytest.mark.parametrize("act, direction", [("gelu", "forward"), ("swiglu", "forward"),
                                             ("gelu", "backward"), ("swiglu", "backward"),
                                             ("identity", "backward")])
def test_amax_only_calls_write_the_amax_alone(device, act, direction):
    """An output with neither data slot but an amax (current scaling's first pass) gets the
    amax of the full call's fp32 values, and nothing is written anywhere else."""
    x, g = make_inputs(act, direction, (144, 136), "bfloat16", 5)
    full = run(device.cpu, act, direction, x, g)
    amax = device.put(np.array([-7.0], np.float32))
    out = core.Tensor(amax=amax)
    if direction == "forward":
        core.activation_forward(activation(act), device.put(x), out, stream=device.stream)
    else:
        core.activation_backward(activation(act), device.put(g), device.put(x), out,
                                 stream=device.stream)
    ref.assert_float_equal(device.get(amax), full["amax"], "amax")
    with pytest.raises(ValueError, match="output.data, output.columnwise_data or output.amax "
                                         "must be set, got none"):
        core.activation_forward(activation("gelu"), device.put(x), core.Tensor())
