// The fused FP8 blocks whole: LayerNormLinear's and LayerNormMLP's forward, each one operator
// call from the weights' casts to the output, and their backward, each one call from
// grad_output to every gradient (compiled_blocks.py). They compose the step operators
// (operators.h) with the same core calls and arguments as the Python steps of
// layernorm_linear_fn / layernorm_mlp_fn, so the same bits; what is new here is only the
// weights' casts (as module.base._weight_operand makes them) and the norm's backward (as
// ops.norm_backward).
//
// Why whole blocks: a small block's step is bound by host time, and every Python op call,
// allocation and autograd node of a block costs some (benchmarks/results/host_probes.md).
#include "operators.h"

namespace te_eager {
namespace {

// A weight's FP8 copy as a GEMM's operand: the row-wise bytes [N, K], scale_inv [1] and the
// column-wise bytes [K, N] ([0] where no GEMM of the backward reads them).
struct Fp8Weight {
  Tensor data, sinv, col;
};

// Floats of a weight's scalars (scale_inv, then current scaling's scale and amax).
constexpr int64_t kScalarRow = 3;

// The FP8 copies of a block's weights (weights[i] [N_i, K_i], state column columns[i] of the
// forward: 2 * gemm + 1), cast in one core call; each as module.base._weight_operand's fresh
// quantization makes it (quantization.quantize of the "weight" role). Delayed scaling casts
// with scales[column] and raises history[0, column]; current scaling takes each scale from
// its weight's amax.
std::vector<Fp8Weight> cast_weights(const std::vector<Tensor> &weights, const std::vector<int64_t> &columns,
                                    const std::vector<bool> &need_col, const Tensor &scales, const Tensor &history,
                                    bool current, te_dtype fp8, bool pow2, double epsilon, te_stream stream,
                                    const Tensor &like, const char *op) {
  const size_t n = weights.size();
  const int32_t u8 = aoti_torch_dtype_uint8(), f32 = aoti_torch_dtype_float32();
  std::vector<int64_t> row_at(n);
  int64_t rows_size = 0;
  for (size_t i = 0; i < n; ++i) {
    const Tensor &w = weights[i];
    TE_EAGER_CHECK(w.dim() == 2 && w.is_contiguous() && floating(w.scalar_type()) && w.is_cuda() == like.is_cuda() &&
                       w.get_device() == like.get_device(),
                   op, ": weights must be contiguous float32/bfloat16/float16 matrices on the input's device");
    TE_EAGER_CHECK(columns[i] < scales.numel() && (current || columns[i] < history.size(1)), op,
                   ": the forward state has no column ", columns[i]);
    row_at[i] = rows_size;
    rows_size += aligned(w.numel());
  }
  // The row-wise copies (which only the forward's GEMMs read) share one buffer; what the
  // backward keeps, each weight's scalars and column-wise copy, gets buffers of its own, since
  // the operators' outputs must not alias (blocks.cpp's custom ops return them).
  const Tensor rows = empty({rows_size}, u8, like);
  std::vector<Fp8Weight> out;
  std::deque<Handle> handles;  // (a deque: handles do not move)
  std::vector<const te_tensor *> ins;
  std::vector<te_tensor *> outs;
  te_quantize_config config{};
  config.accumulate_amax = current ? 0 : 1;  // the step's forwards keep the largest amax
  for (size_t i = 0; i < n; ++i) {
    const Tensor &w = weights[i];
    const int64_t rows_n = w.size(0), k = w.size(1);
    const Tensor scalars = empty({kScalarRow}, f32, like);
    Fp8Weight q{piece(rows, {rows_n, k}, row_at[i]), piece(scalars, {1}, 0),
                empty({need_col[i] ? k : 0, rows_n}, u8, like)};
    const te_buffer x = buffer(w.data_ptr(), core_dtype(w.scalar_type(), op), {rows_n, k}, w);
    const te_buffer data = buffer(q.data.data_ptr(), fp8, {rows_n, k}, like);
    const te_buffer col = buffer(q.col.data_ptr(), fp8, {k, rows_n}, like);
    const te_buffer sinv = element(scalars, 0);
    Handle &in = handles.emplace_back(op);
    Handle &cast = handles.emplace_back(op);
    in.set(TE_SLOT_DATA, x);
    cast.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE_INV, sinv);
    if (need_col[i]) cast.set(TE_SLOT_COLUMNWISE_DATA, col);
    if (current) {
      const te_buffer scale = element(scalars, 1);
      current_scale(x, data, need_col[i] ? &col : nullptr, scale, sinv, element(scalars, 2), pow2, epsilon,
                    stream, op);
      cast.set(TE_SLOT_SCALE, scale);  // (the amax is known: the cast need not reduce it again)
    } else {
      cast.set(TE_SLOT_SCALE, element(scales, columns[i])).set(TE_SLOT_AMAX, element(history, columns[i]));
    }
    ins.push_back(in.get());
    outs.push_back(cast.get());
    out.push_back(std::move(q));
  }
  check(te_quantize_many(ins.data(), outs.data(), n, &config, stream), op);
  return out;
}

// The norm's backward (ops.norm_backward): (grad_input [M, K] in x's dtype, grad_gamma and
// grad_beta in gamma's dtype; grad_beta [0] without beta). dy [M, K] in x's dtype. grad_add
// (x's shape and dtype): a residual gradient the core adds into grad_input (norm.h).
std::tuple<Tensor, Tensor, Tensor> norm_backward(const Tensor &dy, const Tensor &x, const Tensor &mu,
                                                 const Tensor &rsigma, const Tensor &gamma, bool has_beta,
                                                 int64_t norm, bool zero_centered_gamma,
                                                 const std::optional<Tensor> &grad_add, te_stream stream,
                                                 const char *op) {
  const int64_t m = x.size(0), k = x.size(1);
  const te_dtype x_dtype = core_dtype(x.scalar_type(), op), g_dtype = core_dtype(gamma.scalar_type(), op);
  TE_EAGER_CHECK(dy.dim() == 2 && dy.size(0) == m && dy.size(1) == k && dy.scalar_type() == x.scalar_type(), op,
                 ": the norm's grad_output must match its input");
  TE_EAGER_CHECK(!grad_add.has_value() || (grad_add->dim() == 2 && grad_add->size(0) == m &&
                                            grad_add->size(1) == k && grad_add->is_contiguous() &&
                                            grad_add->scalar_type() == x.scalar_type()),
                 op, ": grad_input_add must be a contiguous [M, K] matrix in the norm input's dtype");
  const int32_t g_torch = torch_dtype(gamma.scalar_type());
  Tensor dx = empty({m, k}, torch_dtype(x.scalar_type()), x);
  Tensor dgamma = empty({k}, g_torch, x);
  Tensor dbeta = empty({has_beta ? k : 0}, g_torch, x);
  Tensor ws;
  size_t ws_size = 0;
  if (x.is_cuda()) {
    ws_size = te_norm_backward_workspace_size(m, k);
    ws = empty({static_cast<int64_t>(std::max<size_t>(ws_size, 1))}, aoti_torch_dtype_uint8(), x);
  }
  const bool layernorm = static_cast<te_norm_type>(norm) == TE_NORM_LAYERNORM;
  Handle hdy(op), hx(op), hmu(op), hr(op), hg(op), hadd(op), hdx(op), hdg(op), hdb(op);
  hdy.set(TE_SLOT_DATA, buffer(dy.data_ptr(), x_dtype, {m, k}, x));
  hx.set(TE_SLOT_DATA, buffer(x.data_ptr(), x_dtype, {m, k}, x));
  if (layernorm) hmu.set(TE_SLOT_DATA, buffer(mu.data_ptr(), TE_DTYPE_FLOAT32, {m}, x));
  hr.set(TE_SLOT_DATA, buffer(rsigma.data_ptr(), TE_DTYPE_FLOAT32, {m}, x));
  hg.set(TE_SLOT_DATA, buffer(gamma.data_ptr(), g_dtype, {k}, x));
  if (grad_add.has_value()) hadd.set(TE_SLOT_DATA, buffer(grad_add->data_ptr(), x_dtype, {m, k}, x));
  hdx.set(TE_SLOT_DATA, buffer(dx.data_ptr(), x_dtype, {m, k}, x));
  hdg.set(TE_SLOT_DATA, buffer(dgamma.data_ptr(), g_dtype, {k}, x));
  if (has_beta) hdb.set(TE_SLOT_DATA, buffer(dbeta.data_ptr(), g_dtype, {k}, x));
  const te_norm_config config{static_cast<te_norm_type>(norm), 0.0f, zero_centered_gamma ? 1 : 0, 0};
  check(te_norm_backward(&config, hdy.get(), hx.get(), layernorm ? hmu.get() : nullptr, hr.get(), hg.get(),
                         grad_add.has_value() ? hadd.get() : nullptr, hdx.get(), hdg.get(),
                         has_beta ? hdb.get() : nullptr, x.is_cuda() ? ws.data_ptr() : nullptr, ws_size, stream),
        op);
  return {dx, dgamma, dbeta};
}

// The checks both blocks' forwards make of the input before their steps check the rest.
void check_block_input(const Tensor &input, const Tensor &gamma, const char *op) {
  TE_EAGER_CHECK(input.dim() == 2 && input.is_contiguous() && floating(input.scalar_type()) && input.size(0) > 0, op,
                 ": input must be a contiguous float32/bfloat16/float16 matrix [M, K] with M > 0");
  TE_EAGER_CHECK(gamma.is_cuda() == input.is_cuda() && gamma.get_device() == input.get_device(), op,
                 ": the norm's parameters must be on the input's device");
}

}  // namespace

