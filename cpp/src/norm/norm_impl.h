// The resolved arguments of te_norm_forward / te_norm_backward, and the arithmetic that the CPU
// reference and the CUDA kernels share, so that both compute every value with the same fp32
// operations in the same order (norm.h).
#ifndef TRANSFORMER_ENGINE_SRC_NORM_NORM_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_NORM_NORM_IMPL_H_

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/numerics.h"
#include "transformer_engine/norm.h"

namespace te {

// The fixed order of a row sum (norm.h): element i goes to lane (i / kNormVec) % kNormLanes.
constexpr int kNormLanes = 128;
constexpr int kNormVec = 8;
// Rows per partial column sum of grad_gamma / grad_beta.
constexpr int64_t kNormGroupRows = 32;

struct NormForwardArgs {
  te_norm_type type;
  float eps;
  bool zero_centered;
  const void *input;  // [rows, cols]
  te_dtype input_dtype;
  int64_t rows, cols;
  const void *gamma, *beta;  // [cols]; beta null for RMSNorm
  te_dtype weight_dtype;
  void *output;  // [rows, cols] high precision, or null
  te_dtype output_dtype;
  bool has_fp8;            // output_fp8 given (its data pointer is null when it is empty)
  uint8_t *fp8;            // [rows, cols]
  uint8_t *fp8_transpose;  // [cols, rows] or null (only with fp8)
  te_dtype fp8_dtype;
  const float *scale;
  float *scale_inv, *amax;  // amax may be null
  bool accumulate_amax;     // amax = max(amax, max|y|) instead of max|y|
  float *mu, *rsigma;       // [rows]; mu null for RMSNorm
  const float *gate = nullptr;  // [1] or null: run only while it holds 0 (tensor.h)
};

struct NormBackwardArgs {
  te_norm_type type;
  bool zero_centered;
  const void *grad_output, *input;  // [rows, cols]
  te_dtype input_dtype;
  int64_t rows, cols;
  const float *mu, *rsigma;
  const void *gamma;
  te_dtype weight_dtype;
  const void *grad_add = nullptr;  // [rows, cols] in grad_input_dtype, or null (norm.h)
  void *grad_input;
  te_dtype grad_input_dtype;
  void *grad_gamma, *grad_beta;  // [cols] in weight_dtype; grad_beta null for RMSNorm
  void *workspace;
  size_t workspace_size;
};

// The pairwise tree over the lanes of a row sum; lanes[0] gets the total.
TE_HOST_DEVICE void norm_lane_tree(float *lanes) {
  for (int s = kNormLanes / 2; s >= 1; s /= 2) {
    for (int l = 0; l < s; ++l) lanes[l] += lanes[l + s];
  }
}

TE_HOST_DEVICE float norm_gain(float w, bool zero_centered) { return zero_centered ? 1.0f + w : w; }

// rsigma from the row's sum of squared deviations (or squares) over n elements.
TE_HOST_DEVICE float norm_rsigma(float sum_sq, int64_t n, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(n) + eps);
}

// xhat of one element: (x - mu) * rsigma, or x * rsigma for RMSNorm (mu = 0 is not the same
// bits when x is -0.0, so the two stay separate).
TE_HOST_DEVICE float norm_xhat(float x, float mu, float rsigma, bool layernorm) {
  return layernorm ? (x - mu) * rsigma : x * rsigma;
}

TE_HOST_DEVICE float norm_output(float xhat, float g, float b, bool layernorm) {
  return layernorm ? xhat * g + b : xhat * g;
}

// One element of grad_input from the row means m1 = mean(dyg) and m2 = mean(dyg * xhat).
TE_HOST_DEVICE float norm_grad_input(float dyg, float xhat, float m1, float m2, float rsigma,
                                     bool layernorm) {
  const float t = layernorm ? dyg - m1 : dyg;
  return (t - xhat * m2) * rsigma;
}

// grad_input's value with the residual gradient `add` added as norm.h states it: dx rounded to
// the dtype, then the sum (which the store rounds), a NaN sum as the canonical NaN (an fp32
// grad_input keeps it as it is, and the CPU would pass an operand's NaN through).
TE_HOST_DEVICE float norm_add_rounded(float dx, float add, te_dtype dtype) {
  const float rounded = dtype == TE_DTYPE_FLOAT32   ? dx
                        : dtype == TE_DTYPE_FLOAT16 ? fp16_to_float(float_to_fp16(dx))
                                                    : bf16_to_float(float_to_bf16(dx));
  return canonical(rounded + add);
}

void norm_forward_ref(const NormForwardArgs &args);
void norm_backward_ref(const NormBackwardArgs &args);

// CUDA launchers (in a CPU-only build they report that the build has no CUDA kernels).
te_status norm_forward_cuda(const NormForwardArgs &args, te_stream stream);
te_status norm_backward_cuda(const NormBackwardArgs &args, te_stream stream);

// Bytes of the CUDA backward's partial sums.
inline size_t norm_backward_workspace_bytes(int64_t rows, int64_t cols) {
  const int64_t groups = (rows + kNormGroupRows - 1) / kNormGroupRows;
  return static_cast<size_t>(2 * groups * cols) * sizeof(float);
}

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_NORM_NORM_IMPL_H_
