// Tests of the attention entry points on the CPU path: values worked out by hand, the backend
// query, and the validation messages (the Python tests compare against float64 at large).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "test_util.h"

using te_test::TensorHandle;

namespace {

bool near(float a, float b) { return std::fabs(a - b) <= 1e-6f * (1.0f + std::fabs(b)); }

te_attention_config causal_bshd(float scale) {
  te_attention_config c{};
  c.layout = TE_ATTN_LAYOUT_BSHD;
  c.mask_type = TE_ATTN_MASK_CAUSAL;
  c.window_left = -1;
  c.window_right = -1;
  c.softmax_scale = scale;
  c.backend = TE_ATTN_BACKEND_AUTO;
  return c;
}

}  // namespace

TEST_CASE(causal_attention_of_two_tokens) {
  // One head of dim 1: q = k = [1, 1], v = [2, 4]. Query 0 sees key 0 only: o0 = 2, lse0 = s.
  // Query 1 sees both with equal logits: o1 = 3, lse1 = s + log 2 (s = scale * 1 * 1).
  std::vector<float> q = {1, 1}, k = {1, 1}, v = {2, 4}, o(2, -1), lse(2, 0);
  TensorHandle tq, tk, tv, to, tl;
  tq.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  tk.set(TE_SLOT_DATA, k.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  tv.set(TE_SLOT_DATA, v.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  to.set(TE_SLOT_DATA, o.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  tl.set(TE_SLOT_DATA, lse.data(), TE_DTYPE_FLOAT32, {1, 1, 2});
  const te_attention_config cfg = causal_bshd(0.5f);
  CHECK(te_attention_forward(&cfg, tq, tk, tv, to, tl, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                             nullptr) == TE_SUCCESS);
  CHECK(near(o[0], 2.0f) && near(o[1], 3.0f));
  CHECK(near(lse[0], 0.5f) && near(lse[1], 0.5f + std::log(2.0f)));
  // Backward with d_o = [1, 1]: dv = column sums of p = [1.5, 0.5]. Row 1 has p = [.5, .5],
  // dp = d_o . v = [2, 4], ds = p (dp - p . dp) = [-.5, .5]: dq1 = scale * sum ds k = 0 and
  // dk = scale * ds * q1 = [-.25, .25]; row 0 (one key) has ds = 0.
  std::vector<float> d_o = {1, 1}, dq(2, -1), dk(2, -1), dv(2, -1);
  TensorHandle tdo, tdq, tdk, tdv;
  tdo.set(TE_SLOT_DATA, d_o.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  tdq.set(TE_SLOT_DATA, dq.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  tdk.set(TE_SLOT_DATA, dk.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  tdv.set(TE_SLOT_DATA, dv.data(), TE_DTYPE_FLOAT32, {1, 2, 1, 1});
  CHECK(te_attention_backward(&cfg, tq, tk, tv, to, tdo, tl, nullptr, nullptr, nullptr, nullptr, tdq, tdk, tdv,
                              nullptr, nullptr, 0, nullptr) == TE_SUCCESS);
  CHECK(near(dv[0], 1.5f) && near(dv[1], 0.5f));
  CHECK(near(dq[0], 0.0f) && near(dq[1], 0.0f) && near(dk[0], -0.25f) && near(dk[1], 0.25f));
}

// The two-token example above in FP8: every value is exact in E4M3 (q, k, v, p, o) and E5M2
// (d_o, ds, the gradients) with unit scales, so the FP8 backward must reproduce it exactly, with
// an E5M2 d_o beside the E4M3 o (the HYBRID recipe) and the forward's softmax factors.
TEST_CASE(fp8_backward_of_two_tokens) {
  constexpr uint8_t kE4m3One = 0x38, kE4m3Two = 0x40, kE4m3Four = 0x48, kE5m2One = 0x3C;
  std::vector<uint8_t> q = {kE4m3One, kE4m3One}, k = q, v = {kE4m3Two, kE4m3Four}, o(2, 0xFF);
  std::vector<float> lse(2, 0), one = {1.0f};
  TensorHandle tq, tk, tv, to, tl, ts;
  for (auto [t, data] : {std::pair<te_tensor *, void *>{tq, q.data()}, {tk, k.data()}, {tv, v.data()}}) {
    te_buffer b = te_test::cpu_buffer(data, TE_DTYPE_FLOAT8_E4M3, {1, 2, 1, 1});
    te_tensor_set(t, TE_SLOT_DATA, &b);
    b = te_test::cpu_buffer(one.data(), TE_DTYPE_FLOAT32, {1});
    te_tensor_set(t, TE_SLOT_SCALE_INV, &b);
  }
  to.set(TE_SLOT_DATA, o.data(), TE_DTYPE_FLOAT8_E4M3, {1, 2, 1, 1});
  to.set(TE_SLOT_SCALE, one.data(), TE_DTYPE_FLOAT32, {1});
  to.set(TE_SLOT_SCALE_INV, one.data(), TE_DTYPE_FLOAT32, {1});
  tl.set(TE_SLOT_DATA, lse.data(), TE_DTYPE_FLOAT32, {1, 1, 2});
  ts.set(TE_SLOT_SCALE, one.data(), TE_DTYPE_FLOAT32, {1});
  ts.set(TE_SLOT_SCALE_INV, one.data(), TE_DTYPE_FLOAT32, {1});
  const te_attention_config cfg = causal_bshd(0.5f);
  CHECK(te_attention_forward(&cfg, tq, tk, tv, to, tl, nullptr, nullptr, nullptr, ts, nullptr, 0, nullptr) ==
        TE_SUCCESS);
  CHECK(o[0] == kE4m3Two && o[1] == 0x44);  // 3 = 1.5 * 2: E4M3 0 1000 100
  std::vector<uint8_t> d_o = {kE5m2One, kE5m2One}, dq(2, 0xFF), dk(2, 0xFF), dv(2, 0xFF);
  std::vector<float> amax_dp = {-1}, amax_g = {-1, -1, -1};
  TensorHandle tdo, tdq, tdk, tdv, tdp;
  tdo.set(TE_SLOT_DATA, d_o.data(), TE_DTYPE_FLOAT8_E5M2, {1, 2, 1, 1});
  tdo.set(TE_SLOT_SCALE_INV, one.data(), TE_DTYPE_FLOAT32, {1});
  int i = 0;
  for (auto [t, data] : {std::pair<te_tensor *, void *>{tdq, dq.data()}, {tdk, dk.data()}, {tdv, dv.data()}}) {
    te_buffer b = te_test::cpu_buffer(data, TE_DTYPE_FLOAT8_E5M2, {1, 2, 1, 1});
    te_tensor_set(t, TE_SLOT_DATA, &b);
    b = te_test::cpu_buffer(one.data(), TE_DTYPE_FLOAT32, {1});
    te_tensor_set(t, TE_SLOT_SCALE, &b);
    b = te_test::cpu_buffer(&amax_g[i++], TE_DTYPE_FLOAT32, {1});
    te_tensor_set(t, TE_SLOT_AMAX, &b);
  }
  tdp.set(TE_SLOT_SCALE, one.data(), TE_DTYPE_FLOAT32, {1});
  tdp.set(TE_SLOT_SCALE_INV, one.data(), TE_DTYPE_FLOAT32, {1});
  tdp.set(TE_SLOT_AMAX, amax_dp.data(), TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(te_attention_backward(&cfg, tq, tk, tv, to, tdo, tl, nullptr, nullptr, nullptr, nullptr, tdq, tdk, tdv,
                                    tdp, nullptr, 0, nullptr),
              TE_ERROR_VALUE, "attention_backward: softmax_fp8 must be a tensor handle");
  CHECK(dq[0] == 0xFF && amax_dp[0] == -1.0f);  // nothing written
  CHECK(te_attention_backward(&cfg, tq, tk, tv, to, tdo, tl, nullptr, nullptr, nullptr, ts, tdq, tdk, tdv, tdp,
                              nullptr, 0, nullptr) == TE_SUCCESS);
  // dq = [0, 0], dk = [-0.25, 0.25], dv = [1.5, 0.5]; ds of row 1 = +-0.25 (E5M2 bytes).
  CHECK(dq[0] == 0x00 && dq[1] == 0x00 && dk[0] == 0xB4 && dk[1] == 0x34 && dv[0] == 0x3E && dv[1] == 0x38);
  CHECK(amax_dp[0] == 0.25f && amax_g[0] == 0.0f && amax_g[1] == 0.25f && amax_g[2] == 1.5f);
  // A bf16 d_o cannot go with an E4M3 o.
  std::vector<uint16_t> d_o16(2, 0x3F80);
  TensorHandle tdo16;
  tdo16.set(TE_SLOT_DATA, d_o16.data(), TE_DTYPE_BFLOAT16, {1, 2, 1, 1});
  CHECK_ERROR(te_attention_backward(&cfg, tq, tk, tv, to, tdo16, tl, nullptr, nullptr, nullptr, ts, tdq, tdk, tdv,
                                    tdp, nullptr, 0, nullptr),
              TE_ERROR_TYPE, "d_o must be float8_e4m3 or float8_e5m2 (o is FP8), got bfloat16");
}

TEST_CASE(backend_query_names_each_backend) {
  const te_attention_config cfg = causal_bshd(0.125f);
  te_attention_problem p{};
  p.batch = 1;
  p.heads_q = p.heads_kv = 2;
  p.seqlen_q = p.seqlen_kv = 16;
  p.head_dim_qk = p.head_dim_v = 64;
  p.qkv_dtype = p.o_dtype = p.do_dtype = p.grad_dtype = TE_DTYPE_BFLOAT16;
  p.device = TE_DEVICE_CPU;
  te_attn_backend b = TE_ATTN_BACKEND_AUTO;
  char reasons[TE_ATTN_BACKEND_COUNT][TE_ATTN_REASON_SIZE];
  CHECK(te_attention_backend(&cfg, &p, 0, &b, reasons) == TE_SUCCESS);
  CHECK(b == TE_ATTN_BACKEND_CPU && reasons[TE_ATTN_BACKEND_CPU][0] == '\0');
  CHECK(std::strstr(reasons[TE_ATTN_BACKEND_CUDNN], "CUDA tensors") != nullptr);
  p.heads_kv = 3;
  CHECK_ERROR(te_attention_backend(&cfg, &p, 0, &b, reasons), TE_ERROR_VALUE, "attention_backend: heads_q",
              "multiple of heads_kv");
  size_t bytes = 1;
  p.heads_kv = 2;
  CHECK(te_attention_workspace_size(&cfg, &p, 1, &bytes) == TE_SUCCESS && bytes == 0);
  CHECK(std::strcmp(te_attn_backend_name(TE_ATTN_BACKEND_CUDA_MATH), "cuda_math") == 0);
}

TEST_CASE(validation_messages) {
  std::vector<float> q(16), k(32), o(16), lse(4);
  TensorHandle tq, tk, to, tl;
  tq.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT32, {1, 2, 2, 4});
  tk.set(TE_SLOT_DATA, k.data(), TE_DTYPE_FLOAT32, {1, 2, 2, 8});
  to.set(TE_SLOT_DATA, o.data(), TE_DTYPE_FLOAT32, {1, 2, 2, 4});
  tl.set(TE_SLOT_DATA, lse.data(), TE_DTYPE_FLOAT32, {1, 2, 2});
  te_attention_config cfg = causal_bshd(1.0f);
  CHECK_ERROR(te_attention_forward(&cfg, tq, tk, tk, to, tl, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                                   nullptr),
              TE_ERROR_VALUE, "attention_forward: k.data must have q's head dim 4");
  cfg.softmax_scale = 0.0f;
  CHECK_ERROR(te_attention_forward(&cfg, tq, tq, tq, to, tl, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                                   nullptr),
              TE_ERROR_VALUE, "config.softmax_scale must be finite and > 0");
  cfg = causal_bshd(1.0f);
  cfg.layout = static_cast<te_attn_layout>(7);
  CHECK_ERROR(te_attention_forward(&cfg, tq, tq, tq, to, tl, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                                   nullptr),
              TE_ERROR_VALUE, "config.layout must be");
  cfg = causal_bshd(1.0f);
  cfg.mask_type = TE_ATTN_MASK_PADDING;
  CHECK_ERROR(te_attention_forward(&cfg, tq, tq, tq, to, tl, nullptr, nullptr, nullptr, nullptr, nullptr, 0,
                                   nullptr),
              TE_ERROR_VALUE, "cu_seqlens_q must be a tensor handle");
}

TEST_CASE(scaled_softmax_causal_row) {
  // Row 0 of a causal 2x2: only j = 0 -> [1, 0]; row 1: equal inputs -> [0.5, 0.5].
  std::vector<float> x = {3, 5, 1, 1}, y(4, -1);
  TensorHandle tx, ty;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 1, 2, 2});
  ty.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {1, 1, 2, 2});
  CHECK(te_scaled_softmax_forward(TE_SOFTMAX_MASK_CAUSAL, 2.0f, tx, nullptr, ty, nullptr) == TE_SUCCESS);
  CHECK(y[0] == 1.0f && y[1] == 0.0f && near(y[2], 0.5f) && near(y[3], 0.5f));
}

int main() { return te_test::run_all(); }
