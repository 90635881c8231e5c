"""te_gemm against a float64 numpy product of the same operands (gemm.h's rules).

FP8 operands are made by the numpy reference quantizer (not the core's), so the GEMM is tested
on its own. Each case runs on the CPU and on CUDA (cuBLASLt); bounds come from
_tolerances.gemm_bound.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref
from te_common_tests import _tolerances as tol
from te_common_tests._reference import stable_seed

from transformer_engine.common import _core as core

HP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FP8_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]


def fp8_dtype(name: str):
    return getattr(core.DType, "float8_" + name)


def random_matrix(rng, shape, spread=1.0):
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-spread, spread, size=shape)).astype(
        np.float32
    )


class Operand:
    """An operand as stored, its float64 value (dequantized) and how to pass it to the core."""

    def __init__(self, stored64: np.ndarray, arrays: dict, dtype=None, mode="tensor"):
        self.value = stored64
        self.arrays = arrays
        self.dtype = dtype
        self.mode = mode

    def on(self, device):
        put = {k: device.put(v) for k, v in self.arrays.items()}
        if self.dtype is None:
            return put["data"]
        return core.Tensor(
            dtype=self.dtype, scaling_mode=getattr(core.ScalingMode, self.mode), **put
        )


def hp_operand(x: np.ndarray, dtype: str) -> Operand:
    stored = x.astype(HP[dtype])
    return Operand(stored.astype(np.float64), {"data": stored})


def fp8_tensor_operand(x: np.ndarray, fmt_name: str, rng) -> Operand:
    fmt = ref.FORMATS[fmt_name]
    scale = np.float32(fmt.max / max(float(np.abs(x).max()), 1e-30) * rng.uniform(0.5, 1.0))
    data = ref.cast_to_fp8(x * scale, fmt)
    scale_inv = np.float32(1.0) / scale
    value = ref.fp8_to_float32(data, fmt).astype(np.float64) * np.float64(scale_inv)
    arrays = {"data": data, "scale_inv": np.array([scale_inv], np.float32)}
    return Operand(value, arrays, fp8_dtype(fmt_name))


def fp8_block_operand(x: np.ndarray, fmt_name: str, mode: str) -> Operand:
    fmt = ref.FORMATS[fmt_name]
    q = ref.quantize_blocks(x, mode, fmt)
    m, k = x.shape
    per_element = ref.block_scale_inv_per_element(mode, q["scale_inv"], m, k)
    value = ref.fp8_to_float32(q["data"], fmt).astype(np.float64) * per_element.astype(np.float64)
    arrays = {"data": q["data"], "scale_inv": q["scale_inv"]}
    return Operand(value, arrays, fp8_dtype(fmt_name), mode)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def run_gemm(
    device,
    workspaces,
    a: Operand,
    b: Operand,
    out_dtype: str,
    *,
    transpose_a=False,
    transpose_b=True,
    bias=None,
    gelu=False,
    accumulate_into=None,
    split=True,
):
    """Runs the core's GEMM; returns (d, pre_gelu or None) as float64 numpy arrays."""
    av = a.value.T if transpose_a else a.value
    bv = b.value.T if transpose_b else b.value
    m, n = av.shape[0], bv.shape[1]
    d0 = accumulate_into if accumulate_into is not None else np.full((m, n), np.nan, np.float32)
    d = device.put(d0.astype(HP[out_dtype]))
    pre = device.put(np.full((m, n), np.nan, HP[out_dtype])) if gelu else None
    core.gemm(
        a.on(device),
        b.on(device),
        d,
        bias=None if bias is None else device.put(bias),
        pre_gelu_out=pre,
        transpose_a=transpose_a,
        transpose_b=transpose_b,
        accumulate=accumulate_into is not None,
        use_split_accumulator=split,
        gelu=gelu,
        workspace=workspaces(device),
        stream=device.stream,
    )
    got = device.get(d).astype(np.float64)
    return got, (device.get(pre).astype(np.float64) if gelu else None)


