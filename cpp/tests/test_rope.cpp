// Tests of te_rope_forward / te_rope_backward on the CPU path: the core's cos and sin against
// libm in double precision, values worked out by hand for both pairings and partial rotary,
// the backward as the transpose of the forward, THD with start positions against per-sequence
// SBHD calls, and the validation messages with nothing written on failure (the Python tests
// cover layouts, dtypes and accuracy at large).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/numerics.h"
#include "rope/rope_impl.h"
#include "test_util.h"

using te_test::TensorHandle;

namespace {

bool near(double got, double want, double tol) { return std::fabs(got - want) <= tol; }

// A deterministic value in [-1, 1) from an index (no RNG state shared between tests).
float wave(int64_t i) { return static_cast<float>(std::sin(0.7 * static_cast<double>(i) + 0.3)); }

te_rope_config config(te_rope_format format, bool interleaved) {
  te_rope_config c{};
  c.format = format;
  c.interleaved = interleaved ? 1 : 0;
  return c;
}

}  // namespace

TEST_CASE(sincos_is_libm_rounded_once) {
  // Within half an fp32 ulp of the double-precision value, plus the reduction's error (rope.h).
  std::vector<float> angles = {0.0f, -0.0f, 1e-30f, 1e-8f, 0.5f, 0.7853982f, 1.5707964f, 3.1415927f, -2.0f,
                               100.0f, 12345.678f, 1048575.0f, -1000000.5f, 7e8f};
  for (int i = 0; i < 20000; ++i) angles.push_back(static_cast<float>(i) * 0.37f - 3700.0f);
  for (float a : angles) {
    float c = 0, s = 0;
    te::rope_sincos(a, &c, &s);
    const double x = a, tol_extra = 1e-16 + std::fabs(x) * std::ldexp(1.0, -52);
    const double ec = std::cos(x), es = std::sin(x);
    const double ulp_c = std::ldexp(1.0, std::ilogb(static_cast<float>(ec)) - 23);
    const double ulp_s = std::ldexp(1.0, std::ilogb(static_cast<float>(es)) - 23);
    if (ec != 0) CHECK(near(c, ec, 0.5 * ulp_c + tol_extra));
    if (es != 0) CHECK(near(s, es, 0.5 * ulp_s + tol_extra));
  }
  float c = 0, s = 0;
  te::rope_sincos(0.0f, &c, &s);
  CHECK(c == 1.0f && s == 0.0f);
  te::rope_sincos(-0.0f, &c, &s);
  CHECK(c == 1.0f && s == 0.0f);
  for (float bad : {NAN, INFINITY, -INFINITY, 1073741824.0f, -2e30f}) {
    te::rope_sincos(bad, &c, &s);
    CHECK(te::float_bits(c) == te::kCanonicalNaN && te::float_bits(s) == te::kCanonicalNaN);
  }
}

TEST_CASE(forward_by_hand_rotate_half_and_interleaved_partial) {
  // One token, one head, D = 6, R = 4; the last two features are copied.
  std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f, -5.5f, NAN}, y(6, 0.0f);
  std::vector<float> f = {0.5f, -1.25f, 0.5f, -1.25f};  // one position, angles [a0, a1, a0, a1]
  TensorHandle in, out, fr;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {1, 1, 1, 6});
  out.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {1, 1, 1, 6});
  fr.set(TE_SLOT_DATA, f.data(), TE_DTYPE_FLOAT32, {1, 4});
  te_rope_config cfg = config(TE_ROPE_SBHD, false);
  CHECK(te_rope_forward(&cfg, in, fr, nullptr, nullptr, out, nullptr) == TE_SUCCESS);
  const double c0 = std::cos(0.5), s0 = std::sin(0.5), c1 = std::cos(-1.25), s1 = std::sin(-1.25);
  // Pairs (0, 2) and (1, 3).
  CHECK(near(y[0], 1 * c0 - 3 * s0, 1e-6) && near(y[2], 3 * c0 + 1 * s0, 1e-6));
  CHECK(near(y[1], 2 * c1 - 4 * s1, 1e-6) && near(y[3], 4 * c1 + 2 * s1, 1e-6));
  CHECK(y[4] == -5.5f && std::memcmp(&y[5], &x[5], 4) == 0);
  // Interleaved: pairs (0, 1) and (2, 3) with angles [a0, a0, a1, a1].
  std::vector<float> fi = {0.5f, 0.5f, -1.25f, -1.25f};
  fr.set(TE_SLOT_DATA, fi.data(), TE_DTYPE_FLOAT32, {1, 1, 1, 4});
  cfg = config(TE_ROPE_SBHD, true);
  CHECK(te_rope_forward(&cfg, in, fr, nullptr, nullptr, out, nullptr) == TE_SUCCESS);
  CHECK(near(y[0], 1 * c0 - 2 * s0, 1e-6) && near(y[1], 2 * c0 + 1 * s0, 1e-6));
  CHECK(near(y[2], 3 * c1 - 4 * s1, 1e-6) && near(y[3], 4 * c1 + 3 * s1, 1e-6));
}

