// CUDA kernels of the unfused path's scaled masked softmax: one block per row of sk elements,
// three passes over the row (max, sum, write), fp32 math, the masks of attention.h.
#include <cuda_runtime.h>

#include "attention/attention_kernel.cuh"
#include "attention/attention_math.h"
#include "common/cuda_utils.cuh"

namespace te {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) scaled_softmax_forward_kernel(SoftmaxForwardArgs a) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const int64_t i = row % a.sq, h = (row / a.sq) % a.heads, b = row / (a.sq * a.heads);
  const int64_t base = row * a.sk;
  auto logit = [&](int64_t j) {
    return softmax_masked(a, b, h, i, j) ? -INFINITY : a.scale * attn_load(a.x, base + j, a.dtype, 1.f);
  };
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < a.sk; j += kThreads) m = fmaxf(m, logit(j));
  m = block_reduce(m, scratch, true);
  const bool empty = m == -INFINITY;
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < a.sk && !empty; j += kThreads) sum += expf(logit(j) - m);
  sum = block_reduce(sum, scratch, false);
  for (int64_t j = threadIdx.x; j < a.sk; j += kThreads) {
    attn_store(a.y, base + j, a.dtype, empty ? 0.f : expf(logit(j) - m) / sum, nullptr, nullptr);
  }
}

__global__ void __launch_bounds__(kThreads) scaled_softmax_backward_kernel(SoftmaxBackwardArgs a) {
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * a.cols;
  float part = 0.f;
  for (int64_t j = threadIdx.x; j < a.cols; j += kThreads) {
    part += attn_load(a.dy, base + j, a.dtype, 1.f) * attn_load(a.y, base + j, a.dtype, 1.f);
  }
  const float row_dot = block_reduce(part, scratch, false);
  for (int64_t j = threadIdx.x; j < a.cols; j += kThreads) {
    const float y = attn_load(a.y, base + j, a.dtype, 1.f);
    attn_store(a.dx, base + j, a.dtype, a.scale * y * (attn_load(a.dy, base + j, a.dtype, 1.f) - row_dot), nullptr,
               nullptr);
  }
}

}  // namespace

te_status scaled_softmax_forward_cuda(const SoftmaxForwardArgs &a, te_stream stream) {
  const int64_t rows = a.batch * a.heads * a.sq;
  if (rows > 0 && a.sk > 0) {
    scaled_softmax_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, cuda_stream(stream)>>>(a);
  }
  return launch_status("scaled_softmax_forward");
}

te_status scaled_softmax_backward_cuda(const SoftmaxBackwardArgs &a, te_stream stream) {
  if (a.rows > 0 && a.cols > 0) {
    scaled_softmax_backward_kernel<<<static_cast<unsigned>(a.rows), kThreads, 0, cuda_stream(stream)>>>(a);
  }
  return launch_status("scaled_softmax_backward");
}

}  // namespace te
