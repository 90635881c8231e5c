// The forward steps of the fused blocks in pairs, each one operator call
// (compiled_forward.py): a norm with the FP8 GEMM after it, an activation with the FP8 GEMM
// after it.
#include "operators.h"

namespace te_eager {

constexpr const char *kNormLinear = "te_eager.norm_linear_fp8_forward";

// norm(input) @ weight^T (+ bias), the norm writing the GEMM's FP8 input (layernorm_linear_fn:
// norm_to_fp8 then fp8_gemm, with the same core calls and arguments, so the same bits), for
// LayerNormLinear and LayerNormMLP's first GEMM. input [M, K]; gamma, beta (LayerNorm; none for
// RMSNorm) [K]; `norm` a te_norm_type; the weight already in FP8: w_data [N, K] with w_sinv.
// Delayed scaling casts the norm's output with scales[0] and raises history[0, 0] in the norm's
// own pass; current scaling has the norm write high precision, then casts it with the scale
// of its own amax.
//
// Returns (output [M, N] in input's dtype, the norm output's FP8 scale_inv [1], its column-wise
// copy [K, M] ([0] unless need_col), mu [M] (LayerNorm; [0] for RMSNorm), rsigma [M]).
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear_fp8_forward(
    Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps, bool zero_centered_gamma,
    Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col, int64_t stream_handle) {
  return guarded(kNormLinear, input, [&]() -> std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> {
    const char *op = kNormLinear;
    TE_EAGER_CHECK(input.dim() == 2 && input.is_contiguous() && floating(input.scalar_type()), op,
                   ": input must be a contiguous float32/bfloat16/float16 matrix [M, K]");
    const int64_t m = input.size(0), k = input.size(1), n = w_data.size(0);
    TE_EAGER_CHECK(w_data.dim() == 2 && w_data.size(1) == k && w_data.scalar_type() == ScalarType::Byte &&
                       w_data.is_contiguous(),
                   op, ": the weight's FP8 data must be a contiguous uint8 [N, ", k, "] matrix");
    TE_EAGER_CHECK(m % kGranule == 0 && n % kGranule == 0 && k % kGranule == 0, op,
                   ": M, N and K must be multiples of 16, got M=", m, " N=", n, " K=", k);
    const auto norm_type = static_cast<te_norm_type>(norm);
    const bool layernorm = norm_type == TE_NORM_LAYERNORM;
    TE_EAGER_CHECK(gamma.dim() == 1 && gamma.size(0) == k && gamma.is_contiguous() &&
                       (!beta.has_value() || (beta->dim() == 1 && beta->size(0) == k && beta->is_contiguous())) &&
                       layernorm == beta.has_value(),
                   op, ": gamma (and, for LayerNorm only, beta) must be contiguous [", k, "] vectors");
    TE_EAGER_CHECK(!bias.has_value() || (bias->scalar_type() == input.scalar_type() && bias->dim() == 1 &&
                                         bias->size(0) == n && bias->is_contiguous()),
                   op, ": bias must be a contiguous [", n, "] tensor of the input's dtype");
    const auto fp8 = static_cast<te_dtype>(fp8_dtype);
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    const int32_t u8 = aoti_torch_dtype_uint8(), f32 = aoti_torch_dtype_float32();
    const te_dtype in_dtype = core_dtype(input.scalar_type(), op);
    const te_buffer x = buffer(input.data_ptr(), in_dtype, {m, k}, input);

    // The row-wise FP8 copy (the GEMM's alone), the scalars (scale_inv; current scaling's scale
    // and amax), the column-wise copy (wgrad's), the statistics (mu, then rsigma).
    const Tensor rows = empty({m * k}, u8, input);
    const Tensor scalars = empty({3}, f32, input);
    // (unneeded: [0], the shape of the Python steps' placeholder: a checkpoint's recompute may
    // take those steps and must save tensors of the same shapes)
    const Tensor col_t = need_col ? empty({k, m}, u8, input) : empty({0}, u8, input);
    // (mu and rsigma apart: outputs must not alias, blocks.cpp's custom ops return them)
    const Tensor mu_t = empty({layernorm ? m : 0}, f32, input), rsigma_t = empty({m}, f32, input);
    const Tensor sinv_t = piece(scalars, {1}, 0);
    const te_buffer data = buffer(rows.data_ptr(), fp8, {m, k}, input);
    const te_buffer col = buffer(col_t.data_ptr(), fp8, {k, m}, input);
    const te_buffer sinv = element(scalars, 0);
    Handle in(op), g(op), b(op), mu(op), rsigma(op);
    in.set(TE_SLOT_DATA, x);
    g.set(TE_SLOT_DATA, buffer(gamma.data_ptr(), core_dtype(gamma.scalar_type(), op), {k}, gamma));
    if (layernorm) {
      b.set(TE_SLOT_DATA, buffer(beta->data_ptr(), core_dtype(beta->scalar_type(), op), {k}, gamma));
      mu.set(TE_SLOT_DATA, buffer(mu_t.data_ptr(), TE_DTYPE_FLOAT32, {m}, input));
    }
    rsigma.set(TE_SLOT_DATA, buffer(rsigma_t.data_ptr(), TE_DTYPE_FLOAT32, {m}, input));
    te_norm_config config{};
    config.type = norm_type;
    config.eps = static_cast<float>(eps);
    config.zero_centered_gamma = zero_centered_gamma ? 1 : 0;
    if (!current) {
      Handle q(op);
      q.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, element(scales, 0)).set(TE_SLOT_SCALE_INV, sinv);
      q.set(TE_SLOT_AMAX, element(history, 0));
      if (need_col) q.set(TE_SLOT_COLUMNWISE_DATA, col);
      config.accumulate_amax = 1;  // the step's forwards keep the largest amax
      check(te_norm_forward(&config, in.get(), g.get(), layernorm ? b.get() : nullptr, nullptr, q.get(),
                            layernorm ? mu.get() : nullptr, rsigma.get(), stream),
            op);
    } else {
      const Tensor y_t = empty({m, k}, torch_dtype(input.scalar_type()), input);
      const te_buffer y = buffer(y_t.data_ptr(), in_dtype, {m, k}, input);
      Handle yh(op);
      yh.set(TE_SLOT_DATA, y);
      check(te_norm_forward(&config, in.get(), g.get(), layernorm ? b.get() : nullptr, yh.get(), nullptr,
                            layernorm ? mu.get() : nullptr, rsigma.get(), stream),
            op);
      quantize_current(y, &data, need_col ? &col : nullptr, element(scalars, 1), sinv, element(scalars, 2), pow2,
                       epsilon, stream, op);
    }
    Tensor out = empty({m, n}, torch_dtype(input.scalar_type()), input);
    out = forward_gemm(data, sinv, buffer(w_data.data_ptr(), fp8, {n, k}, w_data), element(w_sinv, 0), bias, out, m, n,
                       workspace, stream, op);
    return {out, sinv_t, col_t, mu_t, rsigma_t};
  });
}

