// Grouped GEMM on Hopper (sm_90a) in one launch: CUTLASS's pointer-array grouped kernel
// (GroupProblemShape, KernelPtrArrayTmaWarpSpecializedCooperative), behind te_grouped_gemm's
// resolved arguments.
//
// The problem, for every group g (row-major, as gemm.h states it):
//   D_g [M_g, N_g] = alpha_g * (A_g [M_g, K_g] @ B_g [N_g, K_g]^T) (+ bias_g [N_g])
// with alpha_g = sa_g * sb_g, the product of the group's per-tensor scale_inv values, for FP8
// operands, and 1 for bf16 operands. A_g is row-major (K contiguous), B_g too ([N, K], "TN"),
// D_g row-major. In CUTLASS's terms each group is its own (M, N, K) GEMM with A row-major, B
// column-major and D row-major, no transposition; M, N and K may differ from group to group
// (in the MoE case only M does).
//
// How one launch runs them all:
// - The kernel takes device arrays indexed by group: problem shapes (M, N, K), pointers to A, B
//   and D, and their row strides. They are laid out in the caller's workspace, after CUTLASS's
//   own part (per-SM copies of the TMA descriptors, which each CTA rewrites when it moves on to
//   another group's tiles). The host writes all the arrays into one pinned staging buffer and
//   copies them with one cudaMemcpyAsync; then the kernel is launched. Nothing waits for the
//   device (see argument_staging.cu for how the staging buffer outlives its copy).
// - The persistent group tile scheduler (PersistentTileSchedulerSm90Group) launches at most one
//   CTA per SM and walks the tiles of every group in order; groups with M = 0 have no tiles (the
//   host leaves them out of the arrays altogether). The grid is sized from the host copy of the
//   problem shapes, which CUTLASS reads while the call is being set up.
// - Epilogue (an epilogue visitor tree, since CUTLASS's prebuilt pointer-array fusions have no
//   bias): D = alpha * acc + bias, in fp32, rounded once to D's type (an FMA: this file is
//   compiled with contraction, cmake/cutlass.cmake). alpha is a scalar broadcast that reads two
//   pointer arrays (each group's A and B scale_inv) and multiplies them, per tile, on the device:
//   the scales never travel to the host and need no kernel of their own. For bf16 both factors
//   are the literal 1. The bias is a row broadcast reading a pointer array (one bias per group),
//   or the constant 0 when no group has one. C is void: D is never read.
//
// Kernels, one per (operands, D): E4M3 -> bf16, E4M3 -> fp32, bf16 -> bf16; all cooperative
// (two consumer warpgroups share a tile's rows), with a 1x2 cluster: the two CTAs of a cluster
// take neighbouring N tiles of the same rows and A's tile is multicast to both, which halves
// A's loads from L2 and costs nothing in the MoE shapes (N = 4096 or 7168: no odd N tile). A
// cluster along M would waste a CTA on every group whose row count ends in half a cluster.
// - FP8: tile 128x128x128. The FP8 mainloop of CUTLASS (not its FP8FastAccum schedule) sums each
//   k-tile's four k32 WGMMAs in a separate set of accumulators and adds them to the fp32
//   accumulators after each k-tile (mma_promotion_interval = 4 MMAs = 128 of K): the tensor
//   cores' reduced accumulation precision (about 14 bits, see the test) then applies to sums of
//   128 products only, whatever K is. That is te_gemm's split accumulator; fast accumulation
//   (cuBLASLt without split) lets the tensor cores sum all of K. The two accumulator sets take
//   64 + 64 registers per thread at 128x128, which is why the tile is not 128x256 (256
//   registers: over the 232 a consumer warpgroup gets). Six pipeline stages of 32 KiB. A
//   FastAccum instantiation at 128x256 for config.use_split_accumulator = 0 is the first variant
//   to measure (README.md).
// - bf16: tile 128x256x64, the usual Hopper bf16 shape: 128 fp32 accumulators per thread, four
//   pipeline stages of 48 KiB.
// The pingpong schedule (KernelPtrArrayTmaWarpSpecializedPingpong: one warpgroup per tile, the
// two alternating between MMA and epilogue) is the other variant to measure.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/functional.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/numeric_types.h"

