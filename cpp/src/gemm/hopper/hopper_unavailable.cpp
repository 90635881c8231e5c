// The C entry points of hopper_gemm.h in a build without the Hopper kernels (CPU-only, or CUDA
// where cmake/cutlass.cmake did not add them; cpp/CMakeLists.txt compiles this file exactly
// then). They exist so that callers (the Python binding, benchmarks) link and load the same way
// in every build; each fails at once, before looking at its arguments, and writes nothing.
#include "common/internal.h"
#include "transformer_engine/hopper_gemm.h"

namespace te {
namespace {

te_status unavailable(const char *op) {
  return fail(TE_ERROR_UNSUPPORTED, op,
              "this build of the core has no Hopper kernels: built without CUTLASS or not for sm_90a");
}

}  // namespace
}  // namespace te

extern "C" {

int te_hopper_gemm_available(void) { return 0; }

te_status te_hopper_block_scaled_gemm(const te_tensor *, const te_tensor *, te_tensor *, const te_tensor *,
                                      const te_gemm_config *, void *, size_t, te_stream) {
  return te::unavailable("hopper_block_scaled_gemm");
}

te_status te_hopper_grouped_gemm(const te_tensor *const *, const te_tensor *const *, te_tensor *const *,
                                 const te_tensor *const *, size_t, const te_gemm_config *, void *, size_t,
                                 te_stream) {
  return te::unavailable("hopper_grouped_gemm");
}

// 0, not a guess: the real figure starts with what CUTLASS's kernel asks for, which needs its
// headers to compute; hopper_gemm.h documents the 0.
size_t te_hopper_grouped_gemm_workspace_size(size_t) { return 0; }

}  // extern "C"
