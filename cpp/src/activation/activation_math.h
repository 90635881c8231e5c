// The activations and their derivatives, one element at a time, in fp32: the numerics of the
// CPU reference and of the CUDA kernels alike (both call these functions), so the two paths
// compute the same bits.
//
// libm's expf and CUDA's differ in the last ulp, so exp is the core's own: Cody-Waite range
// reduction x = k ln2 + r (|r| <= ln2/2, exact: ln2's high part has 15 significant bits), a
// degree-7 Taylor polynomial for e^r (its truncation is below 0.1 ulp there), and 2^k applied
// by two exact power-of-two multiplies, so that results in the subnormal range are rounded
// once. Only +, -, *, / and comparisons are used, each correctly rounded on both sides
// (--fmad=false, -ffp-contract=off, IEEE division on the GPU).
//
// GELU's tanh form is evaluated as x * sigmoid(2u): 0.5 (1 + tanh(u)) = sigmoid(2u) exactly in
// real arithmetic, and the sigmoid form has no cancellation for negative x, where 1 + tanh(u)
// loses every digit. Sigmoid itself takes e = exp(-|z|) <= 1 and returns both s and 1 - s as
// 1/(1+e) and e/(1+e), so neither is computed by a cancelling subtraction.
//
// Infinities: forward inputs are clamped below at -FLT_MAX, derivative inputs to the range
// beyond which the function is saturated in fp32 (there the clamp changes no bit), so that
// inf * 0 never arises; NaN passes every clamp.
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_MATH_H_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_MATH_H_

#include <cstdint>

#include "common/numerics.h"
#include "transformer_engine/activation.h"

