// The block-scaled FP8 GEMM of the DeepSeek-V3 recipe on Hopper (sm_90a), written directly on
// TMA, mbarriers and WGMMA (wgmma_primitives.cuh), without CUTLASS's mainloop:
//
//   D[m, n] = sum over K blocks b of  sa[m, b] * sb[n / 128, b] * sum_{k in b} A[m, k] B[n, k]
//             (+ D[m, n] with accumulate) (+ bias[n])
//
// with block_scaled_gemm.h's operands and layouts (A [M, K] and B [N, K] E4M3, K contiguous; sa
// [M, ceil(K/128)] and sb [ceil(N/128), ceil(K/128)] fp32, row-major).
//
// Shape of the kernel (one CTA per SM, persistent):
// - Tile 128 x 128 (or 128 x 256, WgmmaOptions::block_n), k-block 128. 128 along K is the scale
//   block, so each k-block is one promotion; 128 along N is B's scale block, so one B scale per
//   k-block and 128-column half.
// - Three warpgroups. The first is the producer: one thread issues the TMA loads of A's and B's
//   k-block tiles into a ring of stages (16 KiB per 128 x 128 tile, 128-byte swizzle) and gives
//   its registers back (setmaxnreg). The other two are consumers of 64 rows each: per k-block they
//   wait for the stage, run four m64n128k32 WGMMAs into a block sum, wait for them, free the
//   stage, and promote: acc = fma(block, sa[row] * sb, acc) (CUTLASS's blockwise mainloop does
//   the same arithmetic, so both give the same bits). While one consumer promotes, the other's
//   WGMMAs keep the tensor cores busy.
// - Each consumer thread holds 64 accumulators per 128 columns and 64 block sums (the WGMMA
//   fragment of two rows and 32 columns). The 128-column tile can hold a second set of block
//   sums, so that the next k-block's WGMMAs run during this one's promotion (overlap); the
//   256-column tile, 128 accumulators and one set, cannot. It trades that for L2 traffic: per
//   k-block it loads 48 KiB for twice the 128 x 128 tile's work, which loads 32 KiB.
// - With a cluster of two CTAs along N (cluster_n = 2), each CTA loads half of the A tile they
//   share and multicasts it to both, halving A's traffic from L2; along M (cluster_m = 2, for
//   the 256-column tile, whose B tile is the larger) they share B the same way. A stage is then
//   free once the consumers of both CTAs have read it, so each consumer warp arrives on both
//   CTAs' barriers.
// - The persistent loop walks the tiles in groups of group_m row blocks, column by column, so
//   that the tiles in flight at once share their A and B blocks in L2.
// - Epilogue: the consumers write D from registers (two columns per store), adding D's old value
//   and the bias in fp32 first, while the producer already loads the next tile's k-blocks.
//
// Rows past M, columns past N and K past its end read zeros (TMA's out-of-bounds fill) and are not
// stored; a CTA whose tile is past M or N still runs the mainloop when its cluster partner needs its
// half of the shared tile and its arrivals.
//
// Files: the consumers' mainloops are in wgmma_mainloop.cuh, the operands' TMA descriptors are
// made by tma_operand.cu; this file holds the producer, the tile loop, the epilogue and the
// launch.
#include "gemm/hopper/block_scaled_wgmma.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "common/internal.h"
#include "gemm/hopper/tma_operand.h"
#include "gemm/hopper/wgmma_mainloop.cuh"