constexpr const char *kLnLinearForward = "te_eager.layernorm_linear_fp8_forward";

// LayerNormLinear's FP8 forward (layernorm_linear_fn.Fp8LayerNormLinearFunction.forward with a
// fresh weight cast and a high-precision output): the weight's cast (state column 1), then
// norm_linear_fp8_forward (the norm writing the GEMM's FP8 input with column 0, the GEMM).
// input [M, K]; weight [N, K]. need_dgrad: the backward's dgrad runs (the weight's column-wise
// copy is made); need_wgrad: its wgrad runs (the norm output's column-wise copy).
//
// Returns (output [M, N], then what the backward reads: the norm output's scale_inv and
// column-wise copy, mu, rsigma, the weight's scale_inv and column-wise copy).
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_linear_fp8_forward(
    Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps, bool zero_centered_gamma,
    Tensor weight, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace, bool current,
    int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad, int64_t stream) {
  return guarded(kLnLinearForward, input, [&]() -> std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> {
    const char *op = kLnLinearForward;
    check_block_input(input, gamma, op);
    const te_stream s = reinterpret_cast<te_stream>(stream);
    const Fp8Weight w = cast_weights({weight}, {1}, {need_dgrad}, scales, history, current,
                                     static_cast<te_dtype>(fp8_dtype), pow2, epsilon, s, input, op)[0];
    auto [status, out, ln_sinv, ln_col, mu, rsigma] =
        norm_linear_fp8_forward(input, gamma, beta, norm, eps, zero_centered_gamma, w.data, w.sinv, bias, scales,
                                history, workspace, current, fp8_dtype, pow2, epsilon, need_wgrad, stream);
    ok(status);
    return {out, ln_sinv, ln_col, mu, rsigma, w.sinv, w.col};
  });
}