constexpr const char *kActLinear = "te_eager.act_linear_fp8_forward";

// act(h) @ weight^T (+ bias), the activation writing the GEMM's FP8 input (layernorm_mlp_fn:
// act_to_fp8 then fp8_gemm, with the same core calls and arguments, so the same bits), for
// LayerNormMLP's second half. h [M, K] (gated: [M, 2K]); `act` a te_activation; the weight
// already in FP8: w_data [N, K] with w_sinv. Delayed scaling casts with scales[2] and raises
// history[0, 2] (FC2's input column) in the activation's own pass; current scaling takes the
// scale from the activation's amax (an amax-only pass over h), then the same one FP8 pass.
//
// Returns (output [M, N] in h's dtype, the activation output's FP8 scale_inv [1], its
// column-wise copy [K, M] ([0] unless need_col)).
std::tuple<int64_t, Tensor, Tensor, Tensor> act_linear_fp8_forward(
    Tensor h, int64_t act, Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history,
    Tensor workspace, bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col,
    int64_t stream_handle) {
  return guarded(kActLinear, h, [&]() -> std::tuple<Tensor, Tensor, Tensor> {
    const char *op = kActLinear;
    constexpr int64_t kColumn = 2;  // FC2's input in the forward state (base.py)
    const auto activation = static_cast<te_activation>(act);
    TE_EAGER_CHECK(h.dim() == 2 && h.is_contiguous() && floating(h.scalar_type()), op,
                   ": h must be a contiguous float32/bfloat16/float16 matrix");
    const bool gated = te_activation_is_gated(activation) != 0;
    const int64_t m = h.size(0), k = gated ? h.size(1) / 2 : h.size(1), n = w_data.size(0);
    TE_EAGER_CHECK(w_data.dim() == 2 && w_data.size(1) == k && w_data.scalar_type() == ScalarType::Byte &&
                       w_data.is_contiguous(),
                   op, ": the weight's FP8 data must be a contiguous uint8 [N, ", k, "] matrix");
    TE_EAGER_CHECK(m % kGranule == 0 && n % kGranule == 0 && k % kGranule == 0, op,
                   ": M, N and K must be multiples of 16, got M=", m, " N=", n, " K=", k);
    TE_EAGER_CHECK(!bias.has_value() || (bias->scalar_type() == h.scalar_type() && bias->dim() == 1 &&
                                         bias->size(0) == n && bias->is_contiguous()),
                   op, ": bias must be a contiguous [", n, "] tensor of h's dtype");
    TE_EAGER_CHECK(scales.numel() > kColumn && history.dim() == 2 && history.size(1) > kColumn, op,
                   ": the forward state must have FC2's input column");
    const auto fp8 = static_cast<te_dtype>(fp8_dtype);
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    const int32_t u8 = aoti_torch_dtype_uint8(), f32 = aoti_torch_dtype_float32();
    const te_dtype h_dtype = core_dtype(h.scalar_type(), op);
    const Tensor rows = empty({m * k}, u8, h);
    const Tensor scalars = empty({3}, f32, h);
    const Tensor col_t = need_col ? empty({k, m}, u8, h) : empty({0}, u8, h);  // (as above)
    const Tensor sinv_t = piece(scalars, {1}, 0);
    const te_buffer data = buffer(rows.data_ptr(), fp8, {m, k}, h);
    const te_buffer col = buffer(col_t.data_ptr(), fp8, {k, m}, h);
    const te_buffer sinv = element(scalars, 0);
    Handle in(op);
    in.set(TE_SLOT_DATA, buffer(h.data_ptr(), h_dtype, {m, h.size(1)}, h));
    const te_buffer h_buf = buffer(h.data_ptr(), h_dtype, {m, h.size(1)}, h);
    te_buffer scale = element(scales, kColumn);
    if (current) {  // the scale from the activation's own amax first (an amax-only pass)
      scale = element(scalars, 1);
      activation_current_scale(activation, nullptr, h_buf, data, scale, sinv, element(scalars, 2), pow2, epsilon,
                               stream, op);
    }
    Handle q(op);
    q.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, sinv);
    if (!current) q.set(TE_SLOT_AMAX, element(history, kColumn));
    if (need_col) q.set(TE_SLOT_COLUMNWISE_DATA, col);
    check(te_activation_forward(activation, nullptr, in.get(), q.get(), current ? 0 : 1, stream), op);
    Tensor out = empty({m, n}, torch_dtype(h.scalar_type()), h);
    out = forward_gemm(data, sinv, buffer(w_data.data_ptr(), fp8, {n, k}, w_data), element(w_sinv, 0), bias, out, m, n,
                       workspace, stream, op);
    return {out, sinv_t, col_t};
  });
}

}  // namespace te_eager

STABLE_TORCH_LIBRARY_IMPL(te_eager, CompositeExplicitAutograd, m) {
  m.impl("norm_linear_fp8_forward", TORCH_BOX(&te_eager::norm_linear_fp8_forward));
  m.impl("act_linear_fp8_forward", TORCH_BOX(&te_eager::act_linear_fp8_forward));
}
