"""numpy models of what the core computes, written from the recipe's formulas (independent
of the code under test): FP8 quantization, current and delayed scaling."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8 = {"float8_e4m3": (ml_dtypes.float8_e4m3fn, 448.0),
       "float8_e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
FLT_MAX = float(np.finfo(np.float32).max)


def quantize(x, scale: float, fmt: str) -> np.ndarray:
    """FP8 values of x * scale (fp32 product, finite values saturated to the finite max,
    nearest even; NaN and +-Inf stay non-finite: Inf in E5M2, NaN in E4M3)."""
    dtype, fmax = FP8[fmt]
    y = np.asarray(x, np.float32) * np.float32(scale)
    y = np.where(np.isfinite(y), np.clip(y, -fmax, fmax), y)
    return y.astype(dtype)


def fake_quantize(x, scale: float, fmt: str) -> np.ndarray:
    """The fp64 value an FP8 GEMM sees for x: quantize, then multiply by 1/scale."""
    return quantize(x, scale, fmt).astype(np.float64) * (1.0 / np.float32(scale)).astype(np.float64)


def scale_from_amax(amax: float, fmt: str, epsilon: float = 0.0, pow2: bool = False) -> float:
    """Current scaling's scale (recipe.Float8CurrentScaling)."""
    fmax = FP8[fmt][1]
    a = np.float32(max(amax, epsilon))
    if a == 0 or not np.isfinite(a):
        return 1.0
    s = np.float32(fmax) / a
    if np.isinf(s):
        s = np.float32(FLT_MAX)
    if pow2:
        s = np.float32(2.0 ** np.floor(np.log2(s)))
    return float(s)


def step_scale(history: np.ndarray, scale: float, amax: float, fmt: str, margin: int = 0) -> float:
    """The scale delayed scaling quantizes a tensor with in a step: the stored ``scale``, or,
    while the history is still empty with the initial scale of 1 (a first step), the update's
    formula on the tensor's own
    ``amax``."""
    if np.any(history != 0) or scale != 1.0:
        return scale
    return delayed_update(np.array([amax], np.float32), scale, fmt, margin)[1]


def delayed_update(history: np.ndarray, scale: float, fmt: str, margin: int = 0,
                   algo: str = "max") -> tuple[np.ndarray, float]:
    """recipe.DelayedScaling's update of one tensor: (rolled history, new scale)."""
    fmax = FP8[fmt][1]
    amax = np.float32(history.max() if algo == "max" else history[0])
    new_scale = np.float32(scale)
    if np.isfinite(amax) and amax > 0:
        new_scale = (np.float32(fmax) / amax) / np.float32(2.0 ** margin)
        if np.isinf(new_scale):
            new_scale = np.float32(FLT_MAX)
    rolled = np.roll(history, -1)
    rolled[0] = 0.0
    return rolled.astype(np.float32), float(new_scale)
