// CUDA fused activations: forward and backward, with the output in high precision or FP8
// (row-wise and/or transposed, + amax), and backward the bias gradient, in one pass.
//
// Design. A bandwidth-bound elementwise op with a fused transpose, whose arithmetic is still
// heavy (the core's own exp and a correctly rounded reciprocal, to match the CPU bit for bit:
// 23-35 instructions per element for GELU/SwiGLU, ~32-43 with the rest of the kernel, at one
// instruction per clock per scheduler), so that issue time rivals memory time. The kernel
// keeps both busy at once:
//   - One persistent kernel: blocks of 256 threads loop over 128x128 tiles of the activation
//     output [M, N] (tiles b, b + grid, ...; the grid is one wave of resident blocks), each
//     thread owning an 8x8 patch (16 patch columns per tile row).
//   - Inputs are staged in shared memory by cp.async one tile ahead (two stages where the
//     device has the shared memory, as Hopper has for every 16-bit kernel; else one), so the
//     next tile's loads are in flight during this tile's arithmetic without holding registers.
//     Each thread copies exactly its own patch (a warp's copies are two whole 256-byte row
//     segments) and reads only that back, so its own cp.async wait orders them. Out-of-range
//     patches (fast path) and elements (masked path) are staged as zeros: their values are 0,
//     which changes neither amax nor a column sum. fp32 inputs with 2-3 operands, one stage of
//     which would outgrow pre-Hopper GPUs, are read straight from global memory instead.
//   - Arithmetic, per patch row: the 8 values of each operand (one 128-bit shared-memory read
//     for 16-bit inputs), the element math of activation_math.h, a NaN-propagating running
//     max for amax, the dbias column sums (backward), then the FP8 bytes (hardware conversion)
//     or the high-precision stores. The output kind (E4M3, E5M2, high precision) is a template
//     parameter, so the loop has no branch on it.
//   - FP8 NaN bytes are made the one NaN code only in patches that hold a NaN (their amax is
//     NaN), or everywhere when the scale is 0, infinite or NaN: the conversion itself never
//     makes a NaN code out of a number.
//   - Row-wise FP8: 8 bytes per patch row, one 64-bit store. Transposed FP8: each patch is
//     transposed in registers and staged (the swizzled TransposeStage of cuda_utils.cuh), then
//     the block writes whole 128-byte output rows. Gated backward writes two patches per
//     thread (d/da at column c, d/db at N + c), staged side by side.
//   - dbias: each thread sums its patch's 8 rows per column; the 16 patch rows of a column are
//     summed in order through shared memory; the tile's column sums go to a partial buffer
//     [tiles_r, K] (scratch from the core's stream-ordered pool, scratch.cuh: the C API has no
//     workspace argument), and a second kernel sums each column's partials in tile-row order. That is the documented
//     order (activation.h), the one the CPU reference follows, whatever the grid.
//   - The transposes and column sums are staged in the tile's input stage, free once every
//     thread's arithmetic is done (or in their own space, without staging). So a tile takes
//     three barriers when it has either (before they are written, before they are read back,
//     and before the stage is refilled), and none otherwise.
//   - Amax: per thread, then the block, one atomicMax per block, NaN as kCanonicalNaN.
//   - Residency on Hopper: a one-operand 16-bit kernel takes 64 KiB of shared memory and at
//     most 128 registers, so two or three blocks share an SM; the other staged ones take
//     128-192 KiB, one block per SM, their loads covered by the stage ahead.
// Calls that need no tile (non-gated, a high-precision output or the amax alone, no dbias, on
// the fast path) take the flat kernel of activation_flat.cuh instead, with more warps per SM.
// The fast path needs M % 16 == 0, N % 8 == 0 and 16-byte aligned operands (8 bytes for FP8
// rows); other shapes run the same kernel with masked scalar loads and stores, so the order of
// every sum is the same.
// Numerics: the element values come from activation_math.h, as in the reference; the FP8
// conversion is that of fp8x4 (cuda_utils.cuh), proven equal to the reference's by the
// quantize tests.
#include <algorithm>
#include <cstdint>
#include <string>

#include "activation/activation_kernel.cuh"
#include "common/scratch.cuh"