namespace {

constexpr const char *kLnLinearBackward = "te_eager.layernorm_linear_fp8_backward";

// LayerNormLinear's FP8 backward (Fp8LayerNormLinearFunction.backward without a returned
// ln_out): linear_fp8_backward (grad_output's cast into backward column 0, the scale update,
// dgrad and wgrad), then the norm's backward where dgrad runs. x [M, K] is the norm's input.
//
// Returns (grad_input [M, K], grad_gamma, grad_beta, grad_weight, grad_bias), each [0] where
// not needed (grad_beta without beta).
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_linear_fp8_backward(
    Tensor grad_output, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, bool has_beta, int64_t norm,
    bool zero_centered_gamma, Tensor ln_sinv, Tensor ln_col, Tensor w_sinv, Tensor w_col, Tensor grad_history,
    Tensor grad_scale, Tensor grad_scale_inv, Tensor workspace, bool current, int64_t fwd_dtype, int64_t bwd_dtype,
    bool pow2, double epsilon, int64_t algo, int64_t margin, bool need_dgrad, bool need_wgrad,
    ScalarType weight_dtype, std::optional<ScalarType> bias_dtype, std::optional<Tensor> grad_input_add,
    int64_t stream) {
  return guarded(kLnLinearBackward, grad_output, [&]() -> std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> {
    const char *op = kLnLinearBackward;
    TE_EAGER_CHECK(x.dim() == 2, op, ": x must be the norm's input [M, K]");
    TE_EAGER_CHECK(need_dgrad || !grad_input_add.has_value(), op, ": grad_input_add needs need_dgrad");
    auto [status, d_ln, grad_weight, grad_bias] = linear_fp8_backward(
        grad_output, std::nullopt, TE_ACTIVATION_IDENTITY, ln_sinv, w_sinv, ln_col, w_col, grad_history, grad_scale,
        grad_scale_inv, 0, true, workspace, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin, need_dgrad,
        need_wgrad, x.scalar_type(), weight_dtype, bias_dtype, stream);
    ok(status);
    Tensor dx = d_ln, dgamma, dbeta;  // (d_ln: linear_fp8_backward's empty "not needed")
    if (!need_dgrad) {
      dgamma = empty({0}, aoti_torch_dtype_float32(), grad_output);
      dbeta = empty({0}, aoti_torch_dtype_float32(), grad_output);
    } else {
      std::tie(dx, dgamma, dbeta) = norm_backward(d_ln, x, mu, rsigma, gamma, has_beta, norm, zero_centered_gamma,
                                                  grad_input_add, reinterpret_cast<te_stream>(stream), op);
    }
    return {dx, dgamma, dbeta, grad_weight, grad_bias};
  });
}

}  // namespace

