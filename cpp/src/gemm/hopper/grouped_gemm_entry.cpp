// C entry points te_hopper_grouped_gemm and te_hopper_grouped_gemm_workspace_size
// (hopper_gemm.h): te_grouped_gemm's checks (resolve_groups: each group by te_gemm's rules,
// then the groups together), then the Hopper grouped kernel, never cuBLASLt. For
// tests and benchmarks; te_grouped_gemm's own dispatch is untouched.
#include <string>
#include <vector>

#include "common/internal.h"
#include "gemm/hopper/grouped_gemm.h"

namespace te {
namespace {

constexpr const char *kOp = "hopper_grouped_gemm";

te_status resolve_and_run(const te_tensor *const *a, const te_tensor *const *b, te_tensor *const *d,
                          const te_tensor *const *bias, size_t groups, const te_gemm_config *config,
                          void *workspace, size_t workspace_size, te_stream stream) {
  std::vector<GemmArgs> args;
  te_device_type device = TE_DEVICE_CPU;
  if (te_status st = resolve_groups(kOp, a, b, d, bias, groups, config, workspace, workspace_size, &args, &device);
      st != TE_SUCCESS) {
    return st;
  }
  if (groups == 0) return TE_SUCCESS;
  if (device != TE_DEVICE_CUDA) {
    Checker check(kOp);
    return check.reject(TE_ERROR_VALUE, "the groups must be on a CUDA device (the kernel has no CPU path), got "
                                        "group 0 on the CPU");
  }
  CudaDeviceScope on_device(args[0].device);
  return hopper_grouped_gemm(args.data(), groups, workspace, workspace_size, stream);
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_hopper_grouped_gemm(const te_tensor *const *a, const te_tensor *const *b, te_tensor *const *d,
                                 const te_tensor *const *bias, size_t groups, const te_gemm_config *config,
                                 void *workspace, size_t workspace_size, te_stream stream) {
  return te::guarded("hopper_grouped_gemm", [&]() -> te_status {
    return te::resolve_and_run(a, b, d, bias, groups, config, workspace, workspace_size, stream);
  });
}

size_t te_hopper_grouped_gemm_workspace_size(size_t groups) { return te::hopper_grouped_gemm_workspace_size(groups); }

// This file is compiled exactly when the kernels are (cmake/cutlass.cmake);
// hopper_unavailable.cpp returns 0 in every other build.
int te_hopper_gemm_available(void) { return 1; }

}  // extern "C"