def reference(
    a: Operand, b: Operand, *, transpose_a=False, transpose_b=True, bias=None, accumulate_into=None
):
    av = a.value.T if transpose_a else a.value
    bv = b.value.T if transpose_b else b.value
    want = av @ bv
    abs_product = np.abs(av) @ np.abs(bv)
    if accumulate_into is not None:
        want = want + accumulate_into.astype(np.float64)
        abs_product = abs_product + np.abs(accumulate_into.astype(np.float64))
    if bias is not None:
        want = want + bias.astype(np.float64)
        abs_product = abs_product + np.abs(bias.astype(np.float64))
    return want, abs_product, av.shape[1]


def assert_within(got, want, bound, what):
    err = np.abs(got - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err / bound, 0)), got.shape)
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements out of bounds; worst at {i}: "
            f"got {got[i]!r}, want {want[i]!r}, bound {bound[i]!r}"
        )


@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("transpose_a,transpose_b", [(0, 1), (0, 0), (1, 0), (1, 1)])
@pytest.mark.parametrize("mnk", [(1, 1, 1), (17, 33, 45), (64, 48, 80)])
def test_high_precision(device, workspaces, dtype, transpose_a, transpose_b, mnk):
    rng = np.random.default_rng(stable_seed(dtype, transpose_a, transpose_b, mnk))
    m, n, k = mnk
    a = hp_operand(random_matrix(rng, (k, m) if transpose_a else (m, k)), dtype)
    b = hp_operand(random_matrix(rng, (n, k) if transpose_b else (k, n)), dtype)
    for out in {dtype, "float32"}:
        got, _ = run_gemm(
            device,
            workspaces,
            a,
            b,
            out,
            transpose_a=bool(transpose_a),
            transpose_b=bool(transpose_b),
        )
        want, absp, kk = reference(
            a, b, transpose_a=bool(transpose_a), transpose_b=bool(transpose_b)
        )
        assert_within(got, want, tol.gemm_bound(absp, want, kk, out), f"{dtype} -> {out}")


def test_rank3_input(device, workspaces):
    rng = np.random.default_rng(3)
    x = random_matrix(rng, (2, 8, 32))
    a = hp_operand(x.reshape(16, 32), "float32")
    a.arrays["data"] = x
    b = hp_operand(random_matrix(rng, (24, 32)), "float32")
    got, _ = run_gemm(device, workspaces, a, b, "float32")
    want, absp, k = reference(hp_operand(x.reshape(16, 32), "float32"), b)
    assert_within(got, want, tol.gemm_bound(absp, want, k, "float32"), "rank 3")


