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
