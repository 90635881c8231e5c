// CUDA transpose of raw elements of 1, 2, 4 or 8 bytes: out[c, r] = in[r, c].
//
// Design. FP8 data is the case that matters (the column-wise copy of an already quantized
// tensor), so 1-byte elements get the layout of the fast quantize + transpose: a 128x128 tile per
// block of 256 threads, each thread an 8x8 patch read with 8 64-bit loads (a half-warp reads 128
// contiguous bytes of a row), transposed in registers with __byte_perm, staged in the
// XOR-swizzled TransposeStage (conflict-free 8-byte writes, no padding) and written with 128-bit
// stores, 8 threads per 128-byte output row. It needs rows % 16 == 0, cols % 8 == 0 and aligned
// pointers. Everything else (other element sizes, odd shapes) takes the classic 32x32 tile
// through shared memory padded to 33 columns, with coalesced reads and writes of whole elements
// and bounds checks, correct for any shape. Blocks stride over tiles, so any size fits a launch.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "transpose/transpose_impl.h"

namespace te {
namespace {

constexpr const char *kOp = "transpose";
constexpr int kThreads = kStageThreads;  // the byte kernel stages with all of them
constexpr int kByteTile = 128;
constexpr int kTile = 32;

__global__ void __launch_bounds__(kThreads)
    transpose_bytes_kernel(const uint8_t *__restrict__ input, uint8_t *__restrict__ output, int64_t rows,
                           int64_t cols, int64_t tiles_c, int64_t num_tiles) {
  __shared__ TransposeStage stage;
  const int pr = threadIdx.x / 16, pc = threadIdx.x % 16;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    if (tile != blockIdx.x) __syncthreads();  // the previous tile's stage has been read
    const int64_t r0 = (tile / tiles_c) * kByteTile, c0 = (tile % tiles_c) * kByteTile;
    const int64_t prow = r0 + pr * 8, pcol = c0 + pc * 8;
    const bool valid = prow < rows && pcol < cols;  // whole patches: rows, cols % 8 == 0
    uint32_t lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint2 v = valid ? *reinterpret_cast<const uint2 *>(input + (prow + i) * cols + pcol) : make_uint2(0, 0);
      lo[i] = v.x;
      hi[i] = v.y;
    }
    stage_put_patch(stage, pr, pc, lo, hi);
    __syncthreads();
    stage_store_transposed(stage, output, r0, c0, rows, cols);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    transpose_kernel(const T *__restrict__ input, T *__restrict__ output, int64_t rows, int64_t cols,
                     int64_t tiles_c, int64_t num_tiles) {
  __shared__ T tile_data[kTile][kTile + 1];  // +1: column reads hit distinct banks
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  constexpr int kRowsPerPass = kThreads / kTile;
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    if (tile != blockIdx.x) __syncthreads();
    const int64_t r0 = (tile / tiles_c) * kTile, c0 = (tile % tiles_c) * kTile;
#pragma unroll
    for (int k = 0; k < kTile; k += kRowsPerPass) {
      const int64_t r = r0 + ty + k, c = c0 + tx;
      if (r < rows && c < cols) tile_data[ty + k][tx] = input[r * cols + c];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile; k += kRowsPerPass) {
      const int64_t orow = c0 + ty + k, ocol = r0 + tx;  // output [cols, rows]
      if (orow < cols && ocol < rows) output[orow * rows + ocol] = tile_data[tx][ty + k];
    }
  }
}

template <typename T>
te_status launch_generic(const TransposeArgs &a, cudaStream_t stream) {
  const int64_t tiles_c = ceil_div(a.cols, kTile), num_tiles = ceil_div(a.rows, kTile) * tiles_c;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(num_tiles, INT_MAX));
  transpose_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T *>(a.input), static_cast<T *>(a.output),
                                                       a.rows, a.cols, tiles_c, num_tiles);
  return launch_status(kOp);
}

}  // namespace

te_status transpose_cuda(const TransposeArgs &a, te_stream stream_handle) {
  if (a.rows * a.cols == 0) return TE_SUCCESS;
  const cudaStream_t stream = cuda_stream(stream_handle);
  switch (a.element_size) {
    case 1: {
      if (a.rows % 16 == 0 && a.cols % 8 == 0 && aligned(a.input, 8) && aligned(a.output, 16)) {
        const int64_t tiles_c = ceil_div(a.cols, kByteTile), num_tiles = ceil_div(a.rows, kByteTile) * tiles_c;
        const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(num_tiles, INT_MAX));
        transpose_bytes_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t *>(a.input),
                                                                static_cast<uint8_t *>(a.output), a.rows, a.cols,
                                                                tiles_c, num_tiles);
        return launch_status(kOp);
      }
      return launch_generic<uint8_t>(a, stream);
    }
    case 2: return launch_generic<uint16_t>(a, stream);
    case 4: return launch_generic<uint32_t>(a, stream);
    case 8: return launch_generic<uint64_t>(a, stream);
    default:
      return fail(TE_ERROR_UNSUPPORTED, kOp,
                  "element size must be 1, 2, 4 or 8 bytes, got " + std::to_string(a.element_size));
  }
}

}  // namespace te
