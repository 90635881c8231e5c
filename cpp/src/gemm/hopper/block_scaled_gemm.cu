// Block-scaled FP8 GEMM on Hopper (sm_90a) with CUTLASS's blockwise-scaling mainloop
// (KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum), behind te_gemm's resolved arguments.
//
// The problem (row-major, as gemm.h states it):
//   D[M, N] = sum over K blocks b of  sa[m, b] * sb[n / 128, b] * sum_{k in b} A[m, k] B[n, k]
//             (+ D[M, N] with accumulate) (+ bias[N])
// with A [M, K] E4M3 row-major (K contiguous) and its BLOCK_1X128 scale_inv sa [M, ceil(K/128)]
// row-major, B [N, K] E4M3 row-major and its BLOCK_128X128 scale_inv sb [ceil(N/128), ceil(K/128)]
// row-major (tensor.h's layouts: what te_quantize writes, and what the CPU path and the cuBLASLt
// path read).
//
// In CUTLASS's terms that is its own (M, N, K) GEMM with A row-major, B column-major (the K-major
// "TN" layout, the only one Hopper's FP8 tensor cores take) and D row-major; no transposition.
// The scale layouts map onto CUTLASS's blockwise scale layouts with scale granularity
// (M, N, K) = (1, 128, 128) and both scale tensors K-major:
//   SFA ((1, M), (128, ceil(K/128))) : ((0, ceil(K/128)), (0, 1))   == sa[m * ceil(K/128) + b]
//   SFB ((128, ceil(N/128)), (128, ceil(K/128))) : ((0, ceil(K/128)), (0, 1))
//                                                                    == sb[(n/128) * ceil(K/128) + b]
// so the kernel reads our scale buffers as they are, with no staging pass (the cuBLASLt path
// rewrites them into its own layouts first). K-major scales are loaded by the producer's
// auxiliary warp with predicated cp.async (CUTLASS takes TMA only for M-major scale columns);
// rows past M and blocks past K are predicated off, and their accumulators never reach D.
//
// Tile 128x128x128, cluster 1x2x1, cooperative persistent kernel:
// - K = 128 is the scale block: each k-tile is one promotion (four k32 WGMMAs accumulate a
//   block in the tensor cores, then fp32 accum += block * sa * sb), and the mainloop requires
//   the tile's K to be a multiple of the scale block; 128 is the smallest, which leaves shared
//   memory for the most pipeline stages.
// - N = 128 is B's scale block, so one B scale per k-tile (the tile's N must be a multiple of it).
// - M = 128 is two consumer warpgroups of 64 rows (cooperative); each thread holds 64 fp32
//   accumulators plus 64 of the per-block temporary, 128 registers, which is why 128x256 tiles
//   (256 registers of accumulators) are not used.
// - The 1x2 cluster multicasts each A tile to the two CTAs that share it along N, halving A's
//   traffic from L2, which matters for the large-M GEMMs of training.
// - The persistent tile scheduler launches one CTA per SM (cluster-rounded) and walks the tiles.
// The kernel itself is block_scaled_kernel.cuh's, for a configuration (ProductionConfig below);
// the other configurations (pingpong with 64-row tiles per warpgroup, other clusters, stream-K)
// are timed against this one by cpp/tests/hopper/sweep_block_scaled_gemm.cpp.
// One instantiation per D dtype (fp32, bf16); the epilogue is D = acc + bias + beta * C with
// C = D (beta 1 with accumulate, else 0: C is then not read) and a null bias reading as 0.
//
// Numerics. Each 128-block is summed by the tensor cores (with their limited accumulation
// precision; see the test), then promoted in fp32. This file is compiled with FMA contraction
// (cmake/cutlass.cmake), unlike the rest of the core: the promotion fma(block, scale, acc) per
// accumulator and k-tile is on the critical path between MMAs, and as separate multiply and add
// it would cost twice the fp32 issue slots; it is also one rounding fewer. The result cannot be
// bitwise the CPU path's anyway (the tensor cores sum a block in their own order and precision).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "common/internal.h"
#include "gemm/hopper/block_scaled_gemm.h"
#include "gemm/hopper/block_scaled_kernel.cuh"
#include "gemm/hopper/block_scaled_wgmma.h"
#include "gemm/hopper/hopper_common.cuh"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
#error "The Hopper block-scaled GEMM needs CUDA 12 or newer (CUTLASS's SM90 support)"
#endif