@pytest.mark.parametrize("fmt_a,fmt_b", FP8_PAIRS)
@pytest.mark.parametrize("out", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mnk", [(16, 16, 16), (32, 48, 160), (128, 64, 256)])
@pytest.mark.parametrize("split", [True, False])
def test_fp8_tensor_scaling(device, workspaces, fmt_a, fmt_b, out, mnk, split):
    rng = np.random.default_rng(stable_seed(fmt_a, fmt_b, out, mnk))
    m, n, k = mnk
    a = fp8_tensor_operand(random_matrix(rng, (m, k)), fmt_a, rng)
    b = fp8_tensor_operand(random_matrix(rng, (n, k)), fmt_b, rng)
    got, _ = run_gemm(device, workspaces, a, b, out, split=split)
    want, absp, kk = reference(a, b)
    bound = tol.gemm_bound(absp, want, kk, out, fp8=True)
    assert_within(got, want, bound, f"{fmt_a} x {fmt_b} -> {out}")


@pytest.mark.parametrize("out_fmt", ["e4m3", "e5m2"])
def test_fp8_output_scale_amax(device, workspaces, out_fmt):
    rng = np.random.default_rng(7)
    m, n, k = 32, 64, 96
    # cuBLASLt writes E5M2 only when an operand is E5M2 (gemm.h).
    a = fp8_tensor_operand(random_matrix(rng, (m, k)), "e4m3", rng)
    b = fp8_tensor_operand(random_matrix(rng, (n, k)), out_fmt, rng)
    want, absp, _ = reference(a, b)
    fmt = ref.FORMATS[out_fmt]
    scale = np.float32(fmt.max / np.abs(want).max() / 2)
    arrays = {
        "data": np.zeros((m, n), np.uint8),
        "scale": np.array([scale], np.float32),
        "scale_inv": np.array([-1], np.float32),
        "amax": np.array([-1], np.float32),
    }
    on = {name: device.put(v) for name, v in arrays.items()}
    d = core.Tensor(dtype=fp8_dtype(out_fmt), **on)
    core.gemm(
        a.on(device),
        b.on(device),
        d,
        use_split_accumulator=True,
        workspace=workspaces(device),
        stream=device.stream,
    )
    got = {name: device.get(v) for name, v in on.items()}
    bound = tol.gemm_bound(absp, want, k, "float32", fp8=True)
    assert abs(got["amax"][0] - np.abs(want).max()) <= bound.max(), (
        got["amax"],
        np.abs(want).max(),
    )
    assert got["scale_inv"][0] == np.float32(1) / scale
    # Each FP8 value is the scaled result rounded once: within half an FP8 ulp (relative
    # 2^-(mantissa+1)) of the exact scaled value, plus the GEMM's own error, plus the
    # subnormal spacing near zero.
    values = ref.fp8_to_float32(got["data"], fmt).astype(np.float64)
    scaled = want * np.float64(scale)
    fp8_bound = np.abs(scaled) * 2.0 ** -(fmt.mantissa_bits + 1) + fmt.min_subnormal / 2
    assert_within(values, scaled, fp8_bound + bound * scale * 1.01, f"fp8 output {out_fmt}")


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8"])
@pytest.mark.parametrize("gelu", [False, True])
def test_bias_and_gelu(device, workspaces, kind, gelu):
    rng = np.random.default_rng(11)
    m, n, k = 48, 64, 32
    x, w = random_matrix(rng, (m, k), 0.3), random_matrix(rng, (n, k), 0.3)
    if kind == "fp8":
        a, b, out = (
            fp8_tensor_operand(x, "e4m3", rng),
            fp8_tensor_operand(w, "e4m3", rng),
            "bfloat16",
        )
    else:
        a, b, out = hp_operand(x, kind), hp_operand(w, kind), kind
    bias = random_matrix(rng, (n,)).astype(HP[out])
    got, pre = run_gemm(device, workspaces, a, b, out, bias=bias, gelu=gelu)
    want, absp, kk = reference(a, b, bias=bias)
    bound = tol.gemm_bound(absp, want, kk, out, fp8=kind == "fp8")
    if gelu:
        assert_within(pre, want, bound, "pre_gelu_out")
        # gelu' is at most 1.13 in magnitude: the pre-activation's error grows by that much.
        want_g = gelu_tanh(want)
        assert_within(got, want_g, 1.2 * bound + tol.OUTPUT_HALF_ULP[out] * np.abs(want_g), "gelu")
    else:
        assert_within(got, want, bound, "bias")


@pytest.mark.parametrize("kind", ["float32", "fp8"])
def test_accumulate(device, workspaces, kind):
    rng = np.random.default_rng(13)
    m, n, k = 32, 16, 48
    x, w = random_matrix(rng, (m, k)), random_matrix(rng, (n, k))
    if kind == "fp8":
        a, b = fp8_tensor_operand(x, "e5m2", rng), fp8_tensor_operand(w, "e4m3", rng)
    else:
        a, b = hp_operand(x, kind), hp_operand(w, kind)
    d0 = random_matrix(rng, (m, n))
    got, _ = run_gemm(device, workspaces, a, b, "float32", accumulate_into=d0)
    want, absp, kk = reference(a, b, accumulate_into=d0)
    bound = tol.gemm_bound(absp, want, kk, "float32", fp8=kind == "fp8")
    assert_within(got, want, bound, "accumulate")


@pytest.mark.parametrize("mode_b", ["block_128x128", "block_1x128"])
@pytest.mark.parametrize("mnk", [(128, 128, 128), (256, 384, 512), (144, 272, 384)])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_block_scaled(device, workspaces, mode_b, mnk, out):
    rng = np.random.default_rng(stable_seed(mode_b, mnk, out))
    m, n, k = mnk
    # Blocks of very different magnitudes: a per-tensor scale could not serve them all.
    x = random_matrix(rng, (m, k), 2.0)
    w = random_matrix(rng, (n, k), 2.0)
    a = fp8_block_operand(x, "e4m3", "block_1x128")
    b = fp8_block_operand(w, "e4m3", mode_b)
    got, _ = run_gemm(device, workspaces, a, b, out)
    want, absp, kk = reference(a, b)
    assert_within(got, want, tol.gemm_bound(absp, want, kk, out, fp8=True), f"1x128 x {mode_b}")


def test_empty(device, workspaces):
    a = hp_operand(np.zeros((0, 32), np.float32), "float32")
    b = hp_operand(np.ones((16, 32), np.float32), "float32")
    got, _ = run_gemm(device, workspaces, a, b, "float32")
    assert got.shape == (0, 16)


def test_empty_contraction_on_cpu(cpu, workspaces):
    # K = 0 (an empty batch in a weight gradient): D = 0 + bias.
    a = hp_operand(np.zeros((4, 0), np.float32), "float32")
    b = hp_operand(np.zeros((3, 0), np.float32), "float32")
    bias = np.array([1, 2, 3], np.float32)
    got, _ = run_gemm(cpu, workspaces, a, b, "float32", bias=bias)
    np.testing.assert_array_equal(got, np.broadcast_to(bias, (4, 3)))


@pytest.mark.cuda
def test_cuda_matches_cpu_at_a_model_shape(cuda_device, cpu, workspaces):
    """The seed example's forward GEMM (2048 x 768 -> 3072) in FP8: CUDA against the CPU path."""
    rng = np.random.default_rng(17)
    a = fp8_tensor_operand(random_matrix(rng, (2048, 768), 0.5), "e4m3", rng)
    b = fp8_tensor_operand(random_matrix(rng, (3072, 768), 0.5), "e4m3", rng)
    got_cuda, _ = run_gemm(cuda_device, workspaces, a, b, "float32")
    got_cpu, _ = run_gemm(cpu, workspaces, a, b, "float32")
    want, absp, k = reference(a, b)
    bound = tol.gemm_bound(absp, want, k, "float32", fp8=True)
    assert_within(got_cuda, want, bound, "cuda")
    assert_within(got_cpu, want, bound, "cpu")


# ---------------------------------------------------------------- errors


def fp8_arrays(device, shape, fmt="e4m3"):
    return core.Tensor(
        device.put(np.zeros(shape, np.uint8)),
        dtype=fp8_dtype(fmt),
        scale_inv=device.put(np.ones(1, np.float32)),
    )


def expect(exc, match, *args, **kwargs):
    before = [np.array(a, copy=True) if isinstance(a, np.ndarray) else None for a in args]
    with pytest.raises(exc, match=match):
        core.gemm(*args, **kwargs)
    for a, b in zip(args, before, strict=True):
        if b is not None:
            np.testing.assert_array_equal(a, b)  # nothing written on failure


def test_errors(cpu):
    f32 = np.float32
    d = np.full((32, 48), 7, f32)
    expect(
        ValueError,
        r"^gemm: M \(rows of a\) must be a multiple of 16 for FP8 operands.*got 40",
        fp8_arrays(cpu, (40, 32)),
        fp8_arrays(cpu, (48, 32)),
        np.zeros((40, 48), f32),
    )
    expect(
        ValueError,
        r"^gemm: K \(columns of a and b\) must be a multiple of 16.*got 24",
        fp8_arrays(cpu, (32, 24)),
        fp8_arrays(cpu, (48, 24)),
        d,
    )
    expect(
        ValueError,
        r"transpose_a = 0 and transpose_b = 1 for FP8",
        fp8_arrays(cpu, (32, 32)),
        fp8_arrays(cpu, (32, 48)),
        d,
        transpose_b=False,
    )
    expect(
        TypeError,
        r"must not both be float8_e5m2",
        fp8_arrays(cpu, (32, 32), "e5m2"),
        fp8_arrays(cpu, (48, 32), "e5m2"),
        d,
    )
    expect(
        TypeError,
        r"^gemm: b.data must have the dtype of a.data \(float32",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), np.float16),
        d,
    )
    expect(
        ValueError,
        r"^gemm: b.data must have K = 8 .*got float32 \[48, 9\]",
        np.zeros((32, 8), f32),
        np.zeros((48, 9), f32),
        d,
    )
    expect(
        ValueError,
        r"^gemm: d.data must have shape \[32, 48\], got float32 \[48, 32\]",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), f32),
        np.zeros((48, 32), f32),
    )
    expect(
        ValueError,
        r"^gemm: bias.data must have shape \[48\]",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), f32),
        d,
        bias=np.zeros(47, f32),
    )
    expect(
        TypeError,
        r"^gemm: bias.data must be float32",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), f32),
        d,
        bias=np.zeros(48, np.float16),
    )
    expect(
        ValueError,
        r"^gemm: pre_gelu_out must be a tensor handle",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), f32),
        d,
        gelu=True,
    )
    expect(
        ValueError,
        r"pre_gelu_out must be NULL unless config.gelu",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), f32),
        d,
        pre_gelu_out=np.zeros((32, 48), f32),
    )
    expect(
        ValueError,
        r"d.amax must be unset unless a and b are FP8",
        np.zeros((32, 8), f32),
        np.zeros((48, 8), f32),
        core.Tensor(d, amax=np.zeros(1, f32)),
    )
    expect(
        ValueError,
        r"^gemm: d.scale must be set",
        fp8_arrays(cpu, (32, 32)),
        fp8_arrays(cpu, (48, 32)),
        core.Tensor(np.zeros((32, 48), np.uint8), dtype=core.DType.float8_e4m3),
    )
    expect(
        ValueError,
        r"scaling modes of a and b must be tensor x tensor",
        fp8_arrays(cpu, (32, 128)),
        core.Tensor(
            np.zeros((48, 128), np.uint8),
            dtype=core.DType.float8_e4m3,
            scaling_mode=core.ScalingMode.block_128x128,
            scale_inv=np.ones((1, 1), f32),
        ),
        d,
    )
    expect(
        ValueError,
        r"^gemm: b.scale_inv must have shape \[1, 1\]",
        core.Tensor(
            np.zeros((32, 128), np.uint8),
            dtype=core.DType.float8_e4m3,
            scaling_mode=core.ScalingMode.block_1x128,
            scale_inv=np.ones((32, 1), f32),
        ),
        core.Tensor(
            np.zeros((48, 128), np.uint8),
            dtype=core.DType.float8_e4m3,
            scaling_mode=core.ScalingMode.block_128x128,
            scale_inv=np.ones((2, 1), f32),
        ),
        d,
    )
    shared = np.zeros((32, 32), f32)
    expect(
        ValueError,
        r"^gemm: d.data must not overlap the input a.data",
        shared,
        np.zeros((32, 32), f32),
        shared,
    )


