// The pieces of the fused activation kernel around its arithmetic (see activation.cu for the
// design): its parameters and shape, the staging of input tiles in shared memory, and the
// stores of its outputs.
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_IO_CUH_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_IO_CUH_

#include <cuda_fp16.h>

#include <cstdint>

#include "activation/activation_impl.h"
#include "activation/activation_math.h"
#include "common/cuda_utils.cuh"

namespace te {
namespace activation_detail {

constexpr const char *kOp = "activation";
constexpr int kTile = 128;
constexpr int kThreads = kStageThreads;  // 256: 16 x 16 patches of 8x8
constexpr int kPatchesPerRow = kTile / 8;

// The kind of output, a template parameter so that the row loop has no branch on it: FP8 in
// either format (row-wise and/or transposed), high precision (fp32/fp16/bf16, row-wise), or
// none (the amax alone: current scaling's first pass), whose kernel then holds no store code.
enum class Out { kHighPrecision, kE4M3, kE5M2, kAmaxOnly };

struct ActParams {
  const void *input;
  const void *grad;
  void *out;
  uint8_t *out_t;
  const float *scale;
  float *scale_inv;
  float *amax;
  const float *gate;  // [1] or null: run only while it holds 0 (tensor.h)
  act::Params params;  // CLAMPED_SWIGLU's
  float *partial;  // [tiles_r, out_cols] or null
  int64_t rows, n, in_cols, out_cols, tiles_r, tiles_c, num_tiles;
  int stages;  // input stages in shared memory (1 or 2; kernels that stage inputs)
  te_dtype out_dtype;
  bool fp8;
  bool fast;
  bool flat;  // non-gated, high precision or amax only, no dbias, fast path: activation_flat.cuh
};

// ---------------------------------------------------------------------------------------------
// Input staging: each operand's 128x128 tile is copied into shared memory with cp.async, one
// tile ahead of its use, so that the loads of the next tile are in flight during this tile's
// arithmetic without holding registers. Each thread copies exactly its own 8x8 patch (8 rows
// of 16 or 32 bytes: a warp's copies are two whole 256-byte row segments) and reads only that
// back, so its own cp.async wait is all the ordering the inputs need.

// One operand's tile as staged: 128 rows of raw input elements. fp32 rows keep the two 16-byte
// pieces of each patch row 256 bytes apart, so that each of a thread's two 128-bit reads makes
// 8 consecutive threads read 128 contiguous bytes (no bank conflict), as 16-bit rows do.
template <te_dtype kIn>
struct StagedTile {
  using Storage = typename Hp<kIn>::Storage;
  static constexpr int kElemBytes = sizeof(Storage);
  static constexpr int kRowBytes = kTile * kElemBytes;
  static constexpr int kBytes = kTile * kRowBytes;
  static constexpr int kPieces = kElemBytes / 2;        // 16-byte pieces of a patch row: 1 or 2
  static constexpr int kPieceElems = 16 / kElemBytes;  // 8 or 4

  // Byte offsets within a row: piece h of patch column pc, and its element j (of 8).
  static __device__ __forceinline__ int piece(int pc, int h) { return h * (kRowBytes / kPieces) + pc * 16; }
  static __device__ __forceinline__ int element(int pc, int j) {
    return piece(pc, j / kPieceElems) + (j % kPieceElems) * kElemBytes;
  }

