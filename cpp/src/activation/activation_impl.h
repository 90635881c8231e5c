// The resolved arguments of te_activation_forward / te_activation_backward, shared by the C
// entry points, the CPU reference and the CUDA launchers. The entry points have checked them.
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_IMPL_H_

#include <cstdint>

#include "activation/activation_math.h"
#include "transformer_engine/activation.h"

namespace te {

// The rows of every operand are the same M. Columns: the activation output (forward) and
// grad_output have n; the input has 2n when gated, else n; grad_input (backward) has the
// input's columns.
struct ActivationArgs {
  te_activation act;
  act::Params params;  // CLAMPED_SWIGLU's; zero for the others
  bool backward;
  bool gated;
  int64_t rows, n;
  te_dtype in_dtype;        // of input and grad_output (fp32/fp16/bf16)
  const void *input;        // [rows, gated ? 2n : n]; null for IDENTITY backward
  const void *grad_output;  // backward: [rows, n]
  void *out;                // output / grad_input, row-wise [rows, out_cols], or null
  te_dtype out_dtype;       // high precision, or the FP8 format of out / out_t
  uint8_t *out_t;           // FP8 transpose [out_cols, rows], or null
  const float *scale;       // FP8: [1]
  float *scale_inv;         // FP8: [1]
  float *amax;              // [1] or null
  bool accumulate_amax;     // amax = max(amax, this call's) instead of this call's
  void *dbias;              // backward: [out_cols] or null
  te_dtype dbias_dtype;
  const float *gate = nullptr;  // [1] or null: run only while it holds 0 (tensor.h)

  int64_t in_cols() const { return gated ? 2 * n : n; }
  int64_t out_cols() const { return backward && gated ? 2 * n : n; }
  bool fp8_out() const { return out_dtype == TE_DTYPE_FLOAT8_E4M3 || out_dtype == TE_DTYPE_FLOAT8_E5M2; }
};

// Rows per chunk of the dbias reduction (see activation.h for the order).
constexpr int64_t kDbiasChunkRows = 128;
constexpr int64_t kDbiasRunRows = 8;

void activation_ref(const ActivationArgs &args);

// CUDA launcher (in a CPU-only build it reports that the build has no CUDA kernels).
te_status activation_cuda(const ActivationArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_IMPL_H_