namespace te {
namespace hopper {
namespace {

constexpr int kBlockM = 128;     // (kBlockK and kTileBytes: wgmma_mainloop.cuh)
constexpr int kThreads = 384;    // producer + two consumer warpgroups
constexpr int kConsumerWarps = 8;
// 128 * 40 + 256 * 232 registers fit the SM's 65536.
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;

// The tile's width: kHalves 128-column halves (B's scale blocks). A stage holds A's k-block tile
// and B's kHalves tiles; as many stages as fit in the 227 KiB of shared memory a CTA may have.
template <int kHalves>
struct Width {
  static_assert(kHalves == 1 || kHalves == 2, "the tile is 128 or 256 columns wide");
  static constexpr int kBlockN = 128 * kHalves;
  static constexpr uint32_t kStageBytes = (1 + kHalves) * kTileBytes;
  static constexpr int kStages = kHalves == 1 ? 6 : 4;
  // The stages (1024-byte aligned for the swizzle), then the full and empty barriers.
  static constexpr size_t kSharedBytes = 1024 + kStages * kStageBytes + 2 * kStages * sizeof(uint64_t);
};

// The CTAs of a cluster: one, or a pair that shares one operand's k-block tiles (each CTA loads
// half of the shared tile and multicasts it to both): side by side along N sharing A, or one
// above the other along M sharing B.
enum class Pair { kNone, kAlongN, kAlongM };

template <Pair kPair>
constexpr int kClusterSize = kPair == Pair::kNone ? 1 : 2;

struct Params {
  int m, n, kblocks;
  int m_blocks, n_blocks;  // tiles along M and N
  int sb_rows;             // B's 128-row scale blocks: ceil(n / 128)
  int rows, columns;       // the cluster's units: m_blocks and n_blocks over the pair's extent
  int tiles;               // rows * columns: the persistent loop's units, one per cluster
  int group_m;
  const float *sa, *sb;
  void *d;
  const __nv_bfloat16 *bias;
  int accumulate;
};

// Unit t of the loop: the row block and column block of this CTA (cluster rank `rank`).
template <Pair kPair>
__device__ __forceinline__ void tile_at(const Params &p, int t, uint32_t rank, int *mb, int *nb) {
  const int per_group = p.group_m * p.columns;
  const int group = t / per_group;
  const int first = group * p.group_m;
  const int rows = min(p.rows - first, p.group_m);
  const int r = t - group * per_group;
  const int row = first + r % rows, column = r / rows;
  *mb = kPair == Pair::kAlongM ? 2 * row + static_cast<int>(rank) : row;
  *nb = kPair == Pair::kAlongN ? 2 * column + static_cast<int>(rank) : column;
}

__device__ __forceinline__ float load_d(const float *p) { return *p; }
__device__ __forceinline__ float load_d(const __nv_bfloat16 *p) { return __bfloat162float(*p); }

__device__ __forceinline__ void store_pair(float *out, float v0, float v1) {
  *reinterpret_cast<float2 *>(out) = make_float2(v0, v1);
}
__device__ __forceinline__ void store_pair(__nv_bfloat16 *out, float v0, float v1) {
  *reinterpret_cast<__nv_bfloat162 *>(out) = __floats2bfloat162_rn(v0, v1);
}

// Writes this thread's accumulators of tile column block nb to D (rows row0 and row0 + 8 of the
// fragment), times the per-tensor scales where there are some, plus D's old value
// (accumulate) and the bias, in fp32. Fragment element i: row row0 + 8 * ((i >> 1) & 1), column
// 8 * (i / 4) + 2 * (lane % 4) + (i & 1) of its half; pairs (i, i + 1) are adjacent columns. N
// is even, so a pair is in or out.
template <typename DT, int kHalves, bool kBlockScaled>
__device__ __forceinline__ void store_tile(const Params &p, const float (&acc)[kHalves][64], int row0,
                                           int nb, int lane) {
  DT *d = static_cast<DT *>(p.d);
  const float tensor_scale = kBlockScaled ? 1.0f : __ldg(p.sa) * __ldg(p.sb);
#pragma unroll
  for (int h = 0; h < kHalves; ++h) {
    const int col0 = nb * Width<kHalves>::kBlockN + h * 128 + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < 64; i += 2) {
      const int row = row0 + ((i & 2) ? 8 : 0);
      const int col = col0 + 8 * (i / 4);
      if (row < p.m && col < p.n) {
        DT *out = d + static_cast<size_t>(row) * p.n + col;
        float v0 = acc[h][i], v1 = acc[h][i + 1];
        if constexpr (!kBlockScaled) {
          v0 *= tensor_scale;
          v1 *= tensor_scale;
        }
        if (p.accumulate) {
          v0 += load_d(out);
          v1 += load_d(out + 1);
        }
        if (p.bias != nullptr) {
          v0 += __bfloat162float(p.bias[col]);
          v1 += __bfloat162float(p.bias[col + 1]);
        }
        store_pair(out, v0, v1);
      }
    }
  }
}

// The kernel of one configuration: D's type, the cluster, the overlapped mainloop or not, tiles
// of 128 x (128 * kHalves), block or per-tensor scales.
template <typename DT, Pair kPair, bool kOverlap, int kHalves, bool kBlockScaled>
__global__ void __launch_bounds__(kThreads, 1)
    block_scaled_wgmma_kernel(const __grid_constant__ CUtensorMap map_a,
                              const __grid_constant__ CUtensorMap map_b, const Params p) {
  using W = Width<kHalves>;
  static_assert(!kOverlap || (kHalves == 1 && kBlockScaled),
                "the overlapped mainloop promotes block sums of 128-column tiles");
  constexpr int kCluster = kClusterSize<kPair>;
  constexpr uint16_t kBoth = 3;  // the multicast mask of a pair
  extern __shared__ uint8_t shared_raw[];
  uint8_t *shared = reinterpret_cast<uint8_t *>(
      (reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t{1023});
  uint8_t *tiles_a = shared;                              // stage s: s * kTileBytes
  uint8_t *tiles_b = shared + W::kStages * kTileBytes;    // stage s: s * kHalves * kTileBytes
  uint64_t *full = reinterpret_cast<uint64_t *>(tiles_b + W::kStages * kHalves * kTileBytes);
  uint64_t *empty = full + W::kStages;

  const int warpgroup = threadIdx.x / 128;
  const uint32_t rank = kCluster > 1 ? ptx::cluster_cta_rank() : 0;
  const int cluster = blockIdx.x / kCluster;
  const int clusters = gridDim.x / kCluster;

  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&map_a);
    ptx::prefetch_tensor_map(&map_b);
    for (int s = 0; s < W::kStages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kConsumerWarps * kCluster);
    }
    ptx::fence_barrier_init();
  }
  if (kCluster > 1) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  if (warpgroup == 0) {
    ptx::registers_release<kProducerRegisters>();
    if (threadIdx.x == 0) {
      Ring<W::kStages> ring;
      for (int t = cluster; t < p.tiles; t += clusters) {
        int mb, nb;
        tile_at<kPair>(p, t, rank, &mb, &nb);
        for (int kb = 0; kb < p.kblocks; ++kb) {
          const int stage = ring.stage;
          ptx::mbarrier_wait(&empty[stage], ring.phase ^ 1);
          ptx::mbarrier_arrive_expect_bytes(&full[stage], W::kStageBytes);
          uint8_t *a = tiles_a + stage * kTileBytes;
          uint8_t *b = tiles_b + stage * kHalves * kTileBytes;
          if constexpr (kPair == Pair::kAlongN) {
            constexpr int kRows = kBlockM / 2;  // this CTA's share of the A tile
            ptx::tma_load_2d_multicast(a + rank * kRows * kBlockK, &map_a, &full[stage],
                                       kb * kBlockK, mb * kBlockM + static_cast<int>(rank) * kRows,
                                       kBoth);
          } else {
            ptx::tma_load_2d(a, &map_a, &full[stage], kb * kBlockK, mb * kBlockM);
          }
          if constexpr (kPair == Pair::kAlongM) {
            constexpr int kRows = W::kBlockN / 2;  // this CTA's share of the B tile
            ptx::tma_load_2d_multicast(b + rank * kRows * kBlockK, &map_b, &full[stage],
                                       kb * kBlockK, nb * W::kBlockN + static_cast<int>(rank) * kRows,
                                       kBoth);
          } else {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              ptx::tma_load_2d(b + h * kTileBytes, &map_b, &full[stage], kb * kBlockK,
                               nb * W::kBlockN + h * 128);
            }
          }
          ring.advance();
        }
      }
    }
  } else {
    ptx::registers_claim<kConsumerRegisters>();
    const int half = warpgroup - 1;  // rows 64 * half .. of the tile
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    Ring<W::kStages> ring;
    // Block sums: one set, or two when the next block's WGMMAs overlap this one's promotion.
    float part[64], part2[kOverlap ? 64 : 1];
#pragma unroll
    for (int i = 0; i < 64; ++i) part[i] = 0.0f;
#pragma unroll
    for (int i = 0; i < (kOverlap ? 64 : 1); ++i) part2[i] = 0.0f;

    for (int t = cluster; t < p.tiles; t += clusters) {
      int mb, nb;
      tile_at<kPair>(p, t, rank, &mb, &nb);
      // This thread's two rows of the WGMMA fragment: row0 and row0 + 8.
      const int row0 = mb * kBlockM + half * 64 + warp * 16 + lane / 4;
      Scales scales[kHalves];
#pragma unroll
      for (int h = 0; h < kHalves && kBlockScaled; ++h) {
        scales[h].a0 = p.sa + static_cast<size_t>(min(row0, p.m - 1)) * p.kblocks;
        scales[h].a1 = p.sa + static_cast<size_t>(min(row0 + 8, p.m - 1)) * p.kblocks;
        scales[h].b = p.sb + static_cast<size_t>(min(nb * kHalves + h, p.sb_rows - 1)) * p.kblocks;
      }
      const uint8_t *a = tiles_a + half * 64 * kBlockK;

      float acc[kHalves][64];
#pragma unroll
      for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
      }

      const ConsumerStages at{a, tiles_b, full, empty, lane};
      if constexpr (!kBlockScaled) {
        tensor_mainloop<kCluster, kHalves>(acc, ring, at, p.kblocks);
      } else if constexpr (!kOverlap) {
        serial_mainloop<kCluster, kHalves>(acc, part, scales, ring, at, p.kblocks);
      } else {
        overlapped_mainloop<kCluster>(acc[0], part, part2, scales[0], ring, at, p.kblocks);
      }
      if (nb < p.n_blocks) store_tile<DT, kHalves, kBlockScaled>(p, acc, row0, nb, lane);
    }
  }
  // No CTA leaves while its cluster partner may still deliver to its shared memory or arrive on
  // its barriers. (The producer warp's lanes meet first: the cluster barrier is warp-aligned.)
  if constexpr (kCluster > 1) {
    __syncwarp();
    ptx::cluster_sync();
  }
}