TEST_CASE(backward_is_the_transpose_of_forward) {
  // <forward(x), g> = <x, backward(g)>, also with angles that differ within a pair; and with
  // shared angles backward(forward(x)) = x.
  const int64_t S = 3, B = 2, H = 2, D = 8, R = 6, n = S * B * H * D;
  for (bool interleaved : {false, true}) {
    std::vector<float> x(n), g(n), y(n), gx(n), back(n), f(S * R), fs(S * R);
    for (int64_t i = 0; i < n; ++i) x[i] = wave(i), g[i] = wave(3 * i + 1);
    for (int64_t i = 0; i < S * R; ++i) f[i] = 2.0f * wave(7 * i + 2);
    for (int64_t p = 0; p < S; ++p) {
      for (int64_t j = 0; j < R; ++j) {
        const int64_t k = interleaved ? j / 2 : j % (R / 2);
        fs[p * R + j] = 0.3f * static_cast<float>(p + 1) * static_cast<float>(k + 1);
      }
    }
    TensorHandle tx, tg, ty, tgx, tf, tback;
    tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
    tg.set(TE_SLOT_DATA, g.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
    ty.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
    tgx.set(TE_SLOT_DATA, gx.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
    tback.set(TE_SLOT_DATA, back.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
    tf.set(TE_SLOT_DATA, f.data(), TE_DTYPE_FLOAT32, {S, R});
    const te_rope_config cfg = config(TE_ROPE_SBHD, interleaved);
    CHECK(te_rope_forward(&cfg, tx, tf, nullptr, nullptr, ty, nullptr) == TE_SUCCESS);
    CHECK(te_rope_backward(&cfg, tg, tf, nullptr, nullptr, tgx, nullptr) == TE_SUCCESS);
    double lhs = 0, rhs = 0;
    for (int64_t i = 0; i < n; ++i) lhs += double{y[i]} * g[i], rhs += double{x[i]} * gx[i];
    CHECK(near(lhs, rhs, 1e-5));
    tf.set(TE_SLOT_DATA, fs.data(), TE_DTYPE_FLOAT32, {S, R});
    CHECK(te_rope_forward(&cfg, tx, tf, nullptr, nullptr, ty, nullptr) == TE_SUCCESS);
    CHECK(te_rope_backward(&cfg, ty, tf, nullptr, nullptr, tback, nullptr) == TE_SUCCESS);
    for (int64_t i = 0; i < n; ++i) CHECK(near(back[i], x[i], 1e-6));
  }
}

TEST_CASE(thd_with_start_positions_matches_per_sequence_calls) {
  // Sequences of 2, 0 and 3 tokens packed; each as its own BSHD call with its rows of freqs.
  const int64_t H = 2, D = 4, R = 4, P = 9;
  std::vector<int32_t> cu = {0, 2, 2, 5}, start = {4, 0, 1};
  std::vector<float> x(5 * H * D), y(5 * H * D), f(P * R);
  for (size_t i = 0; i < x.size(); ++i) x[i] = wave(static_cast<int64_t>(i));
  for (size_t i = 0; i < f.size(); ++i) f[i] = 3.0f * wave(static_cast<int64_t>(5 * i + 4));
  TensorHandle tx, ty, tf, tcu, tstart;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {5, H, D});
  ty.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {5, H, D});
  tf.set(TE_SLOT_DATA, f.data(), TE_DTYPE_FLOAT32, {P, R});
  tcu.set(TE_SLOT_DATA, cu.data(), TE_DTYPE_INT32, {4});
  tstart.set(TE_SLOT_DATA, start.data(), TE_DTYPE_INT32, {3});
  const te_rope_config thd = config(TE_ROPE_THD, false), bshd = config(TE_ROPE_BSHD, false);
  CHECK(te_rope_forward(&thd, tx, tf, tcu, tstart, ty, nullptr) == TE_SUCCESS);
  for (int b : {0, 2}) {
    const int64_t len = cu[b + 1] - cu[b];
    std::vector<float> want(len * H * D);
    TensorHandle sx, sy, sf;
    sx.set(TE_SLOT_DATA, x.data() + cu[b] * H * D, TE_DTYPE_FLOAT32, {1, len, H, D});
    sy.set(TE_SLOT_DATA, want.data(), TE_DTYPE_FLOAT32, {1, len, H, D});
    sf.set(TE_SLOT_DATA, f.data() + start[b] * R, TE_DTYPE_FLOAT32, {len, R});
    CHECK(te_rope_forward(&bshd, sx, sf, nullptr, nullptr, sy, nullptr) == TE_SUCCESS);
    CHECK(std::memcmp(want.data(), y.data() + cu[b] * H * D, want.size() * 4) == 0);
  }
}

TEST_CASE(bad_arguments_name_op_and_argument_and_write_nothing) {
  const int64_t S = 2, B = 2, H = 1, D = 4;
  std::vector<float> x(S * B * H * D, 1.0f), y(S * B * H * D, 7.0f), f(3 * 4, 0.5f), odd(3 * 3, 0.5f);
  std::vector<uint16_t> y16(S * B * H * D, 7);
  std::vector<int32_t> cu = {0, 3, 2}, start = {0, 2}, neg = {-1, 0};
  TensorHandle tx, ty, tf, todd, ty16, tcu, tstart, tneg;
  tx.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
  ty.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {S, B, H, D});
  tf.set(TE_SLOT_DATA, f.data(), TE_DTYPE_FLOAT32, {3, 4});
  todd.set(TE_SLOT_DATA, odd.data(), TE_DTYPE_FLOAT32, {3, 3});
  ty16.set(TE_SLOT_DATA, y16.data(), TE_DTYPE_BFLOAT16, {S, B, H, D});
  tcu.set(TE_SLOT_DATA, cu.data(), TE_DTYPE_INT32, {3});
  tstart.set(TE_SLOT_DATA, start.data(), TE_DTYPE_INT32, {2});
  tneg.set(TE_SLOT_DATA, neg.data(), TE_DTYPE_INT32, {2});
  const te_rope_config sbhd = config(TE_ROPE_SBHD, false), thd = config(TE_ROPE_THD, false);
  te_rope_config bad = sbhd;
  bad.format = static_cast<te_rope_format>(7);
  CHECK_ERROR(te_rope_forward(&bad, tx, tf, nullptr, nullptr, ty, nullptr), TE_ERROR_VALUE, "rope_forward",
              "config.format");
  CHECK_ERROR(te_rope_forward(&sbhd, tx, todd, nullptr, nullptr, ty, nullptr), TE_ERROR_VALUE, "rope_forward",
              "freqs.data", "even");
  CHECK_ERROR(te_rope_forward(&sbhd, tx, tf, nullptr, nullptr, ty16, nullptr), TE_ERROR_TYPE, "output.data",
              "float32");
  CHECK_ERROR(te_rope_backward(&sbhd, tx, tf, nullptr, nullptr, tx, nullptr), TE_ERROR_VALUE, "rope_backward",
              "grad_input.data", "overlap");
  CHECK_ERROR(te_rope_forward(&sbhd, tx, tf, tcu, nullptr, ty, nullptr), TE_ERROR_VALUE, "cu_seqlens",
              "NULL");
  // start 2 + S 2 needs 4 rows of freqs, which has 3.
  CHECK_ERROR(te_rope_forward(&sbhd, tx, tf, nullptr, tstart, ty, nullptr), TE_ERROR_VALUE, "freqs.data",
              "position", "3");
  CHECK_ERROR(te_rope_forward(&sbhd, tx, tf, nullptr, tneg, ty, nullptr), TE_ERROR_VALUE,
              "start_positions.data", ">= 0");
  // THD: [T = 4, H, D] with decreasing offsets; then with a wrong total.
  TensorHandle tx3, ty3;
  tx3.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {4, H, D});
  ty3.set(TE_SLOT_DATA, y.data(), TE_DTYPE_FLOAT32, {4, H, D});
  CHECK_ERROR(te_rope_forward(&thd, tx3, tf, tcu, nullptr, ty3, nullptr), TE_ERROR_VALUE, "cu_seqlens.data",
              "decrease");
  cu = {0, 1, 3};
  CHECK_ERROR(te_rope_forward(&thd, tx3, tf, tcu, nullptr, ty3, nullptr), TE_ERROR_VALUE, "cu_seqlens.data[-1]",
              "4");
  CHECK_ERROR(te_rope_forward(&thd, tx3, tf, nullptr, nullptr, ty3, nullptr), TE_ERROR_VALUE, "cu_seqlens",
              "THD");
  CHECK_ERROR(te_rope_forward(&thd, tx, tf, tcu, nullptr, ty, nullptr), TE_ERROR_VALUE, "input.data",
              "[T, H, D]");
  for (float v : y) CHECK(v == 7.0f);
  for (uint16_t v : y16) CHECK(v == 7);
}

int main() { return te_test::run_all(); }
