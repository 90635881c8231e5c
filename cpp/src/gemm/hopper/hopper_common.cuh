// What the CUTLASS-based Hopper kernels (src/gemm/hopper) share: CUTLASS's status as the core's
// error, and the check that the current device is the sm_90 they are compiled for.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_HOPPER_COMMON_CUH_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_HOPPER_COMMON_CUH_

#include <cuda_runtime.h>

#include <string>

#include "common/cuda_utils.cuh"
#include "common/internal.h"
#include "cutlass/cutlass.h"

namespace te {
namespace hopper {

// A CUTLASS call's failure in op's name: a shape or alignment it refuses is unsupported, the
// rest a runtime error.
inline te_status cutlass_failure(const char *op, const char *what, cutlass::Status s) {
  return fail(s == cutlass::Status::kErrorMisalignedOperand || s == cutlass::Status::kErrorInvalidProblem
                  ? TE_ERROR_UNSUPPORTED
                  : TE_ERROR_RUNTIME,
              op, std::string("CUTLASS ") + what + " failed: " + cutlass::cutlassGetStatusString(s));
}

// The current device (into *device) must be an sm_90: the kernels are compiled for sm_90a only.
inline te_status check_sm90(const char *op, int *device) {
  if (te_status st = cuda_status(op, cudaGetDevice(device))) return st;
  const int sm = device_sm(*device);
  if (sm != 90) {
    return fail(TE_ERROR_UNSUPPORTED, op,
                "the device must be an sm_90 (Hopper; the kernel is built for sm_90a only), got " +
                    (sm < 0 ? std::string("one whose compute capability cannot be read")
                            : "sm_" + std::to_string(sm)));
  }
  return TE_SUCCESS;
}

}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_HOPPER_COMMON_CUH_
