// CUDA LayerNorm / RMSNorm: the launchers of both directions (the kernels are in
// norm_forward.cuh and norm_backward.cuh), and the backward's last step, which adds the groups'
// partial column sums in group order.
//
// The forward writes the FP8 transpose itself when it can stage a band of rows in shared
// memory (rows % 16 == 0); otherwise the FP8 transpose kernel runs on the row-wise FP8 output.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "norm/norm_cuda.cuh"
#include "norm/norm_impl.h"
#include "transpose/transpose_impl.h"

namespace te {
namespace {

using namespace norm_cuda;

constexpr int kFinalizeThreads = 64;  // small blocks: the columns spread over every SM
constexpr int kFinalizeAhead = 32;    // loads issued before their sums (the adds are a chain)

// grad_gamma[c] (blockIdx.y 0) or grad_beta[c] (1) = the groups' partials added in group order.
// The order makes each column one chain of adds, so the parallelism is in the loads: each
// thread has kFinalizeAhead of them in flight.
__global__ void __launch_bounds__(kFinalizeThreads)
    norm_backward_finalize_kernel(const NormBackwardArgs a, const float *partials, int64_t groups) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(kFinalizeThreads) + threadIdx.x;
  if (c >= a.cols) return;
  const bool beta = blockIdx.y == 1;
  const float *p = partials + (beta ? groups : 0) * a.cols + c;
  float sum = 0.0f;
  int64_t k = 0;
  for (; k + kFinalizeAhead <= groups; k += kFinalizeAhead) {
    float v[kFinalizeAhead];
#pragma unroll
    for (int i = 0; i < kFinalizeAhead; ++i) v[i] = p[(k + i) * a.cols];
#pragma unroll
    for (int i = 0; i < kFinalizeAhead; ++i) sum += v[i];
  }
  for (; k < groups; ++k) sum += p[k * a.cols];
  store_any(beta ? a.grad_beta : a.grad_gamma, c, a.weight_dtype, sum);
}

// Rows can be moved as whole 8-element vectors: 8 | cols and every row start 16-byte aligned
// (8-byte for the FP8 output).
bool rows_aligned(const void *p, int64_t cols, size_t es) {
  return cols % kNormVec == 0 && aligned(p, es == 1 ? 8 : 16);
}

__global__ void scale_inv_kernel(const float *scale, float *scale_inv) { *scale_inv = canonical_div(1.0f, *scale); }

}  // namespace

te_status norm_forward_cuda(const NormForwardArgs &a, te_stream stream) {
  constexpr const char *kOp = "norm_forward";
  cudaStream_t s = cuda_stream(stream);
  if (a.has_fp8 && a.amax != nullptr && !a.accumulate_amax) {  // the blocks atomicMax into it
    if (te_status st = cuda_status(kOp, cudaMemsetAsync(a.amax, 0, sizeof(float), s))) return st;
  }
  if (a.rows > 0) {
    if (a.rows > 0x7FFFFFFF) return fail(TE_ERROR_UNSUPPORTED, kOp, "rows must be below 2^31 on CUDA");
    const size_t es = te_dtype_size(a.input_dtype);
    const bool vector_io = rows_aligned(a.input, a.cols, es) &&
                           (a.output == nullptr || rows_aligned(a.output, a.cols, te_dtype_size(a.output_dtype))) &&
                           (!a.has_fp8 || rows_aligned(a.fp8, a.cols, 1));
    te_status st = with_hp_dtype(a.input_dtype, [&](auto in) {
      return forward<decltype(in)::value>(a, vector_io, s);
    });
    if (st != TE_SUCCESS) return st;
  }
  if (a.rows == 0 && a.has_fp8) {  // no block ran: scale_inv still gets 1 / scale
    scale_inv_kernel<<<1, 1, 0, s>>>(a.scale, a.scale_inv);
    if (te_status st = launch_status(kOp)) return st;
  }
  if (a.fp8_transpose != nullptr && a.rows > 0) {
    const TransposeArgs t{a.fp8, a.fp8_transpose, a.rows, a.cols, 1};
    return transpose_cuda(t, stream);
  }
  return TE_SUCCESS;
}

te_status norm_backward_cuda(const NormBackwardArgs &a, te_stream stream) {
  constexpr const char *kOp = "norm_backward";
  cudaStream_t s = cuda_stream(stream);
  const int64_t groups = div_up(a.rows, kNormGroupRows);
  float *partials = static_cast<float *>(a.workspace);
  if (a.rows > 0) {
    if (groups > 0x7FFFFFFF) return fail(TE_ERROR_UNSUPPORTED, kOp, "rows must be below 2^36 on CUDA");
    const size_t es = te_dtype_size(a.input_dtype);
    const bool vector_io = rows_aligned(a.input, a.cols, es) && rows_aligned(a.grad_output, a.cols, es) &&
                           rows_aligned(a.grad_input, a.cols, te_dtype_size(a.grad_input_dtype)) &&
                           (a.grad_add == nullptr || rows_aligned(a.grad_add, a.cols, te_dtype_size(a.grad_input_dtype)));
    te_status st = with_hp_dtype(a.input_dtype, [&](auto in) {
      return backward<decltype(in)::value>(a, vector_io, partials, groups, s);
    });
    if (st != TE_SUCCESS) return st;
  }
  if (a.cols > 0) {
    const dim3 blocks(static_cast<unsigned>(div_up(a.cols, kFinalizeThreads)), a.grad_beta != nullptr ? 2 : 1);
    norm_backward_finalize_kernel<<<blocks, kFinalizeThreads, 0, s>>>(a, partials, groups);
  }
  return launch_status(kOp);
}

}  // namespace te