// One instantiation of the kernel, as a value (with_config passes it to a generic lambda).
template <typename DT, Pair kPair, bool kOverlap, int kHalves, bool kBlockScaled>
struct Config {};

// The launch configuration of the kernel (its shared-memory limit raised first), for a grid of
// `clusters` clusters.
template <typename DT, Pair kPair, bool kOverlap, int kHalves, bool kBlockScaled>
te_status configure(const char *op, cudaStream_t stream, int clusters, cudaLaunchAttribute *attribute,
                    cudaLaunchConfig_t *config) {
  constexpr int kCluster = kClusterSize<kPair>;
  auto *kernel = block_scaled_wgmma_kernel<DT, kPair, kOverlap, kHalves, kBlockScaled>;
  if (te_status st = cuda_status(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                          static_cast<int>(Width<kHalves>::kSharedBytes)))) {
    return st;
  }
  *attribute = cudaLaunchAttribute{};
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = kCluster;
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  *config = cudaLaunchConfig_t{};
  config->gridDim = dim3(static_cast<unsigned>(clusters * kCluster));
  config->blockDim = dim3(kThreads);
  config->dynamicSmemBytes = Width<kHalves>::kSharedBytes;
  config->stream = stream;
  config->attrs = attribute;
  config->numAttrs = 1;
  return TE_SUCCESS;
}

