// CUDA quantization by 128x128 tiles, for any shape: the block modes (1x128 and 128x128 with
// fp32 scales, MXFP8 with E8M0 scales) and TENSOR mode where the fast cast + transpose of
// quantize.cu does not apply (odd shapes, misaligned pointers).
//
// Design. Blocks of 256 threads stride over the 128x128 tiles, as many blocks as stay resident.
// Lane l of warp w holds rows 16w .. 16w+15, columns 4l .. 4l+3 of the tile in registers (64
// values). When cols % 4 == 0 and the pointers allow, those 16 pieces of 8 or 16 bytes are
// copied with cp.async one tile ahead into the thread's own slots of a shared-memory double
// buffer, so that the next tile's loads are in flight while this one is converted and stored
// (the thread reads back only its own slots: its cp.async wait orders them); other shapes load
// element by element. This layout makes every block amax a cheap reduction:
//   - a 1x128 row block is one warp: warp_max of the lane maxima (one REDUX);
//   - a 1x32 MXFP8 row block is 8 consecutive lanes: three xor-shuffles;
//   - a 128x1 column block is 8 warps x 16 rows: per-lane partials through shared memory;
//   - a 32x1 MXFP8 column block is 2 warps x 16 rows, the same partials;
//   - the 128x128 tile (and the global amax) is the block max.
// Row-wise bytes go straight out, 4 per lane (a warp writes a 128-byte row). Transposed
// (column-wise) output: each lane owns 16 consecutive input rows of 4 columns, i.e. 16
// contiguous bytes of 4 output rows, staged as 16-byte units in a 16 KiB shared tile whose unit
// index is XOR-swizzled with (output row / 4) % 8, so that 8 lanes of a quarter-warp (8 output
// rows, one unit each) hit distinct banks; the block then writes each 128-byte output row with
// 8 threads. MXFP8 column-wise data keeps the [M, K] layout, so it goes out like row-wise data.
// Empty tensors come here too: only amax (0) and, in TENSOR mode, scale_inv are written.
// Numerics: exactly the reference's: block amax = max of abs_bits, scale = scale_from_amax (or
// the E8M0 pair), one fp32 multiply, fp8x4, scale_inv = 1 / scale.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "quantize/quantize_impl.h"

