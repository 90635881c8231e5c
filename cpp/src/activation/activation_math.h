// The activations and their derivatives, one element at a time, in fp32: the numerics of the
// CPU reference and of the CUDA kernels alike (both call these functions), so the two paths
// compute the same bits.
//
// Only correctly rounded operations are used, so that both sides agree: +, -, *, comparisons,
// and fused multiply-add written out as fma_f32 (std::fma on the CPU, the GPU's fma: each rounds
// a * b + c once). Nothing is left to contraction (--fmad=false, -ffp-contract=off). The one
// division is a reciprocal of a number in [1, 2] (recip_1_2), correctly rounded on both sides.
//
// libm's expf and CUDA's differ in the last ulp, so exp is the core's own, and in base 2: every
// caller needs e^z only for the sigmoid, as 2^-|w| with w = z log2(e), and the log2(e) is folded
// into the caller's constants (GELU's 2 sqrt(2/pi) log2(e), ...): one more rounding of the
// argument, of the kind whose amplification by exp activation.h already accounts for. 2^v =
// 2^k 2^f with k = round(v) and f in [-0.5, 0.5] exactly, 2^f by a degree-6 minimax polynomial
// (relative error 2e-9; the result is within 0.95 ulp, measured), and 2^k applied with one
// multiply, so that results in the subnormal range are rounded once.
//
// GELU's tanh form is evaluated as x * sigmoid(2u): 0.5 (1 + tanh(u)) = sigmoid(2u) exactly in
// real arithmetic, and the sigmoid form has no cancellation for negative x, where 1 + tanh(u)
// loses every digit. Sigmoid itself takes e = 2^-|w| <= 1 and returns both s and 1 - s as
// 1/(1+e) and e/(1+e), so neither is computed by a cancelling subtraction.
//
// Infinities: forward inputs are clamped below at -FLT_MAX, derivative inputs to the range
// beyond which the function is saturated in fp32 (there the clamp changes no bit), so that
// inf * 0 never arises; NaN passes every clamp. NaN payloads are not pinned here: a NaN may come
// out of these functions with any payload, and the callers write every NaN as kCanonicalNaN
// (fp32 outputs, amax, dbias) or through a conversion that does (16-bit and FP8 outputs).
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_MATH_H_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_MATH_H_

#include <cmath>
#include <cstdint>

#include "common/numerics.h"
#include "transformer_engine/activation.h"

namespace te {
namespace act {

// a * b + c, rounded once.
TE_HOST_DEVICE float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// max(x, lo) and min(x, hi) for a nonzero bound; a NaN x gives NaN (the GPU's max.NaN: one
// instruction where the comparison and select would take two).
TE_HOST_DEVICE float max_keep_nan(float x, float lo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(lo));
  return r;
#else
  return x < lo ? lo : x;
#endif
}

TE_HOST_DEVICE float min_keep_nan(float x, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(hi));
  return r;
#else
  return x > hi ? hi : x;
#endif
}

// lo <= x <= hi; NaN stays NaN.
TE_HOST_DEVICE float clamp(float x, float lo, float hi) { return min_keep_nan(max_keep_nan(x, lo), hi); }

// 1 / d for d in [1, 2] (or NaN), correctly rounded. The GPU's IEEE reciprocal checks for
// arguments near the ends of the exponent range before it takes its fast path, the hardware
// estimate refined by one Newton step with fma; d is never near them, so only that fast path
// is written here, instruction for instruction what the compiler emits for it.
TE_HOST_DEVICE float recip_1_2(float d) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  return __fmaf_rn(r, __fmaf_rn(-d, r, 1.0f), r);
#else
  return 1.0f / d;
#endif
}

// 2^f for f in [-0.5, 0.5], times 2^-64 (see exp2_nonpositive): a minimax polynomial of degree
// 6 with p(0) = 1 exactly, its coefficients scaled by 2^-64 (exact: powers of two, and fma
// never rounds a product on its own, so the scaled Horner steps round as the unscaled would).
constexpr float kExp2Scale = 0x1p-64f;
constexpr float kExp2C0 = 1.0f * kExp2Scale;
constexpr float kExp2C1 = 0.693147182f * kExp2Scale;
constexpr float kExp2C2 = 0.240226477f * kExp2Scale;
constexpr float kExp2C3 = 0.0555033237f * kExp2Scale;
constexpr float kExp2C4 = 0.00961843692f * kExp2Scale;
constexpr float kExp2C5 = 0.0013398875f * kExp2Scale;
constexpr float kExp2C6 = 0.00015353362f * kExp2Scale;

