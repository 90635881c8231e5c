"""The one table of error bounds of the op tests, each with its reason.

Quantization, dequantization, amax, scales and transposes are compared with the reference bit
for bit (see _reference.py): they are each a fixed sequence of correctly rounded float32
operations, so no tolerance applies. The only bounds are those of the round-trip properties,
dequantize(quantize(x)) against x, where the FP8 rounding itself is the error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from te_common_tests._reference import FORMATS


@dataclasses.dataclass(frozen=True)
class RoundTripBound:
    # Round to nearest even with m mantissa bits errs by at most half an ulp, and an ulp is at
    # most 2^-m of the value's magnitude in the normal range: 2^-(m+1) relative.
    relative: float
    # Below the smallest normal the grid is uniform, spaced by the smallest subnormal: half of
    # it, in units of the scaled value (divide by the scale for the input's units).
    absolute_scaled: float


ROUND_TRIP = {
    name: RoundTripBound(
        relative=2.0 ** -(f.mantissa_bits + 1), absolute_scaled=f.min_subnormal / 2
    )
    for name, f in FORMATS.items()
}
assert ROUND_TRIP["e4m3"].relative == 2.0**-4 and ROUND_TRIP["e5m2"].relative == 2.0**-3

# x * scale, 1 / scale and q * scale_inv are three float32 roundings, each within 2^-24 of
# the value; 2^-21 relative covers them with room (it is far below any FP8 ulp).
FLOAT32_SLACK = 2.0**-21


def round_trip_bound(x: np.ndarray, scale_inv: np.ndarray, fmt_name: str) -> np.ndarray:
    """Largest |dequantize(quantize(x)) - x| allowed per element, for unsaturated x, given the
    (per-element) scale_inv that goes with its FP8 value (so 1/scale_inv multiplied x)."""
    b = ROUND_TRIP[fmt_name]
    ax = np.abs(x.astype(np.float64))
    return ax * (b.relative + FLOAT32_SLACK) + b.absolute_scaled * scale_inv.astype(np.float64)


# ---------------------------------------------------------------- GEMM
# A GEMM is compared with a float64 product of the same (dequantized) operands. Summing K
# products in float32 errs by at most about K * 2^-24 times sum_k |a_ik b_kj| (the classic
# recursive-summation bound; blocked or tree orders only lower it), so the bound below is that
# with a factor 2 of room, plus half an ulp of the output dtype for the final rounding.
# FP8 operands go through Hopper's FP8 tensor cores, whose MMA accumulates with only about 14
# significant bits before partial sums are promoted to float32 (the DeepSeek-V3 report measured
# this on H800); the split accumulator promotes more often but cannot undo it within one MMA.
# On the H200 the error reached 2^-10.5 of sum |a b| (torch._scaled_mm gives the same bits);
# 2^-9 gives that three times the room. It also covers fast accumulation at the tests' K <= 512.
FP32_ACCUMULATION = 2.0**-23
FP8_TENSOR_CORE_ACCUMULATION = 2.0**-9
OUTPUT_HALF_ULP = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def gemm_bound(
    abs_product: np.ndarray, want: np.ndarray, k: int, out_dtype: str, fp8: bool = False
) -> np.ndarray:
    """Largest |got - want| allowed per element of a GEMM output: abs_product is |A| @ |B| of
    the (dequantized) operands in float64, want the float64 result."""
    acc = FP32_ACCUMULATION * max(k, 1) + (FP8_TENSOR_CORE_ACCUMULATION if fp8 else 0.0)
    return acc * abs_product + OUTPUT_HALF_ULP[out_dtype] * np.abs(want) + 1e-30