#include "common/cuda_utils.cuh"
#include "common/internal.h"
#include "gemm/hopper/argument_staging.h"
#include "gemm/hopper/grouped_gemm.h"
#include "gemm/hopper/hopper_common.cuh"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "The Hopper grouped GEMM needs CUDA 12.3 or newer (CUTLASS's device-side TMA descriptor updates)"
#endif

namespace te {
namespace {

constexpr const char *kOp = "hopper_grouped_gemm";

// The SMs the workspace is sized for: CUTLASS keeps A, B and D descriptors per SM. Hopper parts
// have at most 132; a larger device would run on the first 256 (the persistent grid just
// gets smaller).
constexpr int kMaxSms = 256;
constexpr size_t kWorkspaceAlign = 256;  // the workspace base; CUTLASS's descriptors need 64
constexpr size_t kArrayAlign = 16;       // each argument array

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;
// Row stride of a K-major A or B, or of a row-major D: (row pitch, 1, no batch).
using PackedStride = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;

namespace fusion = cutlass::epilogue::fusion;

// One kernel: operand element ElementAB (A and B), output ElementD, tile and cluster shapes.
template <typename ElementAB_, typename ElementD_, typename TileShape_>
struct GroupedKernel {
  using ElementAB = ElementAB_;
  using ElementD = ElementD_;
  using TileShape = TileShape_;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  static constexpr bool kFp8 = sizeof(ElementAB) == 1;
  static constexpr int kAlignmentAB = 16 / sizeof(ElementAB);  // elements: 16 bytes for TMA
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);

  // alpha = scale_a[g] * scale_b[g] (two pointer arrays, multiplied), or literals.
  using Alpha = fusion::Sm90ScalarBroadcastPtrArray<float, cute::Stride<cute::_0, cute::_0, int64_t>, 2>;
  // bias_g [N] broadcast over the rows; a pointer array (the L stride is 0: each group's
  // pointer is its own row), or 0 when the array pointer is null.
  using Bias = fusion::Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t *, float,
                                        cute::Stride<cute::_0, cute::_1, cute::_0>>;
  // D = alpha * acc + bias, computed in fp32, rounded to ElementD to nearest even.
  using Epilogue =
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float,
                                          cutlass::FloatRoundStyle::round_to_nearest>,
                      Alpha, fusion::Sm90AccFetch, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor *, kAlignmentD,
      ElementD, cutlass::layout::RowMajor *, kAlignmentD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Epilogue>::CollectiveOp;