namespace te {
namespace {

constexpr const char *kOp = "quantize";
constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kRowsPerWarp = kTile / (kThreads / 32);  // 16

struct TiledParams {
  const void *input;
  uint8_t *rowwise;
  uint8_t *columnwise;
  const float *scale;  // TENSOR mode
  float *scale_inv;    // TENSOR mode
  void *rowwise_scale_inv;
  void *columnwise_scale_inv;
  float *amax;
  int64_t rows, cols, tiles_r, tiles_c, num_tiles;
  float fp8_max, epsilon;
  bool pow2;
  bool vec_io;          // 4-element loads and 4-byte stores of row-major data
  bool vec_transposed;  // 16-byte stores of transposed rows
};

// Output rows (input columns) x 16-byte units (16 input rows), swizzled as described above.
struct __align__(16) TiledStage {
  uint4 unit[kTile][kTile / 16];
};

__device__ __forceinline__ int stage_unit(int r, int q) { return q ^ ((r >> 2) & 7); }

// The input double buffer: the 4-element piece of row i of thread x in buffer b at
// [(b * kRowsPerWarp + i) * kThreads + x], so that a warp's pieces are contiguous.
template <te_dtype kIn>
constexpr size_t kPieceBytes = 4 * sizeof(typename Hp<kIn>::Storage);
template <te_dtype kIn>
constexpr size_t kInputStageBytes = 2 * kRowsPerWarp * kThreads * kPieceBytes<kIn>;

__device__ __forceinline__ void store_row4(uint8_t *p, int64_t col, int64_t cols, uint32_t q, bool vec) {
  if (vec) {
    if (col < cols) *reinterpret_cast<uint32_t *>(p) = q;
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (col + j < cols) p[j] = static_cast<uint8_t>(q >> (8 * j));
    }
  }
}

template <te_dtype kIn, te_dtype kFp8, te_scaling_mode kMode>
__global__ void __launch_bounds__(kThreads, 2) quantize_tiled_kernel(const TiledParams p) {
  constexpr bool kTransposed = kMode != TE_SCALING_MXFP8;  // column-wise data is [K, M]
  constexpr bool kColumnPartials = kMode == TE_SCALING_BLOCK_1X128 || kMode == TE_SCALING_MXFP8;
  using S = typename Hp<kIn>::Storage;
  __shared__ TiledStage stage;
  __shared__ uint4 col_partial[kThreads / 32][32];  // per warp and lane: 4 column maxima
  __shared__ float4 col_mult[32];                    // 1x128: the scales of lane l's 4 columns
  __shared__ float row_scale[kThreads / 32][kRowsPerWarp];  // 1x128: of each warp's rows
  __shared__ uint32_t warp_amax[kThreads / 32];
  extern __shared__ uint4 input_stage[];  // kInputStageBytes<kIn> when p.vec_io, else none
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float tensor_scale = kMode == TE_SCALING_TENSOR ? *p.scale : 1.0f;
  // This thread's first row and column of a tile.
  auto origin = [&](int64_t tile, int64_t *r0, int64_t *c) {
    *r0 = tile / p.tiles_c * kTile + warp * kRowsPerWarp;
    *c = tile % p.tiles_c * kTile + lane * 4;
  };
  // The piece of row i of this thread in buffer b (4 elements).
  auto piece = [&](int b, int i) {
    return reinterpret_cast<S *>(input_stage) + ((b * kRowsPerWarp + i) * kThreads + threadIdx.x) * 4;
  };
  // Copies this thread's pieces of `tile` (if it exists) into buffer b and closes a cp.async
  // group (an empty one past the last tile, so that the wait below counts uniformly).
  auto stage_tile = [&](int64_t tile, int b) {
    if (tile < p.num_tiles) {
      int64_t r0, c;
      origin(tile, &r0, &c);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        if (r0 + i < p.rows && c < p.cols) {
          const S *src = static_cast<const S *>(p.input) + (r0 + i) * p.cols + c;
          if constexpr (kPieceBytes<kIn> == 16) {
            cp_async16(piece(b, i), src);
          } else {
            cp_async8(piece(b, i), src);
          }
        }
      }
    }
    cp_async_commit();
  };
  if (p.vec_io) stage_tile(blockIdx.x, 0);

  int parity = 0;  // the input buffer of this tile
  for (int64_t tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x, parity ^= 1) {
    if (tile != blockIdx.x) __syncthreads();  // shared memory of the previous tile is consumed
    const int64_t tile_r = tile / p.tiles_c, tile_c = tile % p.tiles_c;
    int64_t r0, c;
    origin(tile, &r0, &c);

    // Out-of-range elements read as 0: they change no maximum and are never stored.
    float v[kRowsPerWarp][4];
    if (p.vec_io) {
      stage_tile(tile + gridDim.x, parity ^ 1);
      cp_async_wait<1>();  // this tile's pieces have landed (the next tile's may be in flight)
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t row = r0 + i;
      if (p.vec_io && row < p.rows && c < p.cols) {
        load_hp4<kIn>(piece(parity, i), 0, v[i]);
      } else if (p.vec_io) {
        v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.0f;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          v[i][j] = (row < p.rows && c + j < p.cols) ? load_hp1<kIn>(p.input, row * p.cols + c + j) : 0.0f;
        }
      }
    }

