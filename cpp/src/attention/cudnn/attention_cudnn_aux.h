// Small CUDA kernels around cuDNN's fused attention: the per-sequence lengths and ragged
// offsets that its graphs read from device memory, and the fills of outputs that it leaves
// unwritten (see attention_cudnn.cpp).
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_AUX_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_AUX_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "transformer_engine/tensor.h"

namespace te {

// What cudnn_sequence_metadata writes, all from cu_seqlens ([batch + 1] int32 prefix sums):
//  seqlen_q[b] = cu_seqlens_q[b + 1] - cu_seqlens_q[b], and likewise seqlen_kv (int32 [batch]);
//  offsets[t][i] = cu_seqlens[i] * elements_per_token[t] for i <= batch, int32 or int64 (wide),
//  from cu_seqlens_kv where from_kv[t], else from cu_seqlens_q.
// Null outputs are skipped.
struct CudnnSequenceMetadata {
  const int32_t *cu_seqlens_q, *cu_seqlens_kv;
  int64_t batch;
  int32_t *seqlen_q, *seqlen_kv;
  static constexpr int kMaxOffsets = 4;
  void *offsets[kMaxOffsets];
  int64_t elements_per_token[kMaxOffsets];
  bool from_kv[kMaxOffsets];
  bool wide;
};

te_status cudnn_sequence_metadata(const char *op, const CudnnSequenceMetadata &m, cudaStream_t stream);

// out[0, n) = value.
te_status cudnn_fill_fp32(const char *op, float *out, int64_t n, float value, cudaStream_t stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_AUX_H_
