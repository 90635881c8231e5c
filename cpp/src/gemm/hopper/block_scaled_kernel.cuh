// The CUTLASS kernel of the block-scaled FP8 GEMM for one D type and one configuration (tile,
// cluster, schedule, tile scheduler), and its launch from te_gemm's resolved arguments.
//
// block_scaled_gemm.cu instantiates the configuration te_gemm runs (kProductionConfig there says
// why it is that one); cpp/tests/hopper/sweep_block_scaled_gemm.cu instantiates others to time
// them against it on a GPU. Included only by CUDA files compiled for sm_90a with CUTLASS.
//
// The problem and the scale layouts are block_scaled_gemm.cu's (its top comment): A [M, K] E4M3
// row-major with BLOCK_1X128 scales, B [N, K] E4M3 row-major with BLOCK_128X128 scales, D [M, N]
// row-major; scale granularity (M, N, K) = (1, 128, 128), both scale tensors K-major.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_KERNEL_CUH_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/numeric_types.h"

#include "common/cuda_utils.cuh"
#include "common/internal.h"
#include "gemm/gemm_impl.h"
#include "gemm/hopper/hopper_common.cuh"

namespace te {
namespace hopper {

// The two warp-specialized schedules of the blockwise mainloop: cooperative (both consumer
// warpgroups on one tile, 64 rows each) and pingpong (one tile per warpgroup, one warpgroup's
// promotion and epilogue overlapping the other's MMAs).
struct Cooperative {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
  static constexpr const char *kName = "cooperative";
};
struct Pingpong {
  using Mainloop = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::TmaWarpSpecialized;
  static constexpr const char *kName = "pingpong";
};

// The persistent tile schedulers: data-parallel (each CTA walks whole tiles) or stream-K
// (the last wave's K range split between CTAs, for shapes with few tiles).
struct Persistent {
  using Scheduler = cutlass::gemm::PersistentScheduler;
  static constexpr const char *kName = "persistent";
};
struct StreamK {
  using Scheduler = cutlass::gemm::StreamKScheduler;
  static constexpr const char *kName = "stream_k";
};

// A configuration: the CTA tile (M x N; K is always the 128-wide scale block), the cluster
// (M x N CTAs), the schedule and the tile scheduler. The tile's N must be a multiple of B's
// 128-row scale block.
template <int TileM, int TileN, int ClusterM, int ClusterN, class Schedule, class Scheduler = Persistent>
struct BlockScaledConfig {
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::_128>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using ScheduleT = Schedule;
  using SchedulerT = typename Scheduler::Scheduler;
  static_assert(TileN % 128 == 0, "the tile's N must hold whole 128-row scale blocks of B");
  static std::string name() {
    return std::to_string(TileM) + "x" + std::to_string(TileN) + "x128 cluster " + std::to_string(ClusterM) +
           "x" + std::to_string(ClusterN) + " " + Schedule::kName + " " + Scheduler::kName;
  }
};

// The runtime choices of the persistent schedulers, left to CUTLASS by default: the order in
// which a CTA walks the output tiles (raster along M or N; 0 lets CUTLASS pick by shape) and
// the swizzle that groups neighbouring tiles (1 = none).
struct LaunchOptions {
  int raster = 0;  // 0 heuristic, 1 along M, 2 along N
  int swizzle = 1;
};

// The kernel for one D element type (float or cutlass::bfloat16_t) and configuration.
template <typename ElementD, typename Config>
struct BlockScaledKernel {
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;

  // Scale granularity (M, N, K) = (1, 128, 128), both scale tensors K-major.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using ElementAB = cutlass::float_e4m3_t;
  using ElementBias = cutlass::bfloat16_t;
  static constexpr int kAlignmentAB = 16;                     // elements: 16 bytes for TMA
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);   // elements: 16 bytes for TMA

  // D = alpha * acc + bias[n] + beta * C, computed in fp32, C of D's type.
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<ElementD, float, ElementBias, ElementD, float>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      ElementD, cutlass::layout::RowMajor, kAlignmentD,
      ElementD, cutlass::layout::RowMajor, kAlignmentD,
      typename Config::ScheduleT::Epilogue, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, kAlignmentAB,
      ElementAB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, kAlignmentAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::ScheduleT::Mainloop>::CollectiveOp;

