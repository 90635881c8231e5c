"""Per-tensor (TENSOR mode) quantize and dequantize against the reference, bit for bit.

Each case runs on the CPU and on CUDA; on CUDA the result must also equal the CPU's bit for
bit (quantize.h: "the CPU and CUDA paths give identical bits").
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

IN_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SHAPES = [(1,), (1, 1), (3, 5), (17, 33), (2, 3, 40), (128, 128), (129, 257), (0, 16), (16, 0)]
LAYOUTS = ["rowwise", "columnwise", "both"]
SENTINEL_BYTE = 0xA5  # outputs start as this, so an element the op skipped shows


def fp8_dtype(fmt: ref.Fp8Format):
    return getattr(core.DType, "float8_" + fmt.name)


def random_values(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Values over several decades, both signs, exactly representable in dtype."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, size=shape)
    return x.astype(np.float32).astype(dtype)


def run_quantize(device, x, fmt, scale, layout="both", with_amax=True, columnwise_shape=None,
                 accumulate_from=None):
    """quantize(x) on device into fresh outputs; returns the numpy contents of every slot.
    ``accumulate_from``: the amax slot starts at this value and is raised (accumulate_amax)."""
    m, k = ref.matrix(x).shape
    arrays = {
        "scale": np.array([scale], np.float32),
        "scale_inv": np.array([-1.0], np.float32),
    }
    if layout in ("rowwise", "both"):
        arrays["data"] = np.full(x.shape, SENTINEL_BYTE, np.uint8)
    if layout in ("columnwise", "both"):
        arrays["columnwise_data"] = np.full(columnwise_shape or (k, m), SENTINEL_BYTE, np.uint8)
    if with_amax:
        start = -7.0 if accumulate_from is None else accumulate_from
        arrays["amax"] = np.array([start], np.float32)
    on_device = {name: device.put(a) for name, a in arrays.items()}
    out = core.Tensor(dtype=fp8_dtype(fmt), **on_device)
    core.quantize(device.put(x), out, accumulate_amax=accumulate_from is not None,
                  stream=device.stream)
    return {name: device.get(a) for name, a in on_device.items()}


def check_quantize(got, x, fmt, scale, columnwise_shape=None):
    want = ref.quantize_tensor(x, scale, fmt)
    m, k = ref.matrix(x).shape
    ref.assert_float_equal(got["scale"], np.array([scale], np.float32), "scale (an input)")
    ref.assert_float_equal(got["scale_inv"], np.array([want["scale_inv"]]), "scale_inv")
    if "data" in got:
        ref.assert_fp8_equal(got["data"], want["data"], fmt, "data")
    if "columnwise_data" in got:
        want_col = want["columnwise_data"].reshape(columnwise_shape or (k, m))
        ref.assert_fp8_equal(got["columnwise_data"], want_col, fmt, "columnwise_data")
    if "amax" in got:
        ref.assert_float_equal(got["amax"], np.array([want["amax"]]), "amax")


def check_cuda_matches_cpu(device, got, run):
    if device.is_cuda:
        on_cpu = run(device.cpu)
        for name in got:
            if name == "amax":  # a NaN amax may carry another payload
                ref.assert_float_equal(got[name], on_cpu[name], "amax, CUDA vs CPU")
            else:
                ref.assert_same_bits(got[name], on_cpu[name], f"{name}, CUDA vs CPU")


@pytest.mark.cuda
def test_core_has_cuda_kernels_when_a_gpu_is_present():
    """On a GPU machine the core must have been built with CUDA, or the cuda runs of the op
    tests would all be skipped."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert core.built_with_cuda(), "a GPU is present but the core was built without CUDA"


