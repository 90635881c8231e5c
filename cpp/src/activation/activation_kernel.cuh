// The fused activation kernel and its per-activation launchers (see activation.cu for the
// design). Each input dtype and direction instantiates them in its own file
// (activation_<dtype>_<direction>.cu), so that the instantiations compile in parallel;
// activation.cu holds the host launcher.
#ifndef TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_KERNEL_CUH_
#define TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_KERNEL_CUH_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "activation/activation_flat.cuh"
#include "activation/activation_io.cuh"

namespace te {
namespace activation_detail {

template <te_dtype kIn, te_activation kAct, bool kBackward, Out kKind>
__global__ void __launch_bounds__(kThreads, (Shape<kIn, kAct, kBackward>::kMinBlocks))
    activation_kernel(const ActParams p) {
  if (p.gate != nullptr && *p.gate != 0.0f) return;  // a shut gate: the amax stays 0 (tensor.h)
  using S = Shape<kIn, kAct, kBackward>;
  using T = StagedTile<kIn>;
  constexpr int kOps = S::kOps, kOut = S::kOut;
  constexpr bool kFp8 = kKind == Out::kE4M3 || kKind == Out::kE5M2;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ uint32_t warp_amax[kThreads / 32];
  const int pr = threadIdx.x / kPatchesPerRow, pc = threadIdx.x % kPatchesPerRow;
  const float scale = kFp8 ? *p.scale : 1.0f;
  const float abs_scale = fabsf(scale);
  // y * scale is NaN only where y is, unless scale is 0, infinite or NaN: then every patch's
  // FP8 bytes are checked for NaN codes, not only those of patches with a NaN value.
  const bool check_all = kFp8 && !(abs_scale <= kFloatMax && scale != 0.0f);
  // The transposed FP8 output (fast path) and the dbias column sums go from thread to thread
  // through shared memory, behind barriers; without them a block needs none.
  const bool transpose = kFp8 && p.out_t != nullptr && p.fast;
  const bool exchange = transpose || (kBackward && p.partial != nullptr);
  // Tile counts fit in 32 bits (the launcher checks); an empty output (N = 0) has no tiles.
  const int tiles_r = p.num_tiles > 0 ? static_cast<int>(p.tiles_r) : 0;
  const int tiles_c = max(static_cast<int>(p.tiles_c), 1);

  const int stages = S::kStaged ? p.stages : 0;  // 1 or 2 when staged

  // Stages this thread's patches of a tile (if it exists) and closes a cp.async group.
  auto fill = [&](const TileCursor &at, int stage) {
    if (!S::kStaged) return;
    if (at.r < tiles_r) {
      const int64_t prow = static_cast<int64_t>(at.r) * kTile + pr * 8;
      const int64_t pcol = static_cast<int64_t>(at.c) * kTile + pc * 8;
      unsigned char *dst = smem + stage * S::kStageBytes + pr * 8 * T::kRowBytes;
#pragma unroll
      for (int o = 0; o < kOps; ++o) {
        const auto *src = operand_at<kBackward, typename T::Storage>(p, o, prow, pcol);
        const int64_t stride = operand_stride<kBackward>(p, o);
        if (p.fast) {
          T::fill_fast(dst + o * T::kBytes, pc, src, stride, prow < p.rows && pcol < p.n);
        } else {
          T::fill_masked(dst + o * T::kBytes, pc, src, stride, p.rows - prow, p.n - pcol);
        }
      }
    }
    cp_async_commit();  // an empty group past the last tile keeps the group count uniform
  };

  float amax = 0.0f;  // max |value| so far; NaN once any value is NaN
  const int step_r = gridDim.x / tiles_c, step_c = gridDim.x % tiles_c;
  TileCursor at(blockIdx.x, tiles_c), ahead = at;  // the tile in work, the next to fill
  if (stages == 2) {
    fill(ahead, 0);
    ahead.next(step_r, step_c, tiles_c);
  }
  for (int k = 0; at.r < tiles_r; ++k, at.next(step_r, step_c, tiles_c)) {
    // The stage refilled now (or the exchange space) held the previous tile's transposes and
    // column sums: every thread must be done storing them.
    if (exchange && k > 0) __syncthreads();
    const int buffer = stages == 2 ? k & 1 : 0;
    fill(ahead, stages == 2 ? buffer ^ 1 : 0);
    ahead.next(step_r, step_c, tiles_c);
    // This tile's patches have landed (own copies only).
    if (stages == 2) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    unsigned char *stage = smem + buffer * S::kStageBytes;  // the inputs, then the exchange
    const int64_t r0 = static_cast<int64_t>(at.r) * kTile, c0 = static_cast<int64_t>(at.c) * kTile;
    const int64_t prow = r0 + pr * 8, pcol = c0 + pc * 8;

    float patch_amax = 0.0f;
    [[maybe_unused]] float csum[kOut][8];
    [[maybe_unused]] uint32_t lo[kOut][8], hi[kOut][8];
    // Backward, 16-bit high-precision rows (fast path): stored once the patch is done, as the
    // FP8 kinds hold their bytes. A global store inside the row loop, through a pointer the
    // compiler cannot tell from the staged inputs, keeps it from overlapping one row's
    // shared-memory reads and arithmetic with the next row's: on an H100 the bf16 GELU
    // backward at [8192, 4096] took 171 us a call that way and 113 us this way. The forward
    // (one operand, two blocks per SM, half the registers) was slower deferred: 81 us against
    // 71, so it keeps its stores in the loop; so do fp32 inputs (read from global memory,
    // where holding the rows made the gated backward spill).
    [[maybe_unused]] uint4 hp16[kOut][8];
    constexpr bool kDeferHp = kBackward && kIn != TE_DTYPE_FLOAT32 && kKind == Out::kHighPrecision;
    [[maybe_unused]] const bool defer_hp = kDeferHp && p.fast && p.out_dtype != TE_DTYPE_FLOAT32;
#pragma unroll
    for (int q = 0; q < kOut; ++q) {
#pragma unroll
      for (int j = 0; j < 8; ++j) csum[q][j] = 0.0f;
    }
    const unsigned char *mine = stage + pr * 8 * T::kRowBytes;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float x[kOps][8];
#pragma unroll
      for (int o = 0; o < kOps; ++o) {
        if constexpr (S::kStaged) {
          T::read(mine + o * T::kBytes + i * T::kRowBytes, pc, x[o]);
        } else {
          read_direct<kIn, kBackward>(p, o, prow + i, pcol, x[o]);
        }
      }
      float y[kOut][8];
      row_values<kAct, kBackward, kOps, kOut>(x, y, p.params);
      const int64_t row = prow + i;
#pragma unroll
      for (int q = 0; q < kOut; ++q) {
        float row_amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          row_amax = act::max_keep_nan(row_amax, fabsf(y[q][j]));
          if constexpr (kBackward) csum[q][j] += y[q][j];
        }
        patch_amax = act::max_keep_nan(patch_amax, row_amax);
        // (NaN so far in the patch: the high-precision stores then put back the reference's
        // NaN pattern)
        [[maybe_unused]] const bool nan = patch_amax != patch_amax;
        if constexpr (kFp8) {
          float s[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) s[j] = y[q][j] * scale;
          const uint2 w = fp8x8_nan_raw<kFp8Dtype<kKind>>(s, row_amax, abs_scale);
          lo[q][i] = w.x, hi[q][i] = w.y;
        } else if constexpr (kKind == Out::kHighPrecision) {
          const int64_t base = row * p.out_cols + q * p.n + pcol;  // row-wise index of y[q][0]
          if (defer_hp) {
            hp16[q][i] = pack_hp16x8(p.out_dtype, y[q], nan);
          } else if (p.fast) {
            if (row < p.rows && pcol < p.n) store_hp8(p.out, base, p.out_dtype, y[q], nan);
          } else if (row < p.rows) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              if (pcol + j < p.n) store_hp_one(p.out, base + j, p.out_dtype, y[q][j]);
            }
          }
        }
      }
    }

    if constexpr (kKind == Out::kHighPrecision) {
      if (defer_hp && pcol < p.n) {
#pragma unroll
        for (int q = 0; q < kOut; ++q) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            if (prow + i < p.rows) {
              *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p.out) + (prow + i) * p.out_cols + q * p.n + pcol) =
                  hp16[q][i];
            }
          }
        }
      }
    }
    if constexpr (kFp8) {
      if (check_all || patch_amax != patch_amax) {
#pragma unroll
        for (int q = 0; q < kOut; ++q) {
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            lo[q][i] = canonical_fp8_nan<kFp8Dtype<kKind>>(lo[q][i]);
            hi[q][i] = canonical_fp8_nan<kFp8Dtype<kKind>>(hi[q][i]);
          }
        }
      }
      if (p.out != nullptr) store_fp8_rows<kOut>(p, prow, pcol, lo, hi);
      if (p.out_t != nullptr && !p.fast) store_fp8_transposed_masked<kOut>(p, prow, pcol, lo, hi);
    }
    amax = act::max_keep_nan(amax, patch_amax);

    if (exchange) {
      __syncthreads();  // every thread is done with this stage's inputs (if staged)
      TransposeStage *transposed = reinterpret_cast<TransposeStage *>(stage);
      float *col_sums = reinterpret_cast<float *>(stage + S::kTransposeBytes);  // [kOut][16][128]
      if constexpr (kFp8) {
        if (transpose) {
#pragma unroll
          for (int q = 0; q < kOut; ++q) stage_put_patch(transposed[q], pr, pc, lo[q], hi[q]);
        }
      }
      if constexpr (kBackward) {
        if (p.partial != nullptr) {
#pragma unroll
          for (int q = 0; q < kOut; ++q) {
#pragma unroll
            for (int j = 0; j < 8; ++j) col_sums[(q * kPatchesPerRow + pr) * kTile + pc * 8 + j] = csum[q][j];
          }
        }
      }
      __syncthreads();
      if constexpr (kFp8) {
        if (transpose) {
#pragma unroll
          for (int q = 0; q < kOut; ++q) {
            store_transposed(transposed[q], p.out_t + q * p.n * p.rows, r0, c0, p.rows, p.n);
          }
        }
      }
      if constexpr (kBackward) {
        if (p.partial != nullptr) {
          // Thread t sums column t % 128 of output patch t / 128 over the 16 patch rows, in order.
          for (int t = threadIdx.x; t < kOut * kTile; t += kThreads) {
            const int q = t / kTile, col = t % kTile;
            float s = 0.0f;
#pragma unroll
            for (int r = 0; r < kPatchesPerRow; ++r) s += col_sums[(q * kPatchesPerRow + r) * kTile + col];
            if (c0 + col < p.n) p.partial[at.r * p.out_cols + q * p.n + c0 + col] = s;
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  if (p.amax != nullptr) {
    const uint32_t m = block_max<kThreads>(float_bits(amax), warp_amax);
    if (threadIdx.x == 0) atomic_max_amax(p.amax, is_nan_bits(m) ? kCanonicalNaN : m);
  }
  if (kFp8 && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = canonical_div(1.0f, scale);
}

// Launches the kernel on as many blocks as stay resident (they loop over the tiles). Once per
// device: the stage count its shared memory allows, the kernel's shared-memory limit raised
// to that (past 48 KiB a kernel must ask), all of L1 given to shared memory (the inputs
// bypass L1, and two blocks fit where they can), and the residency.
template <te_dtype kIn, te_activation kAct, bool kBackward, Out kKind>
te_status launch(ActParams p, cudaStream_t stream, int sms) {
  using S = Shape<kIn, kAct, kBackward>;
  auto kernel = activation_kernel<kIn, kAct, kBackward, kKind>;
  constexpr int kMaxDevices = 64;
  static std::atomic<uint32_t> cached[kMaxDevices];  // stages << 16 | blocks per SM; 0: not set up
  int device = 0;
  if (te_status s = cuda_status(kOp, cudaGetDevice(&device))) return s;
  const bool cacheable = device >= 0 && device < kMaxDevices;
  const uint32_t bits = cacheable ? cached[device].load(std::memory_order_relaxed) : 0;
  int stages = static_cast<int>(bits >> 16), per_sm = static_cast<int>(bits & 0xFFFF);
  if (bits == 0) {
    int limit = 0;  // bytes of shared memory a block may opt in to, static included
    if (te_status s = cuda_status(kOp, cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                              device))) {
      return s;
    }
    constexpr int kSlack = 1024;  // the kernel's static shared memory, with room
    stages = S::smem_bytes(2) + kSlack <= limit ? 2 : 1;
    if (S::smem_bytes(stages) + kSlack > limit) {
      return fail(TE_ERROR_UNSUPPORTED, kOp,
                  "the device must offer " + std::to_string(S::smem_bytes(stages) + kSlack) +
                      " bytes of shared memory per block, got " + std::to_string(limit));
    }
    const int smem = S::smem_bytes(stages);
    if (te_status s = cuda_status(kOp, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            smem))) {
      return s;
    }
    if (te_status s = cuda_status(kOp, cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                            cudaSharedmemCarveoutMaxShared))) {
      return s;
    }
    if (te_status s = cuda_status(kOp, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads,
                                                                                     smem))) {
      return s;
    }
    per_sm = std::min(std::max(per_sm, 1), 0xFFFF);
    if (cacheable) cached[device].store(static_cast<uint32_t>(stages) << 16 | per_sm, std::memory_order_relaxed);
  }
  p.stages = stages;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(p.num_tiles, static_cast<int64_t>(sms) * per_sm));
  kernel<<<static_cast<unsigned>(grid), kThreads, S::smem_bytes(stages), stream>>>(p);
  return launch_status(kOp);
}

