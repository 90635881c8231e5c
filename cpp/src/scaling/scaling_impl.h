// Resolved arguments of the amax and scale ops, shared by the C entry points, the CPU
// reference and the CUDA launchers.
#ifndef TRANSFORMER_ENGINE_SRC_SCALING_SCALING_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_SCALING_SCALING_IMPL_H_

#include <cstddef>
#include <cstdint>

#include "transformer_engine/scaling.h"

namespace te {

struct AmaxArgs {
  const void *input;
  te_dtype input_dtype;  // fp32/fp16/bf16
  int64_t numel;
  float *amax;  // [1]
  const float *gate = nullptr;  // [1] or null: run only while it holds 0 (tensor.h)
};

struct ScaleFromAmaxArgs {
  const float *amax;  // [1]
  float *scale;       // [1]
  float *scale_inv;   // [1]
  float fp8_max;
  float epsilon;
  bool pow2;
};

// One amax history [history_len, columns] with its scales [columns], its format's maximum and,
// when the caller keeps them apart, the amaxes [columns] of the step that just ran.
struct DelayedScalingGroup {
  float *history;
  int64_t history_len;
  int64_t columns;
  float *scale;
  float *scale_inv;
  float fp8_max;
  const float *step_amax = nullptr;  // recorded into slot 0 (recorded_amax) before the update
};

struct DelayedScalingArgs {
  const DelayedScalingGroup *groups;  // host array
  size_t num_groups;
  te_amax_compute_algo algo;
  int32_t margin;
};

void compute_amax_ref(const AmaxArgs &args);
void scale_from_amax_ref(const ScaleFromAmaxArgs &args);
void delayed_scaling_update_ref(const DelayedScalingArgs &args);

// CUDA launchers (in a CPU-only build they report that the build has no CUDA kernels).
te_status compute_amax_cuda(const AmaxArgs &args, te_stream stream);
te_status scale_from_amax_cuda(const ScaleFromAmaxArgs &args, te_stream stream);
te_status delayed_scaling_update_cuda(const DelayedScalingArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_SCALING_SCALING_IMPL_H_
