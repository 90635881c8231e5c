// Tests of te_activation_forward / te_activation_backward on the CPU path: values worked out by
// hand, the FP8 + transpose + amax outputs, the dbias order, and the validation messages (the
// Python tests cover shapes, dtypes and accuracy at large).
#include <cmath>
#include <cstdint>
#include <vector>

#include "activation/activation_math.h"
#include "common/numerics.h"
#include "test_util.h"

using te_test::TensorHandle;

namespace {

bool near(float got, double want, double rel = 4e-7) {
  return std::fabs(got - want) <= rel * std::fabs(want) + 1e-30;
}

}  // namespace

TEST_CASE(exp2_is_accurate_and_saturates) {
  using te::act::exp2_nonpositive;
  CHECK(exp2_nonpositive(0.0f) == 1.0f && exp2_nonpositive(-0.0f) == 1.0f);
  CHECK(exp2_nonpositive(-1.0f) == 0.5f && exp2_nonpositive(-126.0f) == std::ldexp(1.0f, -126));
  CHECK(near(exp2_nonpositive(-0.3f), std::exp2(-0.3)));
  CHECK(near(exp2_nonpositive(-7.25f), std::exp2(-7.25)));
  CHECK(near(exp2_nonpositive(-100.5f), std::exp2(-100.5)));
  CHECK(near(exp2_nonpositive(-28.8539009f), std::exp2(double{-28.8539009f})));  // about e^-20
  // Subnormal results, rounded once: 2^-149 exactly, and 2^-140.3 = 415.87 * 2^-149.
  CHECK(exp2_nonpositive(-149.0f) == std::ldexp(1.0f, -149));
  CHECK(exp2_nonpositive(-140.3f) == 416 * std::ldexp(1.0f, -149));
  CHECK(exp2_nonpositive(-150.75f) == 0.0f && exp2_nonpositive(-1000.0f) == 0.0f);
  CHECK(exp2_nonpositive(-INFINITY) == 0.0f && std::isnan(exp2_nonpositive(NAN)));
}

TEST_CASE(forward_values_by_hand) {
  // gelu(1) = 0.5 (1 + tanh(0.79788456 * 1.044715)) = 0.841192; silu(1) = 1/(1+e^-1).
  std::vector<float> x = {1.0f, -1.0f, 0.0f, 2.0f}, y(4, -1.0f);
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 4});
  out.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {1, 4});
  CHECK(te_activation_forward(TE_ACTIVATION_GELU, nullptr, in, out, 0, nullptr) == TE_SUCCESS);
  CHECK(near(y[0], 0.8411919906082768) && near(y[1], -0.15880800939172324) && y[2] == 0.0f);
  CHECK(te_activation_forward(TE_ACTIVATION_SILU, nullptr, in, out, 0, nullptr) == TE_SUCCESS);
  CHECK(near(y[0], 0.7310585786300049) && near(y[1], -0.2689414213699951) && near(y[3], 1.7615941559557646));
  CHECK(te_activation_forward(TE_ACTIVATION_SRELU, nullptr, in, out, 0, nullptr) == TE_SUCCESS);
  CHECK(y[0] == 1.0f && y[1] == 0.0f && y[3] == 4.0f);
}

TEST_CASE(swiglu_forward_and_backward_by_hand) {
  // Input [1, 4] = [a0, a1, b0, b1]; out = silu(a) * b.
  std::vector<float> x = {1.0f, -2.0f, 3.0f, 0.5f}, y(2), g = {2.0f, 4.0f}, gi(4), db(4);
  TensorHandle in, out, tg, tgi, tdb;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 4});
  out.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {1, 2});
  CHECK(te_activation_forward(TE_ACTIVATION_SWIGLU, nullptr, in, out, 0, nullptr) == TE_SUCCESS);
  const double s1 = 1 / (1 + std::exp(-1.0)), s2 = 1 / (1 + std::exp(2.0));
  CHECK(near(y[0], 1 * s1 * 3) && near(y[1], -2 * s2 * 0.5));
  tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {1, 2});
  tgi.set(TE_SLOT_DATA, gi.data(), TE_DTYPE_FLOAT32, {1, 4});
  tdb.set(TE_SLOT_DATA, db.data(), TE_DTYPE_FLOAT32, {4});
  CHECK(te_activation_backward(TE_ACTIVATION_SWIGLU, nullptr, tg, in, tgi, tdb, 0, nullptr) == TE_SUCCESS);
  const double d1 = s1 * (1 + 1 * (1 - s1)), d2 = s2 * (1 - 2 * (1 - s2));
  CHECK(near(gi[0], 2 * d1 * 3, 1e-6) && near(gi[1], 4 * d2 * 0.5, 1e-6));
  CHECK(near(gi[2], 2 * 1 * s1) && near(gi[3], 4 * -2 * s2));
  for (int c = 0; c < 4; ++c) CHECK(db[c] == gi[c]);  // one row: the sums are the values
}