  // With E4M3 operands the builder picks the promoting FP8 mainloop
  // (MainloopSm90ArrayTmaGmmaWarpSpecializedFP8), with bf16 the plain one.
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAB, cutlass::layout::RowMajor *, kAlignmentAB,
      ElementAB, cutlass::layout::ColumnMajor *, kAlignmentAB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // The argument arrays are written as PackedStride (array_layout, fill_arguments).
  static_assert(std::is_same_v<typename Kernel::InternalStrideA, PackedStride> &&
                std::is_same_v<typename Kernel::InternalStrideB, PackedStride> &&
                std::is_same_v<typename Kernel::InternalStrideD, PackedStride>);
};

using TileFp8 = cute::Shape<cute::_128, cute::_128, cute::_128>;
using TileBf16 = cute::Shape<cute::_128, cute::_256, cute::_64>;
using Fp8ToBf16 = GroupedKernel<cutlass::float_e4m3_t, cutlass::bfloat16_t, TileFp8>;
using Fp8ToFp32 = GroupedKernel<cutlass::float_e4m3_t, float, TileFp8>;
using Bf16ToBf16 = GroupedKernel<cutlass::bfloat16_t, cutlass::bfloat16_t, TileBf16>;

enum class Kind { kFp8ToBf16, kFp8ToFp32, kBf16ToBf16 };

const char *kind_name(Kind k) {
  switch (k) {
    case Kind::kFp8ToBf16: return "float8_e4m3 -> bfloat16";
    case Kind::kFp8ToFp32: return "float8_e4m3 -> float32";
    default: return "bfloat16 -> bfloat16";
  }
}

std::string num(int64_t v) { return std::to_string(v); }
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
bool aligned(const void *p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
bool has_work(const GemmArgs &g) { return g.m > 0 && g.n > 0; }

// --- workspace ---------------------------------------------------------------------------------

// CUTLASS's part of the workspace for kernel K with kMaxSms SMs (its descriptors; the
// epilogue tree and the group scheduler take none). Host arithmetic only.
template <typename K>
size_t cutlass_workspace_bound() {
  typename K::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.hw_info.sm_count = kMaxSms;
  return K::Gemm::get_workspace_size(args);
}

// Bytes reserved for CUTLASS at the front of the workspace: the most any kernel asks.
size_t cutlass_reserve() {
  static const size_t bytes = round_up(std::max({cutlass_workspace_bound<Fp8ToBf16>(),
                                                 cutlass_workspace_bound<Fp8ToFp32>(),
                                                 cutlass_workspace_bound<Bf16ToBf16>()}),
                                       kWorkspaceAlign);
  return bytes;
}

// Offsets (from the start of the argument arrays) of each array, for `groups` groups.
struct ArrayLayout {
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, scale_a, scale_b, bias, bytes;
};

ArrayLayout array_layout(size_t groups) {
  size_t at = 0;
  auto next = [&](size_t each) {
    const size_t start = at;
    at = round_up(at + each * groups, kArrayAlign);
    return start;
  };
  ArrayLayout l{};
  l.shapes = next(sizeof(GroupShape));
  l.ptr_a = next(sizeof(void *));
  l.ptr_b = next(sizeof(void *));
  l.ptr_d = next(sizeof(void *));
  l.stride_a = next(sizeof(PackedStride));
  l.stride_b = next(sizeof(PackedStride));
  l.stride_d = next(sizeof(PackedStride));
  l.scale_a = next(sizeof(const float *));
  l.scale_b = next(sizeof(const float *));
  l.bias = next(sizeof(const void *));
  l.bytes = at;
  return l;
}

template <typename T>
void put(uint8_t *base, size_t offset, size_t index, const T &value) {
  std::memcpy(base + offset + index * sizeof(T), &value, sizeof(T));
}

// The argument arrays of the groups `work`, as the kernel reads them, into host memory `out`.
void fill_arguments(const std::vector<const GemmArgs *> &work, const ArrayLayout &l, uint8_t *out) {
  std::memset(out, 0, l.bytes);
  for (size_t i = 0; i < work.size(); ++i) {
    const GemmArgs &g = *work[i];
    put(out, l.shapes, i, GroupShape{static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k)});
    put(out, l.ptr_a, i, g.a.data);
    put(out, l.ptr_b, i, g.b.data);
    put(out, l.ptr_d, i, static_cast<const void *>(g.d));
    put(out, l.stride_a, i, PackedStride{g.k, cute::Int<1>{}, cute::Int<0>{}});  // A [M, K]
    put(out, l.stride_b, i, PackedStride{g.k, cute::Int<1>{}, cute::Int<0>{}});  // B [N, K]
    put(out, l.stride_d, i, PackedStride{g.n, cute::Int<1>{}, cute::Int<0>{}});  // D [M, N]
    put(out, l.scale_a, i, g.a.scale_inv);  // null for bf16 (not read)
    put(out, l.scale_b, i, g.b.scale_inv);
    put(out, l.bias, i, g.bias);            // null everywhere when no group has a bias
  }
}

// --- running ----------------------------------------------------------------------------------

template <typename K>
te_status run_kernel(const std::vector<const GemmArgs *> &work, uint8_t *workspace, int device,
                     cudaStream_t stream) {
  using Gemm = typename K::Gemm;
  using ElementAB = typename K::ElementAB;
  using ElementD = typename K::ElementD;
  const size_t groups = work.size();
  const ArrayLayout layout = array_layout(groups);
  uint8_t *arrays = workspace + cutlass_reserve();
  auto at = [&](size_t offset) { return static_cast<void *>(arrays + offset); };

  // The shapes on the host too: CUTLASS checks them (can_implement) and sizes the grid from
  // them (initialize, run); the kernel reads the device copy.
  std::vector<GroupShape> host_shapes(groups);
  bool any_bias = false;
  for (size_t i = 0; i < groups; ++i) {
    const GemmArgs &g = *work[i];
    host_shapes[i] = GroupShape{static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k)};
    any_bias = any_bias || g.bias != nullptr;
  }

