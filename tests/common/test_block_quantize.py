"""Block-scaled quantize and dequantize (1x128, 128x128, MXFP8) against the reference.

The reference computes blocks with numpy reshapes (ragged edge blocks padded with zeros, which
leave an amax unchanged); scales, scale_invs and data are compared bit for bit. Layouts are
those of tensor.h: column-wise 1x128 / 128x128 data is the transpose [K, M] blocked like
row-wise data, column-wise MXFP8 data keeps [M, K] with 32x1 blocks.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

IN_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
MODES = ["block_1x128", "block_128x128", "mxfp8"]
SHAPES = [
    (1,),
    (1, 1),
    (3, 5),
    (17, 33),
    (2, 3, 40),
    (65, 96),
    (128, 128),
    (129, 257),
    (0, 16),
    (16, 0),
]
LAYOUTS = ["rowwise", "columnwise", "both"]
SENTINEL_BYTE = 0xA5


def fp8_dtype(fmt):
    return getattr(core.DType, "float8_" + fmt.name)


def random_values(rng, shape, dtype):
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, size=shape)
    return x.astype(np.float32).astype(dtype)


def sentinel_scale_inv(mode, shape):
    if mode == "mxfp8":
        return np.full(shape, 0x5A, np.uint8)
    return np.full(shape, -3.0, np.float32)


def run_block_quantize(device, x, mode, fmt, layout="both", with_amax=True, amax_start=-7.0,
                       **config):
    m, k = ref.matrix(x).shape
    arrays = {}
    if layout in ("rowwise", "both"):
        arrays["data"] = np.full(x.shape, SENTINEL_BYTE, np.uint8)
        arrays["scale_inv"] = sentinel_scale_inv(mode, ref.scale_inv_shape(mode, m, k))
    if layout in ("columnwise", "both"):
        col_shape = x.shape if mode == "mxfp8" else (k, m)
        arrays["columnwise_data"] = np.full(col_shape, SENTINEL_BYTE, np.uint8)
        col_sinv_shape = ref.scale_inv_shape(mode, m, k, columnwise=True)
        arrays["columnwise_scale_inv"] = sentinel_scale_inv(mode, col_sinv_shape)
    if with_amax:
        arrays["amax"] = np.array([amax_start], np.float32)
    on_device = {name: device.put(a) for name, a in arrays.items()}
    out = core.Tensor(
        dtype=fp8_dtype(fmt), scaling_mode=getattr(core.ScalingMode, mode), **on_device
    )
    core.quantize(device.put(x), out, stream=device.stream, **config)
    return {name: device.get(a) for name, a in on_device.items()}


def check_block_quantize(got, x, mode, fmt, epsilon=0.0, pow2=False):
    want = ref.quantize_blocks(x, mode, fmt, epsilon, pow2)
    order = ["scale_inv", "columnwise_scale_inv", "amax", "data", "columnwise_data"]
    for name, value in sorted(got.items(), key=lambda item: order.index(item[0])):
        if name in ("data", "columnwise_data"):
            expected = want[name].reshape(value.shape)
            ref.assert_fp8_equal(value, expected, fmt, name)
        elif name == "amax":
            ref.assert_float_equal(value, np.array([want["amax"]]), "amax")
        elif mode == "mxfp8":
            np.testing.assert_array_equal(value, want[name], err_msg=f"{name} (E8M0 bytes)")
        else:
            ref.assert_float_equal(value, want[name], name)


def check_cuda_matches_cpu(device, got, run):
    if device.is_cuda:
        on_cpu = run(device.cpu)
        for name in got:
            if name == "amax":
                ref.assert_float_equal(got[name], on_cpu[name], "amax, CUDA vs CPU")
            else:
                ref.assert_same_bits(got[name], on_cpu[name], f"{name}, CUDA vs CPU")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_block_quantize(device, in_dtype, fmt, mode, shape, layout):
    rng = np.random.default_rng([len(shape), *shape, fmt.mantissa_bits, len(mode)])
    x = random_values(rng, shape, IN_DTYPES[in_dtype])

    def run(d):
        return run_block_quantize(d, x, mode, fmt, layout, with_amax=layout != "rowwise")

    got = run(device)
    check_block_quantize(got, x, mode, fmt)
    check_cuda_matches_cpu(device, got, run)


@pytest.mark.parametrize("start", [0.5, 1e6, np.nan], ids=lambda s: f"start{s:g}")
@pytest.mark.parametrize("shape", [(17, 33), (128, 256), (0, 16)], ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_block_quantize_accumulate_amax(device, mode, shape, start):
    """accumulate_amax raises the whole input's amax into the slot (quantize.h) and changes
    nothing else."""
    x = random_values(np.random.default_rng(list(shape)), shape, np.float32)

    def run(d):
        return run_block_quantize(d, x, mode, ref.E4M3, "both", amax_start=start,
                                  accumulate_amax=True)

    got = run(device)
    check_cuda_matches_cpu(device, got, run)
    want = np.float32(np.nan) if np.isnan(start) else np.maximum(np.float32(start), ref.amax(x))
    ref.assert_float_equal(got.pop("amax"), np.array([want], np.float32), "raised amax")
    check_block_quantize(got, x, mode, ref.E4M3)


def special_matrix(dtype, tiny_row: bool) -> np.ndarray:
    """A [70, 300] matrix whose rows and columns hold the edge cases of a block's amax: all
    zeros, NaN, +-Inf, fp32 denormals beside normal values, huge and tiny values."""
    rng = np.random.default_rng(5)
    x = random_values(rng, (70, 300), np.float32)
    x[0, :] = 0.0
    x[1, 5] = np.nan
    x[2, 200], x[2, 7] = np.inf, -np.inf
    x[3, :] = 1e-40
    x[3, ::32] = 1.0
    x[4, :] = 3e38 * np.sign(x[4, :])
    x[5, :] = 1e-30 * rng.uniform(0.5, 1.0, 300)
    x[40, 10] = np.nan
    x[:, 20] = -0.0
    if tiny_row:  # a block of denormals alone: an infinite scale, which becomes FLT_MAX
        x[6, :] = 1e-40
    with np.errstate(all="ignore"):
        return x.astype(dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_block_quantize_special_values(device, in_dtype, fmt, mode):
    x = special_matrix(IN_DTYPES[in_dtype], tiny_row=mode != "mxfp8")

    def run(d):
        return run_block_quantize(d, x, mode, fmt)

    got = run(device)
    check_block_quantize(got, x, mode, fmt)
    check_cuda_matches_cpu(device, got, run)


@pytest.mark.parametrize("amax_value", [448 * 2.0**-127, 448 * 2.0**-130, 1e-40, 1e-45])
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_mxfp8_tiny_block_amax_takes_the_smallest_scale(device, fmt, amax_value):
    """For amax / fp8_max <= 2^-127 the smallest E8M0 scale, 2^-127 (byte 0), is the power of
    two at or above it; a larger one throws away precision the format has."""
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = amax_value
    x[0, 1] = amax_value / 4
    got = run_block_quantize(device, x, "mxfp8", fmt, "rowwise")
    check_block_quantize(got, x, "mxfp8", fmt)


@pytest.mark.parametrize("epsilon", [0.0, 1e-3, 100.0])
@pytest.mark.parametrize("pow2", [False, True], ids=["any_scale", "pow2"])
@pytest.mark.parametrize("shape", [(17, 33), (129, 257)], ids=str)
@pytest.mark.parametrize("mode", ["block_1x128", "block_128x128"])
def test_block_scale_options(device, mode, shape, pow2, epsilon):
    """force_pow2_scales rounds each block's scale down to a power of two; amax_epsilon floors
    each block's amax (with 100, most blocks take the scale fp8_max / 100)."""
    x = random_values(np.random.default_rng(list(shape)), shape, np.float32)
    x[0, :] = 0.0  # a zero block: epsilon decides its scale
    fmt = ref.E4M3

    def run(d):
        return run_block_quantize(d, x, mode, fmt, force_pow2_scales=pow2, amax_epsilon=epsilon)

    got = run(device)
    check_block_quantize(got, x, mode, fmt, epsilon, pow2)
    if pow2:
        mantissa, _ = np.frexp(got["scale_inv"])
        assert np.all(mantissa == 0.5), "a scale_inv that is not a power of two"
    check_cuda_matches_cpu(device, got, run)