@pytest.mark.cuda
def test_block_scaled_needs_workspace(cuda_device):
    a = core.Tensor(
        cuda_device.put(np.zeros((128, 128), np.uint8)),
        dtype=core.DType.float8_e4m3,
        scaling_mode=core.ScalingMode.block_1x128,
        scale_inv=cuda_device.put(np.ones((128, 1), np.float32)),
    )
    b = core.Tensor(
        cuda_device.put(np.zeros((128, 128), np.uint8)),
        dtype=core.DType.float8_e4m3,
        scaling_mode=core.ScalingMode.block_128x128,
        scale_inv=cuda_device.put(np.ones((1, 1), np.float32)),
    )
    with pytest.raises(ValueError, match=r"^gemm: workspace must be given for block-scaled"):
        core.gemm(
            a, b, cuda_device.put(np.zeros((128, 128), np.float32)), stream=cuda_device.stream
        )


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_fp8_amax_of_a_high_precision_output(device, workspaces, out):
    """With a high-precision D, d.amax is max|D| of D as stored (gemm.h)."""
    rng = np.random.default_rng(19)
    a = fp8_tensor_operand(random_matrix(rng, (32, 64)), "e4m3", rng)
    b = fp8_tensor_operand(random_matrix(rng, (48, 64)), "e5m2", rng)
    d = device.put(np.zeros((32, 48), HP[out]))
    amax = device.put(np.full(1, -1, np.float32))
    core.gemm(
        a.on(device),
        b.on(device),
        core.Tensor(d, amax=amax),
        workspace=workspaces(device),
        stream=device.stream,
    )
    stored = device.get(d).astype(np.float32)
    assert device.get(amax)[0] == np.abs(stored).max()