  int sms = 0;
  if (te_status st = sm_count(kOp, &sms)) return st;

  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{static_cast<int32_t>(groups), static_cast<GroupShape *>(at(layout.shapes)),
                                    host_shapes.data()};
  args.mainloop.ptr_A = static_cast<const ElementAB **>(at(layout.ptr_a));
  args.mainloop.dA = static_cast<PackedStride *>(at(layout.stride_a));
  args.mainloop.ptr_B = static_cast<const ElementAB **>(at(layout.ptr_b));
  args.mainloop.dB = static_cast<PackedStride *>(at(layout.stride_b));
  if constexpr (K::kFp8) args.mainloop.mma_promotion_interval = 4;  // every k-tile (see the top)

  auto &alpha = args.epilogue.thread.op_0;
  alpha.scalars[0] = 1.0f;
  alpha.scalars[1] = 1.0f;
  if constexpr (K::kFp8) {
    alpha.scalar_ptr_arrays[0] = static_cast<const float *const *>(at(layout.scale_a));
    alpha.scalar_ptr_arrays[1] = static_cast<const float *const *>(at(layout.scale_b));
  }
  // A nonzero L stride: a per-group scalar, read with the tile's group index.
  alpha.dScalar[0] = {cute::_0{}, cute::_0{}, 1};
  alpha.dScalar[1] = {cute::_0{}, cute::_0{}, 1};
  auto &bias = args.epilogue.thread.op_2;
  bias.ptr_row = any_bias ? static_cast<const cutlass::bfloat16_t *const *>(at(layout.bias)) : nullptr;
  bias.null_default = cutlass::bfloat16_t(0.0f);
  args.epilogue.ptr_C = nullptr;  // void C: D is not read
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = static_cast<ElementD **>(at(layout.ptr_d));
  args.epilogue.dD = static_cast<PackedStride *>(at(layout.stride_d));
  args.hw_info.device_id = device;
  args.hw_info.sm_count = std::min(sms, kMaxSms);

  if (cutlass::Status s = Gemm::can_implement(args); s != cutlass::Status::kSuccess) {
    return hopper::cutlass_failure(kOp, "can_implement", s);
  }
  const size_t needed = Gemm::get_workspace_size(args);
  if (needed > cutlass_reserve()) {  // cannot happen with sm_count <= kMaxSms; checked anyway
    return fail(TE_ERROR_RUNTIME, kOp, "CUTLASS asks for " + num(static_cast<int64_t>(needed)) +
                                           " bytes of workspace, more than the " +
                                           num(static_cast<int64_t>(cutlass_reserve())) + " reserved");
  }
  if (te_status st = hopper::copy_arguments(arrays, layout.bytes, device, stream,
                                    [&](uint8_t *host) { fill_arguments(work, layout, host); })) {
    return st;
  }
  Gemm gemm;
  // initialize() builds the (placeholder) TMA descriptors that each CTA copies into its slot of
  // the workspace and rewrites per group, and raises the kernel's shared-memory limit.
  if (cutlass::Status s = gemm.initialize(args, workspace, stream); s != cutlass::Status::kSuccess) {
    return hopper::cutlass_failure(kOp, "initialize", s);
  }
  if (cutlass::Status s = gemm.run(stream); s != cutlass::Status::kSuccess) {
    launch_status(kOp);  // clears a pending launch error; the CUTLASS status is the message
    return hopper::cutlass_failure(kOp, "launch", s);
  }
  return launch_status(kOp);
}

