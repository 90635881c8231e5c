// CUDA dequantization, every scaling mode: output = fp8_value * scale_inv, encoded to the output
// dtype exactly as the reference does.
//
// Design. A 2-D launch over [rows, cols] (TENSOR mode flattens to one row): threadIdx.x walks
// groups of 8 elements along a row (one 64-bit load of FP8 bytes, one 128-bit store of bf16/fp16
// or two of fp32), threadIdx.y and blockIdx.y walk rows, so no thread divides by cols. The block
// shape follows the row width (a narrow matrix puts more rows in a block). A group never
// straddles a scale block (blocks are 32 or 128 wide, groups start at multiples of 8), so each
// group reads one scale_inv. The vector path needs 8-element rows (or a single row, with a
// scalar tail) and aligned pointers; otherwise one element per thread.
// Numerics: the product goes through canonical_mul, so any NaN result (FP8 NaN data, an E8M0
// NaN scale, 0 * inf) is written as the one NaN the reference writes.
#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "quantize/quantize_impl.h"

namespace te {
namespace {

constexpr const char *kOp = "dequantize";
constexpr int kThreads = 256;

// blocks_per_row: scale_inv entries per row of blocks (ceil(cols / 128) or ceil(cols / 32)).
template <te_scaling_mode kMode>
__device__ __forceinline__ float scale_inv_at(const void *scale_inv, int64_t r, int64_t c, int64_t blocks_per_row) {
  const float *f = static_cast<const float *>(scale_inv);
  switch (kMode) {
    case TE_SCALING_TENSOR: return f[0];
    case TE_SCALING_BLOCK_1X128: return f[r * blocks_per_row + c / 128];
    case TE_SCALING_BLOCK_128X128: return f[(r / 128) * blocks_per_row + c / 128];
    default: return e8m0_to_float(static_cast<const uint8_t *>(scale_inv)[r * blocks_per_row + c / 32]);
  }
}

template <te_dtype kOut, te_dtype kFp8>
__device__ __forceinline__ void store8(void *out, int64_t i, const uint2 q, float s) {
  float y[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint32_t w = k < 4 ? q.x : q.y;
    y[k] = canonical_mul(s, fp8_decode<kFp8>(static_cast<uint8_t>(w >> (8 * (k % 4)))));
  }
  if constexpr (kOut == TE_DTYPE_FLOAT32) {
    float4 *p = reinterpret_cast<float4 *>(static_cast<float *>(out) + i);
    p[0] = make_float4(y[0], y[1], y[2], y[3]);
    p[1] = make_float4(y[4], y[5], y[6], y[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = static_cast<uint32_t>(Hp<kOut>::encode(y[2 * k])) |
             (static_cast<uint32_t>(Hp<kOut>::encode(y[2 * k + 1])) << 16);
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <te_dtype kOut, te_dtype kFp8>
__device__ __forceinline__ void store1(void *out, int64_t i, uint8_t q, float s) {
  using S = typename Hp<kOut>::Storage;
  static_cast<S *>(out)[i] = Hp<kOut>::encode(canonical_mul(s, fp8_decode<kFp8>(q)));
}

template <te_dtype kOut, te_dtype kFp8, te_scaling_mode kMode>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t *__restrict__ input, const void *__restrict__ scale_inv,
                      void *__restrict__ output, int64_t rows, int64_t cols, bool vectorized) {
  const int64_t blocks_per_row = div_up(cols, kMode == TE_SCALING_MXFP8 ? 32 : 128);
  const int64_t groups = vectorized ? cols / 8 : 0;
  const int64_t tail0 = groups * 8;  // first element handled one at a time
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  const int64_t col_step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t x0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += row_step) {
    for (int64_t g = x0; g < groups; g += col_step) {
      const int64_t i = r * cols + g * 8;
      const uint2 q = *reinterpret_cast<const uint2 *>(input + i);
      store8<kOut, kFp8>(output, i, q, scale_inv_at<kMode>(scale_inv, r, g * 8, blocks_per_row));
    }
    for (int64_t col = tail0 + x0; col < cols; col += col_step) {
      const int64_t i = r * cols + col;
      store1<kOut, kFp8>(output, i, input[i], scale_inv_at<kMode>(scale_inv, r, col, blocks_per_row));
    }
  }
}

}  // namespace

te_status dequantize_cuda(const DequantizeArgs &a, te_stream stream_handle) {
  if (a.rows * a.cols == 0) return TE_SUCCESS;
  const cudaStream_t stream = cuda_stream(stream_handle);
  int sms = 0;
  if (te_status s = sm_count(kOp, &sms)) return s;
  // TENSOR mode has one scale: the matrix is one long row.
  const bool flat = a.mode == TE_SCALING_TENSOR;
  const int64_t rows = flat ? 1 : a.rows, cols = flat ? a.rows * a.cols : a.cols;
  const uintptr_t out_vec = 16;  // 8 bf16/fp16 elements or 4 fp32 ones per store
  const bool vectorized = (rows == 1 || cols % 8 == 0) && aligned(a.input, 8) && aligned(a.output, out_vec);
  const int64_t width = vectorized ? std::max<int64_t>(cols / 8, 1) : cols;
  int bx = kThreads;
  while (bx > 32 && bx / 2 >= width) bx /= 2;
  const dim3 block(bx, kThreads / bx);
  const int64_t max_blocks = static_cast<int64_t>(sms) * 8;
  const int64_t gx = std::min<int64_t>(ceil_div(width, bx), max_blocks);
  const int64_t gy = std::min<int64_t>({ceil_div(rows, block.y), std::max<int64_t>(max_blocks / gx, 1), 65535});
  const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  return with_hp_dtype(a.output_dtype, [&](auto out) {
    return with_fp8_dtype(a.fp8_dtype, [&](auto fp8) {
      constexpr te_dtype kOut = decltype(out)::value, kFp8 = decltype(fp8)::value;
      switch (a.mode) {
        case TE_SCALING_TENSOR:
          dequantize_kernel<kOut, kFp8, TE_SCALING_TENSOR><<<grid, block, 0, stream>>>(
              a.input, a.scale_inv, a.output, rows, cols, vectorized);
          break;
        case TE_SCALING_BLOCK_1X128:
          dequantize_kernel<kOut, kFp8, TE_SCALING_BLOCK_1X128><<<grid, block, 0, stream>>>(
              a.input, a.scale_inv, a.output, rows, cols, vectorized);
          break;
        case TE_SCALING_BLOCK_128X128:
          dequantize_kernel<kOut, kFp8, TE_SCALING_BLOCK_128X128><<<grid, block, 0, stream>>>(
              a.input, a.scale_inv, a.output, rows, cols, vectorized);
          break;
        default:
          dequantize_kernel<kOut, kFp8, TE_SCALING_MXFP8><<<grid, block, 0, stream>>>(
              a.input, a.scale_inv, a.output, rows, cols, vectorized);
          break;
      }
      return launch_status(kOp);
    });
  });
}

}  // namespace te
