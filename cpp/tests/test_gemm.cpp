// Tests of te_gemm on the CPU path: small products worked out by hand, the FP8 scale rule, the
// epilogue, and the validation messages (the Python tests cover shapes and dtypes at large).
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/numerics.h"
#include "test_util.h"

using te_test::TensorHandle;

TEST_CASE(gemm_fp32_tn_with_bias) {
  // a [2, 3], b [2, 3] (N = 2): d = a @ b^T + bias.
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {1, 0, -1, 2, 1, 0}, bias = {10, 20}, d(4, -1);
  TensorHandle ta, tb, td, tbias;
  ta.set(TE_SLOT_DATA, a.data(), TE_DTYPE_FLOAT32, {2, 3});
  tb.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT32, {2, 3});
  td.set(TE_SLOT_DATA, d.data(), TE_DTYPE_FLOAT32, {2, 2});
  tbias.set(TE_SLOT_DATA, bias.data(), TE_DTYPE_FLOAT32, {2});
  CHECK(te_gemm(ta, tb, td, tbias, nullptr, nullptr, nullptr, 0, nullptr) == TE_SUCCESS);
  CHECK(d[0] == 1 - 3 + 10 && d[1] == 2 + 2 + 20 && d[2] == 4 - 6 + 10 && d[3] == 8 + 5 + 20);
}

TEST_CASE(gemm_fp8_applies_both_scale_invs_and_the_output_scale) {
  // 16x16x16 of ones (E4M3 x E5M2): each dot is 16, times scale_inv 0.5 * 0.25.
  std::vector<uint8_t> a(256, 0x38), b(256, 0x3C), d(256, 0);  // 1.0 in E4M3 and in E5M2
  float sa = 0.5f, sb = 0.25f, dscale = 4.0f, amax = -1, dscale_inv = -1;
  TensorHandle ta, tb, td;
  ta.set(TE_SLOT_DATA, a.data(), TE_DTYPE_FLOAT8_E4M3, {16, 16});
  ta.set(TE_SLOT_SCALE_INV, &sa, TE_DTYPE_FLOAT32, {1});
  tb.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT8_E5M2, {16, 16});
  tb.set(TE_SLOT_SCALE_INV, &sb, TE_DTYPE_FLOAT32, {1});
  td.set(TE_SLOT_DATA, d.data(), TE_DTYPE_FLOAT8_E4M3, {16, 16});
  td.set(TE_SLOT_SCALE, &dscale, TE_DTYPE_FLOAT32, {1});
  td.set(TE_SLOT_SCALE_INV, &dscale_inv, TE_DTYPE_FLOAT32, {1});
  td.set(TE_SLOT_AMAX, &amax, TE_DTYPE_FLOAT32, {1});
  CHECK(te_gemm(ta, tb, td, nullptr, nullptr, nullptr, nullptr, 0, nullptr) == TE_SUCCESS);
  CHECK(amax == 2.0f);                        // 16 * 0.5 * 0.25
  CHECK(dscale_inv == 0.25f);
  CHECK(d[0] == te::float_to_e4m3(8.0f) && d[255] == d[0]);  // 2 * scale 4
}

TEST_CASE(gemm_gelu_writes_the_pre_activation) {
  std::vector<float> a = {1, -1}, b = {2, 1}, d(1), pre(1);  // [1, 2] x [1, 2]^T = 1
  TensorHandle ta, tb, td, tpre;
  ta.set(TE_SLOT_DATA, a.data(), TE_DTYPE_FLOAT32, {1, 2});
  tb.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT32, {1, 2});
  td.set(TE_SLOT_DATA, d.data(), TE_DTYPE_FLOAT32, {1, 1});
  tpre.set(TE_SLOT_DATA, pre.data(), TE_DTYPE_FLOAT32, {1, 1});
  te_gemm_config cfg{0, 1, 0, 0, 1};
  CHECK(te_gemm(ta, tb, td, nullptr, tpre, &cfg, nullptr, 0, nullptr) == TE_SUCCESS);
  CHECK(pre[0] == 1.0f);
  CHECK(std::fabs(d[0] - 0.841192f) < 1e-5f);  // tanh-approximated GELU(1)
}