    uint32_t m = 0, cm[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) cm[j] = max(cm[j], abs_bits(v[i][j]));
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) m = max(m, cm[j]);
    if (kColumnPartials && p.columnwise != nullptr) col_partial[warp][lane] = make_uint4(cm[0], cm[1], cm[2], cm[3]);
    m = warp_max(m);
    if (lane == 0) warp_amax[warp] = m;
    __syncthreads();
    uint32_t tile_amax = warp_amax[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) tile_amax = max(tile_amax, warp_amax[w]);
    if (threadIdx.x == 0 && p.amax != nullptr) atomic_max_amax(p.amax, tile_amax);
    const float tile_scale = kMode == TE_SCALING_BLOCK_128X128
                                 ? scale_from_amax(bits_float(tile_amax), p.fp8_max, p.epsilon, p.pow2)
                                 : tensor_scale;

    if (p.rowwise != nullptr) {
      // 1x128: the scale of the warp's row i is computed by lane i alone and then broadcast, so
      // that a warp does two divisions (scale, scale_inv) per tile instead of two per row: the
      // divisions, not the memory traffic, bounded this kernel.
      if constexpr (kMode == TE_SCALING_BLOCK_1X128) {
        uint32_t mine = 0;
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const uint32_t rm =
              warp_max(max(max(abs_bits(v[i][0]), abs_bits(v[i][1])), max(abs_bits(v[i][2]), abs_bits(v[i][3]))));
          if (lane == i) mine = rm;
        }
        const float own = scale_from_amax(bits_float(mine), p.fp8_max, p.epsilon, p.pow2);
        if (lane < kRowsPerWarp) {
          row_scale[warp][lane] = own;
          if (r0 + lane < p.rows) {
            static_cast<float *>(p.rowwise_scale_inv)[(r0 + lane) * p.tiles_c + tile_c] = canonical_div(1.0f, own);
          }
        }
        __syncwarp();
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int64_t row = r0 + i;
        float mult = kMode == TE_SCALING_BLOCK_1X128 ? row_scale[warp][i] : tile_scale;
        uint8_t e8 = 0;
        if constexpr (kMode == TE_SCALING_MXFP8) {
          const uint32_t rm =
              group_max<8>(max(max(abs_bits(v[i][0]), abs_bits(v[i][1])), max(abs_bits(v[i][2]), abs_bits(v[i][3]))));
          e8 = e8m0_scale_inv_from_amax(bits_float(rm), p.fp8_max);
          mult = e8m0_inverse_to_float(e8);
        }
        if (row < p.rows) {
          const uint32_t q = fp8x4<kFp8>(v[i][0] * mult, v[i][1] * mult, v[i][2] * mult, v[i][3] * mult);
          store_row4(p.rowwise + row * p.cols + c, c, p.cols, q, p.vec_io);
          if (kMode == TE_SCALING_MXFP8 && lane % 8 == 0 && c < p.cols) {
            static_cast<uint8_t *>(p.rowwise_scale_inv)[row * div_up(p.cols, 32) + tile_c * 4 + lane / 8] = e8;
          }
        }
      }
      if (kMode == TE_SCALING_BLOCK_128X128 && threadIdx.x == 0) {
        static_cast<float *>(p.rowwise_scale_inv)[tile_r * p.tiles_c + tile_c] = canonical_div(1.0f, tile_scale);
      }
    }

    if (p.columnwise != nullptr) {
      float mult[4] = {tile_scale, tile_scale, tile_scale, tile_scale};
      uint8_t e8[4] = {0, 0, 0, 0};
      if constexpr (kMode == TE_SCALING_BLOCK_1X128) {
        // Column x of the tile's scale by thread x alone (not by every warp for its 4 columns),
        // shared through col_mult: one barrier instead of eight divisions per thread.
        if (threadIdx.x < kTile) {
          const int owner = threadIdx.x / 4, j = threadIdx.x % 4;
          uint32_t am = 0;
#pragma unroll
          for (int w = 0; w < kThreads / 32; ++w) {
            const uint32_t *partial = reinterpret_cast<const uint32_t *>(&col_partial[w][owner]);
            am = max(am, partial[j]);
          }
          const float scale = scale_from_amax(bits_float(am), p.fp8_max, p.epsilon, p.pow2);
          reinterpret_cast<float *>(col_mult)[threadIdx.x] = scale;
          const int64_t col = tile_c * kTile + threadIdx.x;
          if (col < p.cols) {
            static_cast<float *>(p.columnwise_scale_inv)[col * p.tiles_r + tile_r] = canonical_div(1.0f, scale);
          }
        }
        __syncthreads();
        const float4 m4 = col_mult[lane];
        mult[0] = m4.x, mult[1] = m4.y, mult[2] = m4.z, mult[3] = m4.w;
      } else if constexpr (kMode == TE_SCALING_MXFP8) {
        // The 32-row block of this warp's 16 rows is shared with the neighbouring warp.
        const uint4 a = col_partial[warp & ~1][lane], b = col_partial[warp | 1][lane];
        const uint32_t am[4] = {max(a.x, b.x), max(a.y, b.y), max(a.z, b.z), max(a.w, b.w)};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          e8[j] = e8m0_scale_inv_from_amax(bits_float(am[j]), p.fp8_max);
          mult[j] = e8m0_inverse_to_float(e8[j]);
        }
        if (warp % 2 == 0 && r0 < p.rows) {
          uint8_t *sinv = static_cast<uint8_t *>(p.columnwise_scale_inv) + (r0 / 32) * p.cols;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            if (c + j < p.cols) sinv[c + j] = e8[j];
          }
        }
      } else if constexpr (kMode == TE_SCALING_BLOCK_128X128) {
        if (threadIdx.x == 0) {
          static_cast<float *>(p.columnwise_scale_inv)[tile_c * p.tiles_r + tile_r] = canonical_div(1.0f, tile_scale);
        }
      }

      if constexpr (!kTransposed) {
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const int64_t row = r0 + i;
          if (row < p.rows) {
            const uint32_t q = fp8x4<kFp8>(v[i][0] * mult[0], v[i][1] * mult[1], v[i][2] * mult[2], v[i][3] * mult[3]);
            store_row4(p.columnwise + row * p.cols + c, c, p.cols, q, p.vec_io);
          }
        }
      } else {
        // Column j of this lane: 16 bytes for input rows r0 .. r0+15, i.e. unit `warp` of
        // staged row 4 * lane + j.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            w[k] = fp8x4<kFp8>(v[4 * k][j] * mult[j], v[4 * k + 1][j] * mult[j], v[4 * k + 2][j] * mult[j],
                               v[4 * k + 3][j] * mult[j]);
          }
          const int r = lane * 4 + j;
          stage.unit[r][stage_unit(r, warp)] = make_uint4(w[0], w[1], w[2], w[3]);
        }
        __syncthreads();
        const int64_t out_row0 = tile_c * kTile, out_col0 = tile_r * kTile;
