// The fused activation kernel and its per-activation launchers (see activation.cu for the
// design). Each input dtype and direction instantiates them in its own file
// (activation_<dtype>_<direction>.cu), so that the instantiations compile in parallel;
// activation.cu holds the host launcher.
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_KERNEL_CUH_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_KERNEL_CUH_

#include <algorithm>
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

struct ActParams {
  const void *input;
  const void *grad;
  void *out;
  uint8_t *out_t;
  const float *scale;
  float *scale_inv;
  float *amax;
  float *partial;  // [tiles_r, out_cols] or null
  int64_t rows, n, in_cols, out_cols, tiles_c, num_tiles;
  te_dtype out_dtype;
  bool fp8;
  bool fast;
};

// Operand o of a kernel: forward {a, b}, backward {grad_output, a, b}; x is a when not gated.
template <bool kBackward>
__device__ __forceinline__ void operand(const ActParams &p, int o, const void **ptr, int64_t *stride,
                                        int64_t *offset) {
  const int io = kBackward ? o - 1 : o;  // index among the input's operands
  if (kBackward && o == 0) {
    *ptr = p.grad, *stride = p.n, *offset = 0;
  } else {
    *ptr = p.input, *stride = p.in_cols, *offset = io == 0 ? 0 : p.n;
  }
}

template <te_dtype kFp8>
__device__ __forceinline__ uint32_t pack_fp8(const float *y, float scale) {
  return fp8x4<kFp8>(y[0] * scale, y[1] * scale, y[2] * scale, y[3] * scale);
}

__device__ __forceinline__ uint32_t fp8_word(te_dtype dt, const float *y, float scale) {
  return dt == TE_DTYPE_FLOAT8_E4M3 ? pack_fp8<TE_DTYPE_FLOAT8_E4M3>(y, scale)
                                    : pack_fp8<TE_DTYPE_FLOAT8_E5M2>(y, scale);
}

__device__ __forceinline__ uint16_t hp16(te_dtype dt, float v) {
  return dt == TE_DTYPE_BFLOAT16 ? float_to_bf16(v) : float_to_fp16(v);
}

__device__ __forceinline__ void store_hp_one(void *out, int64_t i, te_dtype dt, float v) {
  if (dt == TE_DTYPE_FLOAT32) {
    static_cast<float *>(out)[i] = v;
  } else {
    static_cast<uint16_t *>(out)[i] = hp16(dt, v);
  }
}

