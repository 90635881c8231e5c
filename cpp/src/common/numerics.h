// Bit-level number conversions shared by the CPU reference and the CUDA kernels.
//
// These functions are the numerics contract of the core: the CPU path uses them directly,
// and the CUDA kernels use them too except where a hardware instruction is proven (by the
// CUDA tests) to give the same bits, as the FP8 conversion does. Nothing here may depend on
// the rounding mode, flush-to-zero, or FMA contraction, so both sides compute identically.
#ifndef TRANSFORMER_ENGINE_SRC_COMMON_NUMERICS_H_
#define TRANSFORMER_ENGINE_SRC_COMMON_NUMERICS_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TE_HOST_DEVICE inline
#endif

namespace te {

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr float kFloatMax = 3.402823466e+38f;
// The one NaN pattern the FP8 conversion writes, whatever the sign or payload of the input
// (E4M3's infinities included, see float_to_fp8_bits).
constexpr uint8_t kFp8NaN = 0x7F;
// E5M2's infinity without its sign: the code one above the largest finite one, 0x7B.
constexpr uint8_t kE5M2Inf = 0x7C;

TE_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

TE_HOST_DEVICE float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

TE_HOST_DEVICE bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
TE_HOST_DEVICE bool is_finite_float(float x) {
  return (float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

// NaN results of fp32 arithmetic that reach an output are written as this one quiet NaN, on
// both paths: CPUs and GPUs differ in which NaN an operation returns (x86 passes an operand's
// NaN through or writes 0xFFC00000; the GPU writes 0x7FFFFFFF), so the bits are pinned here.
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;

TE_HOST_DEVICE float canonical(float x) {
  return is_nan_bits(float_bits(x)) ? bits_float(kCanonicalNaN) : x;
}
TE_HOST_DEVICE float canonical_mul(float a, float b) { return canonical(a * b); }
TE_HOST_DEVICE float canonical_div(float a, float b) { return canonical(a / b); }

// Rounds a non-negative float to the nearest integer, ties to even, for 0 <= x < 2^22.
// (Adding 2^23 pushes the fraction out of the mantissa; the add itself rounds to even.)
TE_HOST_DEVICE uint32_t round_half_even_small(float x) {
  const float shifted = x + 8388608.0f;
  return float_bits(shifted) - float_bits(8388608.0f);
}

// fp32 -> FP8 with round-to-nearest-even and saturation of finite values to the finite max.
// A non-finite value stays non-finite, so that an overflow upstream is never hidden as a
// plausible number: NaN -> kFp8NaN; +-Inf -> +-Inf in E5M2, and kFp8NaN in E4M3, which has no
// infinity (the one NaN code, unsigned, like every other FP8 NaN written here).
// kMantBits/kBias select E4M3 (3, 7) or E5M2 (2, 15).
template <int kMantBits, int kBias>
TE_HOST_DEVICE uint8_t float_to_fp8_bits(float x, float max_finite, uint8_t max_code) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kFp8NaN;
  if (a == 0x7F800000u) return kMantBits == 2 ? static_cast<uint8_t>(sign | kE5M2Inf) : kFp8NaN;
  if (a >= float_bits(max_finite)) return sign | max_code;
  // Smallest normal of the FP8 format: 2^(1 - bias).
  const uint32_t min_normal_bits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  if (a < min_normal_bits) {
    // Subnormal range: count multiples of the smallest subnormal 2^(1 - bias - mant), exactly
    // (a power-of-two scaling), then round; a result of 2^mant is the smallest normal.
    const float units = bits_float(a) * bits_float(static_cast<uint32_t>(127 - (1 - kBias - kMantBits)) << 23);
    return sign | static_cast<uint8_t>(round_half_even_small(units));
  }
  const int shift = 23 - kMantBits;
  const uint32_t rounded = a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u);
  const uint32_t code = (rounded >> shift) - (static_cast<uint32_t>(127 - kBias) << kMantBits);
  return sign | static_cast<uint8_t>(code);
}

TE_HOST_DEVICE uint8_t float_to_e4m3(float x) { return float_to_fp8_bits<3, 7>(x, kE4M3Max, 0x7E); }
TE_HOST_DEVICE uint8_t float_to_e5m2(float x) { return float_to_fp8_bits<2, 15>(x, kE5M2Max, 0x7B); }

TE_HOST_DEVICE float e4m3_to_float(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xFu;
  const uint32_t mant = v & 0x7u;
  if ((v & 0x7Fu) == 0x7Fu) return bits_float(sign | 0x7FC00000u);
  if (exp == 0) {
    // mant * 2^-9, exact.
    return bits_float(sign | float_bits(static_cast<float>(mant) * 0.001953125f));
  }
  return bits_float(sign | ((exp + 127 - 7) << 23) | (mant << 20));
}

TE_HOST_DEVICE float e5m2_to_float(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 2) & 0x1Fu;
  const uint32_t mant = v & 0x3u;
  if (exp == 0x1Fu) return bits_float(sign | (mant == 0 ? 0x7F800000u : 0x7FC00000u));
  if (exp == 0) {
    // mant * 2^-16, exact.
    return bits_float(sign | float_bits(static_cast<float>(mant) * 1.52587890625e-05f));
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (mant << 21));
}

