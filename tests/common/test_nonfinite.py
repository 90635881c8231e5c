"""No silent wrong answers: a NaN or an infinity never becomes a finite FP8 value.

Every kernel that writes FP8 (per-tensor quantize under delayed and current scaling, block
quantize 1x128 / 128x128 / MXFP8, the fused norm and activation casts, and their transposed
outputs) must give: NaN -> the NaN byte 0x7F; +-Inf -> +-Inf in E5M2 (0x7C / 0xFC) and the
NaN byte in E4M3 (no infinity there). Finite values beyond the format still saturate to +-max.
The expected bytes are written out here, not taken from the shared reference, so that a
reference that drifted with the core would not hide a regression. Each case runs on the CPU
and on CUDA; on CUDA the bytes must also equal the CPU's.
"""

from __future__ import annotations

import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

FORMATS = list(ref.FORMATS.values())
BLOCK_MODES = ["block_1x128", "block_128x128", "mxfp8"]
NAN_BYTE = 0x7F


def fp8_dtype(fmt):
    return getattr(core.DType, "float8_" + fmt.name)


def inf_bytes(fmt) -> tuple[int, int]:
    """The bytes of +Inf and -Inf inputs."""
    return (0x7C, 0xFC) if fmt.name == "e5m2" else (NAN_BYTE, NAN_BYTE)


def expected_special_bytes(fmt, x: np.ndarray) -> np.ndarray:
    """The byte every non-finite element of x must get (0 where x is finite: not checked)."""
    pos, neg = inf_bytes(fmt)
    return np.select([np.isnan(x), x == np.inf, x == -np.inf], [NAN_BYTE, pos, neg], 0)


def assert_nonfinite_kept(fmt, data: np.ndarray, x: np.ndarray, what: str) -> None:
    """The bytes of the non-finite elements of x are the documented ones, and every finite
    element of x has a finite byte (saturated if need be, never NaN or Inf)."""
    data = np.asarray(data, np.uint8).reshape(x.shape)
    special = ~np.isfinite(x)
    np.testing.assert_array_equal(
        data[special], expected_special_bytes(fmt, x)[special], err_msg=f"{what}: non-finite"
    )
    decoded = ref.fp8_to_float32(data, fmt)
    assert np.all(np.isfinite(decoded[~special])), f"{what}: a finite element became non-finite"


def same_on_cpu(device, got: dict, again) -> None:
    if device.is_cuda:
        on_cpu = again(device.cpu)
        for name in got:
            a, b = np.asarray(got[name]), np.asarray(on_cpu[name])
            if a.dtype.kind == "f":
                # A high-precision NaN's payload and sign are the hardware's (inf - inf is
                # 0x7FFFFFFF on the GPU, 0xFFC00000 on x86): NaN where NaN, other bits equal.
                np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
                a, b = np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b)
            ref.assert_same_bits(a, b, f"{name}, CUDA vs CPU")


def with_specials(rng, shape) -> np.ndarray:
    """Random finite values with +Inf, -Inf, NaN and a finite overflow (1e9) in known places."""
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    flat = x.reshape(-1)
    flat[[3, 130, 260]] = [np.inf, -np.inf, np.nan]
    flat[[4, 131]] = [1e9, -1e9]  # finite, in the blocks of the infinities
    return x


# ---------------------------------------------------------------- per-tensor quantize


def quantize_tensor(d, x, fmt, scale, current):
    """Per-tensor quantize on d; ``current``: the scale is computed from x's amax first, as
    Float8CurrentScaling does (compute_amax, compute_scale_from_amax, quantize)."""
    m, k = ref.matrix(x).shape
    arrays = {
        "data": np.full(x.shape, 0xA5, np.uint8),
        "columnwise_data": np.full((k, m), 0xA5, np.uint8),
        "scale": np.array([scale], np.float32),
        "scale_inv": np.array([-1.0], np.float32),
        "amax": np.array([-7.0], np.float32),
    }
    on = {name: d.put(a) for name, a in arrays.items()}
    out = core.Tensor(dtype=fp8_dtype(fmt), **on)
    if current:
        core.compute_amax(d.put(x), out, stream=d.stream)
        core.compute_scale_from_amax(out, stream=d.stream)
    core.quantize(d.put(x), out, stream=d.stream)
    return {name: d.get(a) for name, a in on.items()}


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_per_tensor_quantize_keeps_nonfinite(device, fmt, recipe):
    x = with_specials(np.random.default_rng(1), (3, 160))
    run = lambda d: quantize_tensor(d, x, fmt, 0.5, recipe == "current")  # noqa: E731
    got = run(device)
    assert_nonfinite_kept(fmt, got["data"], x, "data")
    assert_nonfinite_kept(fmt, got["columnwise_data"].T, x, "columnwise_data (transposed)")
    assert np.isnan(got["amax"][0])
    if recipe == "current":
        # The fallback rule: a non-finite amax gives scale 1, so finite elements are cast as
        # they are (those beyond the format saturate).
        assert got["scale"][0] == 1.0 and got["scale_inv"][0] == 1.0
    scale = got["scale"][0]
    finite = np.isfinite(x)
    want = ref.cast_to_fp8(x * np.float32(scale), fmt)
    np.testing.assert_array_equal(got["data"][finite], want[finite])
    top = fmt.max_code
    assert got["data"].reshape(-1)[4] == top and got["data"].reshape(-1)[131] == 0x80 | top
    same_on_cpu(device, got, run)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_inf_alone_keeps_its_sign_in_e5m2(device, fmt):
    """Only infinities (no NaN): amax is Inf, not NaN, and the sign survives where it can."""
    x = np.array([[1.0, np.inf, -np.inf, 2e9, -3.0]], np.float32)
    got = quantize_tensor(device, x, fmt, 1.0, current=True)
    assert got["amax"][0] == np.inf and got["scale"][0] == 1.0
    pos, neg = inf_bytes(fmt)
    top = fmt.max_code
    np.testing.assert_array_equal(got["data"][0, 1:4], [pos, neg, top])