#pragma unroll
        for (int k = 0; k < kTile * kTile / 16 / kThreads; ++k) {
          const int r = k * (kThreads / 8) + threadIdx.x / 8, q = threadIdx.x % 8;
          const int64_t orow = out_row0 + r, ocol = out_col0 + q * 16;
          if (orow >= p.cols || ocol >= p.rows) continue;
          const uint4 u = stage.unit[r][stage_unit(r, q)];
          uint8_t *dst = p.columnwise + orow * p.rows + ocol;
          if (p.vec_transposed) {
            *reinterpret_cast<uint4 *>(dst) = u;
          } else {
            const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
            for (int b = 0; b < 16; ++b) {
              if (ocol + b < p.rows) dst[b] = static_cast<uint8_t>(w[b / 4] >> (8 * (b % 4)));
            }
          }
        }
      }
    }
  }
  if (p.vec_io) cp_async_wait<0>();  // the last, empty group
  if (kMode == TE_SCALING_TENSOR && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = canonical_div(1.0f, tensor_scale);
}

// Empty tensor in TENSOR mode: scale_inv is still 1 / scale.
__global__ void scale_inv_kernel(const float *scale, float *scale_inv) { *scale_inv = canonical_div(1.0f, *scale); }

// As many blocks as stay resident (each strides over the tiles), with the input double buffer
// when the kernel stages its input.
template <te_dtype kIn, te_dtype kFp8, te_scaling_mode kMode>
te_status launch_tiled(const TiledParams &p, cudaStream_t stream) {
  const auto kernel = quantize_tiled_kernel<kIn, kFp8, kMode>;
  const size_t smem = p.vec_io ? kInputStageBytes<kIn> : 0;
  int64_t capacity = 0;
  bool fits = false;
  if (te_status st = resident_capacity(kOp, kernel, kThreads, smem, &capacity, &fits)) return st;
  if (!fits) {
    return fail(TE_ERROR_UNSUPPORTED, kOp,
                "the tiled kernel needs " + std::to_string(smem) + " bytes of shared memory per block, more than "
                "this device allows");
  }
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>({p.num_tiles, capacity, INT_MAX}));
  kernel<<<blocks, kThreads, smem, stream>>>(p);
  return launch_status(kOp);
}

}  // namespace