namespace te {
namespace activation_detail {

// Instantiated in activation_<dtype>_<direction>.cu.
extern template te_status launch_act<TE_DTYPE_FLOAT32, false>(const ActParams &, te_activation, cudaStream_t, int);
extern template te_status launch_act<TE_DTYPE_FLOAT32, true>(const ActParams &, te_activation, cudaStream_t, int);
extern template te_status launch_act<TE_DTYPE_FLOAT16, false>(const ActParams &, te_activation, cudaStream_t, int);
extern template te_status launch_act<TE_DTYPE_FLOAT16, true>(const ActParams &, te_activation, cudaStream_t, int);
extern template te_status launch_act<TE_DTYPE_BFLOAT16, false>(const ActParams &, te_activation, cudaStream_t, int);
extern template te_status launch_act<TE_DTYPE_BFLOAT16, true>(const ActParams &, te_activation, cudaStream_t, int);

namespace {

// dbias[c] = the sum of partial[t][c] over t in order, from +0. Each thread issues a batch of
// loads before adding them (in order), so that many are in flight: a column's sum is a chain.
constexpr int kReduceThreads = 128;
constexpr int kReduceBatch = 16;

__global__ void dbias_reduce_kernel(const float *__restrict__ partial, int64_t tiles_r, int64_t cols,
                                    void *__restrict__ dbias, te_dtype dtype) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    int64_t t = 0;
    for (; t + kReduceBatch <= tiles_r; t += kReduceBatch) {
      float v[kReduceBatch];
#pragma unroll
      for (int u = 0; u < kReduceBatch; ++u) v[u] = partial[(t + u) * cols + c];
#pragma unroll
      for (int u = 0; u < kReduceBatch; ++u) s += v[u];
    }
    for (; t < tiles_r; ++t) s += partial[t * cols + c];
    store_hp_one(dbias, c, dtype, s);  // fp32 NaN written as kCanonicalNaN
  }
}

bool fast_path(const ActivationArgs &a) {
  const size_t in_size = a.in_dtype == TE_DTYPE_FLOAT32 ? 4 : 2;
  const bool fp8 = a.fp8_out();
  const uintptr_t out_align = fp8 ? 8 : 16;
  return a.rows % 16 == 0 && a.n % 8 == 0 && (a.n * in_size) % 16 == 0 &&
         (a.input == nullptr || aligned(a.input, 16)) &&
         (a.grad_output == nullptr || aligned(a.grad_output, 16)) &&
         (a.out == nullptr || aligned(a.out, out_align)) && (a.out_t == nullptr || aligned(a.out_t, 16));
}

}  // namespace
}  // namespace activation_detail

te_status activation_cuda(const ActivationArgs &a, te_stream stream_handle) {
  using namespace activation_detail;
  const cudaStream_t stream = cuda_stream(stream_handle);
  int sms = 0;
  if (te_status s = sm_count(kOp, &sms)) return s;
  ActParams p{};
  p.input = a.input;
  p.grad = a.grad_output;
  p.out = a.out;
  p.out_t = a.out_t;
  p.scale = a.scale;
  p.scale_inv = a.scale_inv;
  p.amax = a.amax;
  p.gate = a.gate;
  p.params = a.params;
  p.rows = a.rows;
  p.n = a.n;
  p.in_cols = a.in_cols();
  p.out_cols = a.out_cols();
  p.tiles_c = ceil_div(a.n, kTile);
  p.tiles_r = ceil_div(a.rows, kTile);
  p.num_tiles = p.tiles_r * p.tiles_c;
  const int64_t tiles_r = p.tiles_r;
  if (p.num_tiles > INT32_MAX) {  // the kernel counts tiles in 32 bits
    return fail(TE_ERROR_UNSUPPORTED, kOp,
                "the output must have fewer than 2^31 tiles of 128 x 128 on CUDA, got [" + std::to_string(a.rows) +
                    ", " + std::to_string(p.out_cols) + "]");
  }
  p.out_dtype = a.out_dtype;
  p.fp8 = a.fp8_out();
  p.fast = fast_path(a);
  // Element by element, with no tile to build: activation_flat.cuh.
  p.flat = p.fast && !p.fp8 && a.dbias == nullptr && !a.gated;
  // The blocks atomicMax into amax: zeroed first unless it accumulates.
  if (a.amax != nullptr && !a.accumulate_amax) {
    if (te_status s = cuda_status(kOp, cudaMemsetAsync(a.amax, 0, sizeof(float), stream))) return s;
  }
  const size_t partial_bytes = a.dbias != nullptr ? static_cast<size_t>(tiles_r * p.out_cols) * sizeof(float) : 0;
  if (partial_bytes > 0) {
    void *w = nullptr;
    if (te_status s = scratch_alloc(kOp, partial_bytes, stream, &w)) return s;
    p.partial = static_cast<float *>(w);
  }
  te_status status = with_hp_dtype(a.in_dtype, [&](auto in) {
    constexpr te_dtype kIn = decltype(in)::value;
    return a.backward ? launch_act<kIn, true>(p, a.act, stream, sms) : launch_act<kIn, false>(p, a.act, stream, sms);
  });
  if (status == TE_SUCCESS && a.dbias != nullptr && p.out_cols > 0) {
    const int64_t blocks = std::min<int64_t>(ceil_div(p.out_cols, kReduceThreads), static_cast<int64_t>(sms) * 16);
    dbias_reduce_kernel<<<static_cast<unsigned>(blocks), kReduceThreads, 0, stream>>>(p.partial, tiles_r, p.out_cols,
                                                                                       a.dbias, a.dbias_dtype);
    status = launch_status(kOp);
  }
  if (p.partial != nullptr) {
    const te_status s = scratch_free(kOp, p.partial, stream);
    if (status == TE_SUCCESS) status = s;
  }
  return status;
}

}  // namespace te