TE_HOST_DEVICE float bf16_to_float(uint16_t v) { return bits_float(static_cast<uint32_t>(v) << 16); }

// fp32 -> bf16, round to nearest even; NaN -> the quiet NaN 0x7FC0.
TE_HOST_DEVICE uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if (is_nan_bits(u)) return 0x7FC0u;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

TE_HOST_DEVICE float fp16_to_float(uint16_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
  const uint32_t exp = (v >> 10) & 0x1Fu;
  const uint32_t mant = v & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    // mant * 2^-24, exact.
    return bits_float(sign | float_bits(static_cast<float>(mant) * 5.9604644775390625e-08f));
  }
  return bits_float(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

// fp32 -> fp16, round to nearest even, overflow to infinity; NaN -> the quiet NaN 0x7E00.
TE_HOST_DEVICE uint16_t float_to_fp16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7E00u;
  // 65520 = 65504 + half an ulp: from there on, round to nearest even gives infinity.
  if (a >= 0x477FF000u) return sign | 0x7C00u;
  if (a < 0x38800000u) {  // below 2^-14: subnormal, multiples of 2^-24
    const float units = bits_float(a) * 16777216.0f;
    return sign | static_cast<uint16_t>(round_half_even_small(units));
  }
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded >> 13) - (112u << 10));
}

// The scale of current scaling and of block scaling (see te_compute_scale_from_amax).
TE_HOST_DEVICE float scale_from_amax(float amax, float fp8_max_value, float epsilon, bool pow2) {
  float a = amax < epsilon ? epsilon : amax;  // NaN stays NaN
  if (!(a > 0.0f) || !is_finite_float(a)) return 1.0f;
  float scale = fp8_max_value / a;
  if (!is_finite_float(scale)) scale = kFloatMax;
  if (pow2) scale = bits_float(float_bits(scale) & 0xFF800000u);  // drop the mantissa
  return scale;
}

// The delayed-scaling scale of one history column (see te_delayed_scaling_update);
// margin in [0, 126] (checked by the entry point), so 2^margin is an exact normal float.
TE_HOST_DEVICE float delayed_scale(float amax, float old_scale, float fp8_max_value, int margin) {
  if (!(amax > 0.0f) || !is_finite_float(amax)) return old_scale;
  const float s = (fp8_max_value / amax) / bits_float(static_cast<uint32_t>(127 + margin) << 23);
  return is_finite_float(s) ? s : kFloatMax;
}

// Slot 0 of an amax history after a step's amax is recorded into it: the larger of the two,
// NaN (canonical) where either is NaN, so that a non-finite step is never forgotten.
TE_HOST_DEVICE float recorded_amax(float slot0, float step_amax) {
  if (is_nan_bits(float_bits(slot0)) || is_nan_bits(float_bits(step_amax))) return bits_float(kCanonicalNaN);
  return step_amax > slot0 ? step_amax : slot0;
}

// MXFP8: the E8M0 scale_inv of a 32-element block, the power of two at or above
// amax / fp8_max so that no element saturates; 0xFF (NaN) for a NaN or infinite amax.
TE_HOST_DEVICE uint8_t e8m0_scale_inv_from_amax(float amax, float fp8_max_value) {
  if (!is_finite_float(amax) || is_nan_bits(float_bits(amax))) return 0xFF;
  const uint32_t t = float_bits(amax / fp8_max_value);
  // Below the normal range the smallest scale, 2^-127 (byte 0), covers t up to 2^-127 itself.
  if (t <= 0x00400000u) return 0;
  if (t < 0x00800000u) return 1;
  uint32_t exp = t >> 23;
  if ((t & 0x7FFFFFu) != 0) exp += 1;  // round up to the next power of two
  return static_cast<uint8_t>(exp > 254u ? 254u : exp);
}

// 2^(e - 127) as a float (e = 255 gives NaN); exact, subnormal results included.
TE_HOST_DEVICE float e8m0_to_float(uint8_t e) {
  if (e == 0xFF) return bits_float(0x7FC00000u);
  if (e == 0) return bits_float(0x00400000u);  // 2^-127
  return bits_float(static_cast<uint32_t>(e) << 23);
}

// 2^(127 - e), the multiplier that goes with scale_inv 2^(e - 127); 1 for the NaN scale so
// that NaN data stays NaN and the rest saturates.
TE_HOST_DEVICE float e8m0_inverse_to_float(uint8_t e) {
  if (e == 0xFF) return 1.0f;
  const int p = 127 - static_cast<int>(e);   // in [-127, 127]
  if (p >= -126) return bits_float(static_cast<uint32_t>(p + 127) << 23);
  return bits_float(0x00400000u);  // 2^-127, subnormal
}

// Amax of values through their bits: for non-negative floats the integer order is the float
// order, and every NaN sorts above infinity, so a NaN input makes the amax NaN.
TE_HOST_DEVICE uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_COMMON_NUMERICS_H_