def test_mxfp8_ignores_force_pow2(device):
    """MXFP8 scales are powers of two already: force_pow2_scales changes nothing."""
    x = random_values(np.random.default_rng(11), (40, 70), np.float32)
    plain = run_block_quantize(device, x, "mxfp8", ref.E5M2)
    forced = run_block_quantize(device, x, "mxfp8", ref.E5M2, force_pow2_scales=True)
    for name in plain:
        ref.assert_same_bits(forced[name], plain[name], name)
    check_block_quantize(plain, x, "mxfp8", ref.E5M2)


# ---------------------------------------------------------------- dequantize


def random_scale_inv(rng, mode, shape):
    if mode == "mxfp8":
        e = rng.integers(100, 150, size=shape).astype(np.uint8)
        e.ravel()[:3] = [0, 254, 255][: e.size]  # 2^-127 (subnormal), 2^127 and NaN
        return e
    return (2.0 ** rng.uniform(-20, 20, size=shape)).astype(np.float32)


@pytest.mark.parametrize("out_dtype", IN_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_block_dequantize(device, fmt, mode, shape, out_dtype):
    """Every byte value over random block scales, into each output dtype: output = fp8 value *
    its block's scale_inv, rounded to nearest even."""
    rng = np.random.default_rng([len(shape), *shape, len(mode)])
    m, k = ref.matrix(np.empty(shape)).shape
    data = rng.integers(0, 256, size=shape, dtype=np.uint8)
    sinv = random_scale_inv(rng, mode, ref.scale_inv_shape(mode, m, k))
    dtype = IN_DTYPES[out_dtype]

    def run(d):
        out = d.put(np.full(shape, 3, dtype))
        t = core.Tensor(
            d.put(data),
            dtype=fp8_dtype(fmt),
            scaling_mode=getattr(core.ScalingMode, mode),
            scale_inv=d.put(sinv),
        )
        core.dequantize(t, out, stream=d.stream)
        return d.get(out)

    got = run(device)
    per_element = ref.block_scale_inv_per_element(mode, sinv, m, k).reshape(shape)
    ref.assert_float_equal(got, ref.dequantize(data, fmt, per_element, dtype), "dequantize output")
    if device.is_cuda:
        ref.assert_float_equal(got, run(device.cpu), "dequantize, CUDA vs CPU")


# ---------------------------------------------------------------- large shapes, CUDA only

LARGE_SHAPES = [
    (1024, 4096, "bfloat16"),
    (2048, 1024, "float32"),
    (256, 512, "float16"),
    (1023, 4097, "bfloat16"),  # ragged blocks in both directions
    (1, 8191, "float32"),
    (300, 31, "float16"),
    (2, 3, 4000, "bfloat16"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", LARGE_SHAPES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("mode", MODES)
def test_cuda_large_block_quantize(cuda_device, mode, case):
    *shape, in_dtype = case
    x = random_values(np.random.default_rng(list(shape)), tuple(shape), IN_DTYPES[in_dtype])
    fmt = ref.E4M3

    def run(d):
        return run_block_quantize(d, x, mode, fmt)

    got = run(cuda_device)
    check_block_quantize(got, x, mode, fmt)
    check_cuda_matches_cpu(cuda_device, got, run)
