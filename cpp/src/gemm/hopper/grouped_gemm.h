// Our own Hopper (sm_90a) grouped GEMM: every group of te_grouped_gemm in one launch of a CUTLASS
// pointer-array kernel (GroupProblemShape, KernelPtrArrayTmaWarpSpecializedCooperative), for
// the experts of a mixture-of-experts layer. Compiled only when the build finds CUTLASS's
// headers (cmake/cutlass.cmake, which defines TE_WITH_CUTLASS), and only for sm_90a.
//
// te_grouped_gemm does not call it yet: on CUDA its groups still run one cuBLASLt GEMM each,
// until the choice between the two has been measured on an H200 (README.md beside this file).
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_GROUPED_GEMM_H_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_GROUPED_GEMM_H_

#include <cstddef>
#include <string>

#include "gemm/gemm_impl.h"
#include "transformer_engine/hopper_gemm.h"  // the C entry points

namespace te {

// "" when the kernel takes these resolved te_grouped_gemm groups, else the reason in a few
// words (naming the group). Groups with M = 0 or N = 0 write nothing and are not looked at
// further. Every other group must be, in te_gemm's terms:
//   - A [M, K] and B [N, K] (transpose_a = 0, transpose_b = 1: "TN");
//   - either FP8 E4M3 x E4M3 with per-tensor scales (each group its own scale_inv pair), D
//     bfloat16 or float32 (any config.use_split_accumulator: the kernel promotes its partial
//     sums to fp32 every 128 of K, which is what the split accumulator asks for and more than
//     fast accumulation does), or bfloat16 x bfloat16 with a bfloat16 D;
//     all groups of one call of the same kind (one kernel per launch);
//   - no accumulation into D, no GELU, no amax, no FP8 D;
//   - a bfloat16 bias [N] in every group or in none;
//   - K > 0, and K and N multiples of 16; M, N, K below 2^31;
//   - A, B and D 16-byte aligned (TMA), scale_inv and bias aligned to their element size.
// The device is not looked at here (hopper_grouped_gemm checks that it is an sm_90).
std::string hopper_grouped_gemm_support(const GemmArgs *groups, size_t n);

inline bool hopper_grouped_gemm_supports(const GemmArgs *groups, size_t n) {
  return hopper_grouped_gemm_support(groups, n).empty();
}

// Bytes of device workspace that hopper_grouped_gemm needs for `groups` groups (the count passed
// to it, empty groups included): the per-SM TMA descriptors of CUTLASS's pointer-array kernel
// (sized for up to 256 SMs), then the groups' problem shapes, pointers and strides: 128 KiB
// plus about 84 bytes per group, which te_gemm_workspace_size() covers many times over.
// Needs no device.
size_t hopper_grouped_gemm_workspace_size(size_t groups);

// Runs the groups on the current device (which must hold every buffer) and stream, with one
// host-to-device copy of the arguments into the workspace and one kernel launch; nothing waits
// for the device. workspace must be device memory of at least
// hopper_grouped_gemm_workspace_size(n) bytes, 256-byte aligned, and not in use by other work
// on another stream while the call runs. Returns TE_ERROR_UNSUPPORTED with the reason, and
// launches nothing, for groups it does not take or a device that is not an sm_90;
// TE_ERROR_VALUE for a missing or short workspace. Groups with nothing to compute (M or N 0)
// are skipped; when no group is left nothing is launched.
te_status hopper_grouped_gemm(const GemmArgs *groups, size_t n, void *workspace, size_t workspace_size,
                              te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_GROUPED_GEMM_H_