@pytest.mark.parametrize("with_amax", [True, False], ids=["amax", "no_amax"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_quantize_tensor(device, in_dtype, fmt, shape, layout, with_amax):
    rng = np.random.default_rng([len(shape), *shape, fmt.mantissa_bits])
    x = random_values(rng, shape, IN_DTYPES[in_dtype])
    a = ref.amax(x)
    # Between 0.6 and 1.6 of the scale that maps amax to fp8_max: the largest values saturate.
    scale = np.float32(fmt.max / a * rng.uniform(0.6, 1.6)) if a > 0 else np.float32(1.5)

    def run(d):
        return run_quantize(d, x, fmt, scale, layout, with_amax)

    got = run(device)
    check_quantize(got, x, fmt, scale)
    check_cuda_matches_cpu(device, got, run)


ACCUMULATE_SHAPES = [(16, 32), (128, 128), (17, 33), (3, 5), (0, 16)]


@pytest.mark.parametrize("start", [0.0, 0.5, 1e6, np.nan], ids=lambda s: f"start{s:g}")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", ACCUMULATE_SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_quantize_accumulate_amax(device, in_dtype, shape, layout, start):
    """accumulate_amax raises the amax slot to max(slot, max|x|) (NaN on either side wins) and
    leaves data and scale_inv as without it. The shapes take the fast kernels (row-wise, and
    cast + transpose on 16-aligned shapes), the tiled one (odd shapes) and the empty path."""
    rng = np.random.default_rng([len(shape), *shape, len(layout)])
    x = random_values(rng, shape, IN_DTYPES[in_dtype])
    fmt = ref.E4M3
    scale = np.float32(fmt.max / ref.amax(x)) if ref.amax(x) > 0 else np.float32(1.0)

    def run(d):
        return run_quantize(d, x, fmt, scale, layout, accumulate_from=np.float32(start))

    got = run(device)
    check_cuda_matches_cpu(device, got, run)
    want_amax = np.float32(np.nan) if np.isnan(start) else np.maximum(np.float32(start),
                                                                      ref.amax(x))
    ref.assert_float_equal(got.pop("amax"), np.array([want_amax], np.float32), "raised amax")
    check_quantize(got, x, fmt, scale)


def test_quantize_accumulate_amax_nan_input(device):
    """A NaN in the input makes the raised amax NaN, whatever the slot held."""
    x = np.array([[1.0, np.nan, -3.0, 2.0]], np.float32)
    got = run_quantize(device, x, ref.E5M2, np.float32(1.0), accumulate_from=np.float32(5.0))
    assert np.isnan(got["amax"][0])


def special_values(fmt: ref.Fp8Format) -> np.ndarray:
    """Every FP8 value, every midpoint between neighbours (a tie: round to even decides) and
    the float32 values either side of it, the subnormal range, fp32 denormals, values just
    above max, +-Inf and NaNs of several signs and payloads."""
    values = ref.all_fp8_values(fmt).astype(np.float64)
    midpoints = (values[1:] + values[:-1]) / 2  # exact in float32: FP8 has 2-3 mantissa bits
    mid32 = midpoints.astype(np.float32)
    above_max = np.array([fmt.max * (1 + 2.0 ** -(fmt.mantissa_bits + 1)), fmt.max * 1.01, 1e30])
    sub = fmt.min_subnormal
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    parts = [
        values.astype(np.float32),
        np.array([0.0, -0.0], np.float32),  # np.unique keeps one zero of the two
        mid32,
        np.nextafter(mid32, np.float32(np.inf)),
        np.nextafter(mid32, np.float32(-np.inf)),
        np.array([0.5, 1.5, 2.5, 3.5, 0.25, 0.75, 0.5001], np.float32) * np.float32(sub),
        np.array([1e-45, -1e-45, 1e-40, -3e-39, 1.1754942e-38, 1.1754944e-38], np.float32),
        np.nextafter(np.float32(fmt.max), np.float32(np.inf)).reshape(1),
        above_max.astype(np.float32),
        -above_max.astype(np.float32),
        np.array(
            [np.finfo(np.float32).max, -np.finfo(np.float32).max, np.inf, -np.inf], np.float32
        ),
        nans,
    ]
    return np.concatenate(parts).astype(np.float32)


@pytest.mark.parametrize("scale", [1.0, 2.0**-5, 3.0], ids=["scale1", "scale2^-5", "scale3"])
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_quantize_special_values(device, in_dtype, fmt, scale):
    with np.errstate(all="ignore"):  # fp16 overflows some of them to Inf, as it should
        x = special_values(fmt).astype(IN_DTYPES[in_dtype])
    x = x.reshape(1, -1)

    def run(d):
        return run_quantize(d, x, fmt, np.float32(scale))

    got = run(device)
    check_quantize(got, x, fmt, np.float32(scale))
    check_cuda_matches_cpu(device, got, run)


@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_saturation_and_nan_bytes(device, fmt):
    """The documented bytes: finite overflow saturates to +-max, +-Inf stays +-Inf in E5M2
    (0x7C / 0xFC) and becomes the NaN byte in E4M3, every NaN becomes 0x7F, the sign of zero is
    kept."""
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001], np.uint32).view(np.float32)
    finite_and_inf = np.array([np.inf, -np.inf, 1e9, -1e9, 0.0, -0.0, -1e-30], np.float32)
    x = np.concatenate([finite_and_inf, nans])
    got = run_quantize(device, x, fmt, np.float32(1.0))
    top = fmt.max_code
    inf, neg_inf = (0x7C, 0xFC) if fmt.name == "e5m2" else (0x7F, 0x7F)
    want = np.array(
        [inf, neg_inf, top, 0x80 | top, 0x00, 0x80, 0x80, 0x7F, 0x7F, 0x7F], np.uint8
    )
    np.testing.assert_array_equal(got["data"], want)
    np.testing.assert_array_equal(got["columnwise_data"].ravel(), want)
    assert np.isnan(got["amax"][0])


