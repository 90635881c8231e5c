"""Independent reference implementations of the core's ops, in numpy and ml_dtypes.

Written from the C API's doc comments (cpp/include/transformer_engine/*.h), not from the
core's sources, and by other means: FP8 rounding is ml_dtypes' cast (round to nearest even)
after an explicit clip of finite values to the finite range (the core saturates them, where
ml_dtypes would give NaN or Inf; infinities stay non-finite, as in the core), blocks are
numpy reshapes, the MXFP8 exponent is found with exact float64 comparisons, and delayed
scaling is a plain loop over the history columns. Each product and quotient is one float32
operation, as in the core, so the results are comparable bit for bit.

Tensors are viewed as matrices [M, K]: K is the last dimension, M the product of the rest.
"""

from __future__ import annotations

import dataclasses
import zlib

import ml_dtypes
import numpy as np

FLT_MAX = np.float32(np.finfo(np.float32).max)


def stable_seed(*parts) -> int:
    """A seed from a test's parameters that is the same in every process (Python's hash of
    strings is salted per process, so it would make each run draw other data)."""
    return zlib.crc32(repr(parts).encode())


F32 = np.float32


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    name: str  # "e4m3" or "e5m2", the suffix of the core's DType.float8_<name>
    dtype: type  # the ml_dtypes scalar type
    max: float  # largest finite value
    mantissa_bits: int
    min_subnormal: float

    @property
    def max_code(self) -> int:
        """The byte of +max."""
        return int(np.array(self.max, self.dtype).view(np.uint8))


E4M3 = Fp8Format("e4m3", ml_dtypes.float8_e4m3fn, 448.0, 3, 2.0**-9)
E5M2 = Fp8Format("e5m2", ml_dtypes.float8_e5m2, 57344.0, 2, 2.0**-16)
FORMATS = {f.name: f for f in (E4M3, E5M2)}

# The one NaN byte the core writes, whatever the sign or payload of the NaN (quantize.h).
CORE_FP8_NAN = 0x7F


def as_float32(x) -> np.ndarray:
    """fp32 / fp16 / bf16 numpy values as float32 (exact)."""
    return np.asarray(x).astype(np.float32)


def matrix(x: np.ndarray) -> np.ndarray:
    """The [M, K] view of a tensor (rank 0 is [1, 1])."""
    x = np.asarray(x)
    k = x.shape[-1] if x.ndim else 1
    m = int(np.prod(x.shape[:-1])) if x.ndim else 1
    return x.reshape(m, k)


# ---------------------------------------------------------------- FP8 conversion