// The kernel of one group with work, or a reason in *why.
bool group_kind(const GemmArgs &g, Kind *kind, std::string *why) {
  if (g.a.transposed || !g.b.transposed) {
    *why = "the layout must be A [M, K] and B [N, K] (transpose_a = 0, transpose_b = 1)";
    return false;
  }
  if (g.fp8) {
    if (g.a.dtype != TE_DTYPE_FLOAT8_E4M3 || g.b.dtype != TE_DTYPE_FLOAT8_E4M3) {
      *why = std::string("FP8 operands must both be float8_e4m3, got ") + te_dtype_name(g.a.dtype) + " x " +
             te_dtype_name(g.b.dtype);
      return false;
    }
    if (g.a.mode != TE_SCALING_TENSOR || g.b.mode != TE_SCALING_TENSOR) {
      *why = std::string("FP8 operands must have per-tensor scales (tensor x tensor), got ") +
             scaling_mode_name(g.a.mode) + " x " + scaling_mode_name(g.b.mode);
      return false;
    }
    if (is_fp8(g.d_dtype) || g.d_scale_inv != nullptr) {
      *why = std::string("an FP8 D is not produced, got d ") + te_dtype_name(g.d_dtype);
      return false;
    }
    if (g.d_dtype != TE_DTYPE_BFLOAT16 && g.d_dtype != TE_DTYPE_FLOAT32) {
      *why = std::string("D must be bfloat16 or float32 with FP8 operands, got ") + te_dtype_name(g.d_dtype);
      return false;
    }
    *kind = g.d_dtype == TE_DTYPE_BFLOAT16 ? Kind::kFp8ToBf16 : Kind::kFp8ToFp32;
    return true;
  }
  if (g.a.dtype != TE_DTYPE_BFLOAT16 || g.b.dtype != TE_DTYPE_BFLOAT16) {
    *why = std::string("the operands must be float8_e4m3 (per-tensor scales) or bfloat16, got ") +
           te_dtype_name(g.a.dtype) + " x " + te_dtype_name(g.b.dtype);
    return false;
  }
  if (g.d_dtype != TE_DTYPE_BFLOAT16) {
    *why = std::string("D must be bfloat16 with bfloat16 operands, got ") + te_dtype_name(g.d_dtype);
    return false;
  }
  *kind = Kind::kBf16ToBf16;
  return true;
}

// The rest of one group's requirements (see grouped_gemm.h), or "".
std::string group_limits(const GemmArgs &g) {
  if (g.accumulate) return "accumulation into D (config.accumulate) is not supported";
  if (g.gelu || g.pre_gelu != nullptr) return "GELU is not fused";
  if (g.d_amax != nullptr) return "amax is not produced";
  if (g.bias != nullptr && g.bias_dtype != TE_DTYPE_BFLOAT16) {
    return std::string("bias must be bfloat16, got ") + te_dtype_name(g.bias_dtype);
  }
  if (g.k <= 0) return "K must be positive, got " + num(g.k);
  // CUTLASS's problem shapes hold 32-bit extents.
  if (g.m > INT_MAX || g.n > INT_MAX || g.k > INT_MAX) {
    return "M, N and K must be below 2^31, got " + num(g.m) + ", " + num(g.n) + ", " + num(g.k);
  }
  // TMA: 16-byte aligned base addresses and row pitches (K and N of 16 cover every type here).
  if (g.k % 16 != 0) return "K must be a multiple of 16, got " + num(g.k);
  if (g.n % 16 != 0) return "N must be a multiple of 16, got " + num(g.n);
  if (!aligned(g.a.data, 16) || !aligned(g.b.data, 16) || !aligned(g.d, 16)) {
    return "A, B and D must be 16-byte aligned";
  }
  if (g.fp8 && (g.a.scale_inv == nullptr || g.b.scale_inv == nullptr)) return "FP8 operands need scale_inv";
  if ((g.fp8 && (!aligned(g.a.scale_inv, 4) || !aligned(g.b.scale_inv, 4))) || !aligned(g.bias, 2)) {
    return "scale_inv and bias must be aligned to their element size";
  }
  return "";
}

