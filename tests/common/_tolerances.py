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


# ---------------------------------------------------------------- FP8 attention backward
# The FP8 backward (attention.h) against float64 attention of the same dequantized q, k, v, d_o:
# the error of each rounded intermediate is bounded elementwise and carried through, as the
# fused kernels (and the core's CPU and CUDA math paths, which emulate them) compute:
#   logits s = scale q.k, then p = exp(s - lse): a dot product errs by `rel` of sum |q||k|,
#     and p by exp(2 max error of its row) - 1 relative (s and the row's lse both move);
#   p rounded to E4M3 with scale 448 (dv and o use it); o = sum_j p v_j, rounded to E4M3;
#   D = d_o . o; dp = d_o . v; ds = scale p (dp - D), rounded to d_o's format with the dp
#     descale; dq = ds k, dk = ds^T q, dv = p^T d_o (each a sum, off by `rel` of its
#     magnitude); FP8 gradients rounded once more.
# rel: fp32 arithmetic on the CPU and the CUDA math path: sums of at most 128 terms err by
# 128 * 2^-24 = 2^-17 of sum |terms|, and exp, log and the scale products by a few ulps: 2^-16
# covers them. cuDNN's FP8 GEMMs add the tensor cores' accumulation (FP8_TENSOR_CORE_ACCUMULATION).
ATTENTION_FP32_REL = 2.0**-16


def _attention_round(x_abs: np.ndarray, err: np.ndarray, fmt_name: str, descale) -> np.ndarray:
    """err plus the rounding of a value within err of x to an FP8 format with this descale."""
    b = ROUND_TRIP[fmt_name]
    return err + b.relative * (x_abs + err) + b.absolute_scaled * np.float64(descale)


def attention_fp8_backward_bound(q, k, v, d_o, allowed, scale, want, *, descale_o, do_fmt,
                                 descale_dp, grad_fmt=None, grad_descales=(1.0, 1.0, 1.0),
                                 cuda_fp8_gemm=False) -> dict:
    """Largest |got - want| per element of dq, dk, dv (``want`` = their float64 values), and
    of ds before its rounding ("ds"; with the float64 ds, "ds_want"). q, k, v, d_o: the
    dequantized inputs [b, s, h, d], float64; allowed [b, sq, skv] as _attention_reference."""
    from te_common_tests import _attention_reference as attn

    q, k, v, d_o = (np.asarray(t, np.float64) for t in (q, k, v, d_o))
    heads, group = q.shape[2], q.shape[2] // k.shape[2]
    ke, ve = (np.repeat(t, group, axis=2) for t in (k, v))
    o, _, p = attn.forward(q, k, v, allowed, scale)
    rel = ATTENTION_FP32_REL + (FP8_TENSOR_CORE_ACCUMULATION if cuda_fp8_gemm else 0.0)
    mask = allowed[:, None].astype(np.float64)  # [b, 1, sq, skv]

    def mm(spec, a, b):
        return np.einsum(spec, a, b)

    es = scale * rel * mm("bihd,bjhd->bhij", np.abs(q), np.abs(ke)) * mask
    ep = p * np.expm1(2.0 * es.max(axis=-1, keepdims=True))
    ep_r = _attention_round(p, ep, "e4m3", 1.0 / 448.0) * mask  # p's E4M3, scale 448
    pa = p + ep_r
    eo = mm("bhij,bjhd->bihd", ep_r, np.abs(ve)) + rel * mm("bhij,bjhd->bihd", pa, np.abs(ve))
    eo = _attention_round(np.abs(o), eo, "e4m3", descale_o)
    e_d = np.sum(np.abs(d_o) * eo, axis=-1).transpose(0, 2, 1)[..., None]  # [b, h, sq, 1]
    dp = mm("bihd,bjhd->bhij", d_o, ve)
    edp = rel * mm("bihd,bjhd->bhij", np.abs(d_o), np.abs(ve))
    big_d = np.sum(d_o * o, axis=-1).transpose(0, 2, 1)[..., None]
    ds = scale * p * (dp - big_d)
    eds = scale * (ep * np.abs(dp - big_d) + (p + ep) * (edp + e_d)) * mask
    eds_r = _attention_round(np.abs(ds), eds, do_fmt, descale_dp) * mask
    dsa = np.abs(ds) + eds_r

    def kv_heads(x):  # sum each group's query heads onto its kv head
        b, s = x.shape[:2]
        return x.reshape(b, s, heads // group, group, -1).sum(3)

    e_dq = mm("bhij,bjhd->bihd", eds_r, np.abs(ke)) + rel * mm("bhij,bjhd->bihd", dsa, np.abs(ke))
    e_dk = kv_heads(mm("bhij,bihd->bjhd", eds_r, np.abs(q))
                    + rel * mm("bhij,bihd->bjhd", dsa, np.abs(q)))
    e_dv = kv_heads(mm("bhij,bihd->bjhd", ep_r, np.abs(d_o))
                    + rel * mm("bhij,bihd->bjhd", pa, np.abs(d_o)))
    errors = [e_dq, e_dk, e_dv]
    if grad_fmt is not None:
        errors = [_attention_round(np.abs(w), e, grad_fmt, d)
                  for w, e, d in zip(want, errors, grad_descales, strict=True)]
    return {"dq": errors[0], "dk": errors[1], "dv": errors[2], "ds": eds, "ds_want": ds}


# ---------------------------------------------------------------- rotary position embedding
# te_rope_forward / te_rope_backward against float64 from the same fp32 angles, relative to the
# magnitude |x_i cos a_i| + |x_k sin a_k'| of each output (k the partner feature, a_k' the
# angle whose sine multiplies it; gradients likewise). cos and sin are within half an fp32 ulp
# (2^-24 relative) plus 1e-16 of exact (rope.h), and the two products and the sum round once
# each: at most 3 * 2^-24 of the magnitude (the 1e-16 is far below an fp32 ulp of the tests'
# products); 2^-22 holds that with a third to spare. The output dtype then rounds once more
# (OUTPUT_HALF_ULP of the result, which the magnitude bounds), and below its smallest normal
# by half its smallest subnormal.
ROPE_FP32 = 2.0**-22
ROPE_HALF_SUBNORMAL = {"float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}


def rope_bound(magnitude: np.ndarray, out_dtype: str) -> np.ndarray:
    """Largest |got - want| allowed per element of a RoPE output (float64 magnitude)."""
    return (ROPE_FP32 + OUTPUT_HALF_ULP[out_dtype]) * magnitude + ROPE_HALF_SUBNORMAL[out_dtype]
