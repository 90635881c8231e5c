// C entry points te_hopper_grouped_gemm and te_hopper_grouped_gemm_workspace_size
// (grouped_gemm.h): te_grouped_gemm's checks (each group by te_gemm's rules through
// resolve_gemm, then the groups together), then the Hopper grouped kernel, never cuBLASLt. For
// tests and benchmarks; te_grouped_gemm's own dispatch is untouched.
#include <string>
#include <vector>

#include "common/internal.h"
#include "gemm/hopper/grouped_gemm.h"

namespace te {
namespace {

constexpr const char *kOp = "hopper_grouped_gemm";

// The buffers of one resolved group that the call writes and reads, named for the overlap check.
void add_buffers(const te_tensor *a, const te_tensor *b, te_tensor *d, const te_tensor *bias, const GemmArgs &g,
                 size_t group, std::vector<Checker::Named> *outputs, std::vector<Checker::Named> *inputs) {
  const std::string at = "group " + std::to_string(group) + " ";
  const te_buffer *none = nullptr;
  outputs->push_back({slot(d, TE_SLOT_DATA), at + "d.data"});
  outputs->push_back({g.d_amax != nullptr ? slot(d, TE_SLOT_AMAX) : none, at + "d.amax"});
  outputs->push_back({g.d_scale_inv != nullptr ? slot(d, TE_SLOT_SCALE_INV) : none, at + "d.scale_inv"});
  inputs->push_back({slot(a, TE_SLOT_DATA), at + "a.data"});
  inputs->push_back({slot(b, TE_SLOT_DATA), at + "b.data"});
  inputs->push_back({g.fp8 ? slot(a, TE_SLOT_SCALE_INV) : none, at + "a.scale_inv"});
  inputs->push_back({g.fp8 ? slot(b, TE_SLOT_SCALE_INV) : none, at + "b.scale_inv"});
  inputs->push_back({is_fp8(g.d_dtype) ? slot(d, TE_SLOT_SCALE) : none, at + "d.scale"});
  inputs->push_back({bias != nullptr ? slot(bias, TE_SLOT_DATA) : none, at + "bias.data"});
}

te_status resolve_and_run(const te_tensor *const *a, const te_tensor *const *b, te_tensor *const *d,
                          const te_tensor *const *bias, size_t groups, const te_gemm_config *config,
                          void *workspace, size_t workspace_size, te_stream stream) {
  Checker check(kOp);
  if (groups > 0 && (a == nullptr || b == nullptr || d == nullptr)) {
    return check.reject(TE_ERROR_VALUE, "a, b and d must be arrays of groups handles, got a NULL array");
  }
  te_gemm_config cfg{0, 1, 0, 0, 0};
  if (config != nullptr) cfg = *config;
  if (cfg.gelu) {
    return check.reject(TE_ERROR_VALUE, "config.gelu must be 0 (no GELU epilogue in a grouped GEMM), got " +
                                            std::to_string(cfg.gelu));
  }
  std::vector<GemmArgs> args(groups);
  std::vector<Checker::Named> outputs, inputs;
  te_device_type device = TE_DEVICE_CPU;
  int device_id = 0;
  for (size_t i = 0; i < groups; ++i) {
    const std::string name = std::string(kOp) + ": group " + std::to_string(i);
    Checker group(name.c_str());
    const te_tensor *bias_i = bias != nullptr ? bias[i] : nullptr;
    if (!resolve_gemm(group, a[i], b[i], d[i], bias_i, nullptr, cfg, &args[i])) return group.status();
    if (i > 0 && (group.device() != device || group.device_id() != device_id)) {
      return check.reject(TE_ERROR_VALUE, "every group must be on the device of group 0, got group " +
                                              std::to_string(i) + " on another");
    }
    device = group.device();
    device_id = group.device_id();
    args[i].workspace = workspace;
    args[i].workspace_size = workspace != nullptr ? workspace_size : 0;
    args[i].device = device_id;
    add_buffers(a[i], b[i], d[i], bias_i, args[i], i, &outputs, &inputs);
  }
  // One launch runs every group at once: no output may meet any group's buffers.
  if (!check.disjoint(outputs, inputs)) return check.status();
  if (groups == 0) return TE_SUCCESS;
  if (device != TE_DEVICE_CUDA) {
    return check.reject(TE_ERROR_VALUE, "the groups must be on a CUDA device (the kernel has no CPU path), got "
                                        "group 0 on the CPU");
  }
  CudaDeviceScope on_device(device_id);
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

}  // extern "C"