def test_columnwise_output_may_keep_leading_dims(device):
    """A rank-3 input's transpose may be given as [K, *leading dims] as well as [K, M]."""
    x = random_values(np.random.default_rng(3), (2, 3, 40), np.float32)
    fmt, scale = ref.E4M3, np.float32(0.75)
    got = run_quantize(device, x, fmt, scale, "columnwise", columnwise_shape=(40, 2, 3))
    check_quantize(got, x, fmt, scale, columnwise_shape=(40, 2, 3))


@pytest.mark.parametrize("scale", [1.0, 0.0, np.inf, 2.0**100])
def test_scale_inv_is_one_over_scale(device, scale):
    """scale_inv = 1/scale in float32, whatever the scale (0 gives Inf, Inf gives 0)."""
    x = np.array([[1.0, -2.0, 0.0]], np.float32)
    with np.errstate(all="ignore"):
        got = run_quantize(device, x, ref.E5M2, np.float32(scale))
        check_quantize(got, x, ref.E5M2, np.float32(scale))


# ---------------------------------------------------------------- dequantize

OUT_DTYPES = IN_DTYPES


def run_dequantize(device, data, fmt, scale_inv, out_dtype):
    out = device.put(np.full(data.shape, 7, out_dtype))
    t = core.Tensor(
        device.put(data),
        dtype=fp8_dtype(fmt),
        scale_inv=device.put(np.array([scale_inv], np.float32)),
    )
    core.dequantize(t, out, stream=device.stream)
    return device.get(out)


@pytest.mark.parametrize(
    "scale_inv", [1.0, 2.0**-7, 1 / 3, 1e-3, 300.0, 2.0**-140, 1e30], ids=lambda s: f"{s:g}"
)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_dequantize_every_code(device, fmt, out_dtype, scale_inv):
    """All 256 bytes (NaNs, +-Inf of E5M2, subnormals), scaled into each output dtype: fp16
    overflow to Inf, subnormal outputs, bf16 rounding."""
    data = np.arange(256, dtype=np.uint8).reshape(2, 128)
    sinv = np.float32(scale_inv)

    def run(d):
        return run_dequantize(d, data, fmt, sinv, OUT_DTYPES[out_dtype])

    got = run(device)
    want = ref.dequantize(data, fmt, sinv, OUT_DTYPES[out_dtype])
    ref.assert_float_equal(got, want, "dequantize output")
    if device.is_cuda:
        ref.assert_float_equal(got, run(device.cpu), "dequantize, CUDA vs CPU")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_shapes(device, shape, out_dtype):
    rng = np.random.default_rng([len(shape), *shape])
    fmt = ref.E4M3 if len(shape) % 2 else ref.E5M2
    data = rng.integers(0, 256, size=shape, dtype=np.uint8)
    sinv = np.float32(rng.uniform(1e-3, 10))
    got = run_dequantize(device, data, fmt, sinv, OUT_DTYPES[out_dtype])
    ref.assert_float_equal(got, ref.dequantize(data, fmt, sinv, OUT_DTYPES[out_dtype]))


# ---------------------------------------------------------------- large shapes, CUDA only