// 2^v for v <= 0 within about 1 ulp; +0 below -150.5, NaN for NaN.
TE_HOST_DEVICE float exp2_nonpositive(float v) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  v = max_keep_nan(v, -152.0f);          // keeps k in [-152, 0]
  const float t = v + kRound;            // kRound + k, k = round(v)
  const float f = v - (t - kRound);      // exact (Sterbenz), in [-0.5, 0.5]
  float p = fma_f32(kExp2C6, f, kExp2C5);
  p = fma_f32(p, f, kExp2C4);
  p = fma_f32(p, f, kExp2C3);
  p = fma_f32(p, f, kExp2C2);
  p = fma_f32(p, f, kExp2C1);
  p = fma_f32(p, f, kExp2C0);
  // 2^(k + 64), a normal number: bits(t) = bits(kRound) + k (t's ulp is 1), and bits(kRound) is
  // a multiple of 2^9, so the shift leaves (k + 64 + 127) << 23.
  const float two_k = bits_float((float_bits(t) + 191u) << 23);
  return p * two_k;  // 2^f 2^k, rounded once
}

// s = sigmoid(w ln 2) = 1 / (1 + 2^-w) and 1 - s, each without cancellation.
struct Sigmoid {
  float s, one_minus_s;
};

TE_HOST_DEVICE Sigmoid sigmoid_log2(float w) {
  const float e = exp2_nonpositive(-fabsf(w));  // in [0, 1]; NaN for NaN
  const float big = recip_1_2(1.0f + e);        // sigmoid(|w| ln 2)
  const float small = e * big;                  // sigmoid(-|w| ln 2)
  return w >= 0.0f ? Sigmoid{big, small} : Sigmoid{small, big};  // NaN: both NaN
}

constexpr float kLog2e = 1.442695f;
// GELU: z = 2 sqrt(2/pi) (x + 0.044715 x^3) = x (kGelu2C + kGeluC3 x^2), and in log2 units
// w = z log2(e) = x (kGeluW1 + kGeluW3 x^2); dz/dx = kGelu2C + kGeluD2 x^2. Each constant is
// the exact product rounded once.
constexpr float kGelu2C = 1.5957692f;  // 2 sqrt(2/pi)
constexpr float kGeluW1 = 2.3022082f;  // 2 sqrt(2/pi) log2(e)
constexpr float kGeluW3 = 0.10294324f;  // 2 sqrt(2/pi) log2(e) 0.044715
constexpr float kGeluD2 = 0.21406445f;  // 2 sqrt(2/pi) 3 0.044715
// Quick GELU: x sigmoid(1.702 x).
constexpr float kQGeluK = 1.702f;
constexpr float kQGeluW = 2.455467f;  // 1.702 log2(e)

TE_HOST_DEVICE float gelu_w(float x, float x2) { return x * fma_f32(kGeluW3, x2, kGeluW1); }

TE_HOST_DEVICE float gelu(float x) {
  x = max_keep_nan(x, -kFloatMax);  // gelu(-inf) = -0, not -inf * 0
  return x * sigmoid_log2(gelu_w(x, x * x)).s;
}

TE_HOST_DEVICE float dgelu(float x) {
  // |x| >= 20: |w| >= 869, so s is exactly 0 or 1 and the derivative exactly 0 or 1.
  x = clamp(x, -20.0f, 20.0f);
  const float x2 = x * x;
  const Sigmoid s = sigmoid_log2(gelu_w(x, x2));
  const float dz = fma_f32(kGeluD2, x2, kGelu2C);
  return s.s * fma_f32(x, s.one_minus_s * dz, 1.0f);
}

TE_HOST_DEVICE float relu(float x) { return x <= 0.0f ? 0.0f : x; }  // NaN stays NaN
TE_HOST_DEVICE float drelu(float x) { return x > 0.0f ? 1.0f : (x <= 0.0f ? 0.0f : x); }

TE_HOST_DEVICE float silu(float x) {
  x = max_keep_nan(x, -kFloatMax);
  return x * sigmoid_log2(x * kLog2e).s;
}

TE_HOST_DEVICE float dsilu(float x) {
  x = clamp(x, -200.0f, 200.0f);  // s is exactly 0 or 1 beyond +-105
  const Sigmoid s = sigmoid_log2(x * kLog2e);
  return s.s * fma_f32(x, s.one_minus_s, 1.0f);
}

TE_HOST_DEVICE float qgelu(float x) {
  x = max_keep_nan(x, -kFloatMax);
  return x * sigmoid_log2(kQGeluW * x).s;
}

