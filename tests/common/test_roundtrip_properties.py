"""Hypothesis properties of dequantize(quantize(x)): the error is bounded by the format
(_tolerances.ROUND_TRIP), per tensor and per block, and block scales never saturate.

These complement the bit-exact tests: they hold whatever the reference says, so they check
the reference's rounding model as much as the core.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis")  # a test requirement; a bare GPU machine may lack it
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402
from te_common_tests import _reference as ref
from te_common_tests import _tolerances as tol

from transformer_engine.common import _core as core

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # x * scale may overflow
# The device fixture is stateless, so sharing it between examples is safe.
PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
FORMATS = st.sampled_from(list(ref.FORMATS.values()))
F32_MAX = float(np.finfo(np.float32).max)


def fp8_dtype(fmt):
    return getattr(core.DType, "float8_" + fmt.name)


def finite_f32(max_magnitude=1e6):
    return st.floats(-max_magnitude, max_magnitude, width=32, allow_nan=False, allow_infinity=False)


@st.composite
def block_inputs(draw, max_rows=140, max_cols=300):
    """A matrix whose rows and 32-element runs span many decades: a shape, a seed, and the
    magnitude range; numpy fills it (faster than drawing thousands of floats)."""
    m = draw(st.integers(1, max_rows))
    k = draw(st.integers(1, max_cols))
    seed = draw(st.integers(0, 2**32 - 1))
    low = draw(st.integers(-30, 30))
    spread = draw(st.integers(0, 8))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(low, low + spread, size=(m, k))
    x[rng.random((m, k)) < 0.05] = 0.0
    return x.astype(np.float32)


def dequantize(device, data, fmt, mode, scale_inv):
    out = device.put(np.full(data.shape, np.nan, np.float32))
    t = core.Tensor(
        device.put(data),
        dtype=fp8_dtype(fmt),
        scaling_mode=getattr(core.ScalingMode, mode),
        scale_inv=device.put(np.asarray(scale_inv)),
    )
    core.dequantize(t, out, stream=device.stream)
    return device.get(out)


def assert_within(back, x, scale_inv, fmt, what):
    bound = tol.round_trip_bound(x, scale_inv, fmt.name)
    error = np.abs(back.astype(np.float64) - x.astype(np.float64))
    worst = np.argmax(error - bound) if error.size else 0
    assert np.all(error <= bound), (
        f"{what}: |error| {error.ravel()[worst]:.3g} > bound {bound.ravel()[worst]:.3g} "
        f"at x = {x.ravel()[worst]!r}, got {back.ravel()[worst]!r}"
    )


@PROPERTY_SETTINGS
@given(
    fmt=FORMATS,
    x=hnp.arrays(
        np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9), elements=finite_f32()
    ),
    log2_scale=st.floats(-20, 20),
)
def test_tensor_round_trip(device, fmt, x, log2_scale):
    """Unsaturated values come back within the format's rounding error; values that the scale
    pushes past fp8_max come back as +-fp8_max * scale_inv."""
    scale = np.float32(2.0**log2_scale)
    data, sinv = device.put(np.zeros(x.shape, np.uint8)), device.put(np.zeros(1, np.float32))
    out = core.Tensor(
        data, dtype=fp8_dtype(fmt), scale=device.put(np.array([scale])), scale_inv=sinv
    )
    core.quantize(device.put(x), out, stream=device.stream)
    data, sinv = device.get(data), device.get(sinv)
    back = dequantize(device, data, fmt, "tensor", sinv)
    scaled = np.abs(x * scale)
    saturated = scaled >= np.float32(fmt.max)
    assert_within(
        back[~saturated],
        x[~saturated],
        np.broadcast_to(sinv, x.shape)[~saturated],
        fmt,
        "round trip",
    )
    edge = np.float32(fmt.max) * sinv[0]
    np.testing.assert_array_equal(back[saturated], np.copysign(edge, x[saturated]))
    assert np.all((back == 0) | (np.sign(back) == np.sign(x))), "a value changed sign"


@PROPERTY_SETTINGS
@given(
    fmt=FORMATS,
    x=block_inputs(),
    mode=st.sampled_from(["block_1x128", "block_128x128"]),
    pow2=st.booleans(),
)
def test_fp32_block_round_trip(device, fmt, x, mode, pow2):
    """Per-block scales from each block's amax: nothing saturates, every element comes back
    within its block's rounding error, row-wise and column-wise (the transpose, dequantized as
    a row-wise tensor of x.T)."""
    m, k = x.shape
    arrays = {
        "data": np.zeros((m, k), np.uint8),
        "scale_inv": np.zeros(ref.scale_inv_shape(mode, m, k), np.float32),
        "columnwise_data": np.zeros((k, m), np.uint8),
        "columnwise_scale_inv": np.zeros(
            ref.scale_inv_shape(mode, m, k, columnwise=True), np.float32
        ),
    }
    on_device = {n: device.put(a) for n, a in arrays.items()}
    out = core.Tensor(
        dtype=fp8_dtype(fmt), scaling_mode=getattr(core.ScalingMode, mode), **on_device
    )
    core.quantize(device.put(x), out, force_pow2_scales=pow2, stream=device.stream)
    got = {n: device.get(a) for n, a in on_device.items()}
    for name, values, data, sinv in (
        ("row-wise", x, got["data"], got["scale_inv"]),
        (
            "column-wise",
            np.ascontiguousarray(x.T),
            got["columnwise_data"],
            got["columnwise_scale_inv"],
        ),
    ):
        assert np.all(np.abs(ref.fp8_to_float32(data, fmt)) <= fmt.max)
        back = dequantize(device, data, fmt, mode, sinv)
        per_element = ref.block_scale_inv_per_element(mode, sinv, *values.shape)
        assert_within(back, values, per_element, fmt, name)
        if pow2:
            assert np.all(np.frexp(sinv)[0] == 0.5), "a scale_inv that is not a power of two"


@PROPERTY_SETTINGS
@given(fmt=FORMATS, x=block_inputs(max_rows=70, max_cols=130))
def test_mxfp8_round_trip(device, fmt, x):
    """E8M0 block scales: the smallest power of two that keeps the block's amax within
    fp8_max never lets an element saturate, and at least half of fp8_max is used (else a
    smaller power of two would do); the round trip is bounded, row-wise and column-wise."""
    m, k = x.shape
    rows_sinv = ref.scale_inv_shape("mxfp8", m, k)
    cols_sinv = ref.scale_inv_shape("mxfp8", m, k, columnwise=True)
    arrays = {
        "data": np.zeros((m, k), np.uint8),
        "scale_inv": np.zeros(rows_sinv, np.uint8),
        "columnwise_data": np.zeros((m, k), np.uint8),
        "columnwise_scale_inv": np.zeros(cols_sinv, np.uint8),
    }
    on_device = {n: device.put(a) for n, a in arrays.items()}
    core.quantize(
        device.put(x),
        core.Tensor(dtype=fp8_dtype(fmt), scaling_mode=core.ScalingMode.mxfp8, **on_device),
        stream=device.stream,
    )
    got = {n: device.get(a) for n, a in on_device.items()}
    # Column-wise data keeps [M, K] with 32x1 blocks: transposed, it is row-wise MXFP8 of x.T.
    for name, values, data, sinv in (
        ("row-wise", x, got["data"], got["scale_inv"]),
        (
            "column-wise",
            x.T.copy(),
            got["columnwise_data"].T.copy(),
            got["columnwise_scale_inv"].T.copy(),
        ),
    ):
        scale_inv = ref.e8m0_to_float32(sinv).astype(np.float64)
        block_amax = ref.block_amax(values, 1, 32).astype(np.float64)
        assert np.all(block_amax <= fmt.max * scale_inv), f"{name}: a block saturates"
        large = block_amax >= 2.0**-100  # away from the bottom of the E8M0 range
        assert np.all(block_amax[large] > fmt.max * scale_inv[large] / 2), (
            f"{name}: a scale is too large"
        )
        back = dequantize(
            device, np.ascontiguousarray(data), fmt, "mxfp8", np.ascontiguousarray(sinv)
        )
        per_element = ref.block_scale_inv_per_element("mxfp8", sinv, *values.shape)
        assert_within(back, values, per_element, fmt, name)


@PROPERTY_SETTINGS
@given(x=hnp.arrays(np.float32, st.integers(1, 64), elements=finite_f32(F32_MAX)), fmt=FORMATS)
def test_current_scaling_round_trip(device, x, fmt):
    """compute_amax, compute_scale_from_amax, quantize, dequantize: the current-scaling
    pipeline maps amax onto fp8_max, so nothing saturates beyond rounding at the top."""
    arrays = {
        "amax": np.zeros(1, np.float32),
        "scale": np.zeros(1, np.float32),
        "scale_inv": np.zeros(1, np.float32),
        "data": np.zeros(x.shape, np.uint8),
    }
    d = {n: device.put(a) for n, a in arrays.items()}
    t = core.Tensor(
        d["data"], dtype=fp8_dtype(fmt), amax=d["amax"], scale=d["scale"], scale_inv=d["scale_inv"]
    )
    x_dev = device.put(x)
    core.compute_amax(x_dev, t, stream=device.stream)
    core.compute_scale_from_amax(t, stream=device.stream)
    core.quantize(x_dev, t, stream=device.stream)
    sinv = device.get(d["scale_inv"])
    back = dequantize(device, device.get(d["data"]), fmt, "tensor", sinv)
    scale = device.get(d["scale"])[0]
    with np.errstate(over="ignore"):
        saturated = np.abs(x * scale) >= np.float32(fmt.max)
    # Only values within float32 rounding of amax may reach fp8_max after the multiply.
    assert np.all(np.abs(x[saturated]) >= ref.amax(x) * (1 - 2.0**-22)), (
        "a value below amax saturated"
    )
    assert_within(
        back[~saturated],
        x[~saturated],
        np.broadcast_to(sinv, x.shape)[~saturated],
        fmt,
        "round trip",
    )