template <typename DT, Pair kPair, bool kOverlap, int kHalves, bool kBlockScaled>
te_status launch(const char *op, Config<DT, kPair, kOverlap, kHalves, kBlockScaled>, const GemmArgs &g,
                 cudaStream_t stream, WgmmaOptions o) {
  CUtensorMap map_a, map_b;
  constexpr int kCluster = kClusterSize<kPair>;
  // Boxes: a pair's shared tile in halves, B's unshared tile in 128-row halves.
  const uint32_t box_a = kPair == Pair::kAlongN ? kBlockM / 2 : kBlockM;
  const uint32_t box_b = kPair == Pair::kAlongM ? Width<kHalves>::kBlockN / 2 : 128;
  if (te_status st = make_fp8_operand_map(op, "A", &map_a, g.a.data, g.m, g.k, box_a)) return st;
  if (te_status st = make_fp8_operand_map(op, "B", &map_b, g.b.data, g.n, g.k, box_b)) return st;

  Params p{};
  p.m = static_cast<int>(g.m);
  p.n = static_cast<int>(g.n);
  p.kblocks = static_cast<int>(ceil_div(g.k, int64_t{kBlockK}));
  p.m_blocks = static_cast<int>(ceil_div(g.m, int64_t{kBlockM}));
  p.n_blocks = static_cast<int>(ceil_div(g.n, int64_t{Width<kHalves>::kBlockN}));
  p.sb_rows = static_cast<int>(ceil_div(g.n, int64_t{128}));
  p.rows = kPair == Pair::kAlongM ? (p.m_blocks + 1) / 2 : p.m_blocks;
  p.columns = kPair == Pair::kAlongN ? (p.n_blocks + 1) / 2 : p.n_blocks;
  p.tiles = p.rows * p.columns;
  p.group_m = o.group_m < 1 ? 1 : o.group_m;
  p.sa = g.a.scale_inv;
  p.sb = g.b.scale_inv;
  p.d = g.d;
  p.bias = static_cast<const __nv_bfloat16 *>(g.bias);
  p.accumulate = g.accumulate ? 1 : 0;

  // One CTA per SM by default, as CUTLASS's persistent kernels size their grids (the first GPU
  // run took the grid from cudaOccupancyMaxActiveClusters; the sweep times both).
  int clusters = o.clusters;
  if (clusters <= 0) {
    int sms = 0;
    if (te_status st = sm_count(op, &sms)) return st;
    clusters = sms / kCluster > 0 ? sms / kCluster : 1;
  }
  if (clusters > p.tiles) clusters = p.tiles;
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config;
  if (te_status st = configure<DT, kPair, kOverlap, kHalves, kBlockScaled>(op, stream, clusters, &attribute, &config)) {
    return st;
  }
  auto *kernel = block_scaled_wgmma_kernel<DT, kPair, kOverlap, kHalves, kBlockScaled>;
  if (te_status st = cuda_status(op, cudaLaunchKernelEx(&config, kernel, map_a, map_b, p))) return st;
  return launch_status(op);
}