namespace te {
namespace act {

// lo <= x <= hi; NaN stays NaN (both comparisons are false).
TE_HOST_DEVICE float clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

// e^x within about 2 ulp; +inf above 88.72, +0 below -103.97, NaN for NaN.
TE_HOST_DEVICE float exp_f32(float x) {
  constexpr float kLog2e = 1.44269502f;
  constexpr float kLn2Hi = 0.693145751953125f;       // 0x3F317200: 15 significant bits
  constexpr float kLn2Lo = 1.42860676533018708e-06f;  // ln2 - kLn2Hi
  constexpr float kRound = 12582912.0f;               // 1.5 * 2^23: adding it rounds to an integer
  x = clamp(x, -104.0f, 89.0f);                       // keeps k in [-150, 129]
  const float t = x * kLog2e + kRound;
  const float kf = t - kRound;
  const int32_t k = static_cast<int32_t>(float_bits(t) - float_bits(kRound));
  // k * kLn2Hi is exact (|k| < 2^8) and x - k * kLn2Hi is exact (Sterbenz).
  const float r = (x - kf * kLn2Hi) - kf * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^k as 2^k1 * 2^k2 with both factors normal: the first product is exact, the second rounds.
  const int32_t k1 = k / 2, k2 = k - k1;
  return (p * bits_float(static_cast<uint32_t>(k1 + 127) << 23)) *
         bits_float(static_cast<uint32_t>(k2 + 127) << 23);
}

// s = sigmoid(z) and 1 - s, each without cancellation.
struct Sigmoid {
  float s, one_minus_s;
};

TE_HOST_DEVICE Sigmoid sigmoid_pair(float z) {
  const float e = exp_f32(-(z < 0.0f ? -z : z));  // in [0, 1]; NaN for NaN
  const float big = 1.0f / (1.0f + e);            // sigmoid(|z|)
  const float small = e * big;                    // sigmoid(-|z|)
  return z >= 0.0f ? Sigmoid{big, small} : Sigmoid{small, big};  // NaN: both NaN
}

TE_HOST_DEVICE float sigmoid(float z) { return sigmoid_pair(z).s; }

constexpr float kGeluA = 0.044715f;
constexpr float kGelu2C = 1.59576912160573f;  // 2 sqrt(2/pi)
constexpr float kQGeluK = 1.702f;

// The argument 2u of the sigmoid form of GELU: 2 sqrt(2/pi) (x + 0.044715 x^3).
TE_HOST_DEVICE float gelu_z(float x) { return kGelu2C * (x + kGeluA * ((x * x) * x)); }

TE_HOST_DEVICE float gelu(float x) {
  x = x < -kFloatMax ? -kFloatMax : x;  // gelu(-inf) = -0, not -inf * 0
  return x * sigmoid(gelu_z(x));
}

TE_HOST_DEVICE float dgelu(float x) {
  // |x| >= 20: z is beyond +-600, so s is exactly 0 or 1 and the derivative exactly 0 or 1.
  x = clamp(x, -20.0f, 20.0f);
  const Sigmoid s = sigmoid_pair(gelu_z(x));
  const float dz = kGelu2C * (1.0f + (3.0f * kGeluA) * (x * x));
  return s.s * (1.0f + x * (s.one_minus_s * dz));
}

TE_HOST_DEVICE float relu(float x) { return x <= 0.0f ? 0.0f : x; }  // NaN stays NaN
TE_HOST_DEVICE float drelu(float x) { return x > 0.0f ? 1.0f : (x <= 0.0f ? 0.0f : x); }

TE_HOST_DEVICE float silu(float x) {
  x = x < -kFloatMax ? -kFloatMax : x;
  return x * sigmoid(x);
}

TE_HOST_DEVICE float dsilu(float x) {
  x = clamp(x, -200.0f, 200.0f);  // s is exactly 0 or 1 beyond +-104
  const Sigmoid s = sigmoid_pair(x);
  return s.s * (1.0f + x * s.one_minus_s);
}

TE_HOST_DEVICE float qgelu(float x) {
  x = x < -kFloatMax ? -kFloatMax : x;
  return x * sigmoid(kQGeluK * x);
}

TE_HOST_DEVICE float dqgelu(float x) {
  x = clamp(x, -200.0f, 200.0f);  // s is exactly 0 or 1 beyond +-62
  const Sigmoid s = sigmoid_pair(kQGeluK * x);
  return s.s * (1.0f + x * (s.one_minus_s * kQGeluK));
}

TE_HOST_DEVICE float srelu(float x) {
  const float r = relu(x);
  return r * r;
}
TE_HOST_DEVICE float dsrelu(float x) { return 2.0f * relu(x); }

// The activation (of a gated one: of its first half) and its derivative.
template <te_activation kAct>
TE_HOST_DEVICE float forward(float x) {
  if constexpr (kAct == TE_ACTIVATION_GELU || kAct == TE_ACTIVATION_GEGLU) return gelu(x);
  if constexpr (kAct == TE_ACTIVATION_RELU || kAct == TE_ACTIVATION_REGLU) return relu(x);
  if constexpr (kAct == TE_ACTIVATION_SILU || kAct == TE_ACTIVATION_SWIGLU) return silu(x);
  if constexpr (kAct == TE_ACTIVATION_QGELU) return qgelu(x);
  if constexpr (kAct == TE_ACTIVATION_SRELU) return srelu(x);
  return x;
}

template <te_activation kAct>
TE_HOST_DEVICE float derivative(float x) {
  if constexpr (kAct == TE_ACTIVATION_GELU || kAct == TE_ACTIVATION_GEGLU) return dgelu(x);
  if constexpr (kAct == TE_ACTIVATION_RELU || kAct == TE_ACTIVATION_REGLU) return drelu(x);
  if constexpr (kAct == TE_ACTIVATION_SILU || kAct == TE_ACTIVATION_SWIGLU) return dsilu(x);
  if constexpr (kAct == TE_ACTIVATION_QGELU) return dqgelu(x);
  if constexpr (kAct == TE_ACTIVATION_SRELU) return dsrelu(x);
  return 1.0f;
}

template <te_activation kAct>
constexpr bool kIsGated =
    kAct == TE_ACTIVATION_GEGLU || kAct == TE_ACTIVATION_SWIGLU || kAct == TE_ACTIVATION_REGLU;

// The values that reach the outputs (and amax, and dbias), NaN pinned to kCanonicalNaN.
// Forward: y = act(x), gated y = act(a) * b.
template <te_activation kAct>
TE_HOST_DEVICE float forward_value(float a, float b) {
  if constexpr (kIsGated<kAct>) {
    return canonical(forward<kAct>(a) * b);
  } else {
    return canonical(forward<kAct>(a));
  }
}

// Backward, non-gated: g * act'(x) (IDENTITY: g itself).
template <te_activation kAct>
TE_HOST_DEVICE float backward_value(float g, float x) {
  if constexpr (kAct == TE_ACTIVATION_IDENTITY) {
    return canonical(g);
  } else {
    return canonical(g * derivative<kAct>(x));
  }
}

// The activation of a gated one and its derivative from one sigmoid: beyond the derivative's
// clamp the sigmoid is exactly 0 or 1 already, so the clamped argument gives the forward's
// sigmoid too, bit for bit (gated backward needs both, and exp is most of the cost).
template <te_activation kAct>
TE_HOST_DEVICE void gated_value_and_derivative(float x, float *f, float *d) {
  if constexpr (kAct == TE_ACTIVATION_GEGLU) {
    const float xc = clamp(x, -20.0f, 20.0f);
    const Sigmoid s = sigmoid_pair(gelu_z(xc));
    const float dz = kGelu2C * (1.0f + (3.0f * kGeluA) * (xc * xc));
    *f = (x < -kFloatMax ? -kFloatMax : x) * s.s;
    *d = s.s * (1.0f + xc * (s.one_minus_s * dz));
  } else if constexpr (kAct == TE_ACTIVATION_SWIGLU) {
    const float xc = clamp(x, -200.0f, 200.0f);
    const Sigmoid s = sigmoid_pair(xc);
    *f = (x < -kFloatMax ? -kFloatMax : x) * s.s;
    *d = s.s * (1.0f + xc * s.one_minus_s);
  } else {
    *f = forward<kAct>(x);
    *d = derivative<kAct>(x);
  }
}

// Backward, gated: d/da = (g * act'(a)) * b, d/db = g * act(a). |act'| <= ~1.13, so
// g * act'(a) cannot overflow where g does not, and a zero derivative gives 0 whatever b.
template <te_activation kAct>
TE_HOST_DEVICE void gated_backward_values(float g, float a, float b, float *da, float *db) {
  float f, d;
  gated_value_and_derivative<kAct>(a, &f, &d);
  *da = canonical((g * d) * b);
  *db = canonical(g * f);
}

}  // namespace act
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_MATH_H_