TEST_CASE(gemm_rejects_bad_arguments_and_writes_nothing) {
  std::vector<uint8_t> a(24 * 32, 0), b(32 * 32, 0);
  std::vector<float> d(24 * 32, 7.0f);
  float s = 1;
  TensorHandle ta, tb, td;
  ta.set(TE_SLOT_DATA, a.data(), TE_DTYPE_FLOAT8_E4M3, {24, 32});
  ta.set(TE_SLOT_SCALE_INV, &s, TE_DTYPE_FLOAT32, {1});
  tb.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT8_E4M3, {32, 32});
  tb.set(TE_SLOT_SCALE_INV, &s, TE_DTYPE_FLOAT32, {1});
  td.set(TE_SLOT_DATA, d.data(), TE_DTYPE_FLOAT32, {24, 32});
  CHECK_ERROR(te_gemm(ta, tb, td, nullptr, nullptr, nullptr, nullptr, 0, nullptr), TE_ERROR_VALUE,
              "gemm: M (rows of a) must be a multiple of 16 for FP8 operands", "got 24");
  CHECK_ERROR(te_gemm(nullptr, tb, td, nullptr, nullptr, nullptr, nullptr, 0, nullptr), TE_ERROR_VALUE,
              "gemm: a must be a tensor handle");
  te_gemm_config cfg{1, 1, 0, 0, 0};
  CHECK_ERROR(te_gemm(ta, tb, td, nullptr, nullptr, &cfg, nullptr, 0, nullptr), TE_ERROR_VALUE,
              "transpose_a = 0 and transpose_b = 1");
  for (float v : d) CHECK(v == 7.0f);
}

TEST_CASE(hopper_entry_points_exist_in_every_build) {
  // CPU buffers: the kernels have no CPU path, so every build refuses these calls; a build
  // without the kernels refuses anything with its own reason.
  std::vector<uint8_t> a(16 * 128, 0x38), b(128 * 128, 0x38);
  std::vector<float> sa(16, 1.0f), sb(1, 1.0f), d(16 * 128, 7.0f);
  TensorHandle ta(TE_SCALING_BLOCK_1X128), tb(TE_SCALING_BLOCK_128X128), td;
  ta.set(TE_SLOT_DATA, a.data(), TE_DTYPE_FLOAT8_E4M3, {16, 128});
  ta.set(TE_SLOT_SCALE_INV, sa.data(), TE_DTYPE_FLOAT32, {16, 1});
  tb.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT8_E4M3, {128, 128});
  tb.set(TE_SLOT_SCALE_INV, sb.data(), TE_DTYPE_FLOAT32, {1, 1});
  td.set(TE_SLOT_DATA, d.data(), TE_DTYPE_FLOAT32, {16, 128});
  const te_tensor *ga[1] = {ta}, *gb[1] = {tb};
  te_tensor *gd[1] = {td};
  if (te_hopper_gemm_available()) {
    CHECK(te_hopper_grouped_gemm_workspace_size(64) > 131072);
    CHECK_ERROR(te_hopper_block_scaled_gemm(ta, tb, td, nullptr, nullptr, nullptr, 0, nullptr), TE_ERROR_VALUE,
                "hopper_block_scaled_gemm: a.data must be on a CUDA device");
    CHECK(te_hopper_grouped_gemm(ga, gb, gd, nullptr, 1, nullptr, nullptr, 0, nullptr) != TE_SUCCESS);
  } else {
    CHECK(te_hopper_grouped_gemm_workspace_size(64) == 0);
    const char *why = "this build of the core has no Hopper kernels: built without CUTLASS or not for sm_90a";
    CHECK_ERROR(te_hopper_block_scaled_gemm(ta, tb, td, nullptr, nullptr, nullptr, 0, nullptr),
                TE_ERROR_UNSUPPORTED, "hopper_block_scaled_gemm: ", why);
    CHECK_ERROR(te_hopper_grouped_gemm(ga, gb, gd, nullptr, 1, nullptr, nullptr, 0, nullptr), TE_ERROR_UNSUPPORTED,
                "hopper_grouped_gemm: ", why);
  }
  for (float v : d) CHECK(v == 7.0f);
}

int main() { return te_test::run_all(); }
