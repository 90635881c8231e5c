// The resolved arguments of quantize / dequantize, shared by the C entry points, the CPU
// reference and the CUDA launchers. Pointers are raw; the entry points have checked them.
#ifndef TRANSFORMER_ENGINE_SRC_QUANTIZE_QUANTIZE_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_QUANTIZE_QUANTIZE_IMPL_H_

#include <cstddef>
#include <cstdint>

#include "transformer_engine/quantize.h"

namespace te {

struct QuantizeArgs {
  te_scaling_mode mode;
  const void *input;  // [rows, cols], fp32/fp16/bf16
  te_dtype input_dtype;
  int64_t rows, cols;
  te_dtype fp8_dtype;  // E4M3 or E5M2
  uint8_t *rowwise;    // [rows, cols] or null
  uint8_t *columnwise; // [cols, rows] (transposed), [rows, cols] for MXFP8, or null
  const float *scale;  // TENSOR mode: [1]
  float *scale_inv;    // TENSOR mode: [1]
  void *rowwise_scale_inv;     // block modes (fp32, E8M0 for MXFP8), null when rowwise is
  void *columnwise_scale_inv;  // block modes, null when columnwise is
  float *amax;         // [1] or null
  bool accumulate_amax;  // amax = max(amax, max|input|) (as bits) instead of overwriting it
  bool pow2;
  float epsilon;
};

struct DequantizeArgs {
  te_scaling_mode mode;
  const uint8_t *input;  // [rows, cols]
  te_dtype fp8_dtype;
  const void *scale_inv;  // by mode
  int64_t rows, cols;
  void *output;  // [rows, cols]
  te_dtype output_dtype;
};

void quantize_ref(const QuantizeArgs &args);
void dequantize_ref(const DequantizeArgs &args);

// CUDA launchers (in a CPU-only build they report that the build has no CUDA kernels).
te_status quantize_cuda(const QuantizeArgs &args, te_stream stream);
// The batch of te_quantize_many (its tensors checked, on one device, disjoint).
te_status quantize_many_cuda(const QuantizeArgs *args, size_t count, te_stream stream);
te_status dequantize_cuda(const DequantizeArgs &args, te_stream stream);
// CUDA builds only (quantize_block.cu): the tiled kernels behind quantize_cuda for the block
// modes, for TENSOR mode with column-wise output of shapes the fast kernel does not take, and
// for empty tensors.
te_status quantize_tiled_cuda(const QuantizeArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_QUANTIZE_QUANTIZE_IMPL_H_
