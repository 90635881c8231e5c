// Small CUDA kernels around cuDNN's fused attention: the per-sequence lengths and ragged
// offsets that its graphs read from device memory, and the rows of its outputs and inputs
// whose values attention_impl.h fixes where cuDNN's may differ (see attention_cudnn.cpp).
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_AUX_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_AUX_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_impl.h"
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

// The forward's rows that have no allowed key, or are no query at all (at or past their
// sequence's length), get softmax_lse = -inf and an o row of zeros (THD has no o row past a
// sequence's end). Lengths come from cu_seqlens, or are seqlen_q / seqlen_kv when those are null.
// Rows of o must be 16-byte aligned (head_dim_v * element size a multiple of 16).
struct CudnnEmptyRows {
  AttnLayout layout;
  int64_t batch, heads, seqlen_q, seqlen_kv, head_dim_v;
  const int32_t *cu_seqlens_q, *cu_seqlens_kv;
  bool bottom_right;
  int64_t window_left, window_right;  // -1: unbounded
  void *o;
  size_t o_element_size;
  float *softmax_lse;
};

te_status cudnn_empty_rows(const char *op, const CudnnEmptyRows &r, cudaStream_t stream);

// The backward's copy of softmax_lse for cuDNN: -inf (a row without keys) becomes +inf, so that
// its probabilities exp(s - lse) are 0 rather than exp(-inf + inf) = NaN.
te_status cudnn_backward_stats(const char *op, const float *lse, float *out, int64_t n, cudaStream_t stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_AUX_H_