def cast_to_fp8(values: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """float32 -> FP8 bytes: round to nearest even, finite values saturate to +-max; NaN stays
    NaN and +-Inf stays non-finite (+-Inf in E5M2, NaN in E4M3, which has no infinity)."""
    v = np.asarray(values, np.float32)
    clipped = np.clip(v, F32(-fmt.max), F32(fmt.max))  # NaN passes through np.clip
    clipped = np.where(np.isinf(v), v, clipped)  # ml_dtypes: Inf -> Inf (E5M2), NaN (E4M3)
    return clipped.astype(fmt.dtype).view(np.uint8)


def fp8_to_float32(data: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    return np.asarray(data, np.uint8).view(fmt.dtype).astype(np.float32)


def fp8_is_nan(data: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    return np.isnan(fp8_to_float32(data, fmt))


def all_fp8_values(fmt: Fp8Format) -> np.ndarray:
    """Every finite value of the format, ascending, as float32 (+0 and -0 both)."""
    v = fp8_to_float32(np.arange(256, dtype=np.uint8), fmt)
    return np.unique(v[np.isfinite(v)])


# ---------------------------------------------------------------- amax and scales


def amax(x) -> np.float32:
    """max |x| in float32; NaN when any element is NaN; 0 for an empty tensor."""
    v = as_float32(x)
    if v.size == 0:
        return F32(0.0)
    return F32(np.max(np.abs(v)))  # np.max propagates NaN


def scale_from_amax(amax_values, fp8_max: float, epsilon: float = 0.0, pow2: bool = False):
    """Current scaling, from quantize.h: returns (scale, scale_inv), float32, elementwise.

    a = max(amax, epsilon); scale = fp8_max / a; an infinite scale becomes FLT_MAX;
    a = 0, NaN or Inf gives scale 1; pow2 rounds the scale down to a power of two.
    """
    a = np.asarray(amax_values, np.float32)
    eps = F32(epsilon)
    a = np.where(a < eps, eps, a)  # a NaN amax stays NaN (NaN < eps is false)
    valid = (a > 0) & np.isfinite(a)
    with np.errstate(all="ignore"):
        s = F32(fp8_max) / np.where(valid, a, F32(1)).astype(np.float32)
    s = np.where(np.isfinite(s), s, FLT_MAX).astype(np.float32)
    if pow2:
        _, exponent = np.frexp(s)  # s = m * 2**exponent, 0.5 <= m < 1
        s = np.ldexp(F32(1), exponent - 1).astype(np.float32)
    s = np.where(valid, s, F32(1)).astype(np.float32)
    return s, (F32(1) / s).astype(np.float32)


# ---------------------------------------------------------------- per-tensor quantization


def quantize_tensor(x, scale, fmt: Fp8Format) -> dict:
    """TENSOR mode: row-wise bytes (shape of x), column-wise bytes [K, M], scale_inv, amax."""
    v = as_float32(x)
    with np.errstate(all="ignore"):  # Inf * 0, overflow: IEEE results wanted
        data = cast_to_fp8(v * F32(scale), fmt)
    return {
        "data": data.reshape(v.shape),
        "columnwise_data": np.ascontiguousarray(matrix(data).T),
        "scale_inv": F32(1) / F32(scale),
        "amax": amax(v),
    }


def transpose(x: np.ndarray) -> np.ndarray:
    """The transpose [K, M] of the [M, K] view of any array."""
    return np.ascontiguousarray(matrix(x).T)


# ---------------------------------------------------------------- block quantization


def _padded_blocks(v2d: np.ndarray, br: int, bc: int) -> np.ndarray:
    """|v| zero-padded to whole blocks, as [rows/br, br, cols/bc, bc]."""
    m, k = v2d.shape
    mb, kb = -(-m // br), -(-k // bc)
    padded = np.zeros((mb * br, kb * bc), np.float32)
    padded[:m, :k] = np.abs(v2d)
    return padded.reshape(mb, br, kb, bc)


def block_amax(v2d: np.ndarray, br: int, bc: int) -> np.ndarray:
    """Amax of every br x bc block of a float32 matrix (ragged edge blocks included)."""
    return np.max(_padded_blocks(v2d, br, bc), axis=(1, 3)).astype(np.float32)


def expand_blocks(per_block: np.ndarray, br: int, bc: int, m: int, k: int) -> np.ndarray:
    """A per-block array spread over the elements of the [m, k] matrix its blocks tile."""
    return np.repeat(np.repeat(per_block, br, axis=0), bc, axis=1)[:m, :k]


def quantize_fp32_blocks(v2d, br, bc, fmt, epsilon=0.0, pow2=False):
    """Blocks with an fp32 scale each (1x128, 128x128): returns (bytes [M, K], scale_inv)."""
    m, k = v2d.shape
    scale, scale_inv = scale_from_amax(block_amax(v2d, br, bc), fmt.max, epsilon, pow2)
    with np.errstate(all="ignore"):
        data = cast_to_fp8(v2d * expand_blocks(scale, br, bc, m, k), fmt)
    return data, scale_inv


def e8m0_from_amax(amax_values: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """MXFP8 scale_inv bytes: the smallest power of two 2^(e-127), e in [0, 254], with
    2^(e-127) * fp8_max >= amax, so that no element of the block saturates; 255 (NaN) for a NaN
    or infinite amax. Found by exact float64 comparisons, not by bit manipulation."""
    a = np.asarray(amax_values, np.float64)
    positive = np.isfinite(a) & (a > 0)
    a_safe = np.where(positive, a, 1.0)
    k = np.frexp(a_safe / fmt.max)[1]  # ceil(log2(amax / fp8_max)), or one off by rounding
    # fp8_max * 2^k is exact in float64 (fp8_max has three significant bits): exact tests.
    k = np.where(np.ldexp(fmt.max, k - 1) >= a_safe, k - 1, k)
    k = np.where(np.ldexp(fmt.max, k) < a_safe, k + 1, k)
    assert np.all(np.ldexp(fmt.max, k) >= a_safe) and np.all(np.ldexp(fmt.max, k - 1) < a_safe)
    e = np.clip(k + 127, 0, 254)
    e = np.where(positive, e, np.where(np.isnan(a) | np.isinf(a), 255, 0))
    return e.astype(np.uint8)


def e8m0_to_float32(e: np.ndarray) -> np.ndarray:
    """2^(e - 127) in float32 (2^-127 is a subnormal, exact); 255 is NaN."""
    e = np.asarray(e, np.int32)
    with np.errstate(all="ignore"):
        v = np.ldexp(np.float32(1), e - 127).astype(np.float32)
    return np.where(e == 255, np.float32(np.nan), v).astype(np.float32)


def quantize_mxfp8_blocks(v2d, br, bc, fmt):
    """MXFP8 blocks (1x32 or 32x1): returns (bytes [M, K], E8M0 scale_inv bytes).

    The data is multiplied by 2^(127 - e), the inverse of the block's scale; a NaN scale
    (NaN or Inf in the block) multiplies by 1, so NaN stays NaN and the rest saturates."""
    m, k = v2d.shape
    e = e8m0_from_amax(block_amax(v2d, br, bc), fmt)
    with np.errstate(all="ignore"):
        multiplier = np.ldexp(np.float32(1), 127 - e.astype(np.int32)).astype(np.float32)
        multiplier = np.where(e == 255, np.float32(1), multiplier).astype(np.float32)
        data = cast_to_fp8(v2d * expand_blocks(multiplier, br, bc, m, k), fmt)
    return data, e


def quantize_blocks(x, mode: str, fmt: Fp8Format, epsilon=0.0, pow2=False) -> dict:
    """All the outputs of a block-mode quantize of x (tensor.h's layouts), by slot name."""
    v = matrix(as_float32(x))
    if mode == "block_1x128":
        data, sinv = quantize_fp32_blocks(v, 1, 128, fmt, epsilon, pow2)
        col_t, col_sinv = quantize_fp32_blocks(
            np.ascontiguousarray(v.T), 1, 128, fmt, epsilon, pow2
        )
    elif mode == "block_128x128":
        data, sinv = quantize_fp32_blocks(v, 128, 128, fmt, epsilon, pow2)
        col_t, col_sinv = np.ascontiguousarray(data.T), np.ascontiguousarray(sinv.T)
    elif mode == "mxfp8":
        data, sinv = quantize_mxfp8_blocks(v, 1, 32, fmt)
        col_t, col_sinv = quantize_mxfp8_blocks(v, 32, 1, fmt)
    else:
        raise ValueError(mode)
    return {
        "data": data,
        "scale_inv": sinv,
        "columnwise_data": col_t,
        "columnwise_scale_inv": col_sinv,
        "amax": amax(v),
    }


def block_shape(mode: str) -> tuple[int, int]:
    """The rows x cols of one row-wise block of a mode."""
    return {"block_1x128": (1, 128), "block_128x128": (128, 128), "mxfp8": (1, 32)}[mode]


def scale_inv_shape(mode: str, m: int, k: int, columnwise: bool = False) -> tuple[int, int]:
    """tensor.h's scale_inv shapes for a [m, k] matrix."""
    if columnwise and mode == "mxfp8":
        return (-(-m // 32), k)
    if columnwise:
        m, k = k, m  # the transpose [K, M], blocked like row-wise data
    br, bc = block_shape(mode)
    return (-(-m // br), -(-k // bc))


# ---------------------------------------------------------------- dequantization


def dequantize(data, fmt: Fp8Format, scale_inv_per_element, out_dtype) -> np.ndarray:
    """fp8 value * scale_inv in float32, rounded to nearest even into out_dtype (float16 by
    numpy, bfloat16 by ml_dtypes)."""
    with np.errstate(all="ignore"):
        v = fp8_to_float32(data, fmt) * np.asarray(scale_inv_per_element, np.float32)
        return v.astype(np.float32).astype(out_dtype)


def block_scale_inv_per_element(mode: str, scale_inv: np.ndarray, m: int, k: int) -> np.ndarray:
    """The row-wise scale_inv of every element of an [m, k] matrix, as float32."""
    s = e8m0_to_float32(scale_inv) if mode == "mxfp8" else np.asarray(scale_inv, np.float32)
    br, bc = block_shape(mode)
    return expand_blocks(s, br, bc, m, k)


# ---------------------------------------------------------------- delayed scaling


def delayed_scaling_update(history, scale, fp8_max: float, algo: str, margin: int):
    """scaling.h's update of one group, as a loop over the columns of its [H] or [H, n]
    history. Returns (new history, new scale, new scale_inv), float32, in the input shapes."""
    h = np.array(history, np.float32)
    shape = h.shape
    h = h.reshape(shape[0], -1)
    new_scale = np.array(scale, np.float32).reshape(-1)
    with np.errstate(all="ignore"):
        for j in range(h.shape[1]):
            column = h[:, j]
            a = np.max(column) if algo == "max" else column[0]  # np.max propagates NaN
            if np.isfinite(a) and a > 0:
                s = (F32(fp8_max) / F32(a)) / F32(2.0**margin)
                new_scale[j] = s if np.isfinite(s) else FLT_MAX
        new_scale_inv = (F32(1) / new_scale).astype(np.float32)
    h = np.roll(h, -1, axis=0)
    h[0, :] = 0
    return (
        h.reshape(shape),
        new_scale.reshape(np.shape(scale)),
        new_scale_inv.reshape(np.shape(scale)),
    )


# ---------------------------------------------------------------- comparisons


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_fp8_equal(got, want, fmt: Fp8Format, what: str = "data") -> None:
    """FP8 bytes equal bit for bit, except that a NaN compares by NaN-ness; and every NaN the
    core wrote is its one NaN byte 0x7F."""
    got = np.asarray(got, np.uint8)
    want = np.asarray(want, np.uint8)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    got_nan, want_nan = fp8_is_nan(got, fmt), fp8_is_nan(want, fmt)
    np.testing.assert_array_equal(got_nan, want_nan, err_msg=f"{what}: NaN positions differ")
    np.testing.assert_array_equal(
        np.where(got_nan, 0, got), np.where(want_nan, 0, want), err_msg=f"{what}: FP8 bytes differ"
    )
    assert np.all(got[got_nan] == CORE_FP8_NAN), f"{what}: a NaN byte other than 0x7F"


def assert_float_equal(got, want, what: str = "value") -> None:
    """Floating values (fp32, fp16, bf16) equal bit for bit (so +0 != -0), NaN by NaN-ness."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    got_nan = np.isnan(got.astype(np.float32))
    want_nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan, err_msg=f"{what}: NaN positions differ")
    np.testing.assert_array_equal(
        np.where(got_nan, 0, _bits(got)),
        np.where(want_nan, 0, _bits(want)),
        err_msg=f"{what}: bits differ (got {got.ravel()[:8]}, want {want.ravel()[:8]})",
    )


def assert_same_bits(got, want, what: str = "value") -> None:
    """Identical bytes, NaN payloads included (CUDA against the CPU for quantization)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{what}: bits differ")
