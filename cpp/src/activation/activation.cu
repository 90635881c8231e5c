// CUDA fused activations: forward and backward, with the output in high precision or FP8
// (row-wise and/or transposed, + amax), and backward the bias gradient, in one pass.
//
// Design. Bandwidth-bound elementwise work with a fused transpose, so one tiled kernel serves
// every case: a block of 256 threads per 128x128 tile of the activation output [M, N] (blocks
// stride over tiles, the grid being one wave of resident blocks), each thread owning an 8x8
// patch (16 patch columns per tile row: a half-warp reads 256 contiguous bytes of a bf16 row).
//   - Loads: every operand's 8 patch rows are issued as 128-bit loads (Packed8) before any
//     arithmetic; 16-bit inputs stay packed until their row is used. Operands: forward x, or
//     a and b of a gated input; backward grad_output plus those.
//   - Row-wise output: FP8 8 bytes per row with one 64-bit store, high precision 8 values
//     with 128-bit stores.
//   - Transposed FP8 output: the patch's bytes are transposed in registers and staged in the
//     swizzled 16 KiB TransposeStage, from which the block writes 128-byte output rows
//     (stage_put_patch / stage_store_transposed, as the quantize kernels do). Gated backward
//     writes two patches per thread (d/da at column c, d/db at N + c), staged one after the
//     other.
//   - dbias: each thread sums its patch's 8 rows per column, the 16 patch rows of a column are
//     summed in order through shared memory, and the tile's column sums go to a partial
//     buffer [tiles_r, K] (cudaMallocAsync on the stream); a second kernel sums each column's
//     partials in tile-row order. That is the documented order (activation.h), the one the
//     CPU reference follows, whatever the grid.
//   - Amax: a running max of abs_bits per thread, the block max, one atomicMax per block.
// The fast path needs M % 16 == 0, N % 8 == 0 and 16-byte aligned operands (8 bytes for FP8
// rows); other shapes run the same kernel with masked scalar loads and stores, so the order of
// every sum is the same.
// Numerics: the element values come from activation_math.h, as in the reference; the FP8
// conversion is fp8x4 (cuda_utils.cuh), proven equal to the reference's by the quantize tests.
#include <algorithm>
#include <cstdint>

#include "activation/activation_kernel.cuh"

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

// dbias[c] = the sum of partial[t][c] over t in order, from +0.
__global__ void dbias_reduce_kernel(const float *__restrict__ partial, int64_t tiles_r, int64_t cols,
                                    void *__restrict__ dbias, te_dtype dtype) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int64_t t = 0; t < tiles_r; ++t) s += partial[t * cols + c];
    store_hp_one(dbias, c, dtype, canonical(s));
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
  p.rows = a.rows;
  p.n = a.n;
  p.in_cols = a.in_cols();
  p.out_cols = a.out_cols();
  p.tiles_c = ceil_div(a.n, kTile);
  const int64_t tiles_r = ceil_div(a.rows, kTile);
  p.num_tiles = tiles_r * p.tiles_c;
  p.out_dtype = a.out_dtype;
  p.fp8 = a.fp8_out();
  p.fast = fast_path(a);
  // amax is overwritten, not accumulated: zero it on the stream, then blocks atomicMax into it.
  if (a.amax != nullptr) {
    if (te_status s = cuda_status(kOp, cudaMemsetAsync(a.amax, 0, sizeof(float), stream))) return s;
  }
  const size_t partial_bytes = a.dbias != nullptr ? static_cast<size_t>(tiles_r * p.out_cols) * sizeof(float) : 0;
  if (partial_bytes > 0) {
    void *w = nullptr;
    if (te_status s = cuda_status(kOp, cudaMallocAsync(&w, partial_bytes, stream))) return s;
    p.partial = static_cast<float *>(w);
  }
  te_status status = with_hp_dtype(a.in_dtype, [&](auto in) {
    constexpr te_dtype kIn = decltype(in)::value;
    return a.backward ? launch_act<kIn, true>(p, a.act, stream, sms) : launch_act<kIn, false>(p, a.act, stream, sms);
  });
  if (status == TE_SUCCESS && a.dbias != nullptr && p.out_cols > 0) {
    const int64_t blocks = std::min<int64_t>(ceil_div(p.out_cols, 256), static_cast<int64_t>(sms) * 8);
    dbias_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p.partial, tiles_r, p.out_cols,
                                                                            a.dbias, a.dbias_dtype);
    status = launch_status(kOp);
  }
  if (p.partial != nullptr) {
    const te_status s = cuda_status(kOp, cudaFreeAsync(p.partial, stream));
    if (status == TE_SUCCESS) status = s;
  }
  return status;
}

}  // namespace te