// Eight values at [i, i + 8) with 128-bit stores (out + i is 16-byte aligned).
__device__ __forceinline__ void store_hp_eight(void *out, int64_t i, te_dtype dt, const float (&y)[8]) {
  if (dt == TE_DTYPE_FLOAT32) {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(out) + i);
    q[0] = make_float4(y[0], y[1], y[2], y[3]);
    q[1] = make_float4(y[4], y[5], y[6], y[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = hp16(dt, y[2 * k]) | (static_cast<uint32_t>(hp16(dt, y[2 * k + 1])) << 16);
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(out) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <te_dtype kIn, te_activation kAct, bool kBackward>
struct Shape {
  static constexpr bool kGated = act::kIsGated<kAct>;
  // Operands read: forward x or {a, b}; backward g, g + x, or g + {a, b}.
  static constexpr int kOps = kBackward ? (kGated ? 3 : (kAct == TE_ACTIVATION_IDENTITY ? 1 : 2)) : (kGated ? 2 : 1);
  // Output patches per thread: gated backward writes d/da and d/db.
  static constexpr int kOut = kBackward && kGated ? 2 : 1;
  // fp32 operands take 16 registers per patch row each: with several operands, load a row at
  // a time rather than the whole patch up front.
  static constexpr bool kPreload = kIn != TE_DTYPE_FLOAT32 || kOps == 1;
  static constexpr int kMinBlocks = kOps == 1 && kIn != TE_DTYPE_FLOAT32 ? 2 : 1;
};

// The element values of one patch row (8 columns) from the decoded operands.
template <te_activation kAct, bool kBackward, int kOps, int kOut>
__device__ __forceinline__ void row_values(const float (&x)[kOps][8], float (&y)[kOut][8]) {
  constexpr bool kGated = act::kIsGated<kAct>;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if constexpr (!kBackward) {
      y[0][j] = act::forward_value<kAct>(x[0][j], kGated ? x[kOps - 1][j] : 0.0f);
    } else if constexpr (kGated) {
      act::gated_backward_values<kAct>(x[0][j], x[1][j], x[2][j], &y[0][j], &y[kOut - 1][j]);
    } else {
      y[0][j] = act::backward_value<kAct>(x[0][j], kOps > 1 ? x[kOps - 1][j] : 0.0f);
    }
  }
}

template <te_dtype kIn, te_activation kAct, bool kBackward>
__global__ void __launch_bounds__(kThreads, (Shape<kIn, kAct, kBackward>::kMinBlocks))
    activation_kernel(const ActParams p) {
  using S = Shape<kIn, kAct, kBackward>;
  constexpr int kOps = S::kOps, kOut = S::kOut;
  __shared__ TransposeStage stage;
  __shared__ float col_sums[kOut][kPatchesPerRow][kTile];
  __shared__ uint32_t warp_amax[kThreads / 32];
  const float scale = p.fp8 ? *p.scale : 1.0f;
  const int pr = threadIdx.x / kPatchesPerRow, pc = threadIdx.x % kPatchesPerRow;
  uint32_t m = 0;

  const void *ptr[kOps];
  int64_t stride[kOps], offset[kOps];
#pragma unroll
  for (int o = 0; o < kOps; ++o) operand<kBackward>(p, o, &ptr[o], &stride[o], &offset[o]);

  for (int64_t tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x) {
    if (tile != blockIdx.x) __syncthreads();  // the previous tile's shared memory is consumed
    const int64_t tile_r = tile / p.tiles_c, r0 = tile_r * kTile, c0 = (tile % p.tiles_c) * kTile;
    const int64_t prow = r0 + pr * 8, pcol = c0 + pc * 8;
    // Fast path: a patch is wholly inside the matrix or wholly outside.
    const bool patch_valid = prow < p.rows && pcol < p.n;

    Packed8<kIn> packed[S::kPreload ? kOps : 1][8];
    if (S::kPreload && p.fast) {
#pragma unroll
      for (int o = 0; o < kOps; ++o) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          if (patch_valid) {
            packed[S::kPreload ? o : 0][i].load(ptr[o], (prow + i) * stride[o] + offset[o] + pcol);
          } else {
            packed[S::kPreload ? o : 0][i].zero();
          }
        }
      }
    }

    uint32_t lo[kOut][8], hi[kOut][8];
    float csum[kOut][8];
#pragma unroll
    for (int q = 0; q < kOut; ++q) {
#pragma unroll
      for (int j = 0; j < 8; ++j) csum[q][j] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t row = prow + i;
      float x[kOps][8];
#pragma unroll
      for (int o = 0; o < kOps; ++o) {
        if (p.fast) {
          if constexpr (S::kPreload) {
            packed[o][i].decode(x[o]);
          } else {
            Packed8<kIn> v;
            if (patch_valid) {
              v.load(ptr[o], row * stride[o] + offset[o] + pcol);
            } else {
              v.zero();
            }
            v.decode(x[o]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            x[o][j] = (row < p.rows && pcol + j < p.n) ? load_hp1<kIn>(ptr[o], row * stride[o] + offset[o] + pcol + j) : 0.0f;
          }
        }
      }
      float y[kOut][8];
      row_values<kAct, kBackward, kOps, kOut>(x, y);
#pragma unroll
      for (int q = 0; q < kOut; ++q) {
        const int64_t base = row * p.out_cols + q * p.n + pcol;  // row-wise index of y[q][0]
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (row < p.rows && pcol + j < p.n) {
            m = max(m, abs_bits(y[q][j]));
            csum[q][j] += y[q][j];
          }
        }
        if (p.fp8) {
          lo[q][i] = fp8_word(p.out_dtype, &y[q][0], scale);
          hi[q][i] = fp8_word(p.out_dtype, &y[q][4], scale);
          if (p.out != nullptr) {
            uint8_t *o8 = static_cast<uint8_t *>(p.out);
            if (p.fast) {
              if (patch_valid) store_u64(o8 + base, lo[q][i], hi[q][i]);
            } else if (row < p.rows) {
#pragma unroll
              for (int j = 0; j < 8; ++j) {
                if (pcol + j < p.n) o8[base + j] = static_cast<uint8_t>((j < 4 ? lo[q][i] : hi[q][i]) >> (8 * (j % 4)));
              }
            }
          }
        } else if (p.fast) {
          if (patch_valid) store_hp_eight(p.out, base, p.out_dtype, y[q]);
        } else if (row < p.rows) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if (pcol + j < p.n) store_hp_one(p.out, base + j, p.out_dtype, y[q][j]);
          }
        }
      }
    }

    if (p.partial != nullptr) {
#pragma unroll
      for (int q = 0; q < kOut; ++q) {
#pragma unroll
        for (int j = 0; j < 8; ++j) col_sums[q][pr][pc * 8 + j] = csum[q][j];
      }
    }

    if (p.out_t != nullptr) {
      if (p.fast) {
#pragma unroll
        for (int q = 0; q < kOut; ++q) {
          if (q > 0) __syncthreads();  // the stage of the previous patch has been written out
          stage_put_patch(stage, pr, pc, lo[q], hi[q]);
          __syncthreads();
          stage_store_transposed(stage, p.out_t + q * p.n * p.rows, r0, c0, p.rows, p.n);
        }
      } else {
#pragma unroll
        for (int q = 0; q < kOut; ++q) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              if (prow + i < p.rows && pcol + j < p.n) {
                const uint32_t w = j < 4 ? lo[q][i] : hi[q][i];
                p.out_t[(q * p.n + pcol + j) * p.rows + prow + i] = static_cast<uint8_t>(w >> (8 * (j % 4)));
              }
            }
          }
        }
      }
    }

    if (p.partial != nullptr) {
      __syncthreads();
      // Thread t sums column t % 128 of output patch t / 128 over the 16 patch rows, in order.
      for (int t = threadIdx.x; t < kOut * kTile; t += kThreads) {
        const int q = t / kTile, col = t % kTile;
        float s = 0.0f;
#pragma unroll
        for (int r = 0; r < kPatchesPerRow; ++r) s += col_sums[q][r][col];
        if (c0 + col < p.n) p.partial[tile_r * p.out_cols + q * p.n + c0 + col] = s;
      }
    }
  }

  if (p.amax != nullptr) {
    m = block_max<kThreads>(m, warp_amax);
    if (threadIdx.x == 0) atomic_max_amax(p.amax, m);
  }
  if (p.fp8 && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = canonical_div(1.0f, scale);
}

