// Tests of te_norm_forward / te_norm_backward on the CPU path: values worked out by hand, and
// the validation messages (the Python tests cover shapes, dtypes and FP8 outputs at large).
#include <cmath>
#include <vector>

#include "test_util.h"

using te_test::TensorHandle;

namespace {
bool near(float a, float b) { return std::fabs(a - b) <= 1e-6f * (1.0f + std::fabs(b)); }
}  // namespace

TEST_CASE(layernorm_of_one_row) {
  std::vector<float> x = {1, 2, 3, 4}, g = {1, 1, 2, 2}, b = {0, 0, 0, 1}, y(4), mu(1), rs(1);
  TensorHandle tx, tg, tb, ty, tmu, trs;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 4});
  tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {4});
  tb.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT32, {4});
  ty.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {1, 4});
  tmu.set(TE_SLOT_DATA, mu.data(), TE_DTYPE_FLOAT32, {1});
  trs.set(TE_SLOT_DATA, rs.data(), TE_DTYPE_FLOAT32, {1});
  const te_norm_config cfg{TE_NORM_LAYERNORM, 0.0f, 0};
  CHECK(te_norm_forward(&cfg, tx, tg, tb, ty, nullptr, tmu, trs, nullptr) == TE_SUCCESS);
  const float r = 1.0f / std::sqrt(1.25f);  // variance of 1..4 is 1.25
  CHECK(mu[0] == 2.5f && near(rs[0], r));
  CHECK(near(y[0], -1.5f * r) && near(y[2], 2 * 0.5f * r) && near(y[3], 2 * 1.5f * r + 1));
}

TEST_CASE(norm_fp8_amax_overwrites_or_accumulates) {
  // RMSNorm of [3, 4] (rms = sqrt(12.5)) with g = 1: max|y| = 4 / sqrt(12.5).
  std::vector<float> x = {3, 4}, g = {1, 1}, rs(1), scale = {1.0f}, scale_inv = {0.0f}, amax = {9.0f};
  std::vector<uint8_t> q(2);
  TensorHandle tx, tg, tq, trs;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 2});
  tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {2});
  tq.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {1, 2});
  tq.set(TE_SLOT_SCALE, scale.data(), TE_DTYPE_FLOAT32, {1});
  tq.set(TE_SLOT_SCALE_INV, scale_inv.data(), TE_DTYPE_FLOAT32, {1});
  tq.set(TE_SLOT_AMAX, amax.data(), TE_DTYPE_FLOAT32, {1});
  trs.set(TE_SLOT_DATA, rs.data(), TE_DTYPE_FLOAT32, {1});
  const float y_max = 4.0f * (1.0f / std::sqrt(12.5f));
  te_norm_config cfg{TE_NORM_RMSNORM, 0.0f, 0, 1};  // accumulate: 9 stays
  CHECK(te_norm_forward(&cfg, tx, tg, nullptr, nullptr, tq, nullptr, trs, nullptr) == TE_SUCCESS);
  CHECK(amax[0] == 9.0f);
  amax[0] = 0.5f;  // accumulate: raised to max|y|
  CHECK(te_norm_forward(&cfg, tx, tg, nullptr, nullptr, tq, nullptr, trs, nullptr) == TE_SUCCESS);
  CHECK(near(amax[0], y_max));
  cfg.accumulate_amax = 0;  // overwrite
  amax[0] = 9.0f;
  CHECK(te_norm_forward(&cfg, tx, tg, nullptr, nullptr, tq, nullptr, trs, nullptr) == TE_SUCCESS);
  CHECK(near(amax[0], y_max));
}

TEST_CASE(rmsnorm_backward_of_a_constant_row_is_zero) {
  // x = c: xhat = 1 everywhere, so with g = 1, dx = rsigma * (dy - mean(dy)) = 0 for dy = 1.
  std::vector<float> x(8, 3.0f), dy(8, 1.0f), g(8, 1.0f), dx(8, -1), dg(8, -1), rs = {1.0f / 3.0f};
  TensorHandle tx, tdy, tg, tdx, tdg, trs;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 8});
  tdy.set(TE_SLOT_DATA, dy.data(), TE_DTYPE_FLOAT32, {1, 8});
  tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {8});
  tdx.set(TE_SLOT_DATA, dx.data(), TE_DTYPE_FLOAT32, {1, 8});
  tdg.set(TE_SLOT_DATA, dg.data(), TE_DTYPE_FLOAT32, {8});
  trs.set(TE_SLOT_DATA, rs.data(), TE_DTYPE_FLOAT32, {1});
  const te_norm_config cfg{TE_NORM_RMSNORM, 0.0f, 0};
  CHECK(te_norm_backward(&cfg, tdy, tx, nullptr, trs, tg, nullptr, tdx, tdg, nullptr, nullptr, 0, nullptr) ==
        TE_SUCCESS);
  for (int i = 0; i < 8; ++i) CHECK(dx[i] == 0.0f && dg[i] == 1.0f);
}

TEST_CASE(norm_rejects_bad_arguments_and_writes_nothing) {
  std::vector<float> x(8, 1.0f), g(7, 1.0f), y(8, 5.0f), rs(2, 5.0f);
  TensorHandle tx, tg, ty, trs;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {2, 4});
  tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {7});
  ty.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {2, 4});
  trs.set(TE_SLOT_DATA, rs.data(), TE_DTYPE_FLOAT32, {2});
  const te_norm_config cfg{TE_NORM_RMSNORM, 1e-5f, 0};
  CHECK_ERROR(te_norm_forward(&cfg, tx, tg, nullptr, ty, nullptr, nullptr, trs, nullptr), TE_ERROR_VALUE,
              "norm_forward: gamma.data must have shape [4], got float32 [7]");
  CHECK_ERROR(te_norm_forward(nullptr, tx, tg, nullptr, ty, nullptr, nullptr, trs, nullptr), TE_ERROR_VALUE,
              "norm_forward: config must be a pointer");
  for (float v : y) CHECK(v == 5.0f);
  for (float v : rs) CHECK(v == 5.0f);
}

int main() { return te_test::run_all(); }