  // The 8 values of patch column pc of a staged row, decoded (exactly: every input format
  // widens to fp32 without rounding; a NaN may change payload, which no output keeps).
  static __device__ __forceinline__ void read(const unsigned char *row, int pc, float (&x)[8]) {
    if constexpr (kIn == TE_DTYPE_FLOAT32) {
      const float4 a = *reinterpret_cast<const float4 *>(row + piece(pc, 0));
      const float4 b = *reinterpret_cast<const float4 *>(row + piece(pc, 1));
      x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    } else {
      const uint4 v = *reinterpret_cast<const uint4 *>(row + piece(pc, 0));
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if constexpr (kIn == TE_DTYPE_BFLOAT16) {
          x[2 * k] = __uint_as_float(w[k] << 16);
          x[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        } else {
          x[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k])));
          x[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[k] >> 16)));
        }
      }
    }
  }

  // Stages this thread's patch of an operand: dst is the patch's first row in the stage, src
  // its first element in the matrix, stride the matrix's row pitch. Fast path: a patch is
  // wholly inside the matrix (copied) or wholly outside (zeros). Masked path: element by
  // element, zeros outside (rows and cols: how many of the patch's are inside). Zeros make
  // every activation value 0 (act(0) and act'(0) are finite, and g or b is 0 too), so padding
  // adds nothing to amax or dbias.
  static __device__ __forceinline__ void fill_fast(unsigned char *dst, int pc, const Storage *src, int64_t stride,
                                                   bool inside) {
#pragma unroll
    for (int i = 0; i < 8; ++i, src += stride) {
#pragma unroll
      for (int h = 0; h < kPieces; ++h) {
        unsigned char *d = dst + i * kRowBytes + piece(pc, h);
        if (inside) {
          cp_async16(d, src + h * kPieceElems);
        } else {
          *reinterpret_cast<uint4 *>(d) = make_uint4(0, 0, 0, 0);
        }
      }
    }
  }

  static __device__ __forceinline__ void fill_masked(unsigned char *dst, int pc, const Storage *src, int64_t stride,
                                                     int64_t rows, int64_t cols) {
    for (int i = 0; i < 8; ++i, src += stride) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<Storage *>(dst + i * kRowBytes + element(pc, j)) =
            i < rows && j < cols ? src[j] : Storage{0};
      }
    }
  }
};

// Walks a block's tiles blockIdx.x, blockIdx.x + gridDim.x, ... as (tile row, tile column),
// without a division per tile. 32 bits suffice: a tensor with 2^31 tiles would not fit in any
// GPU's memory.
struct TileCursor {
  int r, c;
  __device__ __forceinline__ TileCursor(int first, int tiles_c) : r(first / tiles_c), c(first % tiles_c) {}
  // step = (gridDim.x / tiles_c, gridDim.x % tiles_c)
  __device__ __forceinline__ void next(int step_r, int step_c, int tiles_c) {
    r += step_r, c += step_c;
    if (c >= tiles_c) c -= tiles_c, ++r;
  }
};

template <te_dtype kIn, te_activation kAct, bool kBackward>
struct Shape {
  static constexpr bool kGated = act::kIsGated<kAct>;
  // Operands read: forward x or {a, b}; backward g, g + x, or g + {a, b}.
  static constexpr int kOps = kBackward ? (kGated ? 3 : (kAct == TE_ACTIVATION_IDENTITY ? 1 : 2)) : (kGated ? 2 : 1);
  // Output patches per thread: gated backward writes d/da and d/db.
  static constexpr int kOut = kBackward && kGated ? 2 : 1;
  // Inputs staged in shared memory, one tile ahead where two stages fit the device (every
  // 16-bit kernel on Hopper: at most 192 KiB), else one. fp32 with 2-3 operands would take
  // 128-192 KiB for a single stage, more than pre-Hopper GPUs have: its threads load their
  // rows straight from global memory instead.
  static constexpr bool kStaged = kIn != TE_DTYPE_FLOAT32 || kOps == 1;
  static constexpr int kStageBytes = kOps * StagedTile<kIn>::kBytes;
  // The transposed FP8 patches and the dbias column sums, exchanged through shared memory:
  // in the tile's stage once its inputs are consumed, or in their own space (not staged).
  static constexpr int kTransposeBytes = kOut * static_cast<int>(sizeof(TransposeStage));
  static constexpr int kExchangeBytes =
      kTransposeBytes + kOut * kPatchesPerRow * kTile * static_cast<int>(sizeof(float));
  static_assert(!kStaged || kExchangeBytes <= kStageBytes, "the exchange must fit in a consumed stage");
  static constexpr int kMaxSmemBytes = kStaged ? 2 * kStageBytes : kExchangeBytes;
  static constexpr int smem_bytes(int stages) { return kStaged ? stages * kStageBytes : kExchangeBytes; }
  // Blocks per SM the registers are capped for: two where shared memory admits two on Hopper
  // (one operand of 16-bit elements, or no staging), so that one block's barriers overlap the
  // other's work.
  static constexpr int kMinBlocks = 2 * (kMaxSmemBytes + 1024) <= 227 * 1024 ? 2 : 1;
};