template <te_dtype kIn, te_activation kAct, bool kBackward>
te_status launch_kind(const ActParams &p, cudaStream_t stream, int sms) {
  if constexpr (!act::kIsGated<kAct>) {
    if (p.flat) return launch_flat<kIn, kAct, kBackward>(p, stream, sms);
  }
  if (!p.fp8) {  // an amax-only call (no output at all) has a kernel of its own, without stores
    return p.out == nullptr ? launch<kIn, kAct, kBackward, Out::kAmaxOnly>(p, stream, sms)
                            : launch<kIn, kAct, kBackward, Out::kHighPrecision>(p, stream, sms);
  }
  if (p.out_dtype == TE_DTYPE_FLOAT8_E4M3) return launch<kIn, kAct, kBackward, Out::kE4M3>(p, stream, sms);
  return launch<kIn, kAct, kBackward, Out::kE5M2>(p, stream, sms);
}

// Launches the kernel of act and direction for input dtype kIn (instantiated per dtype and
// direction, one file each).
template <te_dtype kIn, bool kBackward>
te_status launch_act(const ActParams &p, te_activation act, cudaStream_t stream, int sms) {
  switch (act) {
    case TE_ACTIVATION_GELU: return launch_kind<kIn, TE_ACTIVATION_GELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_RELU: return launch_kind<kIn, TE_ACTIVATION_RELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SILU: return launch_kind<kIn, TE_ACTIVATION_SILU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_QGELU: return launch_kind<kIn, TE_ACTIVATION_QGELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SRELU: return launch_kind<kIn, TE_ACTIVATION_SRELU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_GEGLU: return launch_kind<kIn, TE_ACTIVATION_GEGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SWIGLU: return launch_kind<kIn, TE_ACTIVATION_SWIGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_REGLU: return launch_kind<kIn, TE_ACTIVATION_REGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_QGEGLU: return launch_kind<kIn, TE_ACTIVATION_QGEGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_SREGLU: return launch_kind<kIn, TE_ACTIVATION_SREGLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_GLU: return launch_kind<kIn, TE_ACTIVATION_GLU, kBackward>(p, stream, sms);
    case TE_ACTIVATION_CLAMPED_SWIGLU:
      return launch_kind<kIn, TE_ACTIVATION_CLAMPED_SWIGLU, kBackward>(p, stream, sms);
    default: return launch_kind<kIn, TE_ACTIVATION_IDENTITY, kBackward>(p, stream, sms);
  }
}

}  // namespace activation_detail
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ACTIVATION_ACTIVATION_KERNEL_CUH_