namespace te {
namespace {

constexpr const char *kOp = "hopper_block_scaled_gemm";
constexpr int64_t kScaleBlock = 128;

// The configuration te_gemm runs from one wave of tiles on (block_scaled_kernel.cuh; the top of
// this file says why); below it, the hand-written kernel (hopper_block_scaled_gemm).
using ProductionConfig = hopper::BlockScaledConfig<128, 128, 1, 2, hopper::Cooperative>;

std::string num(int64_t v) { return std::to_string(v); }

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

std::string hopper_block_scaled_gemm_support(const GemmArgs &g) {
  if (!g.fp8) return "the operands must be FP8";
  if (g.a.dtype != TE_DTYPE_FLOAT8_E4M3 || g.b.dtype != TE_DTYPE_FLOAT8_E4M3) {
    return std::string("the operands must both be float8_e4m3 (one instantiation), got ") +
           te_dtype_name(g.a.dtype) + " x " + te_dtype_name(g.b.dtype);
  }
  if (g.a.mode != TE_SCALING_BLOCK_1X128 || g.b.mode != TE_SCALING_BLOCK_128X128) {
    return std::string("the scaling modes must be block_1x128 x block_128x128, got ") +
           scaling_mode_name(g.a.mode) + " x " + scaling_mode_name(g.b.mode);
  }
  if (g.a.transposed || !g.b.transposed) return "the layout must be A [M, K] and B [N, K] (TN)";
  if (g.d_dtype != TE_DTYPE_FLOAT32 && g.d_dtype != TE_DTYPE_BFLOAT16) {
    return std::string("D must be float32 or bfloat16, got ") + te_dtype_name(g.d_dtype);
  }
  if (g.gelu || g.pre_gelu != nullptr) return "GELU is not fused";
  if (g.d_amax != nullptr || g.d_scale_inv != nullptr) return "amax and an FP8 output are not produced";
  if (g.bias != nullptr && g.bias_dtype != TE_DTYPE_BFLOAT16) {
    return std::string("bias must be bfloat16, got ") + te_dtype_name(g.bias_dtype);
  }
  if (g.m <= 0 || g.n <= 0 || g.k <= 0) {
    return "M, N and K must be positive, got " + num(g.m) + ", " + num(g.n) + ", " + num(g.k);
  }
  // CUTLASS's problem shape and scale layouts hold 32-bit extents and strides.
  const int64_t kb = ceil_div(g.k, kScaleBlock);
  if (g.m > INT_MAX || g.n > INT_MAX || g.k > INT_MAX || g.m * kb > INT_MAX || ceil_div(g.n, kScaleBlock) * kb > INT_MAX) {
    return "M, N, K and the scale counts must fit in 32 bits";
  }
  // TMA: 16-byte aligned base addresses and row pitches.
  if (g.k % 16 != 0) return "K must be a multiple of 16, got " + num(g.k);
  if (g.n * static_cast<int64_t>(te_dtype_size(g.d_dtype)) % 16 != 0) {
    return "N must make D's rows a multiple of 16 bytes, got " + num(g.n);
  }
  if (!aligned16(g.a.data) || !aligned16(g.b.data) || !aligned16(g.d)) {
    return "A, B and D must be 16-byte aligned";
  }
  if (reinterpret_cast<uintptr_t>(g.a.scale_inv) % 4 != 0 || reinterpret_cast<uintptr_t>(g.b.scale_inv) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(g.bias) % 2 != 0) {
    return "scale_inv and bias must be aligned to their element size";
  }
  return "";
}

te_status hopper_block_scaled_gemm(const GemmArgs &g, te_stream stream) {
  const std::string why = hopper_block_scaled_gemm_support(g);
  if (!why.empty()) return fail(TE_ERROR_UNSUPPORTED, kOp, "the kernel does not take this call: " + why);
  int device = 0;
  if (te_status st = hopper::check_sm90(kOp, &device)) return st;
  const cudaStream_t s = cuda_stream(stream);
  // Fewer 128 x 128 tiles than SMs: a single wave, where our hand-written kernel's overlapped
  // mainloop (no cluster, so every tile gets its own SM) finishes first; its D is the CUTLASS
  // kernel's bit for bit (hopper_block_scaled_sweep_f139d55_h100.json: 520 x 200 x 128 in 6 us
  // against 12, 384 x 384 x 336 in 7 against 12; from about a wave on, the CUTLASS kernel;
  // hopper_block_scaled_sweep_1dea7a2_h100.json again: 6.2 against 14.7 us, 7.3 against 11.4).
  int sms = 0;
  if (te_status st = sm_count(kOp, &sms)) return st;
  if (ceil_div(g.m, kScaleBlock) * ceil_div(g.n, kScaleBlock) < sms) {
    return hopper::block_scaled_wgmma_gemm(kOp, g, s);
  }
  if (g.d_dtype == TE_DTYPE_FLOAT32) return hopper::run_block_scaled<float, ProductionConfig>(kOp, g, s);
  return hopper::run_block_scaled<cutlass::bfloat16_t, ProductionConfig>(kOp, g, s);
}

}  // namespace te