LARGE_SHAPES = [
    (1024, 4096, "bfloat16"),  # the fast, 16-aligned kernels
    (4096, 1024, "float32"),
    (2048, 2048, "float16"),
    (16, 16, "bfloat16"),
    (48, 4096, "float32"),
    (1023, 4097, "bfloat16"),  # the generic kernels: no dimension a multiple of 16
    (1, 65537, "float16"),
    (65537, 1, "float32"),
    (3, 5, 1001, "bfloat16"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", LARGE_SHAPES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_cuda_large_quantize_transpose(cuda_device, case, fmt):
    *shape, in_dtype = case
    rng = np.random.default_rng(list(shape))
    x = random_values(rng, tuple(shape), IN_DTYPES[in_dtype])
    scale = np.float32(fmt.max / ref.amax(x) * 1.25)
    got = run_quantize(cuda_device, x, fmt, scale)
    check_quantize(got, x, fmt, scale)
    check_cuda_matches_cpu(cuda_device, got, lambda d: run_quantize(d, x, fmt, scale))


@pytest.mark.cuda
def test_cuda_quantize_runs_on_the_given_stream(cuda_device):
    """Work is ordered on the stream passed in: a side stream's result, read after that
    stream is synchronized, is complete."""
    import torch

    x = random_values(np.random.default_rng(9), (1024, 4096), ml_dtypes.bfloat16)
    scale = np.float32(448.0 / ref.amax(x))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x_dev = cuda_device.put(x)  # made on the side stream, so no other stream orders it
        data = torch.empty((1024, 4096), dtype=torch.uint8, device="cuda")
        col = torch.empty((4096, 1024), dtype=torch.uint8, device="cuda")
        out = core.Tensor(
            data,
            dtype=core.DType.float8_e4m3,
            columnwise_data=col,
            scale=torch.tensor([float(scale)], device="cuda"),
            scale_inv=torch.empty(1, device="cuda"),
        )
        core.quantize(x_dev, out, stream=side.cuda_stream)
    side.synchronize()
    want = ref.quantize_tensor(x, scale, ref.E4M3)
    ref.assert_fp8_equal(data.cpu().numpy(), want["data"], ref.E4M3)
    ref.assert_fp8_equal(col.cpu().numpy(), want["columnwise_data"], ref.E4M3)


# quantize_many's batch: more casts with a transposed copy and one dtype pair (bf16 -> E4M3)
# than one launch takes (4), casts with other dtypes, shapes for the tiled kernel, one-layout
# casts and an empty tensor. (shape, input dtype, format, layout)
MANY_CASES = [
    ((256, 128), "bfloat16", ref.E4M3, "both"),
    ((128, 384), "bfloat16", ref.E4M3, "both"),
    ((64, 64), "float32", ref.E4M3, "both"),
    ((129, 257), "bfloat16", ref.E4M3, "both"),
    ((32, 48), "bfloat16", ref.E5M2, "columnwise"),
    ((16, 16), "bfloat16", ref.E4M3, "rowwise"),
    ((512, 256), "bfloat16", ref.E4M3, "both"),
    ((128, 128), "bfloat16", ref.E4M3, "columnwise"),
    ((256, 64), "bfloat16", ref.E4M3, "both"),
    ((0, 16), "bfloat16", ref.E4M3, "both"),
    ((96, 32), "float16", ref.E5M2, "both"),
]


@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
def test_quantize_many_equals_quantize_each(device, accumulate):
    """quantize_many gives every cast of its batch exactly what quantize gives it alone (on
    CUDA the batch shares kernel launches; the bits must not notice)."""
    rng = np.random.default_rng(11)
    xs, scales = [], []
    for shape, in_dtype, fmt, _ in MANY_CASES:
        x = random_values(rng, shape, IN_DTYPES[in_dtype])
        a = ref.amax(x)
        xs.append(x)
        scales.append(np.float32(fmt.max / a * rng.uniform(0.6, 1.6)) if a > 0 else np.float32(1.5))

    def run(d):
        inputs, outputs, slots = [], [], []
        for x, scale, (_, _, fmt, layout) in zip(xs, scales, MANY_CASES, strict=True):
            m, k = ref.matrix(x).shape
            arrays = {"scale": np.array([scale], np.float32),
                      "scale_inv": np.array([-1.0], np.float32),
                      "amax": np.array([0.0 if accumulate else -7.0], np.float32)}
            if layout in ("rowwise", "both"):
                arrays["data"] = np.full(x.shape, SENTINEL_BYTE, np.uint8)
            if layout in ("columnwise", "both"):
                arrays["columnwise_data"] = np.full((k, m), SENTINEL_BYTE, np.uint8)
            on_device = {name: d.put(a) for name, a in arrays.items()}
            inputs.append(d.put(x))
            outputs.append(core.Tensor(dtype=fp8_dtype(fmt), **on_device))
            slots.append(on_device)
        core.quantize_many(inputs, outputs, accumulate_amax=accumulate, stream=d.stream)
        return [{name: d.get(a) for name, a in s.items()} for s in slots]

    got = run(device)
    for g, x, scale, (_, _, fmt, _) in zip(got, xs, scales, MANY_CASES, strict=True):
        check_quantize(g, x, fmt, scale)
    if device.is_cuda:
        for g, c in zip(got, run(device.cpu), strict=True):
            for name in g:
                ref.assert_same_bits(g[name], c[name], f"{name}, CUDA vs CPU")


def test_quantize_many_rejects_overlap_across_the_batch(device):
    """A cast writing what another of the batch reads is an error naming both, and nothing of
    the batch is written."""
    x = random_values(np.random.default_rng(5), (16, 32), np.float32)
    shared = device.put(np.full((16, 32), SENTINEL_BYTE, np.uint8))

    def out(data):
        return core.Tensor(dtype=core.DType.float8_e4m3, data=data,
                           scale=device.put(np.array([1.0], np.float32)),
                           scale_inv=device.put(np.array([-1.0], np.float32)))

    with pytest.raises(ValueError, match="tensor 0 output.data must not overlap tensor 1 "
                                         "output.data"):
        core.quantize_many([device.put(x), device.put(x)], [out(shared), out(shared)],
                           stream=device.stream)
    assert (device.get(shared) == SENTINEL_BYTE).all()
    with pytest.raises(ValueError, match="as many"):
        core.quantize_many([device.put(x)], [], stream=device.stream)
