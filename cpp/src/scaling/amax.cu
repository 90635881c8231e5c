// CUDA amax and current-scaling scale: te_compute_amax and te_compute_scale_from_amax.
//
// Design. compute_amax_kernel reads the tensor as a flat array, 4 groups of 8 elements per
// thread per iteration (independent 128-bit loads), over a one-wave grid (4 blocks of 256 per SM,
// resident together by the launch bounds), keeping max(abs_bits(x)) as uint32; a block reduces
// it (warp REDUX, then shared memory) and does one atomicMax on the bits of the fp32 output,
// which the launcher zeroes on the stream first (amax is overwritten, not accumulated). A
// scalar grid-stride path serves misaligned pointers; block 0 takes the < 8 tail.
// scale_from_amax_kernel is one thread: scale_from_amax() of numerics.h, then 1 / scale.
#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "scaling/scaling_impl.h"

namespace te {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kBlocksPerSm = 4;

template <te_dtype kIn>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    compute_amax_kernel(const void *__restrict__ input, int64_t n, bool vectorized, float *__restrict__ amax,
                        const float *gate) {
  if (gate != nullptr && *gate != 0.0f) return;  // the amax stays the launcher's 0
  __shared__ uint32_t scratch[kThreads / 32];
  uint32_t m = 0;
  if (vectorized) {
    const int64_t groups = n / 8;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * kUnroll;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < groups;
         base += stride) {
      float x[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * kThreads;
        if (g < groups) {
          load_hp8<kIn>(input, g * 8, x[u]);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) x[u][k] = 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < 8; ++k) m = max(m, abs_bits(x[u][k]));
      }
    }
    const int64_t i = groups * 8 + threadIdx.x;
    if (blockIdx.x == 0 && i < n) m = max(m, abs_bits(load_hp1<kIn>(input, i)));
  } else {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
      m = max(m, abs_bits(load_hp1<kIn>(input, i)));
    }
  }
  m = block_max<kThreads>(m, scratch);
  if (threadIdx.x == 0) atomic_max_amax(amax, m);
}

__global__ void scale_from_amax_kernel(const float *amax, float *scale, float *scale_inv, float fp8_max,
                                       float epsilon, bool pow2) {
  const float s = scale_from_amax(*amax, fp8_max, epsilon, pow2);
  *scale = s;
  *scale_inv = canonical_div(1.0f, s);
}

}  // namespace

te_status compute_amax_cuda(const AmaxArgs &a, te_stream stream_handle) {
  const char *op = "compute_amax";
  const cudaStream_t stream = cuda_stream(stream_handle);
  if (te_status s = cuda_status(op, cudaMemsetAsync(a.amax, 0, sizeof(float), stream))) return s;
  if (a.numel == 0) return TE_SUCCESS;
  int sms = 0;
  if (te_status s = sm_count(op, &sms)) return s;
  const bool vectorized = aligned(a.input, 16);
  const int64_t per_block = static_cast<int64_t>(kThreads) * (vectorized ? 8 * kUnroll : 1);
  const int64_t blocks = std::min<int64_t>(ceil_div(a.numel, per_block), static_cast<int64_t>(sms) * kBlocksPerSm);
  return with_hp_dtype(a.input_dtype, [&](auto in) {
    constexpr te_dtype kIn = decltype(in)::value;
    compute_amax_kernel<kIn><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a.input, a.numel, vectorized,
                                                                                     a.amax, a.gate);
    return launch_status(op);
  });
}

te_status scale_from_amax_cuda(const ScaleFromAmaxArgs &a, te_stream stream_handle) {
  scale_from_amax_kernel<<<1, 1, 0, cuda_stream(stream_handle)>>>(a.amax, a.scale, a.scale_inv, a.fp8_max,
                                                                  a.epsilon, a.pow2);
  return launch_status("compute_scale_from_amax");
}

}  // namespace te