TEST_CASE(gated_backward_shares_the_sigmoid_bit_for_bit) {
  // The fused value-and-derivative of the gated backward equals the separate functions.
  const float xs[] = {-1e30f, -300.0f, -150.0f, -25.0f, -20.0f, -3.0f, -0.5f, 0.0f, 1e-20f, 0.7f, 19.0f, 21.0f, 500.0f};
  for (float x : xs) {
    float f, d;
    te::act::gated_value_and_derivative<TE_ACTIVATION_GEGLU>(x, &f, &d);
    CHECK(te::float_bits(f) == te::float_bits(te::act::gelu(x)) && te::float_bits(d) == te::float_bits(te::act::dgelu(x)));
    te::act::gated_value_and_derivative<TE_ACTIVATION_SWIGLU>(x, &f, &d);
    CHECK(te::float_bits(f) == te::float_bits(te::act::silu(x)) && te::float_bits(d) == te::float_bits(te::act::dsilu(x)));
  }
  // And across the whole fp32 range (every 4099th bit pattern, NaNs compared canonically).
  int mismatches = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4099) {
    const float x = te::bits_float(static_cast<uint32_t>(u));
    float f, d;
    auto same = [](float a, float b) { return te::float_bits(te::canonical(a)) == te::float_bits(te::canonical(b)); };
    te::act::gated_value_and_derivative<TE_ACTIVATION_GEGLU>(x, &f, &d);
    mismatches += !same(f, te::act::gelu(x)) || !same(d, te::act::dgelu(x));
    te::act::gated_value_and_derivative<TE_ACTIVATION_SWIGLU>(x, &f, &d);
    mismatches += !same(f, te::act::silu(x)) || !same(d, te::act::dsilu(x));
  }
  CHECK(mismatches == 0);
}

TEST_CASE(fp8_output_with_transpose_and_amax) {
  // relu of [[1, -1, 2], [-3, 4, 0.5]] * scale 2 in E4M3; transpose [3, 2].
  std::vector<float> x = {1, -1, 2, -3, 4, 0.5f};
  std::vector<uint8_t> q(6, 0xA5), qt(6, 0xA5);
  float scale = 2.0f, scale_inv = -1.0f, amax = -1.0f;
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {2, 3});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {2, 3});
  out.set(TE_SLOT_COLUMNWISE_DATA, qt.data(), TE_DTYPE_FLOAT8_E4M3, {3, 2});
  out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_AMAX, &amax, TE_DTYPE_FLOAT32, {1});
  CHECK(te_activation_forward(TE_ACTIVATION_RELU, nullptr, in, out, 0, nullptr) == TE_SUCCESS);
  const float relu[6] = {1, 0, 2, 0, 4, 0.5f};
  for (int i = 0; i < 6; ++i) CHECK(q[i] == te::float_to_e4m3(relu[i] * 2.0f));
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 3; ++c) CHECK(qt[c * 2 + r] == q[r * 3 + c]);
  }
  CHECK(amax == 4.0f && scale_inv == 0.5f);
  // accumulate_amax raises the amax it finds (a history slot) instead of overwriting it.
  amax = 9.0f;
  CHECK(te_activation_forward(TE_ACTIVATION_RELU, nullptr, in, out, 1, nullptr) == TE_SUCCESS);
  CHECK(amax == 9.0f);
  amax = 3.0f;
  CHECK(te_activation_forward(TE_ACTIVATION_RELU, nullptr, in, out, 1, nullptr) == TE_SUCCESS);
  CHECK(amax == 4.0f);
}

TEST_CASE(dbias_follows_the_documented_order) {
  // 136 rows of one column: 1e8 in row 0, then 135 ones. fp32 spacing at 1e8 is 8, so the 7
  // ones of run 0 vanish into it, but runs 1..15 sum to 8 each before meeting it, and so does
  // chunk 1 (rows 128..135); a plain sequential fp32 sum would drop all 135 ones.
  const int m = 136;
  std::vector<float> g(m, 1.0f), gi(m), db(1, -1.0f);
  g[0] = 1e8f;
  TensorHandle tg, tgi, tdb;
  tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {m, 1});
  tgi.set(TE_SLOT_DATA, gi.data(), TE_DTYPE_FLOAT32, {m, 1});
  tdb.set(TE_SLOT_DATA, db.data(), TE_DTYPE_FLOAT32, {1});
  CHECK(te_activation_backward(TE_ACTIVATION_IDENTITY, nullptr, tg, nullptr, tgi, tdb, 0, nullptr) == TE_SUCCESS);
  // Chunk 0: 1e8 + 15 * 8 = 100000120 (exact); plus chunk 1: 100000128.
  CHECK(db[0] == 100000128.0f);
}

TEST_CASE(rejects_bad_arguments_and_writes_nothing) {
  std::vector<float> x(12, 1.0f), y(6, 7.0f), bad(5, 7.0f);
  TensorHandle in, out, wrong;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {2, 6});
  out.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {2, 3});
  wrong.set(TE_SLOT_DATA, bad.data(), TE_DTYPE_FLOAT32, {5});
  CHECK_ERROR(te_activation_forward(TE_ACTIVATION_GELU, nullptr, in, out, 0, nullptr), TE_ERROR_VALUE,
              "activation_forward: output.data must have shape [2, 6], got float32 [2, 3] on cpu");
  CHECK_ERROR(te_activation_forward(static_cast<te_activation>(42), nullptr, in, out, 0, nullptr), TE_ERROR_VALUE,
              "activation_forward: act must be a te_activation", "got 42");
  CHECK_ERROR(te_activation_backward(TE_ACTIVATION_GEGLU, nullptr, out, in, in, nullptr, 0, nullptr), TE_ERROR_VALUE,
              "activation_backward: grad_input.data must not overlap the input input.data");
  CHECK_ERROR(te_activation_backward(TE_ACTIVATION_RELU, nullptr, out, nullptr, out, nullptr, 0, nullptr), TE_ERROR_VALUE,
              "activation_backward: input must be a tensor handle, got NULL");
  CHECK_ERROR(te_activation_backward(TE_ACTIVATION_GEGLU, nullptr, out, in, in, wrong, 0, nullptr), TE_ERROR_VALUE,
              "activation_backward: dbias.data must have shape [6], got float32 [5] on cpu");
  for (float v : y) CHECK(v == 7.0f);
  for (float v : bad) CHECK(v == 7.0f);
}

int main() { return te_test::run_all(); }
