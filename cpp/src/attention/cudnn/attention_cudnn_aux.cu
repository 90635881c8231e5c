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

__global__ void cudnn_empty_rows_kernel(CudnnEmptyRows r) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;  // (b, h, i)
  if (row >= r.batch * r.heads * r.seqlen_q) return;
  const int64_t i = row % r.seqlen_q, h = row / r.seqlen_q % r.heads, b = row / (r.seqlen_q * r.heads);
  const int64_t lq = r.cu_seqlens_q != nullptr ? r.cu_seqlens_q[b + 1] - r.cu_seqlens_q[b] : r.seqlen_q;
  const int64_t lk = r.cu_seqlens_kv != nullptr ? r.cu_seqlens_kv[b + 1] - r.cu_seqlens_kv[b] : r.seqlen_kv;
  const bool padded = i >= lq;
  const int64_t off = r.bottom_right ? lk - lq : 0;
  const int64_t lo = r.window_left >= 0 ? max(int64_t{0}, i + off - r.window_left) : 0;
  const int64_t hi = r.window_right >= 0 ? min(lk - 1, i + off + r.window_right) : lk - 1;
  if (!padded && lo <= hi) return;
  if (r.softmax_lse != nullptr) r.softmax_lse[row] = -INFINITY;  // (none in inference)
  if (padded && r.layout == AttnLayout::THD) return;  // that token belongs to the next sequence
  int64_t token;  // the o row's index in units of heads * head_dim_v
  switch (r.layout) {
    case AttnLayout::SBHD: token = i * r.batch + b; break;
    case AttnLayout::THD: token = r.cu_seqlens_q[b] + i; break;
    default: token = b * r.seqlen_q + i; break;
  }
  const size_t row_bytes = static_cast<size_t>(r.head_dim_v) * r.o_element_size;
  uint4 *out = reinterpret_cast<uint4 *>(static_cast<char *>(r.o) + (token * r.heads + h) * row_bytes);
  for (size_t k = 0; k < row_bytes / sizeof(uint4); ++k) out[k] = make_uint4(0, 0, 0, 0);
}

__global__ void cudnn_backward_stats_kernel(const float *lse, float *out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = lse[i];
    out[i] = v == -INFINITY ? INFINITY : v;
  }
}

int64_t grid_for(int64_t n) { return div_up(n, kThreads) < 4096 ? div_up(n, kThreads) : 4096; }

}  // namespace

te_status cudnn_empty_rows(const char *op, const CudnnEmptyRows &r, cudaStream_t stream) {
  const int64_t rows = r.batch * r.heads * r.seqlen_q;
  if (rows <= 0) return TE_SUCCESS;
  cudnn_empty_rows_kernel<<<static_cast<unsigned>(div_up(rows, kThreads)), kThreads, 0, stream>>>(r);
  return launch_status(op);
}

te_status cudnn_backward_stats(const char *op, const float *lse, float *out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return TE_SUCCESS;
  cudnn_backward_stats_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(lse, out, n);
  return launch_status(op);
}

te_status cudnn_sequence_metadata(const char *op, const CudnnSequenceMetadata &m, cudaStream_t stream) {
  const int64_t n = m.batch + 1;
  cudnn_sequence_metadata_kernel<<<static_cast<unsigned>(div_up(n, kThreads)), kThreads, 0, stream>>>(m);
  return launch_status(op);
}

te_status cudnn_fill_fp32(const char *op, float *out, int64_t n, float value, cudaStream_t stream) {
  if (n <= 0) return TE_SUCCESS;
  cudnn_fill_fp32_kernel<<<static_cast<unsigned>(grid_for(n)), kThreads, 0, stream>>>(out, n, value);
  return launch_status(op);
}

}  // namespace te