// Operand o of a kernel (forward {a, b}, backward {grad_output, a, b}; x is a when not gated):
// its element at (row, col), and its row pitch. Read from the parameters where needed rather
// than held in registers across the loop.
template <bool kBackward, typename Storage>
__device__ __forceinline__ const Storage *operand_at(const ActParams &p, int o, int64_t row, int64_t col) {
  if (kBackward && o == 0) return static_cast<const Storage *>(p.grad) + row * p.n + col;
  const int io = kBackward ? o - 1 : o;  // index among the input's operands
  return static_cast<const Storage *>(p.input) + row * p.in_cols + (io == 0 ? 0 : p.n) + col;
}

template <bool kBackward>
__device__ __forceinline__ int64_t operand_stride(const ActParams &p, int o) {
  return kBackward && o == 0 ? p.n : p.in_cols;
}

// Kernels that do not stage: the 8 values of operand o at (row, col..col + 7) straight from
// global memory. Fast path: one or two 128-bit loads, zeros for a patch outside the matrix;
// masked path: element by element, zeros outside.
template <te_dtype kIn, bool kBackward>
__device__ __forceinline__ void read_direct(const ActParams &p, int o, int64_t row, int64_t col, float (&x)[8]) {
  using Storage = typename Hp<kIn>::Storage;
  const Storage *src = operand_at<kBackward, Storage>(p, o, row, col);
  if (p.fast) {
    if (row < p.rows && col < p.n) {
      load_hp8<kIn>(src, 0, x);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = 0.0f;
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = row < p.rows && col + j < p.n ? Hp<kIn>::decode(src[j]) : 0.0f;
  }
}

// The element values of one patch row (8 columns) from the decoded operands.
template <te_activation kAct, bool kBackward, int kOps, int kOut>
__device__ __forceinline__ void row_values(const float (&x)[kOps][8], float (&y)[kOut][8], const act::Params &ap) {
  constexpr bool kGated = act::kIsGated<kAct>;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (!kBackward) {
      y[0][j] = act::forward_value<kAct>(x[0][j], kGated ? x[kOps - 1][j] : 0.0f, ap);
    } else if constexpr (kGated) {
      act::gated_backward_values<kAct>(x[0][j], x[1][j], x[2][j], ap, &y[0][j], &y[kOut - 1][j]);
    } else {
      y[0][j] = act::backward_value<kAct>(x[0][j], kOps > 1 ? x[kOps - 1][j] : 0.0f, ap);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Outputs.

template <Out kKind>
constexpr te_dtype kFp8Dtype = kKind == Out::kE4M3 ? TE_DTYPE_FLOAT8_E4M3 : TE_DTYPE_FLOAT8_E5M2;

// One high-precision value at row-wise index i (fp32 NaN written as kCanonicalNaN; the 16-bit
// conversions write their own canonical NaN): the masked path's store.
__device__ __forceinline__ void store_hp_one(void *out, int64_t i, te_dtype dt, float v) {
  if (dt == TE_DTYPE_FLOAT32) {
    static_cast<float *>(out)[i] = canonical(v);
  } else if (dt == TE_DTYPE_BFLOAT16) {
    static_cast<uint16_t *>(out)[i] = float_to_bf16(v);
  } else {
    static_cast<uint16_t *>(out)[i] = float_to_fp16(v);
  }
}

// The block writes a staged transposed tile into the [cols, rows] output, as
// stage_store_transposed (cuda_utils.cuh) does, with the swizzle and addresses worked out once
// per thread: 16 bytes per thread and pass, 8 threads per 128-byte output row, 32 output rows
// per pass. Fast path: rows % 16 == 0, so a 16-byte unit is wholly inside or outside.
__device__ __forceinline__ void store_transposed(const TransposeStage &s, uint8_t *out, int64_t r0, int64_t c0,
                                                 int64_t rows, int64_t cols) {
  constexpr int kRowsPerPass = kThreads / 8;
  const int R = threadIdx.x / 8, q = threadIdx.x % 8;
  if (r0 + q * 16 >= rows) return;
  // stage_get's swizzle key for tile row k * 32 + R is x = 4k + R / 8: its low bit is the
  // same in every pass, and the physical unit is q ^ (x >> 1) = q ^ (2k + R / 16).
  const bool swap = (R / 8) & 1;
  const int unit = q ^ (R / 16);
  const uint4 *src = reinterpret_cast<const uint4 *>(s.chunk[R]);
  uint8_t *dst = out + (c0 + R) * rows + r0 + q * 16;
  const int64_t pass_bytes = kRowsPerPass * rows;
#pragma unroll
  for (int k = 0; k < kTile / kRowsPerPass; ++k, dst += pass_bytes) {
    const uint4 u = src[k * kRowsPerPass * 8 + (unit ^ (2 * k))];  // a tile row is 8 units
    if (c0 + k * kRowsPerPass + R < cols) {
      *reinterpret_cast<uint4 *>(dst) = swap ? make_uint4(u.z, u.w, u.x, u.y) : u;
    }
  }
}

// The FP8 rows of a thread's patches (row i of patch q is lo[q][i], hi[q][i]), row-wise. The
// masked path writes byte by byte in a loop that is not unrolled (code size: it is rare).
template <int kOut>
__device__ __forceinline__ void store_fp8_rows(const ActParams &p, int64_t prow, int64_t pcol,
                                               const uint32_t (&lo)[kOut][8], const uint32_t (&hi)[kOut][8]) {
  uint8_t *o8 = static_cast<uint8_t *>(p.out);
#pragma unroll
  for (int q = 0; q < kOut; ++q) {
    if (p.fast) {
      if (prow < p.rows && pcol < p.n) {
#pragma unroll
        for (int i = 0; i < 8; ++i) store_u64(o8 + (prow + i) * p.out_cols + q * p.n + pcol, lo[q][i], hi[q][i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint64_t bytes = lo[q][i] | (static_cast<uint64_t>(hi[q][i]) << 32);
        uint8_t *dst = o8 + (prow + i) * p.out_cols + q * p.n + pcol;
#pragma unroll 1
        for (int j = 0; j < 8; ++j) {
          if (prow + i < p.rows && pcol + j < p.n) dst[j] = static_cast<uint8_t>(bytes >> (8 * j));
        }
      }
    }
  }
}

// Masked path: the transposed bytes of a thread's patches, one at a time.
template <int kOut>
__device__ __forceinline__ void store_fp8_transposed_masked(const ActParams &p, int64_t prow, int64_t pcol,
                                                            const uint32_t (&lo)[kOut][8],
                                                            const uint32_t (&hi)[kOut][8]) {
#pragma unroll
  for (int q = 0; q < kOut; ++q) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint64_t bytes = lo[q][i] | (static_cast<uint64_t>(hi[q][i]) << 32);
#pragma unroll 1
      for (int j = 0; j < 8; ++j) {
        if (prow + i < p.rows && pcol + j < p.n) {
          p.out_t[(q * p.n + pcol + j) * p.rows + prow + i] = static_cast<uint8_t>(bytes >> (8 * j));
        }
      }
    }
  }
}

}  // namespace activation_detail
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_IO_CUH_
