// The resolved arguments of te_rope_forward / te_rope_backward, and the arithmetic that the
// CPU reference and the CUDA kernel share (rope.h): the token -> position map, cos and sin,
// and the element formula, so that both paths write the same bits.
#ifndef TRANSFORMER_ENGINE_SRC_ROPE_ROPE_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_ROPE_ROPE_IMPL_H_

#include <cstdint>

#include "common/numerics.h"
#include "transformer_engine/rope.h"

namespace te {

struct RopeArgs {
  te_rope_format format;
  bool interleaved;
  bool backward;                // grad_input from grad_output: the transposed map
  const void *input;            // [tokens, heads, dim]: input, or grad_output
  void *output;                 // the same shape: output, or grad_input
  te_dtype dtype;               // of both
  int64_t tokens, heads, dim;   // tokens = S * B, or T
  int64_t seq, batch;           // S (SBHD, BSHD; 0 for THD) and B
  int64_t rot;                  // R: features rotated, even, 0 < R <= dim
  const float *freqs;           // [freq_rows, rot]
  int64_t freq_rows;
  const int32_t *cu_seqlens;    // [batch + 1] (THD), else null
  const int32_t *start_positions;  // [batch] or null
};

// The position of a token (rope.h), or -1 when it has none: outside its sequence, or outside
// the rows of freqs. THD finds the token's sequence by bisection of cu_seqlens (the last b
// with cu_seqlens[b] <= token), which on unchecked (CUDA) offsets still reads only in bounds.
TE_HOST_DEVICE int64_t rope_position(const RopeArgs &a, int64_t token) {
  int64_t b = 0, i = 0;
  if (a.format == TE_ROPE_SBHD) {
    b = token % a.batch;
    i = token / a.batch;
  } else if (a.format == TE_ROPE_BSHD) {
    b = token / a.seq;
    i = token % a.seq;
  } else {
    if (a.batch <= 0) return -1;
    int64_t lo = 0, hi = a.batch - 1;  // the answer lies in [lo, hi]
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (a.cu_seqlens[mid] <= token) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    b = lo;
    i = token - a.cu_seqlens[b];
    if (i < 0 || i >= static_cast<int64_t>(a.cu_seqlens[b + 1]) - a.cu_seqlens[b]) return -1;
  }
  const int64_t p = i + (a.start_positions != nullptr ? a.start_positions[b] : 0);
  return (p >= 0 && p < a.freq_rows) ? p : -1;
}

// cos and sin of an fp32 angle, the same bits on every device (rope.h): x = k pi/2 + r with
// |r| <= pi/4 (pi/2 split in two, the first part with 33 significant bits so that k times it
// is exact for |k| < 2^20; beyond, its rounding is far below the fp32 angle's own), Taylor
// polynomials of sin r and cos r in double precision (the first omitted terms are below 1e-19
// on |r| <= pi/4), the quadrant, then one rounding to fp32. No libm, and k is rounded by the
// 1.5 * 2^52 addition (round to nearest in the default rounding mode, on both sides).
TE_HOST_DEVICE void rope_sincos(float angle, float *cos_out, float *sin_out) {
  if (!(angle > -1073741824.0f && angle < 1073741824.0f)) {  // |angle| >= 2^30, inf, NaN
    *cos_out = *sin_out = bits_float(kCanonicalNaN);
    return;
  }
  constexpr double kTwoOverPi = 0.6366197723675814;
  constexpr double kPiOver2Hi = 1.57079632673412561417;  // 0x3FF921FB54400000
  constexpr double kPiOver2Lo = 6.077100506506192e-11;   // pi/2 - kPiOver2Hi
  constexpr double kRound = 6755399441055744.0;           // 1.5 * 2^52
  const double x = angle;
  const double k = (x * kTwoOverPi + kRound) - kRound;
  const double r = (x - k * kPiOver2Hi) - k * kPiOver2Lo;
  const double r2 = r * r;
  double s = 2.8114572543455206e-15;  // 1/17!, then alternating 1/n! down to 1/3!
  s = s * r2 - 7.647163731819816e-13;
  s = s * r2 + 1.6059043836821613e-10;
  s = s * r2 - 2.505210838544172e-08;
  s = s * r2 + 2.7557319223985893e-06;
  s = s * r2 - 0.0001984126984126984;
  s = s * r2 + 0.008333333333333333;
  s = s * r2 - 0.16666666666666666;
  s = r + r * (r2 * s);
  double c = 1.5619206968586225e-16;  // 1/18!, then alternating 1/n! down to 1/2!
  c = c * r2 - 4.779477332387385e-14;
  c = c * r2 + 1.1470745597729725e-11;
  c = c * r2 - 2.08767569878681e-09;
  c = c * r2 + 2.755731922398589e-07;
  c = c * r2 - 2.48015873015873e-05;
  c = c * r2 + 0.001388888888888889;
  c = c * r2 - 0.041666666666666664;
  c = c * r2 + 0.5;
  c = 1.0 - r2 * c;
  // k is an integer in double; its two low bits are the quadrant (two's complement for k < 0).
  const int quadrant = static_cast<int>(static_cast<int64_t>(k) & 3);
  const double sin_x = quadrant == 0 ? s : quadrant == 1 ? c : quadrant == 2 ? -s : -c;
  const double cos_x = quadrant == 0 ? c : quadrant == 1 ? -s : quadrant == 2 ? -c : s;
  *cos_out = static_cast<float>(cos_x);
  *sin_out = static_cast<float>(sin_x);
}

// The partner of feature j < R in its pair, and whether j is the pair's first feature.
TE_HOST_DEVICE int64_t rope_partner(int64_t j, int64_t rot, bool interleaved) {
  if (interleaved) return j ^ 1;
  return j < rot / 2 ? j + rot / 2 : j - rot / 2;
}
TE_HOST_DEVICE bool rope_first(int64_t j, int64_t rot, bool interleaved) {
  return interleaved ? (j & 1) == 0 : j < rot / 2;
}

// The multiplier of the partner's value in feature j's output: y_j = x_j cos_j + x_k * this.
// Forward: -sin_j for the first feature of a pair, +sin_j for the second. Backward (the
// transpose): +sin_k for the first, -sin_k for the second, k the partner. sin_tab holds the
// token's sines by feature.
TE_HOST_DEVICE float rope_partner_coef(const float *sin_tab, int64_t j, int64_t rot,
                                       bool interleaved, bool backward) {
  const bool first = rope_first(j, rot, interleaved);
  if (!backward) return first ? -sin_tab[j] : sin_tab[j];
  const float s = sin_tab[rope_partner(j, rot, interleaved)];
  return first ? s : -s;
}

// One rotated feature, in fp32 and in this order on both paths (no fused multiply-add).
TE_HOST_DEVICE float rope_rotate(float x, float partner, float cos_j, float partner_coef) {
  return canonical(x * cos_j + partner * partner_coef);
}

void rope_ref(const RopeArgs &args);
// CUDA launcher (in a CPU-only build it reports that the build has no CUDA kernels).
te_status rope_cuda(const RopeArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ROPE_ROPE_IMPL_H_