constexpr const char *kMlpForward = "te_eager.layernorm_mlp_fp8_forward";

// LayerNormMLP's FP8 forward (layernorm_mlp_fn.Fp8LayerNormMLPFunction.forward with fresh
// weight casts): both weights' casts (state columns 1 and 3) in one core call, then
// norm_linear_fp8_forward (FC1) and act_linear_fp8_forward (the activation writing FC2's FP8
// input, FC2). input [M, K]; w1 [F, K] (gated: [2F, K]); w2 [N, F]. need_dgrad: FC1's dgrad
// runs (its weight's column-wise copy); need_wgrad1: FC1's wgrad (the norm output's);
// need_fc1: FC2's dgrad, the gradient of anything before FC2 (FC2's weight's); need_wgrad2:
// FC2's wgrad (the activation output's).
//
// Returns (output [M, N], then what the backward reads: the norm output's scale_inv and
// column-wise copy, mu, rsigma, FC1's weight's scale_inv and column-wise copy, FC1's output h,
// the activation output's scale_inv and column-wise copy, FC2's weight's scale_inv and
// column-wise copy).
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
layernorm_mlp_fp8_forward(Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps,
                          bool zero_centered_gamma, Tensor w1, std::optional<Tensor> b1, int64_t act, Tensor w2,
                          std::optional<Tensor> b2, Tensor scales, Tensor history, Tensor workspace, bool current,
                          int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad1,
                          bool need_fc1, bool need_wgrad2, int64_t stream) {
  using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor>;
  return guarded(kMlpForward, input, [&]() -> Outputs {
    const char *op = kMlpForward;
    check_block_input(input, gamma, op);
    const te_stream s = reinterpret_cast<te_stream>(stream);
    const std::vector<Fp8Weight> w = cast_weights({w1, w2}, {1, 3}, {need_dgrad, need_fc1}, scales, history, current,
                                                  static_cast<te_dtype>(fp8_dtype), pow2, epsilon, s, input, op);
    auto [status1, h, ln_sinv, ln_col, mu, rsigma] =
        norm_linear_fp8_forward(input, gamma, beta, norm, eps, zero_centered_gamma, w[0].data, w[0].sinv, b1, scales,
                                history, workspace, current, fp8_dtype, pow2, epsilon, need_wgrad1, stream);
    ok(status1);
    auto [status2, out, a_sinv, a_col] = act_linear_fp8_forward(h, act, w[1].data, w[1].sinv, b2, scales, history,
                                                                workspace, current, fp8_dtype, pow2, epsilon,
                                                                need_wgrad2, stream);
    ok(status2);
    return {out, ln_sinv, ln_col, mu, rsigma, w[0].sinv, w[0].col, h, a_sinv, a_col, w[1].sinv, w[1].col};
  });
}