  // Problem shape (M, N, K, L).
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, typename Config::SchedulerT>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Runs the GEMM of g (which hopper_block_scaled_gemm_support has accepted) with the kernel of
// ElementD and Config on the current device and stream, in op's name.
template <typename ElementD, typename Config>
te_status run_block_scaled(const char *op, const GemmArgs &g, cudaStream_t stream, LaunchOptions options = {}) {
  using K = BlockScaledKernel<ElementD, Config>;
  using Gemm = typename K::Gemm;
  using StrideA = typename K::Kernel::StrideA;
  using StrideB = typename K::Kernel::StrideB;
  using StrideC = typename K::Kernel::StrideC;
  using StrideD = typename K::Kernel::StrideD;
  using Raster = typename Gemm::GemmKernel::TileScheduler::RasterOrderOptions;

  const int m = static_cast<int>(g.m), n = static_cast<int>(g.n), k = static_cast<int>(g.k);
  // Row pitches in elements; the batch stride (L = 1) is the matrix size.
  const StrideA stride_a = cute::make_stride(g.k, cute::Int<1>{}, g.m * g.k);
  const StrideB stride_b = cute::make_stride(g.k, cute::Int<1>{}, g.n * g.k);
  const StrideC stride_c = cute::make_stride(g.n, cute::Int<1>{}, g.m * g.n);
  const StrideD stride_d = cute::make_stride(g.n, cute::Int<1>{}, g.m * g.n);
  const auto problem = cute::make_shape(m, n, k, 1);

  int sms = 0;
  if (te_status st = sm_count(op, &sms)) return st;

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = problem;
  args.mainloop.ptr_A = static_cast<const typename K::ElementAB *>(g.a.data);
  args.mainloop.dA = stride_a;
  args.mainloop.ptr_B = static_cast<const typename K::ElementAB *>(g.b.data);
  args.mainloop.dB = stride_b;
  args.mainloop.ptr_SFA = g.a.scale_inv;
  args.mainloop.layout_SFA = K::ScaleConfig::tile_atom_to_shape_SFA(problem);
  args.mainloop.ptr_SFB = g.b.scale_inv;
  args.mainloop.layout_SFB = K::ScaleConfig::tile_atom_to_shape_SFB(problem);
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = g.accumulate ? 1.0f : 0.0f;
  args.epilogue.thread.bias_ptr = static_cast<const typename K::ElementBias *>(g.bias);  // null: 0
  // C is D (in place). With beta = 0 the epilogue does not load it; it still gets a valid
  // address, which its TMA descriptor is made from.
  args.epilogue.ptr_C = static_cast<const ElementD *>(g.d);
  args.epilogue.dC = stride_c;
  args.epilogue.ptr_D = static_cast<ElementD *>(g.d);
  args.epilogue.dD = stride_d;
  args.hw_info.device_id = g.device;
  args.hw_info.sm_count = sms;
  args.scheduler.raster_order = options.raster == 1   ? Raster::AlongM
                                : options.raster == 2 ? Raster::AlongN
                                                      : Raster::Heuristic;
  args.scheduler.max_swizzle_size = options.swizzle;

  if (cutlass::Status s = Gemm::can_implement(args); s != cutlass::Status::kSuccess) {
    return cutlass_failure(op, "can_implement", s);
  }
  const size_t workspace = Gemm::get_workspace_size(args);
  if (workspace > 0 && (g.workspace == nullptr || g.workspace_size < workspace)) {
    return fail(TE_ERROR_VALUE, op, "workspace must hold " + std::to_string(workspace) + " bytes, got " +
                                        std::to_string(g.workspace_size));
  }
  Gemm gemm;
  // initialize() builds the TMA descriptors and raises the kernel's shared-memory limit.
  if (cutlass::Status s = gemm.initialize(args, g.workspace, stream); s != cutlass::Status::kSuccess) {
    return cutlass_failure(op, "initialize", s);
  }
  if (cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess) {
    launch_status(op);  // clears a pending launch error; the CUTLASS status is the message
    return cutlass_failure(op, "launch", s);
  }
  return launch_status(op);
}

}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_KERNEL_CUH_
