// The te_eager library: torch operators for the eager FP8 fast paths, on the LibTorch stable
// ABI.
//
// Why compiled code: a small layer's step is bound by host time, and in Python that time is
// spent around the kernels, not in them (benchmarks/results/host_probes.md). te.Linear's FP8
// forward (linear.cpp), a norm or an activation with the FP8 GEMM after it (fused_forward.cpp),
// the backward of any per-tensor FP8 linear layer (linear.cpp), LayerNormLinear's and
// LayerNormMLP's whole forward and whole backward (blocks.cpp, composed of the others), a
// Transformer layer's whole forward, its attention half's forward and that half's projection
// and attention backward (attention_block.cpp) and delayed scaling's scale update (here) are
// each one call into the core's C API, with outputs from torch's allocator.
// Each computes what the Python steps compute, with the same core calls and arguments (so the
// same bits), for the inputs its Python caller accepts; it checks them again and fails (never
// writes) on anything else.
//
// Why the stable ABI: these files include only torch/csrc/stable and torch/headeronly, and are
// compiled with TORCH_TARGET_VERSION set to the oldest supported torch release (setup.py), so
// one binary loads under that release and every later one. The autograd nodes stay in Python:
// the stable ABI has no C++ autograd.
//
// The schemas are here, the library's interface in one place; each operator's file registers
// its kernel. Failures come back as a status and last_error() (common.h, guarded).
#include "common.h"

namespace te_eager {

thread_local std::string last_error_message;

int64_t caught(const char *op) {
  try {
    throw;
  } catch (const std::exception &e) {
    last_error_message = e.what();
  } catch (...) {
    last_error_message = std::string(op) + ": unknown error";
  }
  return 1;
}

namespace {

std::string last_error() { return last_error_message; }

// Delayed scaling's update of histories[i], scales[i], scale_invs[i] in one core call (what
// ops.delayed_scaling_update does), for the autocast exit and the backward in eager mode.
void scale_update(std::vector<Tensor> histories, std::vector<Tensor> scales, std::vector<Tensor> scale_invs,
                            int64_t fp8_dtype, int64_t algo, int64_t margin, int64_t stream_handle) {
  constexpr const char *op = "te_eager.delayed_scaling_update";
  const size_t n = histories.size();
  TE_EAGER_CHECK(scales.size() == n && scale_invs.size() == n, op,
                  ": histories, scales and scale_invs must be as many, got ", n, ", ", scales.size(), " and ",
                  scale_invs.size());
  if (n == 0) return;
  std::deque<Handle> handles;  // (a deque: handles do not move)
  std::vector<te_tensor *> h(n), s(n), si(n);
  for (size_t i = 0; i < n; ++i) {
    for (const Tensor *t : {&histories[i], &scales[i], &scale_invs[i]}) {
      TE_EAGER_CHECK(t->scalar_type() == ScalarType::Float && t->is_contiguous(), op,
                      ": histories, scales and scale_invs must be contiguous float32 tensors");
    }
    h[i] = handles.emplace_back(op).set(TE_SLOT_DATA, whole(histories[i], TE_DTYPE_FLOAT32)).get();
    s[i] = handles.emplace_back(op).set(TE_SLOT_DATA, whole(scales[i], TE_DTYPE_FLOAT32)).get();
    si[i] = handles.emplace_back(op).set(TE_SLOT_DATA, whole(scale_invs[i], TE_DTYPE_FLOAT32)).get();
  }
  check(te_delayed_scaling_update(h.data(), s.data(), si.data(), n, static_cast<te_dtype>(fp8_dtype),
                                  static_cast<te_amax_compute_algo>(algo), static_cast<int32_t>(margin),
                                  reinterpret_cast<te_stream>(stream_handle)),
        op);
}

int64_t delayed_scaling_update(std::vector<Tensor> histories, std::vector<Tensor> scales,
                               std::vector<Tensor> scale_invs, int64_t fp8_dtype, int64_t algo, int64_t margin,
                               int64_t stream) {
  try {
    scale_update(std::move(histories), std::move(scales), std::move(scale_invs), fp8_dtype, algo, margin, stream);
    return 0;
  } catch (...) {
    return caught("te_eager.delayed_scaling_update");
  }
}

}  // namespace
}  // namespace te_eager

