// Our hand-written Hopper (sm_90a) kernel for the block-scaled FP8 GEMM (block_scaled_wgmma.cu):
// TMA, warp-specialized producer and consumer warpgroups, WGMMA with the per-128-block promotion
// of the DeepSeek-V3 recipe, a persistent tile loop. It computes what hopper_block_scaled_gemm
// does (block_scaled_gemm.h states the problem and hopper_block_scaled_gemm_support the calls it
// takes) without CUTLASS's mainloop.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_WGMMA_H_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_WGMMA_H_

#include <cuda_runtime.h>

#include "gemm/gemm_impl.h"

namespace te {
namespace hopper {

// The defaults (128 x 128 tiles, single CTAs, overlapped) are the fastest configuration on
// small problems; on large ones block_n = 256 with cluster_m = 2 is, by about 10%
// (benchmarks/results/hopper_block_scaled_sweep_f139d55_h100.json).
struct WgmmaOptions {
  // CTAs of a cluster along N that share each A tile (TMA multicast): 1 or 2.
  int cluster_n = 1;
  // Tile order: the persistent loop walks column-major within groups of this many 128-row
  // blocks, so that the CTAs running at once share A and B tiles in L2.
  int group_m = 2;
  // Two sets of block sums per consumer thread: the WGMMAs of k-block kb + 1 are issued before
  // block kb is promoted (64 more registers per thread).
  bool overlap = true;
  // Clusters launched: 0 for one CTA per SM (the SM count / the cluster's CTAs), else this many.
  int clusters = 0;
  // The tile's width: 128, or 256 (two 128-column halves per k-block, each A tile from L2
  // serving twice the work; no overlapped form: set overlap = false).
  int block_n = 128;
  // CTAs of a cluster along M that share each B tile (TMA multicast): 1, or 2 with
  // cluster_n = 1 and block_n = 256 (whose B tile is the larger operand tile).
  int cluster_m = 1;
};

// Runs g (accepted by hopper_block_scaled_gemm_support) on the current device, which must be an
// sm_90, and stream, in op's name. It also takes g with per-tensor scales on both operands
// (otherwise the same calls): D = sa * sb * (A B^T, the tensor cores' own fp32 accumulation
// over all of K, as cuBLASLt's fast accumulation), the base for our per-tensor and grouped
// kernels; the overlapped form does not apply there (overlap must be false).
te_status block_scaled_wgmma_gemm(const char *op, const GemmArgs &g, cudaStream_t stream,
                                  WgmmaOptions options = {});

// How many clusters of the kernel (bf16 D) cudaOccupancyMaxActiveClusters says fit on the current
// device at once (for the sweep, which times grids of that size against the default).
te_status block_scaled_wgmma_resident_clusters(const char *op, WgmmaOptions options, int *clusters);

}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_WGMMA_H_