te_status quantize_tiled_cuda(const QuantizeArgs &a, te_stream stream_handle) {
  const cudaStream_t stream = cuda_stream(stream_handle);
  if (a.amax != nullptr && !a.accumulate_amax) {  // the tiles atomicMax into it
    if (te_status s = cuda_status(kOp, cudaMemsetAsync(a.amax, 0, sizeof(float), stream))) return s;
  }
  if (a.rows * a.cols == 0) {
    // Every block scale_inv buffer is empty too (one of its dimensions is 0).
    if (a.mode != TE_SCALING_TENSOR) return TE_SUCCESS;
    scale_inv_kernel<<<1, 1, 0, stream>>>(a.scale, a.scale_inv);
    return launch_status(kOp);
  }
  TiledParams p{};
  p.input = a.input;
  p.rowwise = a.rowwise;
  p.columnwise = a.columnwise;
  p.scale = a.scale;
  p.scale_inv = a.scale_inv;
  p.rowwise_scale_inv = a.rowwise_scale_inv;
  p.columnwise_scale_inv = a.columnwise_scale_inv;
  p.amax = a.amax;
  p.rows = a.rows;
  p.cols = a.cols;
  p.tiles_r = ceil_div(a.rows, kTile);
  p.tiles_c = ceil_div(a.cols, kTile);
  p.num_tiles = p.tiles_r * p.tiles_c;
  p.fp8_max = fp8_max(a.fp8_dtype);
  p.epsilon = a.epsilon;
  p.pow2 = a.pow2;
  const uintptr_t in_vec = a.input_dtype == TE_DTYPE_FLOAT32 ? 16 : 8;
  const bool mx = a.mode == TE_SCALING_MXFP8;
  p.vec_io = a.cols % 4 == 0 && aligned(a.input, in_vec) && aligned(a.rowwise, 4) &&
             (!mx || aligned(a.columnwise, 4));
  p.vec_transposed = !mx && a.rows % 16 == 0 && aligned(a.columnwise, 16);
  return with_hp_dtype(a.input_dtype, [&](auto in) {
    return with_fp8_dtype(a.fp8_dtype, [&](auto fp8) {
      constexpr te_dtype kIn = decltype(in)::value, kFp8 = decltype(fp8)::value;
      switch (a.mode) {
        case TE_SCALING_TENSOR: return launch_tiled<kIn, kFp8, TE_SCALING_TENSOR>(p, stream);
        case TE_SCALING_BLOCK_1X128: return launch_tiled<kIn, kFp8, TE_SCALING_BLOCK_1X128>(p, stream);
        case TE_SCALING_BLOCK_128X128: return launch_tiled<kIn, kFp8, TE_SCALING_BLOCK_128X128>(p, stream);
        default: return launch_tiled<kIn, kFp8, TE_SCALING_MXFP8>(p, stream);
      }
    });
  });
}

}  // namespace te