STABLE_TORCH_LIBRARY(te_eager, m) {
  m.def(
      "linear_fp8_forward(Tensor input, Tensor weight, Tensor? bias, Tensor scales, Tensor(a!) history, "
      "Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, float epsilon, bool need_dgrad, "
      "bool need_wgrad, bool own_buffers, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "linear_fp8_backward(Tensor grad_output, Tensor? act_input, int act, Tensor x_sinv, Tensor w_sinv, "
      "Tensor x_col, Tensor w_col, Tensor(a!) grad_history, Tensor(b!) grad_scale, Tensor(c!) grad_scale_inv, "
      "int column, bool update, Tensor(d!) workspace, bool current, int fwd_dtype, int bwd_dtype, bool pow2, "
      "float epsilon, int algo, int margin, "
      "bool need_dgrad, bool need_wgrad, ScalarType input_dtype, ScalarType weight_dtype, "
      "ScalarType? bias_dtype, int stream) -> (int, Tensor, Tensor, Tensor)");
  m.def(
      "norm_linear_fp8_forward(Tensor input, Tensor gamma, Tensor? beta, int norm, float eps, "
      "bool zero_centered_gamma, Tensor w_data, Tensor w_sinv, Tensor? bias, Tensor scales, "
      "Tensor(a!) history, Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, float epsilon, "
      "bool need_col, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "act_linear_fp8_forward(Tensor h, int act, Tensor w_data, Tensor w_sinv, Tensor? bias, "
      "Tensor scales, Tensor(a!) history, Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, "
      "float epsilon, bool need_col, int stream) -> (int, Tensor, Tensor, Tensor)");
  m.def(
      "layernorm_linear_fp8_forward(Tensor input, Tensor gamma, Tensor? beta, int norm, float eps, "
      "bool zero_centered_gamma, Tensor weight, Tensor? bias, Tensor scales, Tensor(a!) history, "
      "Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, float epsilon, bool need_dgrad, "
      "bool need_wgrad, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layernorm_linear_fp8_backward(Tensor grad_output, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, "
      "bool has_beta, int norm, bool zero_centered_gamma, Tensor ln_sinv, Tensor ln_col, Tensor w_sinv, "
      "Tensor w_col, Tensor(a!) grad_history, Tensor(b!) grad_scale, Tensor(c!) grad_scale_inv, "
      "Tensor(d!) workspace, bool current, int fwd_dtype, int bwd_dtype, bool pow2, float epsilon, int algo, "
      "int margin, bool need_dgrad, bool need_wgrad, ScalarType weight_dtype, ScalarType? bias_dtype, "
      "Tensor? grad_input_add, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layernorm_mlp_fp8_forward(Tensor input, Tensor gamma, Tensor? beta, int norm, float eps, "
      "bool zero_centered_gamma, Tensor w1, Tensor? b1, int act, Tensor w2, Tensor? b2, Tensor scales, "
      "Tensor(a!) history, Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, float epsilon, "
      "bool need_dgrad, bool need_wgrad1, bool need_fc1, bool need_wgrad2, int stream) -> (int, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layernorm_mlp_fp8_backward(Tensor grad_output, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, "
      "bool has_beta, int norm, bool zero_centered_gamma, Tensor ln_sinv, Tensor ln_col, Tensor w1_sinv, "
      "Tensor w1_col, Tensor h, int act, Tensor a_sinv, Tensor a_col, Tensor w2_sinv, Tensor w2_col, "
      "Tensor(a!) grad_history, Tensor(b!) grad_scale, Tensor(c!) grad_scale_inv, Tensor(d!) workspace, "
      "bool current, int fwd_dtype, int bwd_dtype, bool pow2, float epsilon, int algo, int margin, "
      "bool need_dgrad, bool need_wgrad1, bool need_fc1, bool need_wgrad2, ScalarType w1_dtype, "
      "ScalarType? b1_dtype, ScalarType w2_dtype, ScalarType? b2_dtype, Tensor? grad_input_add, int stream) "
      "-> (int, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "attention_block_fp8_forward(Tensor input, Tensor gamma, Tensor? beta, int norm, float eps, "
      "bool zero_centered_gamma, Tensor w_qkv, Tensor? b_qkv, Tensor w_proj, Tensor? b_proj, Tensor qkv_scales, "
      "Tensor(a!) qkv_history, Tensor proj_scales, Tensor(b!) proj_history, Tensor(c!) workspace, bool current, "
      "int fp8_dtype, bool pow2, float epsilon, int[] views, int[] strides, int layout, int mask, "
      "int window_left, int window_right, float softmax_scale, float dropout, int backend, Tensor attention_rng, "
      "int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_fp8_forward(Tensor input, Tensor gamma, Tensor? beta, int norm, float eps, "
      "bool zero_centered_gamma, Tensor w_qkv, Tensor? b_qkv, Tensor w_proj, Tensor? b_proj, Tensor qkv_scales, "
      "Tensor(a!) qkv_history, Tensor proj_scales, Tensor(b!) proj_history, Tensor(c!) workspace, bool current, "
      "int fp8_dtype, bool pow2, float epsilon, int[] views, int[] strides, int layout, int mask, "
      "int window_left, int window_right, float softmax_scale, float dropout, int backend, Tensor attention_rng, "
      "Tensor gamma2, Tensor? beta2, int norm2, float eps2, bool zero_centered_gamma2, Tensor w1, Tensor? b1, "
      "int act, Tensor w2, Tensor? b2, Tensor mlp_scales, Tensor(d!) mlp_history, float residual_dropout, "
      "Tensor residual_rng1, Tensor residual_rng2, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "attention_block_fp8_backward(Tensor grad_output, Tensor qkv, Tensor o, Tensor lse, Tensor attention_rng, "
      "Tensor x_sinv, Tensor pw_sinv, Tensor x_col, Tensor pw_col, Tensor(a!) grad_history, "
      "Tensor(b!) grad_scale, Tensor(c!) grad_scale_inv, Tensor(d!) workspace, bool current, int fwd_dtype, "
      "int bwd_dtype, bool pow2, float epsilon, int algo, int margin, ScalarType weight_dtype, "
      "ScalarType? bias_dtype, int[] views, int[] strides, int layout, int mask, int window_left, "
      "int window_right, float softmax_scale, float dropout, bool deterministic, int backend, int stream) "
      "-> (int, Tensor, Tensor, Tensor)");
  m.def(
      "delayed_scaling_update(Tensor(a!)[] histories, Tensor(b!)[] scales, Tensor(c!)[] scale_invs, "
      "int fp8_dtype, int algo, int margin, int stream) -> int");
  m.def("last_error() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(te_eager, CompositeExplicitAutograd, m) {
  m.impl("delayed_scaling_update", TORCH_BOX(&te_eager::delayed_scaling_update));
  m.impl("last_error", TORCH_BOX(&te_eager::last_error));
}