TE_HOST_DEVICE float dqgelu(float x) {
  x = clamp(x, -200.0f, 200.0f);  // s is exactly 0 or 1 beyond +-62
  const Sigmoid s = sigmoid_log2(kQGeluW * x);
  return s.s * fma_f32(x, s.one_minus_s * kQGeluK, 1.0f);
}

TE_HOST_DEVICE float srelu(float x) {
  const float r = relu(x);
  return r * r;
}
TE_HOST_DEVICE float dsrelu(float x) { return 2.0f * relu(x); }

// The logistic function (GLU's gate) and its derivative s (1 - s).
TE_HOST_DEVICE float sigmoid(float x) {
  x = clamp(x, -200.0f, 200.0f);  // s is exactly 0 or 1 beyond +-105
  return sigmoid_log2(x * kLog2e).s;
}

TE_HOST_DEVICE float dsigmoid(float x) {
  x = clamp(x, -200.0f, 200.0f);
  const Sigmoid s = sigmoid_log2(x * kLog2e);
  return s.s * s.one_minus_s;
}

// The parameters of a parametrized activation (CLAMPED_SWIGLU), resolved once on the host so
// that the CPU and CUDA paths use the same fp32 constants. Zero for the other activations.
struct Params {
  float limit = 0.0f;    // a is clamped above at limit, b to [-limit, limit]
  float alpha = 0.0f;    // the sigmoid's slope
  float alpha_w = 0.0f;  // alpha log2(e), rounded once: the sigmoid's argument in log2 units
  float offset = 0.0f;   // added to the clamped b
  float floor = 0.0f;    // -200 / alpha_w: below it sigmoid(alpha a) is exactly 0 in fp32
};

inline Params make_params(te_activation act, const te_activation_params *p) {
  Params r;
  if (act != TE_ACTIVATION_CLAMPED_SWIGLU || p == nullptr) return r;
  r.limit = p->limit;
  r.alpha = p->alpha;
  r.alpha_w = p->alpha * kLog2e;
  r.offset = p->linear_offset;
  r.floor = -200.0f / r.alpha_w;
  return r;
}

// Clamped SwiGLU's gate half, g sigmoid(alpha g) for g = min(a, limit), and its derivative in
// a (zero above the limit, where the clamp is active). The sigmoid's argument is clamped below
// at the floor, beyond which the sigmoid is exactly 0 in fp32 already, so the forward's value
// comes out bit for bit and the derivative has no -inf * 0.
TE_HOST_DEVICE float clamped_silu(float a, const Params &p) {
  const float g = max_keep_nan(min_keep_nan(a, p.limit), -kFloatMax);
  return g * sigmoid_log2(g * p.alpha_w).s;
}

TE_HOST_DEVICE void clamped_silu_value_and_derivative(float a, const Params &p, float *f, float *d) {
  const float g = min_keep_nan(a, p.limit);
  const float gc = max_keep_nan(g, p.floor);
  const Sigmoid s = sigmoid_log2(gc * p.alpha_w);
  *f = max_keep_nan(g, -kFloatMax) * s.s;
  const float inside = s.s * fma_f32(gc * p.alpha, s.one_minus_s, 1.0f);
  *d = a > p.limit ? 0.0f : inside;  // NaN a: inside is NaN
}

// Clamped SwiGLU's linear half u = clamp(b, -limit, limit) + offset, and its derivative in b:
// 1 inside the bounds (inclusive), 0 outside, NaN for NaN.
TE_HOST_DEVICE float clamped_linear(float b, const Params &p) { return clamp(b, -p.limit, p.limit) + p.offset; }
TE_HOST_DEVICE float clamped_linear_derivative(float b, const Params &p) {
  return fabsf(b) <= p.limit ? 1.0f : (b != b ? b : 0.0f);
}

// The activation (of a gated one: of its first half) and its derivative.
template <te_activation kAct>
TE_HOST_DEVICE float forward(float x) {
  if constexpr (kAct == TE_ACTIVATION_GELU || kAct == TE_ACTIVATION_GEGLU) return gelu(x);
  if constexpr (kAct == TE_ACTIVATION_RELU || kAct == TE_ACTIVATION_REGLU) return relu(x);
  if constexpr (kAct == TE_ACTIVATION_SILU || kAct == TE_ACTIVATION_SWIGLU) return silu(x);
  if constexpr (kAct == TE_ACTIVATION_QGELU || kAct == TE_ACTIVATION_QGEGLU) return qgelu(x);
  if constexpr (kAct == TE_ACTIVATION_SRELU || kAct == TE_ACTIVATION_SREGLU) return srelu(x);
  if constexpr (kAct == TE_ACTIVATION_GLU) return sigmoid(x);
  return x;
}