# ---------------------------------------------------------------- block quantize


def block_quantize(d, x, mode, fmt):
    m, k = ref.matrix(x).shape
    sinv_dtype = np.uint8 if mode == "mxfp8" else np.float32
    arrays = {
        "data": np.full(x.shape, 0xA5, np.uint8),
        "scale_inv": np.zeros(ref.scale_inv_shape(mode, m, k), sinv_dtype),
        "columnwise_data": np.full(x.shape if mode == "mxfp8" else (k, m), 0xA5, np.uint8),
        "columnwise_scale_inv": np.zeros(ref.scale_inv_shape(mode, m, k, True), sinv_dtype),
        "amax": np.array([-7.0], np.float32),
    }
    on = {name: d.put(a) for name, a in arrays.items()}
    out = core.Tensor(dtype=fp8_dtype(fmt), scaling_mode=getattr(core.ScalingMode, mode), **on)
    core.quantize(d.put(x), out, stream=d.stream)
    return {name: d.get(a) for name, a in on.items()}


@pytest.mark.parametrize("mode", BLOCK_MODES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_block_quantize_keeps_nonfinite(device, fmt, mode):
    x = with_specials(np.random.default_rng(2), (4, 256))
    run = lambda d: block_quantize(d, x, mode, fmt)  # noqa: E731
    got = run(device)
    assert_nonfinite_kept(fmt, got["data"], x, "data")
    col = got["columnwise_data"] if mode == "mxfp8" else got["columnwise_data"].T
    assert_nonfinite_kept(fmt, col, x, "columnwise_data")
    # The block of x[0, 3] (+Inf, with 1e9 beside it): the fallback scale (1; MXFP8: the NaN
    # scale byte, which multiplies by 1), so its finite overflow saturates.
    sinv = got["scale_inv"].reshape(-1)[0]
    assert sinv == (255 if mode == "mxfp8" else 1.0)
    assert got["data"][0, 4] == fmt.max_code
    # The whole result is the documented reference's, too.
    want = ref.quantize_blocks(x, mode, fmt)
    ref.assert_fp8_equal(got["data"], want["data"].reshape(x.shape), fmt, "data")
    same_on_cpu(device, got, run)


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_of_nonfinite_codes(device, fmt):
    data = np.array([[0x7C, 0xFC, 0x7F, 0xFF, fmt.max_code, 0x80 | fmt.max_code]], np.uint8)

    def run(d):
        out = d.put(np.zeros(data.shape, np.float32))
        sinv = d.put(np.array([0.5], np.float32))
        t = core.Tensor(d.put(data), dtype=fp8_dtype(fmt), scale_inv=sinv)
        core.dequantize(t, out, stream=d.stream)
        return {"out": d.get(out)}

    got = run(device)["out"][0]
    if fmt.name == "e5m2":
        assert got[0] == np.inf and got[1] == -np.inf
    else:  # 0x7C / 0xFC are finite E4M3 codes (+-384)
        assert got[0] == 192.0 and got[1] == -192.0
    assert np.isnan(got[2]) and np.isnan(got[3])
    assert got[4] == fmt.max / 2 and got[5] == -fmt.max / 2
    same_on_cpu(device, run(device), run)


# ---------------------------------------------------------------- fused casts


def activation_fp8(d, act, direction, x, g, fmt, scale):
    rows, cols = ref.matrix(x).shape
    arrays = {
        "data": np.full((rows, cols), 0xA5, np.uint8),
        "columnwise_data": np.full((cols, rows), 0xA5, np.uint8),
        "scale": np.array([scale], np.float32),
        "scale_inv": np.array([-1.0], np.float32),
        "amax": np.array([-7.0], np.float32),
    }
    on = {name: d.put(a) for name, a in arrays.items()}
    out = core.Tensor(dtype=fp8_dtype(fmt), **on)
    act = getattr(core.Activation, act)
    if direction == "forward":
        core.activation_forward(act, d.put(x), out, stream=d.stream)
    else:
        core.activation_backward(act, d.put(g), d.put(x), out, stream=d.stream)
    return {name: d.get(a) for name, a in on.items()}


@pytest.mark.parametrize("shape", [(3, 160), (128, 256)], ids=str)
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("act", ["identity", "relu"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_activation_cast_keeps_nonfinite(device, fmt, act, direction, shape):
    """identity and relu pass an infinity through (relu(+Inf) = +Inf, relu(-Inf) = 0, relu'
    of a finite x times an infinite gradient is +-Inf or NaN), so the activation's fp32 output
    y is known; its FP8 bytes must keep every non-finite y and saturate the finite overflow."""
    rng = np.random.default_rng(3)
    x = with_specials(rng, shape)
    g = None
    if direction == "backward":
        g, x = x, np.abs((rng.standard_normal(shape) * 4).astype(np.float32)) + 1  # relu' = 1
    run = lambda d: activation_fp8(d, act, direction, x, g, fmt, 2.0)  # noqa: E731
    got = run(device)
    y = (x if act == "identity" else np.maximum(x, 0)) if direction == "forward" else g
    assert_nonfinite_kept(fmt, got["data"], y, "data")
    assert_nonfinite_kept(fmt, got["columnwise_data"].T, y, "columnwise_data (transposed)")
    assert got["data"].reshape(-1)[4] == fmt.max_code
    same_on_cpu(device, got, run)


def norm_fp8(d, norm, x, fmt, scale):
    m, n = x.shape
    arrays = {
        "y": np.full(x.shape, 7.0, np.float32),
        "q": np.full(x.shape, 0xA5, np.uint8),
        "qt": np.full((n, m), 0xA5, np.uint8),
        "scale": np.array([scale], np.float32),
        "scale_inv": np.zeros(1, np.float32),
        "amax": np.array([-1.0], np.float32),
        "rsigma": np.zeros(m, np.float32),
    }
    if norm == "layernorm":
        arrays["mu"] = np.zeros(m, np.float32)
    on = {name: d.put(a) for name, a in arrays.items()}
    out = core.Tensor(
        on["q"], dtype=fp8_dtype(fmt), scale=on["scale"], scale_inv=on["scale_inv"],
        amax=on["amax"], columnwise_data=on["qt"],
    )
    gamma = d.put(np.linspace(0.5, 1.5, n, dtype=np.float32))
    beta = d.put(np.full(n, 0.25, np.float32)) if norm == "layernorm" else None
    core.norm_forward(
        getattr(core.Norm, norm), d.put(x), gamma, beta, output=on["y"], output_fp8=out,
        mu=on.get("mu"), rsigma=on["rsigma"], eps=1e-5, stream=d.stream,
    )
    return {name: d.get(a) for name, a in on.items()}


@pytest.mark.parametrize("shape", [(4, 160), (32, 256)], ids=str)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_norm_cast_keeps_nonfinite(device, fmt, norm, shape):
    """A row with an infinity normalizes to NaN (or, for RMSNorm, 0 and NaN) in fp32; the FP8
    output is non-finite exactly where the fp32 output of the same call is."""
    x = (np.random.default_rng(4).standard_normal(shape) * 4).astype(np.float32)
    x[1, 3] = np.inf
    x[2, 7] = -np.inf
    x[3, 9] = np.nan
    run = lambda d: norm_fp8(d, norm, x, fmt, 2.0)  # noqa: E731
    got = run(device)
    y = got["y"]
    assert not np.all(np.isfinite(y[1:4])), "the fp32 norm output should carry the non-finite rows"
    assert np.all(np.isfinite(y[0]))
    assert_nonfinite_kept(fmt, got["q"], y, "q")
    assert_nonfinite_kept(fmt, got["qt"].T, y, "qt (transposed)")
    same_on_cpu(device, got, run)


# ---------------------------------------------------------------- delayed scaling history


def test_delayed_scaling_keeps_scale_after_nonfinite_amax(device):
    """A step whose amax is Inf or NaN is recorded in the history, and leaves the scale as it
    was (scaling.h); a finite column next to it updates as usual."""
    fmt = core.DType.float8_e4m3
    history = np.array([[np.inf, np.nan, 4.0], [1.0, 1.0, 1.0]], np.float32)  # [len, columns]
    scale = np.array([3.0, 5.0, 7.0], np.float32)
    h, s, si = device.put(history), device.put(scale), device.put(np.zeros(3, np.float32))
    core.delayed_scaling_update([h], [s], [si], fp8_dtype=fmt,
                                algo=core.AmaxComputeAlgo.most_recent, margin=0,
                                stream=device.stream)
    got = device.get(s)
    assert got[0] == 3.0 and got[1] == 5.0
    assert got[2] == np.float32(448.0) / np.float32(4.0)