te_status run_groups(const GemmArgs *groups, size_t n, void *workspace, size_t workspace_size, te_stream stream) {
  const std::string why = hopper_grouped_gemm_support(groups, n);
  if (!why.empty()) return fail(TE_ERROR_UNSUPPORTED, kOp, "the kernel does not take this call: " + why);
  int device = 0;
  if (te_status st = hopper::check_sm90(kOp, &device)) return st;
  std::vector<const GemmArgs *> work;
  for (size_t i = 0; i < n; ++i) {
    if (has_work(groups[i])) work.push_back(&groups[i]);
  }
  if (work.empty()) return TE_SUCCESS;
  const size_t need = hopper_grouped_gemm_workspace_size(n);
  if (workspace == nullptr || workspace_size < need) {
    return fail(TE_ERROR_VALUE, kOp, "workspace must hold " + num(static_cast<int64_t>(need)) + " bytes for " +
                                         num(static_cast<int64_t>(n)) + " groups, got " +
                                         (workspace == nullptr ? std::string("none")
                                                               : num(static_cast<int64_t>(workspace_size))));
  }
  if (!aligned(workspace, kWorkspaceAlign)) {
    return fail(TE_ERROR_VALUE, kOp, "workspace must be 256-byte aligned");
  }
  Kind kind = Kind::kBf16ToBf16;
  std::string unused;
  group_kind(*work.front(), &kind, &unused);
  uint8_t *ws = static_cast<uint8_t *>(workspace);
  const cudaStream_t s = cuda_stream(stream);
  switch (kind) {
    case Kind::kFp8ToBf16: return run_kernel<Fp8ToBf16>(work, ws, device, s);
    case Kind::kFp8ToFp32: return run_kernel<Fp8ToFp32>(work, ws, device, s);
    default: return run_kernel<Bf16ToBf16>(work, ws, device, s);
  }
}

}  // namespace

std::string hopper_grouped_gemm_support(const GemmArgs *groups, size_t n) {
  if (n > static_cast<size_t>(INT_MAX)) return "the group count must be below 2^31";
  const GemmArgs *first = nullptr;  // the first group with work
  size_t first_index = 0;
  Kind first_kind = Kind::kBf16ToBf16;
  for (size_t i = 0; i < n; ++i) {
    const GemmArgs &g = groups[i];
    if (!has_work(g)) continue;
    const std::string at = "group " + std::to_string(i) + ": ";
    Kind kind;
    std::string why;
    if (!group_kind(g, &kind, &why)) return at + why;
    why = group_limits(g);
    if (!why.empty()) return at + why;
    if (first == nullptr) {
      first = &g;
      first_index = i;
      first_kind = kind;
      continue;
    }
    if (kind != first_kind) {
      return at + "every group must be of one kind (one kernel per launch): group " + std::to_string(first_index) +
             " is " + kind_name(first_kind) + ", this one " + kind_name(kind);
    }
    if ((g.bias != nullptr) != (first->bias != nullptr)) {
      return at + "a bias must be given for every group with rows or for none (the kernel reads one per group): "
                  "group " + std::to_string(first_index) + (first->bias != nullptr ? " has one" : " has none") +
             ", this one " + (g.bias != nullptr ? "has one" : "has none");
    }
  }
  return "";
}

size_t hopper_grouped_gemm_workspace_size(size_t groups) {
  return cutlass_reserve() + round_up(array_layout(groups).bytes, kWorkspaceAlign);
}

te_status hopper_grouped_gemm(const GemmArgs *groups, size_t n, void *workspace, size_t workspace_size,
                              te_stream stream) {
  return run_groups(groups, n, workspace, workspace_size, stream);
}

}  // namespace te