// Options the kernel has an instantiation for, else a clear error.
te_status check_options(const char *op, WgmmaOptions o, bool blocked) {
  if (o.cluster_n != 1 && o.cluster_n != 2) {
    return fail(TE_ERROR_VALUE, op, "cluster_n must be 1 or 2, got " + std::to_string(o.cluster_n));
  }
  if (o.cluster_m != 1 && o.cluster_m != 2) {
    return fail(TE_ERROR_VALUE, op, "cluster_m must be 1 or 2, got " + std::to_string(o.cluster_m));
  }
  if (o.cluster_m == 2 && (o.cluster_n == 2 || o.block_n != 256)) {
    return fail(TE_ERROR_VALUE, op, "cluster_m = 2 takes cluster_n = 1 and block_n = 256");
  }
  if (o.block_n != 128 && o.block_n != 256) {
    return fail(TE_ERROR_VALUE, op, "block_n must be 128 or 256, got " + std::to_string(o.block_n));
  }
  if (!blocked && o.overlap) {
    return fail(TE_ERROR_VALUE, op,
                "per-tensor scales have no overlapped mainloop (there are no block sums to "
                "promote): set overlap = false");
  }
  if (o.block_n == 256 && o.overlap) {
    return fail(TE_ERROR_VALUE, op,
                "block_n 256 has no overlapped mainloop (a second set of block sums does not fit "
                "in registers): set overlap = false");
  }
  return TE_SUCCESS;
}

