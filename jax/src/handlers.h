// The handler symbols of the extension: two per op (CPU and CUDA), registered by the Python
// package under one target name per op (see module.cpp).
#ifndef TE_JAX_HANDLERS_H_
#define TE_JAX_HANDLERS_H_

#include "xla/ffi/api/c_api.h"

// X(target name, handler symbol prefix): the prefix gets `Cpu` and `Cuda` appended.
#define TE_JAX_FOR_EACH_HANDLER(X)                    \
  X("te_quantize_ffi", TeQuantize)                    \
  X("te_dequantize_ffi", TeDequantize)                \
  X("te_compute_amax_ffi", TeComputeAmax)             \
  X("te_scale_from_amax_ffi", TeScaleFromAmax)        \
  X("te_delayed_scaling_update_ffi", TeDelayedScalingUpdate) \
  X("te_gemm_ffi", TeGemm)                            \
  X("te_grouped_gemm_ffi", TeGroupedGemm)             \
  X("te_norm_forward_ffi", TeNormForward)             \
  X("te_norm_backward_ffi", TeNormBackward)             \
  X("te_activation_forward_ffi", TeActivationForward)   \
  X("te_activation_backward_ffi", TeActivationBackward) \
  X("te_activation_backward_dbias_ffi", TeActivationBackwardDbias) \
  X("te_attention_forward_ffi", TeAttentionForward)     \
  X("te_attention_backward_ffi", TeAttentionBackward)   \
  X("te_attention_forward_packed_ffi", TeAttentionForwardPacked)   \
  X("te_attention_backward_packed_ffi", TeAttentionBackwardPacked) \
  X("te_rope_forward_ffi", TeRopeForward)               \
  X("te_rope_backward_ffi", TeRopeBackward)

namespace te_jax {
#define TE_JAX_DECLARE_HANDLER(target, prefix)                       \
  extern "C" XLA_FFI_Error *prefix##Cpu(XLA_FFI_CallFrame *frame);   \
  extern "C" XLA_FFI_Error *prefix##Cuda(XLA_FFI_CallFrame *frame);
TE_JAX_FOR_EACH_HANDLER(TE_JAX_DECLARE_HANDLER)
#undef TE_JAX_DECLARE_HANDLER
}  // namespace te_jax

#endif  // TE_JAX_HANDLERS_H_
