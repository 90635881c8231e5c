// One configuration of the block-scaled FP8 GEMM kernel (block_scaled_kernel.cuh) for the
// variant sweep (sweep_block_scaled_gemm.cpp). Compiled once per variant, with
// TE_SWEEP_VARIANT set to its index, so that the variants (a minute of nvcc each) build in
// parallel; each object defines sweep_variant_<index>().
#include "gemm/hopper/block_scaled_kernel.cuh"
#include "hopper/sweep_variant.h"

#include <type_traits>

#ifndef TE_SWEEP_VARIANT
#error "compile with -DTE_SWEEP_VARIANT=<index>"
#endif

namespace {

using te::hopper::BlockScaledConfig;
using te::hopper::Cooperative;
using te::hopper::Pingpong;
using te::hopper::StreamK;

// The variants, by index. 0 is what te_gemm runs (block_scaled_gemm.cu's ProductionConfig).
// Tiles are limited by registers: the blockwise mainloop keeps, per consumer thread, the tile's
// accumulators and as many for the k-block's partial sum, so a warpgroup's tile stays at
// 64 x 128 (128 registers); 64 x 256 or a cooperative 256 x 128 would spill.
#if TE_SWEEP_VARIANT == 0
using Config = BlockScaledConfig<128, 128, 1, 2, Cooperative>;
#elif TE_SWEEP_VARIANT == 1
using Config = BlockScaledConfig<128, 128, 2, 1, Cooperative>;
#elif TE_SWEEP_VARIANT == 2
using Config = BlockScaledConfig<128, 128, 1, 1, Cooperative>;
#elif TE_SWEEP_VARIANT == 3
using Config = BlockScaledConfig<64, 128, 1, 2, Pingpong>;
#elif TE_SWEEP_VARIANT == 4
using Config = BlockScaledConfig<64, 128, 2, 1, Pingpong>;
#elif TE_SWEEP_VARIANT == 5
using Config = BlockScaledConfig<64, 128, 1, 1, Pingpong>;
#elif TE_SWEEP_VARIANT == 6
using Config = BlockScaledConfig<128, 128, 1, 2, Cooperative, StreamK>;
#else
#error "TE_SWEEP_VARIANT must be 0 to 6 (sweep_variant.h's kSweepVariants)"
#endif

te_status run(const te::GemmArgs &g, cudaStream_t stream, int raster, int swizzle) {
  return te::hopper::run_block_scaled<cutlass::bfloat16_t, Config>("block_scaled_sweep", g, stream,
                                                                   {raster, swizzle});
}

}  // namespace

#define TE_SWEEP_CAT2(a, b) a##b
#define TE_SWEEP_CAT(a, b) TE_SWEEP_CAT2(a, b)

sweep::Variant TE_SWEEP_CAT(sweep_variant_, TE_SWEEP_VARIANT)() {
  return {Config::name(), std::is_same_v<typename Config::SchedulerT, cutlass::gemm::StreamKScheduler>, &run};
}