// Block-scaled (A 1x128, B 128x128) or per-tensor (both [1]) scales, else a clear error.
te_status scaling_of(const char *op, const GemmArgs &g, bool *blocked) {
  *blocked = g.a.mode == TE_SCALING_BLOCK_1X128 && g.b.mode == TE_SCALING_BLOCK_128X128;
  if (*blocked || (g.a.mode == TE_SCALING_TENSOR && g.b.mode == TE_SCALING_TENSOR)) return TE_SUCCESS;
  return fail(TE_ERROR_UNSUPPORTED, op,
              "the hand-written kernel takes A 1x128 with B 128x128 block scales, or per-tensor "
              "scales on both");
}

template <typename DT, Pair kPair, bool kOverlap, int kHalves, bool kBlockScaled>
te_status resident(const char *op, Config<DT, kPair, kOverlap, kHalves, kBlockScaled>, int *clusters) {
  cudaLaunchAttribute attribute;
  cudaLaunchConfig_t config;
  if (te_status st = configure<DT, kPair, kOverlap, kHalves, kBlockScaled>(op, nullptr, 1, &attribute, &config)) {
    return st;
  }
  auto *kernel = block_scaled_wgmma_kernel<DT, kPair, kOverlap, kHalves, kBlockScaled>;
  return cuda_status(op, cudaOccupancyMaxActiveClusters(clusters, kernel, &config));
}

// fn(Config<...>{}) for the instantiation that options o ask for, with block or per-tensor
// scales (`blocked`), once check_options has accepted them: the one list of instantiations.
template <typename DT, typename Fn>
te_status with_config(const char *op, WgmmaOptions o, bool blocked, Fn fn) {
  if (te_status st = check_options(op, o, blocked)) return st;
  const bool pair = o.cluster_n == 2;
  if (!blocked) {
    if (o.cluster_m == 2) return fn(Config<DT, Pair::kAlongM, false, 2, false>{});
    if (o.block_n == 256) {
      return pair ? fn(Config<DT, Pair::kAlongN, false, 2, false>{}) : fn(Config<DT, Pair::kNone, false, 2, false>{});
    }
    return pair ? fn(Config<DT, Pair::kAlongN, false, 1, false>{}) : fn(Config<DT, Pair::kNone, false, 1, false>{});
  }
  if (o.cluster_m == 2) return fn(Config<DT, Pair::kAlongM, false, 2, true>{});
  if (o.block_n == 256) {
    return pair ? fn(Config<DT, Pair::kAlongN, false, 2, true>{}) : fn(Config<DT, Pair::kNone, false, 2, true>{});
  }
  if (o.overlap) {
    return pair ? fn(Config<DT, Pair::kAlongN, true, 1, true>{}) : fn(Config<DT, Pair::kNone, true, 1, true>{});
  }
  return pair ? fn(Config<DT, Pair::kAlongN, false, 1, true>{}) : fn(Config<DT, Pair::kNone, false, 1, true>{});
}

template <typename DT>
te_status launch_d(const char *op, const GemmArgs &g, cudaStream_t stream, WgmmaOptions o) {
  bool blocked = true;
  if (te_status st = scaling_of(op, g, &blocked)) return st;
  return with_config<DT>(op, o, blocked, [&](auto config) { return launch(op, config, g, stream, o); });
}

}  // namespace

te_status block_scaled_wgmma_gemm(const char *op, const GemmArgs &g, cudaStream_t stream,
                                  WgmmaOptions options) {
  if (g.d_dtype == TE_DTYPE_FLOAT32) return launch_d<float>(op, g, stream, options);
  return launch_d<__nv_bfloat16>(op, g, stream, options);
}

te_status block_scaled_wgmma_resident_clusters(const char *op, WgmmaOptions o, int *clusters) {
  return with_config<__nv_bfloat16>(op, o, true, [&](auto config) { return resident(op, config, clusters); });
}

}  // namespace hopper
}  // namespace te