namespace {

constexpr const char *kMlpBackward = "te_eager.layernorm_mlp_fp8_backward";

// LayerNormMLP's FP8 backward (Fp8LayerNormMLPFunction.backward in its fused order, without a
// returned ln_out): linear_fp8_backward of FC2 (grad_output into backward column 1), then,
// where need_fc1, of FC1 through the activation's derivative (column 0; it makes the scale
// update of both columns, as the Python steps do once both are recorded; FC2's call makes it
// where FC1's backward does not run), then the norm's backward where need_dgrad. The
// activation's gradient goes once FC1's cast has read it, but what the node saved (FC2's FP8
// input and weight copy, FC1's output) stays alive until the call returns, where the Python
// steps free it as they go: so the Python caller keeps those steps, and their memory-lean
// order, for large blocks (layernorm_mlp_fn.LEAN_BYTES). need_fc1 must come with
// need_dgrad or need_wgrad1, and need_fc1 or need_wgrad2 must hold.
//
// Returns (grad_input [M, K], grad_gamma, grad_beta, FC1's grad_weight and grad_bias, FC2's
// grad_weight and grad_bias), each [0] where not needed.
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> layernorm_mlp_fp8_backward(
    Tensor grad_output, Tensor x, Tensor mu, Tensor rsigma, Tensor gamma, bool has_beta, int64_t norm,
    bool zero_centered_gamma, Tensor ln_sinv, Tensor ln_col, Tensor w1_sinv, Tensor w1_col, Tensor h, int64_t act,
    Tensor a_sinv, Tensor a_col, Tensor w2_sinv, Tensor w2_col, Tensor grad_history, Tensor grad_scale,
    Tensor grad_scale_inv, Tensor workspace, bool current, int64_t fwd_dtype, int64_t bwd_dtype, bool pow2,
    double epsilon, int64_t algo, int64_t margin, bool need_dgrad, bool need_wgrad1, bool need_fc1,
    bool need_wgrad2, ScalarType w1_dtype, std::optional<ScalarType> b1_dtype, ScalarType w2_dtype,
    std::optional<ScalarType> b2_dtype, std::optional<Tensor> grad_input_add, int64_t stream) {
  using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
  return guarded(kMlpBackward, grad_output, [&]() -> Outputs {
    const char *op = kMlpBackward;
    TE_EAGER_CHECK(need_fc1 || need_wgrad2, op, ": FC2's dgrad or wgrad must be needed");
    TE_EAGER_CHECK(!need_fc1 || need_dgrad || need_wgrad1, op,
                   ": FC1's backward must need its dgrad or wgrad when it runs");
    TE_EAGER_CHECK(x.dim() == 2 && h.dim() == 2, op, ": x and h must be matrices");
    TE_EAGER_CHECK((need_fc1 && need_dgrad) || !grad_input_add.has_value(), op,
                   ": grad_input_add needs need_fc1 and need_dgrad");
    auto [status2, grad_act, grad_w2, grad_b2] = linear_fp8_backward(
        grad_output, std::nullopt, TE_ACTIVATION_IDENTITY, a_sinv, w2_sinv, a_col, w2_col, grad_history, grad_scale,
        grad_scale_inv, 1, !need_fc1, workspace, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin, need_fc1,
        need_wgrad2, h.scalar_type(), w2_dtype, b2_dtype, stream);
    ok(status2);
    // (each output not computed an empty tensor of its own: outputs must not alias)
    const auto none = [&] { return empty({0}, aoti_torch_dtype_float32(), grad_output); };
    Tensor d_ln, grad_w1 = none(), grad_b1 = none(), dx = none(), dgamma = none(), dbeta = none();
    if (need_fc1) {
      int64_t status1 = 0;
      std::tie(status1, d_ln, grad_w1, grad_b1) = linear_fp8_backward(
          std::move(grad_act), h, act, ln_sinv, w1_sinv, ln_col, w1_col, grad_history, grad_scale, grad_scale_inv, 0, true,
          workspace, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin, need_dgrad, need_wgrad1,
          x.scalar_type(), w1_dtype, b1_dtype, stream);
      ok(status1);
    }
    if (need_fc1 && need_dgrad) {
      std::tie(dx, dgamma, dbeta) = norm_backward(d_ln, x, mu, rsigma, gamma, has_beta, norm, zero_centered_gamma,
                                                  grad_input_add, reinterpret_cast<te_stream>(stream), op);
    }
    return {dx, dgamma, dbeta, grad_w1, grad_b1, grad_w2, grad_b2};
  });
}

}  // namespace
}  // namespace te_eager

STABLE_TORCH_LIBRARY_IMPL(te_eager, CompositeExplicitAutograd, m) {
  m.impl("layernorm_linear_fp8_forward", TORCH_BOX(&te_eager::layernorm_linear_fp8_forward));
  m.impl("layernorm_linear_fp8_backward", TORCH_BOX(&te_eager::layernorm_linear_fp8_backward));
  m.impl("layernorm_mlp_fp8_forward", TORCH_BOX(&te_eager::layernorm_mlp_fp8_forward));
  m.impl("layernorm_mlp_fp8_backward", TORCH_BOX(&te_eager::layernorm_mlp_fp8_backward));
}
