// CPU reference of LayerNorm / RMSNorm: the numerics oracle of the CUDA kernels (every sum in
// the order of norm.h, every element through the shared formulas of norm_impl.h) and the CPU
// backend of both frameworks.
#include <algorithm>
#include <vector>

#include "common/elementwise.h"
#include "common/internal.h"
#include "norm/norm_impl.h"

namespace te {
namespace {

// The row sum of f(i) over i in [0, n) in the order of norm.h.
template <typename F>
float row_sum(int64_t n, F &&f) {
  float lanes[kNormLanes] = {};
  for (int64_t i = 0; i < n; ++i) lanes[(i / kNormVec) % kNormLanes] += f(i);
  norm_lane_tree(lanes);
  return lanes[0];
}

}  // namespace

void norm_forward_ref(const NormForwardArgs &a) {
  const bool ln = a.type == TE_NORM_LAYERNORM;
  const int64_t n = a.cols;
  const float scale = a.has_fp8 ? *a.scale : 1.0f;
  uint32_t amax_bits = 0;
  std::vector<float> x(static_cast<size_t>(n)), g(static_cast<size_t>(n)), b(static_cast<size_t>(n), 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    g[j] = norm_gain(load_hp(a.gamma, j, a.weight_dtype), a.zero_centered);
    if (ln) b[j] = load_hp(a.beta, j, a.weight_dtype);
  }
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t j = 0; j < n; ++j) x[j] = load_hp(a.input, r * n + j, a.input_dtype);
    float mu = 0.0f;
    if (ln) mu = row_sum(n, [&](int64_t j) { return x[j]; }) / static_cast<float>(n);
    const float sum_sq = row_sum(n, [&](int64_t j) {
      const float d = ln ? x[j] - mu : x[j];
      return d * d;
    });
    const float rsigma = norm_rsigma(sum_sq, n, a.eps);
    if (ln) a.mu[r] = canonical(mu);
    a.rsigma[r] = canonical(rsigma);
    for (int64_t j = 0; j < n; ++j) {
      const float y = norm_output(norm_xhat(x[j], mu, rsigma, ln), g[j], b[j], ln);
      if (a.output != nullptr) store_hp(a.output, r * n + j, a.output_dtype, canonical(y));
      if (a.has_fp8) {
        const uint8_t q = to_fp8(y * scale, a.fp8_dtype);
        a.fp8[r * n + j] = q;
        if (a.fp8_transpose != nullptr) a.fp8_transpose[j * a.rows + r] = q;
        amax_bits = std::max(amax_bits, abs_bits(y));
      }
    }
  }
  if (a.has_fp8) {
    *a.scale_inv = canonical_div(1.0f, scale);
    if (a.amax != nullptr) {
      *a.amax = canonical(bits_float(a.accumulate_amax ? std::max(float_bits(*a.amax), amax_bits) : amax_bits));
    }
  }
}

void norm_backward_ref(const NormBackwardArgs &a) {
  const bool ln = a.type == TE_NORM_LAYERNORM;
  const int64_t n = a.cols;
  const int64_t groups = ceil_div(a.rows, kNormGroupRows);
  std::vector<float> g(static_cast<size_t>(n)), xhat(static_cast<size_t>(n)), dy(static_cast<size_t>(n));
  std::vector<float> dgamma(static_cast<size_t>(n), 0.0f), dbeta(static_cast<size_t>(n), 0.0f);
  std::vector<float> part_g(static_cast<size_t>(n)), part_b(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) g[j] = norm_gain(load_hp(a.gamma, j, a.weight_dtype), a.zero_centered);
  for (int64_t grp = 0; grp < groups; ++grp) {
    std::fill(part_g.begin(), part_g.end(), 0.0f);
    std::fill(part_b.begin(), part_b.end(), 0.0f);
    const int64_t r1 = std::min(a.rows, (grp + 1) * kNormGroupRows);
    for (int64_t r = grp * kNormGroupRows; r < r1; ++r) {
      const float mu = ln ? a.mu[r] : 0.0f, rsigma = a.rsigma[r];
      for (int64_t j = 0; j < n; ++j) {
        xhat[j] = norm_xhat(load_hp(a.input, r * n + j, a.input_dtype), mu, rsigma, ln);
        dy[j] = load_hp(a.grad_output, r * n + j, a.input_dtype);
      }
      const float m1 = ln ? row_sum(n, [&](int64_t j) { return dy[j] * g[j]; }) / static_cast<float>(n) : 0.0f;
      const float m2 = row_sum(n, [&](int64_t j) { return (dy[j] * g[j]) * xhat[j]; }) / static_cast<float>(n);
      for (int64_t j = 0; j < n; ++j) {
        float dx = norm_grad_input(dy[j] * g[j], xhat[j], m1, m2, rsigma, ln);
        if (a.grad_add != nullptr) {
          dx = norm_add_rounded(dx, load_hp(a.grad_add, r * n + j, a.grad_input_dtype), a.grad_input_dtype);
        }
        store_hp(a.grad_input, r * n + j, a.grad_input_dtype, canonical(dx));
        part_g[j] += dy[j] * xhat[j];
        part_b[j] += dy[j];
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      dgamma[j] += part_g[j];
      dbeta[j] += part_b[j];
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    store_hp(a.grad_gamma, j, a.weight_dtype, canonical(dgamma[j]));
    if (ln) store_hp(a.grad_beta, j, a.weight_dtype, canonical(dbeta[j]));
  }
}

}  // namespace te
