// The attention half of a Transformer layer under per-tensor FP8 (layer_block_nodes.py's
// nodes), with few operator calls: its forward is one call (the QKV block, attention over the
// heads of its output read in place, the projection; with the residual, the MLP block and the
// second residual after it, the whole layer's forward), and the backward two: the projection's
// and attention's backward here, then blocks.cpp's QKV block backward once the Python caller
// has freed what attention read (as the Python steps free it).
//
// The same core calls with the same arguments as the Python steps (ops.attention_forward and
// attention_backward_packed, fast_linear, linear_backward, the residual add of
// layer_block_nodes._residual), so the same bits. Why: a layer step is bound by host time at
// hidden 1024 on the GPU's host, and the Python between those calls (the attention call's
// config and views, the operators' wrappers, the residual) is a share of it
// (benchmarks/results/host_probes.md).
#include <cstring>
#include <map>
#include <mutex>

#include "operators.h"
#include "transformer_engine/attention.h"
#include "transformer_engine/dropout.h"

namespace te_eager {
namespace {

// Where q, k and v sit in the QKV output [M, F]: each one's 4-d shape and strides and its
// offset from the output's first element, in elements (the `views` argument: 27 values, q's
// then k's then v's, each as shape[4], stride[4], offset).
struct Views {
  int64_t shape[3][4];
  int64_t stride[3][4];
  int64_t offset[3];
};

constexpr const char *kNames[3] = {"q", "k", "v"};

Views views_of(const std::vector<int64_t> &values, int64_t qkv_elements, const char *op) {
  TE_EAGER_CHECK(values.size() == 27, op, ": views must hold 27 values (shape, stride and offset of q, k and v), got ",
                 values.size());
  Views out{};
  for (int i = 0; i < 3; ++i) {
    const int64_t *v = values.data() + 9 * i;
    int64_t last = v[8];  // (the view's last element)
    for (int d = 0; d < 4; ++d) {
      TE_EAGER_CHECK(v[d] > 0 && v[4 + d] >= 0, op, ": the view of ", kNames[i],
                     " must have positive sizes and non-negative strides");
      out.shape[i][d] = v[d];
      out.stride[i][d] = v[4 + d];
      last += (v[d] - 1) * v[4 + d];
    }
    out.offset[i] = v[8];
    TE_EAGER_CHECK(v[8] >= 0 && last < qkv_elements, op, ": the view of ", kNames[i], " lies outside the QKV output");
  }
  return out;
}

// The attention call's config (ops.attention.config): `strides` are qkv_strides' six (row and
// head stride of q, k, v) or none when all three are dense.
te_attention_config config_of(int64_t layout, int64_t mask, int64_t window_left, int64_t window_right,
                              double softmax_scale, double dropout, bool deterministic, int64_t backend,
                              const std::vector<int64_t> &strides, const char *op) {
  TE_EAGER_CHECK(strides.empty() || strides.size() == 6, op, ": strides must hold 6 values or none, got ",
                 strides.size());
  TE_EAGER_CHECK(layout == TE_ATTN_LAYOUT_BSHD || layout == TE_ATTN_LAYOUT_SBHD, op,
                 ": the layout must be bshd or sbhd (q, k, v read in place)");
  te_attention_config c;
  std::memset(&c, 0, sizeof(c));  // (padding too: the bytes are the workspace cache's key)
  c.layout = static_cast<te_attn_layout>(layout);
  c.mask_type = static_cast<te_attn_mask_type>(mask);
  c.window_left = window_left;
  c.window_right = window_right;
  c.softmax_scale = static_cast<float>(softmax_scale);
  c.dropout = static_cast<float>(dropout);
  c.deterministic = deterministic ? 1 : 0;
  c.backend = static_cast<te_attn_backend>(backend);
  for (size_t i = 0; i < strides.size(); i += 2) {
    c.row_stride[i / 2] = strides[i];
    c.head_stride[i / 2] = strides[i + 1];
  }
  return c;
}

// The problem's sizes (ops.attention.sizes_of) of q, k, v in `layout`.
te_attention_problem problem_of(const Views &v, int64_t layout, te_dtype dtype, const Tensor &on) {
  te_attention_problem p;
  std::memset(&p, 0, sizeof(p));
  const bool bshd = layout == TE_ATTN_LAYOUT_BSHD;
  p.batch = bshd ? v.shape[0][0] : v.shape[0][1];
  p.seqlen_q = bshd ? v.shape[0][1] : v.shape[0][0];
  p.seqlen_kv = bshd ? v.shape[1][1] : v.shape[1][0];
  p.heads_q = v.shape[0][2];
  p.heads_kv = v.shape[1][2];
  p.head_dim_qk = v.shape[0][3];
  p.head_dim_v = v.shape[2][3];
  p.total_q = p.batch * p.seqlen_q;
  p.total_kv = p.batch * p.seqlen_kv;
  p.qkv_dtype = p.o_dtype = p.do_dtype = p.grad_dtype = dtype;
  p.device = on.is_cuda() ? TE_DEVICE_CUDA : TE_DEVICE_CPU;
  p.device_id = on.is_cuda() ? on.get_device_index() : 0;
  return p;
}

// The CUDA workspace of a call: none on the CPU or where the call needs none (an allocation
// costs host time). Its size is the core's query, which plans the call and costs tens of
// microseconds, so it is asked once per kind of call (ops.attention._workspace_for keeps its
// own sizes the same way).
std::optional<Tensor> attention_workspace(const te_attention_config &c, const te_attention_problem &p, bool backward,
                                          const Tensor &on, const char *op) {
  if (!on.is_cuda()) return std::nullopt;
  static std::mutex mutex;
  static std::map<std::string, size_t> sizes;
  std::string key(reinterpret_cast<const char *>(&c), sizeof(c));
  key.append(reinterpret_cast<const char *>(&p), sizeof(p));
  key.push_back(backward ? 1 : 0);
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = sizes.find(key);
    if (it != sizes.end()) {
      bytes = it->second;
    } else {
      check(te_attention_workspace_size(&c, &p, backward ? 1 : 0, &bytes), op);
      if (sizes.size() >= 1024) sizes.clear();  // (shapes that keep changing: no unbounded growth)
      sizes.emplace(std::move(key), bytes);
    }
  }
  if (bytes == 0) return std::nullopt;
  return empty({static_cast<int64_t>(bytes)}, aoti_torch_dtype_uint8(), on);
}

void *data_of(const std::optional<Tensor> &t) { return t.has_value() ? t->data_ptr() : nullptr; }
size_t bytes_of(const std::optional<Tensor> &t) { return t.has_value() ? static_cast<size_t>(t->numel()) : 0; }

// A 4-d view's buffer (its strides are the config's).
te_buffer view_buffer(char *base, const Views &v, int i, te_dtype dtype, size_t element, const Tensor &on) {
  te_buffer b = buffer(base + v.offset[i] * static_cast<int64_t>(element), dtype, {}, on);
  b.ndim = 4;
  for (int d = 0; d < 4; ++d) b.shape[d] = v.shape[i][d];
  return b;
}

// The rng state of a call with dropout (int64 [2]), else none.
void set_rng(Handle &h, const Tensor &rng, double p, const char *op) {
  if (p <= 0.0) return;
  TE_EAGER_CHECK(rng.numel() == 2 && rng.scalar_type() == ScalarType::Long && rng.is_contiguous(), op,
                 ": a dropout's rng state must be a contiguous int64 [2] tensor");
  h.set(TE_SLOT_DATA, whole(rng, TE_DTYPE_INT64));
}

// residual + dropout(h) with dropout p > 0 (te_dropout_add_forward, rng_state int64 [2]),
// else residual + h: layer_block_nodes._residual's two ways, so its bits.
Tensor add_residual(const Tensor &h, const Tensor &residual, double p, const Tensor &rng, te_stream stream,
                    const char *op) {
  if (p <= 0.0) return torch::stable::subtract(residual, h, -1.0);  // r - (-1) * h = r + h, exactly
  Tensor y = empty({h.size(0), h.size(1)}, torch_dtype(h.scalar_type()), h);
  const te_dtype dtype = core_dtype(h.scalar_type(), op);
  Handle hx(op), hr(op), hy(op), hrng(op);
  hx.set(TE_SLOT_DATA, whole(h, dtype));
  hr.set(TE_SLOT_DATA, whole(residual, dtype));
  hy.set(TE_SLOT_DATA, whole(y, dtype));
  set_rng(hrng, rng, p, op);
  check(te_dropout_add_forward(static_cast<float>(p), hx.get(), hr.get(), hrng.get(), hy.get(), stream), op);
  return y;
}

constexpr const char *kForward = "te_eager.attention_block_fp8_forward";

// x [M, K] -> proj(attention(qkv(norm(x)))): layernorm_linear_fp8_forward (need_dgrad and
// need_wgrad), attention over `views` of its output with `strides`, then linear_fp8_forward of
// o [M, H * D] (both copies, shared buffers: the eager step's).
//
// Returns (output [M, N], then what the backward reads: the QKV block's six
// (layernorm_linear_fp8_forward's), the QKV output, o, softmax_lse, and the projection's four
// (its input's and weight's scale_inv and column-wise copies)).
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor>
attention_block_fp8_forward(Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps,
                            bool zero_centered_gamma, Tensor w_qkv, std::optional<Tensor> b_qkv, Tensor w_proj,
                            std::optional<Tensor> b_proj, Tensor qkv_scales, Tensor qkv_history, Tensor proj_scales,
                            Tensor proj_history, Tensor workspace, bool current, int64_t fp8_dtype, bool pow2,
                            double epsilon, std::vector<int64_t> views, std::vector<int64_t> strides, int64_t layout,
                            int64_t mask, int64_t window_left, int64_t window_right, double softmax_scale,
                            double dropout, int64_t backend, Tensor attention_rng, int64_t stream_handle) {
  using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor, Tensor>;
  return guarded(kForward, input, [&]() -> Outputs {
    const char *op = kForward;
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    // (the attention's arguments are checked first: a failed call writes nothing)
    TE_EAGER_CHECK(input.dim() == 2 && w_qkv.dim() == 2, op, ": input and w_qkv must be matrices");
    const Views v = views_of(views, input.size(0) * w_qkv.size(0), op);
    const te_attention_config config =
        config_of(layout, mask, window_left, window_right, softmax_scale, dropout, false, backend, strides, op);
    auto [status1, qkv, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col] = layernorm_linear_fp8_forward(
        input, gamma, beta, norm, eps, zero_centered_gamma, w_qkv, b_qkv, qkv_scales, qkv_history, workspace, current,
        fp8_dtype, pow2, epsilon, true, true, stream_handle);
    ok(status1);
    const te_dtype dtype = core_dtype(qkv.scalar_type(), op);
    const te_attention_problem problem = problem_of(v, layout, dtype, qkv);
    // o: q's layout with v's head dim, dense; softmax_lse [batch, heads_q, seqlen_q] fp32
    const std::vector<int64_t> o_shape = {v.shape[0][0], v.shape[0][1], v.shape[0][2], v.shape[2][3]};
    Tensor o = empty(o_shape, torch_dtype(qkv.scalar_type()), qkv);
    Tensor lse = empty({problem.batch, problem.heads_q, problem.seqlen_q}, aoti_torch_dtype_float32(), qkv);
    const std::optional<Tensor> ws = attention_workspace(config, problem, false, qkv, op);
    char *base = static_cast<char *>(qkv.data_ptr());
    const size_t element = te_dtype_size(dtype);
    Handle hq(op), hk(op), hv(op), ho(op), hl(op), rng(op);
    hq.set(TE_SLOT_DATA, view_buffer(base, v, 0, dtype, element, qkv));
    hk.set(TE_SLOT_DATA, view_buffer(base, v, 1, dtype, element, qkv));
    hv.set(TE_SLOT_DATA, view_buffer(base, v, 2, dtype, element, qkv));
    ho.set(TE_SLOT_DATA, whole(o, dtype));
    hl.set(TE_SLOT_DATA, whole(lse, TE_DTYPE_FLOAT32));
    set_rng(rng, attention_rng, dropout, op);
    check(te_attention_forward(&config, hq.get(), hk.get(), hv.get(), ho.get(), hl.get(), nullptr, nullptr,
                               dropout > 0.0 ? rng.get() : nullptr, nullptr, data_of(ws), bytes_of(ws), stream),
          op);
    const int64_t m = input.size(0);
    Tensor o2 = piece(o, {m, o.numel() / m}, 0);
    auto [status2, out, x_sinv, pw_sinv, x_col, pw_col] =
        linear_fp8_forward(o2, w_proj, b_proj, proj_scales, proj_history, workspace, current, fp8_dtype, pow2, epsilon,
                           true, true, false, stream_handle);
    ok(status2);
    return {out, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, qkv, o, lse, x_sinv, pw_sinv, x_col, pw_col};
  });
}

constexpr const char *kLayerForward = "te_eager.layer_fp8_forward";

// A pre-norm Transformer layer's whole forward, x [M, K] -> mid + mlp(norm(mid)) with mid =
// x + proj(attention(qkv(norm(x)))) (each residual with dropout p > 0 when residual_dropout
// is): attention_block_fp8_forward, the residual add, layernorm_mlp_fp8_forward of mid (every
// gradient needed) and the second residual add. rng states: attention's, then the two
// residuals' (empty where not used).
//
// Returns (output [M, K], the attention half's thirteen tensors that its backward reads (as
// attention_block_fp8_forward returns them after its output), mid, the MLP's eleven (as
// layernorm_mlp_fp8_forward returns them after its output)).
std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor>
layer_fp8_forward(Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps,
                  bool zero_centered_gamma, Tensor w_qkv, std::optional<Tensor> b_qkv, Tensor w_proj,
                  std::optional<Tensor> b_proj, Tensor qkv_scales, Tensor qkv_history, Tensor proj_scales,
                  Tensor proj_history, Tensor workspace, bool current, int64_t fp8_dtype, bool pow2, double epsilon,
                  std::vector<int64_t> views, std::vector<int64_t> strides, int64_t layout, int64_t mask,
                  int64_t window_left, int64_t window_right, double softmax_scale, double dropout, int64_t backend,
                  Tensor attention_rng, Tensor gamma2, std::optional<Tensor> beta2, int64_t norm2, double eps2,
                  bool zero_centered_gamma2, Tensor w1, std::optional<Tensor> b1, int64_t act, Tensor w2,
                  std::optional<Tensor> b2, Tensor mlp_scales, Tensor mlp_history, double residual_dropout,
                  Tensor residual_rng1, Tensor residual_rng2, int64_t stream_handle) {
  using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                             Tensor, Tensor, Tensor, Tensor>;
  return guarded(kLayerForward, input, [&]() -> Outputs {
    const char *op = kLayerForward;
    // (the MLP's operands are checked before anything runs: a failed call writes nothing)
    TE_EAGER_CHECK(w1.dim() == 2 && w2.dim() == 2 && w1.size(1) == input.size(1) && w2.size(0) == input.size(1), op,
                   ": the MLP's weights must be [F, K] and [K, F'] for the input's K = ", input.size(1));
    TE_EAGER_CHECK(gamma2.dim() == 1 && gamma2.size(0) == input.size(1), op,
                   ": the MLP norm's gamma must be a [", input.size(1), "] vector");
    TE_EAGER_CHECK(input.dim() == 2 && input.is_contiguous() && w_proj.dim() == 2 && w_proj.size(0) == input.size(1),
                   op, ": input must be a contiguous matrix [M, K] and the projection's weight [K, N]");
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    auto [status1, proj_out, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, qkv, o, lse, x_sinv, pw_sinv, x_col, pw_col] =
        attention_block_fp8_forward(input, gamma, beta, norm, eps, zero_centered_gamma, w_qkv, b_qkv, w_proj, b_proj,
                                    qkv_scales, qkv_history, proj_scales, proj_history, workspace, current, fp8_dtype,
                                    pow2, epsilon, views, strides, layout, mask, window_left, window_right,
                                    softmax_scale, dropout, backend, attention_rng, stream_handle);
    ok(status1);
    Tensor mid = add_residual(proj_out, input, residual_dropout, residual_rng1, stream, op);
    auto [status2, mlp_out, ln_sinv2, ln_col2, mu2, rsigma2, w1_sinv, w1_col, h, a_sinv, a_col, w2_sinv, w2_col] =
        layernorm_mlp_fp8_forward(mid, gamma2, beta2, norm2, eps2, zero_centered_gamma2, w1, b1, act, w2, b2,
                                  mlp_scales, mlp_history, workspace, current, fp8_dtype, pow2, epsilon, true, true,
                                  true, true, stream_handle);
    ok(status2);
    Tensor out = add_residual(mlp_out, mid, residual_dropout, residual_rng2, stream, op);
    return {out, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col, qkv, o, lse, x_sinv, pw_sinv, x_col, pw_col,
            mid, ln_sinv2, ln_col2, mu2, rsigma2, w1_sinv, w1_col, h, a_sinv, a_col, w2_sinv, w2_col};
  });
}

constexpr const char *kBackward = "te_eager.attention_block_fp8_backward";

// The gradient of the QKV output [M, F] (and of the projection's weight and bias) from g
// [M, N], the projection output's: linear_fp8_backward of the projection (backward column 0,
// the scale update), then attention's backward with dq, dk, dv written where q, k, v sit in
// the gradient (attention_backward_packed). o [.., heads, D] and softmax_lse as the forward
// wrote them.
//
// Returns (grad of the QKV output, grad_weight, grad_bias of the projection ([0] without one)).
std::tuple<int64_t, Tensor, Tensor, Tensor> attention_block_fp8_backward(
    Tensor grad_output, Tensor qkv, Tensor o, Tensor lse, Tensor attention_rng, Tensor x_sinv, Tensor pw_sinv,
    Tensor x_col, Tensor pw_col, Tensor grad_history, Tensor grad_scale, Tensor grad_scale_inv, Tensor workspace,
    bool current, int64_t fwd_dtype, int64_t bwd_dtype, bool pow2, double epsilon, int64_t algo, int64_t margin,
    ScalarType weight_dtype, std::optional<ScalarType> bias_dtype, std::vector<int64_t> views,
    std::vector<int64_t> strides, int64_t layout, int64_t mask, int64_t window_left, int64_t window_right,
    double softmax_scale, double dropout, bool deterministic, int64_t backend, int64_t stream_handle) {
  return guarded(kBackward, grad_output, [&]() -> std::tuple<Tensor, Tensor, Tensor> {
    const char *op = kBackward;
    TE_EAGER_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), op, ": qkv must be the contiguous QKV output [M, F]");
    TE_EAGER_CHECK(o.is_contiguous() && lse.is_contiguous() && o.scalar_type() == qkv.scalar_type(), op,
                   ": o and softmax_lse must be contiguous, o in qkv's dtype");
    const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
    // (checked before the projection's backward updates the scales: a failed call writes nothing)
    const Views v = views_of(views, qkv.numel(), op);
    const te_attention_config config =
        config_of(layout, mask, window_left, window_right, softmax_scale, dropout, deterministic, backend, strides, op);
    const te_dtype dtype = core_dtype(qkv.scalar_type(), op);
    const te_attention_problem problem = problem_of(v, layout, dtype, qkv);
    TE_EAGER_CHECK(o.dim() == 4 && o.numel() == problem.total_q * problem.heads_q * problem.head_dim_v &&
                       lse.numel() == problem.batch * problem.heads_q * problem.seqlen_q,
                   op, ": o and softmax_lse must be the forward's");
    auto [status, d_o, grad_weight, grad_bias] = linear_fp8_backward(
        grad_output, std::nullopt, TE_ACTIVATION_IDENTITY, x_sinv, pw_sinv, x_col, pw_col, grad_history, grad_scale,
        grad_scale_inv, 0, true, workspace, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin, true, true,
        o.scalar_type(), weight_dtype, bias_dtype, stream_handle);
    ok(status);
    TE_EAGER_CHECK(d_o.numel() == o.numel(), op, ": the projection's grad_input must have o's elements");
    Tensor d_qkv = empty({qkv.size(0), qkv.size(1)}, torch_dtype(qkv.scalar_type()), qkv);
    const std::optional<Tensor> ws = attention_workspace(config, problem, true, qkv, op);
    char *base = static_cast<char *>(qkv.data_ptr()), *d_base = static_cast<char *>(d_qkv.data_ptr());
    const size_t element = te_dtype_size(dtype);
    Handle hq(op), hk(op), hv(op), ho(op), hdo(op), hl(op), rng(op), hdq(op), hdk(op), hdv(op);
    hq.set(TE_SLOT_DATA, view_buffer(base, v, 0, dtype, element, qkv));
    hk.set(TE_SLOT_DATA, view_buffer(base, v, 1, dtype, element, qkv));
    hv.set(TE_SLOT_DATA, view_buffer(base, v, 2, dtype, element, qkv));
    hdq.set(TE_SLOT_DATA, view_buffer(d_base, v, 0, dtype, element, qkv));
    hdk.set(TE_SLOT_DATA, view_buffer(d_base, v, 1, dtype, element, qkv));
    hdv.set(TE_SLOT_DATA, view_buffer(d_base, v, 2, dtype, element, qkv));
    ho.set(TE_SLOT_DATA, whole(o, dtype));
    te_buffer d_o_buffer = whole(o, dtype);  // (d_o has o's elements: seen in o's shape)
    d_o_buffer.data = d_o.data_ptr();
    hdo.set(TE_SLOT_DATA, d_o_buffer);
    hl.set(TE_SLOT_DATA, whole(lse, TE_DTYPE_FLOAT32));
    set_rng(rng, attention_rng, dropout, op);
    check(te_attention_backward(&config, hq.get(), hk.get(), hv.get(), ho.get(), hdo.get(), hl.get(), nullptr, nullptr,
                                dropout > 0.0 ? rng.get() : nullptr, nullptr, hdq.get(), hdk.get(), hdv.get(), nullptr,
                                data_of(ws), bytes_of(ws), stream),
          op);
    return {d_qkv, grad_weight, grad_bias};
  });
}

}  // namespace
}  // namespace te_eager

STABLE_TORCH_LIBRARY_IMPL(te_eager, CompositeExplicitAutograd, m) {
  m.impl("attention_block_fp8_forward", TORCH_BOX(&te_eager::attention_block_fp8_forward));
  m.impl("attention_block_fp8_backward", TORCH_BOX(&te_eager::attention_block_fp8_backward));
  m.impl("layer_fp8_forward", TORCH_BOX(&te_eager::layer_fp8_forward));
}
