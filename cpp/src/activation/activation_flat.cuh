// The flat activation kernel: non-gated activations with a high-precision output (or the amax
// alone), without dbias, on the fast path's shapes and alignments (activation.cu decides).
//
// Why a second kernel. The tiled kernel (activation_kernel.cuh) exists for what needs a tile:
// the transposed FP8 output and the dbias column sums in a fixed order. Its stages of shared
// memory leave a two-operand kernel one block of 8 warps per SM, too few to hide the latency
// of an element computation that is a chain of ~25 dependent instructions. Without a transpose
// or column sums, each output element depends on the same element of each operand alone, so
// the tensor can be walked as a flat array: 8 elements per 128-bit access, a grid of one wave
// striding over it, each thread issuing its loads for kFlatUnroll groups before the first use,
// and as many warps per SM as the registers allow.
//
// Numerics: the element values come from activation_math.h, the stores from store_hp8 and
// the amax from max_keep_nan as in the tiled kernel, so both write the same bits (and the CPU
// reference's: activation_ref.cpp).
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_FLAT_CUH_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_FLAT_CUH_

#include <algorithm>
#include <cstdint>

#include "activation/activation_io.cuh"

namespace te {
namespace activation_detail {

constexpr int kFlatThreads = 256;
constexpr int kFlatBlocksPerSm = 4;  // 32 warps per SM: the launch bounds cap registers at 64
constexpr int kFlatUnroll = 2;       // groups of 8 elements whose loads are in flight together

// The element groups: 8 consecutive elements of the [rows, n] output (and of each operand:
// non-gated, so every operand has the output's layout).
template <te_dtype kIn, te_activation kAct, bool kBackward, bool kStore>
__global__ void __launch_bounds__(kFlatThreads, kFlatBlocksPerSm)
    activation_flat_kernel(const ActParams p, int64_t groups) {
  if (p.gate != nullptr && *p.gate != 0.0f) return;  // a shut gate: the amax stays 0 (tensor.h)
  // Operands: forward x; backward g and x (IDENTITY backward: g alone).
  constexpr int kOps = kBackward && kAct != TE_ACTIVATION_IDENTITY ? 2 : 1;
  __shared__ uint32_t warp_amax[kFlatThreads / 32];
  const void *operand[2] = {kBackward ? p.grad : p.input, p.input};
  float amax = 0.0f;  // NaN once any value is NaN
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kFlatThreads * kFlatUnroll;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kFlatThreads * kFlatUnroll + threadIdx.x; base < groups;
       base += stride) {
    Packed8<kIn> in[kFlatUnroll][kOps];
#pragma unroll
    for (int u = 0; u < kFlatUnroll; ++u) {
      const int64_t g = base + u * kFlatThreads;
#pragma unroll
      for (int o = 0; o < kOps; ++o) {
        if (g < groups) {
          in[u][o].load(operand[o], g * 8);
        } else {
          in[u][o].zero();
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kFlatUnroll; ++u) {
      const int64_t g = base + u * kFlatThreads;
      if (g >= groups) continue;
      float x[kOps][8], y[8];
#pragma unroll
      for (int o = 0; o < kOps; ++o) in[u][o].decode(x[o]);
      float group_amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        y[j] = kBackward ? act::backward_value<kAct>(x[0][j], x[kOps - 1][j], p.params)
                         : act::forward_value<kAct>(x[0][j], 0.0f, p.params);
        group_amax = act::max_keep_nan(group_amax, fabsf(y[j]));
      }
      amax = act::max_keep_nan(amax, group_amax);
      if constexpr (kStore) store_hp8(p.out, g * 8, p.out_dtype, y, group_amax != group_amax);
    }
  }
  if (p.amax != nullptr) {
    const uint32_t m = block_max<kFlatThreads>(float_bits(amax), warp_amax);
    if (threadIdx.x == 0) atomic_max_amax(p.amax, is_nan_bits(m) ? kCanonicalNaN : m);
  }
}

// One wave of blocks (kFlatBlocksPerSm per SM, resident by the launch bounds), no more than
// the groups need.
template <te_dtype kIn, te_activation kAct, bool kBackward>
te_status launch_flat(const ActParams &p, cudaStream_t stream, int sms) {
  const int64_t groups = p.rows * p.n / 8;
  if (groups == 0) return TE_SUCCESS;
  const int64_t per_block = static_cast<int64_t>(kFlatThreads) * kFlatUnroll;
  const auto grid = static_cast<unsigned>(
      std::min<int64_t>((groups + per_block - 1) / per_block, static_cast<int64_t>(sms) * kFlatBlocksPerSm));
  if (p.out != nullptr) {
    activation_flat_kernel<kIn, kAct, kBackward, true><<<grid, kFlatThreads, 0, stream>>>(p, groups);
  } else {
    activation_flat_kernel<kIn, kAct, kBackward, false><<<grid, kFlatThreads, 0, stream>>>(p, groups);
  }
  return launch_status(kOp);
}

}  // namespace activation_detail
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_FLAT_CUH_
