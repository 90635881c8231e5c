// What each variant object of the block-scaled GEMM sweep gives the sweep's main program: its
// configuration's name and a launch of its kernel (bf16 D) from te_gemm's resolved arguments.
#ifndef TE_TESTS_HOPPER_SWEEP_VARIANT_H_
#define TE_TESTS_HOPPER_SWEEP_VARIANT_H_

#include <cuda_runtime.h>

#include <string>

#include "gemm/gemm_impl.h"

namespace sweep {

struct Variant {
  std::string name;
  // Stream-K: a tile's k-blocks may be shared by several CTAs, whose partial sums are added in
  // another order than one CTA's; its D is then compared within a tolerance, not bit for bit.
  bool splits_k;
  // raster: 0 CUTLASS's pick, 1 along M, 2 along N; swizzle: 1 (none), 2, 4 or 8
  te_status (*run)(const te::GemmArgs &, cudaStream_t, int raster, int swizzle);
  // false: the kernel has no raster option (only raster 0 is timed; swizzle picks its own
  // tile-order option instead)
  bool has_raster = true;
  // Per-tensor scales (the hand-written kernel's per-tensor form): timed on per-tensor operands
  // and checked against cuBLASLt's per-tensor GEMM with fast accumulation (within a bound: the
  // two add the same products in their own orders).
  bool per_tensor = false;
};

constexpr int kSweepVariants = 7;  // sweep_variant.cu's indices 0 .. 6; 0 is te_gemm's

}  // namespace sweep

sweep::Variant sweep_variant_0();
sweep::Variant sweep_variant_1();
sweep::Variant sweep_variant_2();
sweep::Variant sweep_variant_3();
sweep::Variant sweep_variant_4();
sweep::Variant sweep_variant_5();
sweep::Variant sweep_variant_6();

#endif  // TE_TESTS_HOPPER_SWEEP_VARIANT_H_
