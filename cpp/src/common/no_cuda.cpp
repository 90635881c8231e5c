// Stand-ins for the CUDA launchers in a CPU-only build (CMake drops this file when the
// kernels are compiled): a CUDA buffer gets a clear error instead of a missing symbol.
#include "activation/activation_impl.h"
#include "attention/attention_math.h"
#include "common/internal.h"
#include "dropout/dropout_impl.h"
#include "gemm/gemm_impl.h"
#include "norm/norm_impl.h"
#include "quantize/quantize_impl.h"
#include "rope/rope_impl.h"
#include "scaling/scaling_impl.h"
#include "transpose/transpose_impl.h"

namespace te {

te_status activation_cuda(const ActivationArgs &, te_stream) { return no_cuda_build("activation"); }
te_status quantize_cuda(const QuantizeArgs &, te_stream) { return no_cuda_build("quantize"); }
te_status quantize_many_cuda(const QuantizeArgs *, size_t, te_stream) { return no_cuda_build("quantize_many"); }
te_status dequantize_cuda(const DequantizeArgs &, te_stream) { return no_cuda_build("dequantize"); }
te_status compute_amax_cuda(const AmaxArgs &, te_stream) { return no_cuda_build("compute_amax"); }
te_status scale_from_amax_cuda(const ScaleFromAmaxArgs &, te_stream) {
  return no_cuda_build("compute_scale_from_amax");
}
te_status delayed_scaling_update_cuda(const DelayedScalingArgs &, te_stream) {
  return no_cuda_build("delayed_scaling_update");
}
te_status transpose_cuda(const TransposeArgs &, te_stream) { return no_cuda_build("transpose"); }
te_status gemm_cuda(const GemmArgs &, te_stream) { return no_cuda_build("gemm"); }
size_t gemm_workspace_size() { return 0; }
te_status copy_to_host_cuda(void *, const void *, size_t, int, te_stream) {
  return no_cuda_build("grouped_gemm_ragged");
}
te_status zero_cuda(void *, size_t, te_stream) { return no_cuda_build("grouped_gemm_ragged"); }
te_status scratch_alloc_cuda(size_t, te_stream, void **) { return no_cuda_build("grouped_gemm_ragged"); }
te_status scratch_free_cuda(void *, te_stream) { return no_cuda_build("grouped_gemm_ragged"); }
te_status norm_forward_cuda(const NormForwardArgs &, te_stream) { return no_cuda_build("norm_forward"); }
te_status norm_backward_cuda(const NormBackwardArgs &, te_stream) { return no_cuda_build("norm_backward"); }
te_status attention_forward_cuda(const AttentionForwardArgs &, te_stream) { return no_cuda_build("attention_forward"); }
te_status attention_backward_cuda(const AttentionBackwardArgs &, te_stream) {
  return no_cuda_build("attention_backward");
}
size_t attention_backward_cuda_workspace_size(const AttentionShape &) { return 0; }
te_status scaled_softmax_forward_cuda(const SoftmaxForwardArgs &, te_stream) {
  return no_cuda_build("scaled_softmax_forward");
}
te_status scaled_softmax_backward_cuda(const SoftmaxBackwardArgs &, te_stream) {
  return no_cuda_build("scaled_softmax_backward");
}
te_status dropout_cuda(const DropoutArgs &args, te_stream) {
  return no_cuda_build(args.residual != nullptr ? "dropout_add_forward" : "dropout");
}
te_status rope_cuda(const RopeArgs &args, te_stream) {
  return no_cuda_build(args.backward ? "rope_backward" : "rope_forward");
}
CudaDeviceScope::CudaDeviceScope(int) {}
CudaDeviceScope::~CudaDeviceScope() {}

}  // namespace te
