// The te_eager operators that the whole-block operators (blocks.cpp, attention_block.cpp) are
// made of: each is a step of a fused block, callable on its own from Python and composed here
// in C++. Their contracts are at their definitions (fused_forward.cpp, linear.cpp, blocks.cpp);
// the schemas in library.cpp. Each returns a status first (common.h: guarded), which `ok`
// turns back into an exception inside a composing operator, whose own guard reports it.
#pragma once

#include "common.h"

namespace te_eager {

extern thread_local std::string last_error_message;  // (library.cpp)

// Throws the error of a composed operator that returned a nonzero status.
inline void ok(int64_t status) {
  if (status != 0) throw std::runtime_error(last_error_message);
}

std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear_fp8_forward(
    Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps, bool zero_centered_gamma,
    Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col, int64_t stream_handle);

std::tuple<int64_t, Tensor, Tensor, Tensor> act_linear_fp8_forward(
    Tensor h, int64_t act, Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history,
    Tensor workspace, bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col,
    int64_t stream_handle);

std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> linear_fp8_forward(
    Tensor input, Tensor weight, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad, bool own_buffers,
    int64_t stream_handle);

std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_linear_fp8_forward(
    Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps, bool zero_centered_gamma,
    Tensor weight, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace, bool current,
    int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad, int64_t stream);

std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
layernorm_mlp_fp8_forward(Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps,
                          bool zero_centered_gamma, Tensor w1, std::optional<Tensor> b1, int64_t act, Tensor w2,
                          std::optional<Tensor> b2, Tensor scales, Tensor history, Tensor workspace, bool current,
                          int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad1,
                          bool need_fc1, bool need_wgrad2, int64_t stream);

std::tuple<int64_t, Tensor, Tensor, Tensor> linear_fp8_backward(
    Tensor grad_output, std::optional<Tensor> act_input, int64_t act, Tensor x_sinv, Tensor w_sinv, Tensor x_col,
    Tensor w_col, Tensor grad_history, Tensor grad_scale, Tensor grad_scale_inv, int64_t column, bool update,
    Tensor workspace, bool current, int64_t fwd_dtype, int64_t bwd_dtype, bool pow2, double epsilon, int64_t algo,
    int64_t margin, bool need_dgrad, bool need_wgrad, ScalarType input_dtype, ScalarType weight_dtype,
    std::optional<ScalarType> bias_dtype, int64_t stream_handle);

}  // namespace te_eager