template <te_activation kAct>
TE_HOST_DEVICE float derivative(float x) {
  if constexpr (kAct == TE_ACTIVATION_GELU || kAct == TE_ACTIVATION_GEGLU) return dgelu(x);
  if constexpr (kAct == TE_ACTIVATION_RELU || kAct == TE_ACTIVATION_REGLU) return drelu(x);
  if constexpr (kAct == TE_ACTIVATION_SILU || kAct == TE_ACTIVATION_SWIGLU) return dsilu(x);
  if constexpr (kAct == TE_ACTIVATION_QGELU || kAct == TE_ACTIVATION_QGEGLU) return dqgelu(x);
  if constexpr (kAct == TE_ACTIVATION_SRELU || kAct == TE_ACTIVATION_SREGLU) return dsrelu(x);
  if constexpr (kAct == TE_ACTIVATION_GLU) return dsigmoid(x);
  return 1.0f;
}

template <te_activation kAct>
constexpr bool kIsGated =
    kAct == TE_ACTIVATION_GEGLU || kAct == TE_ACTIVATION_SWIGLU || kAct == TE_ACTIVATION_REGLU ||
    kAct == TE_ACTIVATION_QGEGLU || kAct == TE_ACTIVATION_SREGLU || kAct == TE_ACTIVATION_GLU ||
    kAct == TE_ACTIVATION_CLAMPED_SWIGLU;

// The values that reach the outputs (and amax, and dbias); NaN with any payload. ``p``: the
// parameters (read by CLAMPED_SWIGLU alone).
// Forward: y = act(x), gated y = act(a) * b.
template <te_activation kAct>
TE_HOST_DEVICE float forward_value(float a, float b, const Params &p) {
  if constexpr (kAct == TE_ACTIVATION_CLAMPED_SWIGLU) {
    return clamped_silu(a, p) * clamped_linear(b, p);
  } else if constexpr (kIsGated<kAct>) {
    return forward<kAct>(a) * b;
  } else {
    return forward<kAct>(a);
  }
}

// Backward, non-gated: g * act'(x) (IDENTITY: g itself).
template <te_activation kAct>
TE_HOST_DEVICE float backward_value(float g, float x, const Params &) {
  if constexpr (kAct == TE_ACTIVATION_IDENTITY) {
    return g;
  } else {
    return g * derivative<kAct>(x);
  }
}

// The activation of a gated one and its derivative from one sigmoid: beyond the derivative's
// clamp the sigmoid is exactly 0 or 1 already, so the clamped argument gives the forward's
// sigmoid too, bit for bit (gated backward needs both, and exp is most of the cost).
template <te_activation kAct>
TE_HOST_DEVICE void gated_value_and_derivative(float x, float *f, float *d) {
  if constexpr (kAct == TE_ACTIVATION_GEGLU) {
    const float xc = clamp(x, -20.0f, 20.0f);
    const float x2 = xc * xc;
    const Sigmoid s = sigmoid_log2(gelu_w(xc, x2));
    const float dz = fma_f32(kGeluD2, x2, kGelu2C);
    *f = max_keep_nan(x, -kFloatMax) * s.s;
    *d = s.s * fma_f32(xc, s.one_minus_s * dz, 1.0f);
  } else if constexpr (kAct == TE_ACTIVATION_SWIGLU) {
    const float xc = clamp(x, -200.0f, 200.0f);
    const Sigmoid s = sigmoid_log2(xc * kLog2e);
    *f = max_keep_nan(x, -kFloatMax) * s.s;
    *d = s.s * fma_f32(xc, s.one_minus_s, 1.0f);
  } else {
    *f = forward<kAct>(x);
    *d = derivative<kAct>(x);
  }
}

// Backward, gated: d/da = (g * act'(a)) * b, d/db = g * act(a) (clamped SwiGLU: b is the
// clamped linear half, and d/db carries its derivative). |act'| <= ~1.13, so
// g * act'(a) cannot overflow where g does not, and a zero derivative gives 0 whatever b.
template <te_activation kAct>
TE_HOST_DEVICE void gated_backward_values(float g, float a, float b, const Params &p, float *da, float *db) {
  float f, d;
  if constexpr (kAct == TE_ACTIVATION_CLAMPED_SWIGLU) {
    clamped_silu_value_and_derivative(a, p, &f, &d);
    *da = (g * d) * clamped_linear(b, p);
    *db = (g * f) * clamped_linear_derivative(b, p);
  } else {
    gated_value_and_derivative<kAct>(a, &f, &d);
    *da = (g * d) * b;
    *db = g * f;
  }
}

}  // namespace act
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_MATH_H_