template <te_dtype kIn, te_activation kAct, bool kBackward>
te_status launch(const ActParams &p, cudaStream_t stream, int sms) {
  auto kernel = activation_kernel<kIn, kAct, kBackward>;
  static const int per_sm = [&] {
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0) != cudaSuccess) {
      cudaGetLastError();
      return 1;
    }
    return std::max(blocks, 1);
  }();
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(p.num_tiles, static_cast<int64_t>(sms) * per_sm));
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  return launch_status(kOp);
}

// Launches the kernel of act and direction for input dtype kIn (instantiated per dtype and
// direction, one file each).
template <te_dtype kIn, bool kBackward>
te_status launch_act(const ActParams &p, te_activation act, cudaStream_t stream, int sms) {
  switch (act) {
    case TE_ACTIVATION_GELU: return launch<kIn, TE_ACTIVATION_GELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_RELU: return launch<kIn, TE_ACTIVATION_RELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SILU: return launch<kIn, TE_ACTIVATION_SILU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_QGELU: return launch<kIn, TE_ACTIVATION_QGELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SRELU: return launch<kIn, TE_ACTIVATION_SRELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_GEGLU: return launch<kIn, TE_ACTIVATION_GEGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SWIGLU: return launch<kIn, TE_ACTIVATION_SWIGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_REGLU: return launch<kIn, TE_ACTIVATION_REGLU, kBackward>(p, stream, sms);
    default: return launch<kIn, TE_ACTIVATION_IDENTITY, kBackward>(p, stream, sms);
  }
}

}  // namespace activation_detail
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_KERNEL_CUH_
