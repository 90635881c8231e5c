// The kernels of attention_cudnn_aux.h: a few hundred elements each, one launch per call.
#include "attention/cudnn/attention_cudnn_aux.h"

#include "common/cuda_utils.cuh"

namespace te {
namespace {

constexpr int kThreads = 256;

__global__ void cudnn_sequence_metadata_kernel(CudnnSequenceMetadata m) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i > m.batch) return;
  if (i < m.batch) {
    if (m.seqlen_q != nullptr) m.seqlen_q[i] = m.cu_seqlens_q[i + 1] - m.cu_seqlens_q[i];
    if (m.seqlen_kv != nullptr) m.seqlen_kv[i] = m.cu_seqlens_kv[i + 1] - m.cu_seqlens_kv[i];
  }
#pragma unroll
  for (int t = 0; t < CudnnSequenceMetadata::kMaxOffsets; ++t) {
    if (m.offsets[t] == nullptr) continue;
    const int64_t start = m.from_kv[t] ? m.cu_seqlens_kv[i] : m.cu_seqlens_q[i];
    const int64_t offset = start * m.elements_per_token[t];
    if (m.wide) {
      static_cast<int64_t *>(m.offsets[t])[i] = offset;
    } else {
      static_cast<int32_t *>(m.offsets[t])[i] = static_cast<int32_t>(offset);
    }
  }
}

__global__ void cudnn_fill_fp32_kernel(float *out, int64_t n, float value) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

}  // namespace

te_status cudnn_sequence_metadata(const char *op, const CudnnSequenceMetadata &m, cudaStream_t stream) {
  const int64_t n = m.batch + 1;
  cudnn_sequence_metadata_kernel<<<static_cast<unsigned>(div_up(n, kThreads)), kThreads, 0, stream>>>(m);
  return launch_status(op);
}

te_status cudnn_fill_fp32(const char *op, float *out, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return TE_SUCCESS;
  const int64_t blocks = div_up(n, kThreads) < 4096 ? div_up(n, kThreads) : 4096;
  cudnn_fill_fp32_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, n, value);
  return launch_status(op);
}

}  // namespace te
