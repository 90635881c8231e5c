// te.Linear's FP8 forward and the backward of any per-tensor FP8 linear layer, each one
// operator call (fast_linear.py, compiled_grads.py).
#include "operators.h"

namespace te_eager {
namespace {

constexpr const char *kLinear = "te_eager.linear_fp8_forward";
constexpr int64_t kScalarRow = 64;  // floats: 256 bytes, an allocation's alignment

// The checks of fast_linear.takes, made again where the data is read.
void check_linear(const Tensor &input, const Tensor &weight, const std::optional<Tensor> &bias) {
  TE_EAGER_CHECK(input.dim() >= 1 && weight.dim() == 2 && input.size(-1) == weight.size(1), kLinear,
                  ": input must end in the weight's in_features (", weight.size(-1), ")");
  TE_EAGER_CHECK(input.is_contiguous() && weight.is_contiguous(), kLinear, ": input and weight must be contiguous");
  const int64_t k = weight.size(1), n = weight.size(0), m = k > 0 ? input.numel() / k : 0;
  TE_EAGER_CHECK(k % kGranule == 0 && n % kGranule == 0 && m % kGranule == 0, kLinear,
                  ": M, N and K must be multiples of 16, got M=", m, " N=", n, " K=", k);
  TE_EAGER_CHECK(floating(input.scalar_type()) && floating(weight.scalar_type()), kLinear,
                  ": input and weight must be float32, bfloat16 or float16");
  TE_EAGER_CHECK(input.is_cuda() == weight.is_cuda() && input.get_device() == weight.get_device(), kLinear,
                  ": input and weight must be on one device");
  if (bias.has_value()) {
    TE_EAGER_CHECK(bias->scalar_type() == input.scalar_type() && bias->dim() == 1 && bias->size(0) == n &&
                        bias->is_contiguous() && bias->get_device() == input.get_device(),
                    kLinear, ": bias must be a contiguous [", n, "] tensor of the input's dtype and device");
  }
}

}  // namespace

// input [..., K] @ weight[N, K]^T (+ bias) with both operands cast to `fp8_dtype` (a te_dtype
// code) as the GEMM's row-wise operands and, where the backward needs them, as column-wise
// copies. Delayed scaling (current = false) casts with scales[0] (input) and scales[1] (weight)
// and raises history[0, 0] and history[0, 1]; current scaling takes each scale from its
// tensor's amax (pow2, epsilon as the recipe says) and reads neither.
//
// Returns (output [..., N], input scale_inv [1], weight scale_inv [1], column-wise input [K, M]
// or [0] unless need_wgrad, column-wise weight [K, N] or [0] unless need_dgrad): the output and
// what the backward keeps instead of the activation. With own_buffers each output has an
// allocation of its own (a custom op's outputs may not share storage: the traced graph's
// fast_linear.linear_forward); else the two scale_invs share one and the two column-wise copies
// another, two allocations fewer for the eager step.
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> linear_fp8_forward(
    Tensor input, Tensor weight, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad, bool own_buffers,
    int64_t stream_handle) {
  return guarded(kLinear, input, [&]() -> std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> {
    check_linear(input, weight, bias);
    const auto fp8 = static_cast<te_dtype>(fp8_dtype);
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    const int64_t k = weight.size(1), n = weight.size(0), m = k > 0 ? input.numel() / k : 0;
    const int32_t u8 = aoti_torch_dtype_uint8(), f32 = aoti_torch_dtype_float32();
    // Four allocations (each costs host time, and at small sizes host time is the forward's
    // cost; six with own_buffers): the row-wise copies, which only the GEMM reads; the output;
    // the scalars, one row of kScalarRow floats per operand (scale_inv, then current scaling's
    // scale and amax), each row at a fresh allocation's alignment (cuBLASLt takes the scale_invs
    // as pointers, and 4 bytes apart fails); the column-wise copies.
    const int64_t w_row_at = aligned(m * k);
    const Tensor rows = empty({w_row_at + n * k}, u8, input);
    auto *row_bytes = static_cast<uint8_t *>(rows.data_ptr());
    const te_buffer x_data = buffer(row_bytes, fp8, {m, k}, input), w_data = buffer(row_bytes + w_row_at, fp8, {n, k}, input);
    const Tensor x_scalars = empty({(own_buffers ? 1 : 2) * kScalarRow}, f32, input);
    const Tensor w_scalars = own_buffers ? empty({kScalarRow}, f32, input) : x_scalars;
    const int64_t w_at = own_buffers ? 0 : kScalarRow;  // where the weight's row starts
    const Tensor x_sinv_t = piece(x_scalars, {1}, 0), w_sinv_t = piece(w_scalars, {1}, w_at);
    const int64_t x_col_size = need_wgrad ? aligned(k * m) : 0, w_col_size = need_dgrad ? k * n : 0;
    const Tensor x_cols = empty({x_col_size + (own_buffers ? 0 : w_col_size)}, u8, input);
    const Tensor w_cols = own_buffers ? empty({w_col_size}, u8, input) : x_cols;
    const Tensor x_col_t = piece(x_cols, {need_wgrad ? k : 0, m}, 0);
    const Tensor w_col_t = piece(w_cols, {need_dgrad ? k : 0, n}, own_buffers ? 0 : x_col_size);
    const te_buffer x_sinv = element(x_scalars, 0), w_sinv = element(w_scalars, w_at);
    const te_buffer x_col = buffer(x_col_t.data_ptr(), fp8, {k, m}, input);
    const te_buffer w_col = buffer(w_col_t.data_ptr(), fp8, {k, n}, input);
    const te_buffer *x_col_out = need_wgrad ? &x_col : nullptr, *w_col_out = need_dgrad ? &w_col : nullptr;
    const te_buffer x = buffer(input.data_ptr(), core_dtype(input.scalar_type(), kLinear), {m, k}, input);
    const te_buffer w = buffer(weight.data_ptr(), core_dtype(weight.scalar_type(), kLinear), {n, k}, weight);

    // Both casts in one core call: on the GPU one kernel launch where both have a column-wise
    // copy and the same input dtype (a training step's forward).
    Handle x_in(kLinear), x_out(kLinear), w_in(kLinear), w_out(kLinear);
    x_in.set(TE_SLOT_DATA, x);
    w_in.set(TE_SLOT_DATA, w);
    x_out.set(TE_SLOT_DATA, x_data).set(TE_SLOT_SCALE_INV, x_sinv);
    w_out.set(TE_SLOT_DATA, w_data).set(TE_SLOT_SCALE_INV, w_sinv);
    if (x_col_out != nullptr) x_out.set(TE_SLOT_COLUMNWISE_DATA, x_col);
    if (w_col_out != nullptr) w_out.set(TE_SLOT_COLUMNWISE_DATA, w_col);
    te_quantize_config cast_config{};
    if (!current) {
      x_out.set(TE_SLOT_SCALE, element(scales, 0)).set(TE_SLOT_AMAX, element(history, 0));
      w_out.set(TE_SLOT_SCALE, element(scales, 1)).set(TE_SLOT_AMAX, element(history, 1));
      cast_config.accumulate_amax = 1;  // the step's forwards keep the largest amax
    } else {
      const te_buffer x_scale = element(x_scalars, 1), w_scale = element(w_scalars, w_at + 1);
      current_scale(x, x_data, x_col_out, x_scale, x_sinv, element(x_scalars, 2), pow2, epsilon, stream,
                    kLinear);
      current_scale(w, w_data, w_col_out, w_scale, w_sinv, element(w_scalars, w_at + 2), pow2, epsilon, stream,
                    kLinear);
      // The amaxes are known: the casts need not reduce them again.
      x_out.set(TE_SLOT_SCALE, x_scale);
      w_out.set(TE_SLOT_SCALE, w_scale);
    }
    const te_tensor *cast_in[] = {x_in.get(), w_in.get()};
    te_tensor *cast_out[] = {x_out.get(), w_out.get()};
    check(te_quantize_many(cast_in, cast_out, 2, &cast_config, stream), kLinear);

    // The output in its final shape, which the core sees as the matrix [M, N].
    std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
    shape.back() = n;
    Tensor out = empty(shape, torch_dtype(input.scalar_type()), input);
    out = forward_gemm(x_data, x_sinv, w_data, w_sinv, bias, out, m, n, workspace, stream, kLinear);
    return {out, x_sinv_t, w_sinv_t, x_col_t, w_col_t};
  });
}

constexpr const char *kLinearBackward = "te_eager.linear_fp8_backward";

// The backward of one FP8 linear layer (linear_fn: grad_to_fp8, the scale update and
// backward_gemms, with the same core calls and arguments, so the same bits), for te.Linear,
// LayerNormLinear and LayerNormMLP's second GEMM (compiled_grads.py; its first GEMM, through
// the activation's derivative, is tested against the same steps but not sent here).
//
// The layer's grad_output G [M, N] is act'(H) * grad_output, with `act` a te_activation code and
// H = act_input [M, N] (absent for identity: G is grad_output itself; a gated act's
// grad_output is [M, N/2]). G is cast to `bwd_dtype`, with the bias gradient (the column sums
// of G, in bias_dtype) in the same pass where there is a bias: delayed scaling casts with
// grad_scale[column] and raises grad_history[0, column], and with `update` then updates
// grad_history, grad_scale and grad_scale_inv (all columns) by `algo` and `margin`; current
// scaling takes the scale from G's own amax (pow2, epsilon). Then dgrad = G @ W (from the
// column-wise weight [K, N]) and wgrad = G^T @ X (from the column-wise input [K, M]), both
// with split accumulation. At least one of dgrad and wgrad is needed.
//
// Returns (grad_input [M, K] in input_dtype, grad_weight [N, K] in weight_dtype, grad_bias [N] in
// bias_dtype), each an empty tensor (of any dtype) where not needed.
std::tuple<int64_t, Tensor, Tensor, Tensor> linear_fp8_backward(
    Tensor grad_output, std::optional<Tensor> act_input, int64_t act, Tensor x_sinv, Tensor w_sinv, Tensor x_col,
    Tensor w_col, Tensor grad_history, Tensor grad_scale, Tensor grad_scale_inv, int64_t column, bool update,
    Tensor workspace, bool current, int64_t fwd_dtype, int64_t bwd_dtype, bool pow2, double epsilon, int64_t algo,
    int64_t margin, bool need_dgrad, bool need_wgrad, ScalarType input_dtype, ScalarType weight_dtype,
    std::optional<ScalarType> bias_dtype, int64_t stream_handle) {
  // (x_sinv, not grad_output, gives an error's empty outputs their device: grad_output may be
  // released on the way)
  return guarded(kLinearBackward, x_sinv, [&]() -> std::tuple<Tensor, Tensor, Tensor> {
    const char *op = kLinearBackward;
    const auto activation = static_cast<te_activation>(act);
    const bool identity = activation == TE_ACTIVATION_IDENTITY;
    TE_EAGER_CHECK(need_dgrad || need_wgrad, op, ": dgrad or wgrad must be needed");
    TE_EAGER_CHECK(grad_output.dim() == 2 && grad_output.is_contiguous() && floating(grad_output.scalar_type()), op,
                   ": grad_output must be a contiguous float32/bfloat16/float16 matrix");
    TE_EAGER_CHECK(identity != act_input.has_value(), op, ": act_input must be given exactly when act is not identity");
    const int64_t m = grad_output.size(0);
    const int64_t n = identity ? grad_output.size(1) : act_input->size(-1);
    if (!identity) {
      TE_EAGER_CHECK(act_input->dim() == 2 && act_input->size(0) == m && act_input->is_contiguous() &&
                         act_input->scalar_type() == grad_output.scalar_type(),
                     op, ": act_input must be a contiguous [", m, ", N] matrix of grad_output's dtype");
    }
    const int64_t k = need_dgrad ? w_col.size(0) : x_col.size(0);
    TE_EAGER_CHECK(!need_dgrad || (w_col.dim() == 2 && w_col.size(1) == n), op, ": the column-wise weight must be [K, ",
                   n, "]");
    TE_EAGER_CHECK(!need_wgrad || (x_col.dim() == 2 && x_col.size(0) == k && x_col.size(1) == m), op,
                   ": the column-wise input must be [", k, ", ", m, "]");
    TE_EAGER_CHECK(grad_history.dim() == 2 && column >= 0 && column < grad_history.size(1) &&
                       column < grad_scale.numel(),
                   op, ": column ", column, " is out of the grad_output history's range");
    const auto fwd = static_cast<te_dtype>(fwd_dtype), bwd = static_cast<te_dtype>(bwd_dtype);
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    const int32_t u8 = aoti_torch_dtype_uint8(), f32 = aoti_torch_dtype_float32();
    const te_dtype g_dtype = core_dtype(grad_output.scalar_type(), op);
    const te_buffer dy = buffer(grad_output.data_ptr(), g_dtype, {m, grad_output.size(1)}, grad_output);
    const te_buffer h = identity ? dy : buffer(act_input->data_ptr(), g_dtype, {m, n}, grad_output);

    // G in FP8: row-wise for dgrad, column-wise for wgrad (one allocation), one scale_inv for
    // both (with current scaling's scale and amax beside it).
    const int64_t g_row_size = need_dgrad ? aligned(m * n) : 0;
    const Tensor g_bytes = empty({g_row_size + (need_wgrad ? n * m : 0)}, u8, grad_output);
    const Tensor g_scalars = empty({3}, f32, grad_output);
    auto *g_data = static_cast<uint8_t *>(g_bytes.data_ptr());
    const te_buffer g_row = buffer(g_data, bwd, {m, n}, grad_output);
    const te_buffer g_col = buffer(g_data + g_row_size, bwd, {n, m}, grad_output);
    const te_buffer g_sinv = element(g_scalars, 0);
    const te_buffer *row_out = need_dgrad ? &g_row : nullptr, *col_out = need_wgrad ? &g_col : nullptr;
    Tensor dbias;
    if (bias_dtype.has_value()) dbias = empty({n}, torch_dtype(*bias_dtype), grad_output);
    te_buffer scale = element(grad_scale, column), amax = element(grad_history, column);
    if (current) {
      scale = element(g_scalars, 1);
      amax = element(g_scalars, 2);
    }
    // The cast of G (the branches of linear_fn.grad_to_fp8).
    const auto fp8_grad = [&](Handle &gi) -> Handle & {
      if (row_out != nullptr) gi.set(TE_SLOT_DATA, g_row);
      if (col_out != nullptr) gi.set(TE_SLOT_COLUMNWISE_DATA, g_col);
      return gi.set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, g_sinv).set(TE_SLOT_AMAX, amax);
    };
    Handle db(op);
    if (bias_dtype.has_value()) db.set(TE_SLOT_DATA, buffer(dbias.data_ptr(), core_dtype(*bias_dtype, op), {n}, grad_output));
    te_tensor *db_ptr = bias_dtype.has_value() ? db.get() : nullptr;
    Handle gh(op), hh(op);
    gh.set(TE_SLOT_DATA, dy);
    if (!identity) hh.set(TE_SLOT_DATA, h);
    if (!current && (!identity || bias_dtype.has_value())) {
      // act' * grad_output (+ bias gradient) + cast + transpose in one pass, the amax raising
      // the history's slot.
      Handle gi(op);
      check(te_activation_backward(activation, nullptr, gh.get(), identity ? nullptr : hh.get(), fp8_grad(gi).get(), db_ptr, 1,
                                   stream),
            op);
    } else if (!current) {
      Handle gi(op);
      te_quantize_config config{};
      config.accumulate_amax = 1;
      check(te_quantize(gh.get(), fp8_grad(gi).get(), &config, stream), op);
    } else if (identity && bias_dtype.has_value()) {
      // grad_output's scale first, then the same fused bias gradient + cast.
      current_scale(dy, row_out ? g_row : g_col, nullptr, scale, g_sinv, amax, pow2, epsilon, stream, op);
      Handle gi(op);
      check(te_activation_backward(activation, nullptr, gh.get(), nullptr, fp8_grad(gi).get(), db_ptr, 0, stream), op);
    } else if (identity) {
      quantize_current(dy, row_out, col_out, scale, g_sinv, amax, pow2, epsilon, stream, op);
    } else {
      // G's scale from its own amax (an amax-only pass), then the same fused pass as delayed
      // scaling: act' * grad_output (+ bias gradient) + cast + transpose.
      activation_current_scale(activation, &dy, h, row_out ? g_row : g_col, scale, g_sinv, amax, pow2, epsilon,
                               stream, op);
      Handle gi(op);
      check(te_activation_backward(activation, nullptr, gh.get(), hh.get(), fp8_grad(gi).get(), db_ptr, 0, stream),
            op);
    }
    // grad_output is read for the last time: where this call holds the only reference (a
    // composing operator moved its own gradient in), its memory goes before the GEMMs allocate.
    grad_output = Tensor();
    if (!current && update) {  // the next step's grad_output scales, from this step's amaxes
      Handle hs(op), ss(op), sis(op);
      hs.set(TE_SLOT_DATA, buffer(grad_history.data_ptr(), TE_DTYPE_FLOAT32,
                                  {grad_history.size(0), grad_history.size(1)}, grad_history));
      ss.set(TE_SLOT_DATA, buffer(grad_scale.data_ptr(), TE_DTYPE_FLOAT32, {grad_scale.numel()}, grad_scale));
      sis.set(TE_SLOT_DATA,
              buffer(grad_scale_inv.data_ptr(), TE_DTYPE_FLOAT32, {grad_scale_inv.numel()}, grad_scale_inv));
      te_tensor *histories[] = {hs.get()}, *scales[] = {ss.get()}, *scale_invs[] = {sis.get()};
      check(te_delayed_scaling_update(histories, scales, scale_invs, 1, bwd, static_cast<te_amax_compute_algo>(algo),
                                      static_cast<int32_t>(margin), stream),
            op);
    }

    // The GEMMs, "TN" with split accumulation (linear_fn.backward_gemms).
    void *ws = workspace.numel() > 0 ? workspace.data_ptr() : nullptr;
    const auto gemm = [&](const te_buffer &a_data, const te_buffer &b_data, const Tensor &b_sinv, Tensor &d,
                          ScalarType d_dtype, int64_t rows, int64_t cols) {
      d = empty({rows, cols}, torch_dtype(d_dtype), g_scalars);
      Handle a(op), b(op), dh(op);
      a.set(TE_SLOT_DATA, a_data).set(TE_SLOT_SCALE_INV, g_sinv);
      b.set(TE_SLOT_DATA, b_data).set(TE_SLOT_SCALE_INV, element(b_sinv, 0));
      dh.set(TE_SLOT_DATA, buffer(d.data_ptr(), core_dtype(d_dtype, op), {rows, cols}, g_scalars));
      te_gemm_config config{};
      config.transpose_b = 1;
      config.use_split_accumulator = 1;
      check(te_gemm(a.get(), b.get(), dh.get(), nullptr, nullptr, &config, ws, static_cast<size_t>(workspace.numel()),
                    stream),
            op);
    };
    // What is not needed comes back as an empty piece of a buffer (no allocation).
    // (each output not computed an empty tensor of its own: outputs must not alias, or a
    // graph torch.compile traced through the blocks' custom ops would see them as one)
    const auto none = [&] { return empty({0}, f32, g_scalars); };
    Tensor grad_input = none(), grad_weight = none();
    if (need_dgrad) gemm(g_row, buffer(w_col.data_ptr(), fwd, {k, n}, w_col), w_sinv, grad_input, input_dtype, m, k);
    if (need_wgrad) gemm(g_col, buffer(x_col.data_ptr(), fwd, {k, m}, x_col), x_sinv, grad_weight, weight_dtype, n, k);
    if (!bias_dtype.has_value()) dbias = none();
    return {grad_input, grad_weight, dbias};
  });
}

}  // namespace te_eager

STABLE_TORCH_LIBRARY_IMPL(te_eager, CompositeExplicitAutograd, m) {
  m.impl("linear_fp8_forward", TORCH_BOX(&te_eager::linear_fp8_forward));
  m.impl("linear_fp8_backward", TORCH_BOX(&te_eager::linear_fp8_backward));
}
