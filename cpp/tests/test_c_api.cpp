// Tests of the C API on the CPU path: the handle, argument validation, and the numerics of
// each op against values worked out by hand or through the scalar conversion functions.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "common/numerics.h"
#include "test_util.h"

using te_test::TensorHandle;

namespace {
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();
}  // namespace

TEST_CASE(tensor_set_rejects_bad_buffers) {
  TensorHandle t;
  float x = 0;
  te_buffer b = te_test::cpu_buffer(&x, TE_DTYPE_FLOAT32, {-1});
  CHECK_ERROR(te_tensor_set(t, TE_SLOT_DATA, &b), TE_ERROR_VALUE, "tensor_set", "non-negative");
  b = te_test::cpu_buffer(nullptr, TE_DTYPE_FLOAT32, {2});
  CHECK_ERROR(te_tensor_set(t, TE_SLOT_DATA, &b), TE_ERROR_VALUE, "data must be non-NULL");
  b = te_test::cpu_buffer(&x, static_cast<te_dtype>(99), {1});
  CHECK_ERROR(te_tensor_set(t, TE_SLOT_DATA, &b), TE_ERROR_TYPE, "dtype");
  b = te_test::cpu_buffer(&x, TE_DTYPE_FLOAT32, {1});
  b.ndim = TE_MAX_DIMS + 1;
  CHECK_ERROR(te_tensor_set(t, TE_SLOT_DATA, &b), TE_ERROR_VALUE, "ndim");
  CHECK_ERROR(te_tensor_set(t, static_cast<te_tensor_slot>(42), &b), TE_ERROR_VALUE, "slot");
  te_tensor *none = nullptr;
  CHECK_ERROR(te_tensor_create(static_cast<te_scaling_mode>(7), &none), TE_ERROR_VALUE, "scaling_mode");
  CHECK(none == nullptr);
  b = te_test::cpu_buffer(nullptr, TE_DTYPE_FLOAT32, {0, 3});  // empty: NULL data is fine
  CHECK(te_tensor_set(t, TE_SLOT_DATA, &b) == TE_SUCCESS);
  te_buffer got{};
  CHECK(te_tensor_get(t, TE_SLOT_DATA, &got) == TE_SUCCESS && got.shape[1] == 3);
  CHECK_ERROR(te_tensor_get(t, TE_SLOT_AMAX, &got), TE_ERROR_VALUE, "empty");
}

TEST_CASE(fp8_conversion_rounds_to_nearest_even_and_saturates_finite_values) {
  CHECK(te::float_to_e4m3(1.0f) == 0x38);
  CHECK(te::float_to_e4m3(1.0625f) == 0x38);  // tie between 1 and 1.125: even mantissa
  CHECK(te::float_to_e4m3(1.1875f) == 0x3A);  // tie between 1.125 and 1.25: even mantissa
  CHECK(te::float_to_e4m3(448.0f) == 0x7E);
  CHECK(te::float_to_e4m3(1e6f) == 0x7E);
  CHECK(te::float_to_e4m3(kInf) == te::kFp8NaN);  // E4M3 has no infinity: NaN, not 448
  CHECK(te::float_to_e4m3(-kInf) == te::kFp8NaN);
  CHECK(te::float_to_e4m3(kNaN) == te::kFp8NaN);
  CHECK(te::float_to_e4m3(-kNaN) == te::kFp8NaN);
  CHECK(te::float_to_e4m3(-0.0f) == 0x80);
  CHECK(te::float_to_e4m3(std::ldexp(1.0f, -9)) == 0x01);       // smallest subnormal
  CHECK(te::float_to_e4m3(std::ldexp(1.0f, -10)) == 0x00);      // tie with 0: even
  CHECK(te::float_to_e4m3(3 * std::ldexp(1.0f, -10)) == 0x02);  // tie 1 / 2 units: even
  CHECK(te::float_to_e4m3(std::ldexp(1.0f, -6)) == 0x08);       // smallest normal
  CHECK(te::float_to_e5m2(1.0f) == 0x3C);
  CHECK(te::float_to_e5m2(57344.0f) == 0x7B);
  CHECK(te::float_to_e5m2(1e9f) == 0x7B);
  CHECK(te::float_to_e5m2(kInf) == 0x7C);
  CHECK(te::float_to_e5m2(-kInf) == 0xFC);
  CHECK(te::float_to_e5m2(std::ldexp(1.0f, -16)) == 0x01);
  CHECK(te::float_to_e5m2(kNaN) == te::kFp8NaN);
  // Every finite FP8 value converts back to its own code.
  for (int c = 0; c < 256; ++c) {
    const uint8_t v = static_cast<uint8_t>(c);
    if ((v & 0x7F) != 0x7F) CHECK(te::float_to_e4m3(te::e4m3_to_float(v)) == v);
    if ((v & 0x7C) != 0x7C) CHECK(te::float_to_e5m2(te::e5m2_to_float(v)) == v);
  }
  CHECK(std::isnan(te::e4m3_to_float(0x7F)) && std::isnan(te::e4m3_to_float(0xFF)));
  CHECK(std::isinf(te::e5m2_to_float(0x7C)));
}

TEST_CASE(half_conversions_round_to_nearest_even) {
  CHECK(te::float_to_bf16(1.0f) == 0x3F80);
  CHECK(te::float_to_bf16(te::bits_float(0x3F808000u)) == 0x3F80);  // tie: even
  CHECK(te::float_to_bf16(te::bits_float(0x3F818000u)) == 0x3F82);  // tie: even (up)
  CHECK(te::float_to_fp16(1.0f) == 0x3C00);
  CHECK(te::float_to_fp16(65504.0f) == 0x7BFF);
  CHECK(te::float_to_fp16(65520.0f) == 0x7C00);  // rounds to infinity
  CHECK(te::float_to_fp16(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(te::fp16_to_float(0x0001) == std::ldexp(1.0f, -24));
  for (uint32_t c = 0; c < 0x7C00; ++c) {
    CHECK(te::float_to_fp16(te::fp16_to_float(static_cast<uint16_t>(c))) == c);
  }
}

TEST_CASE(quantize_per_tensor_with_transpose_and_amax) {
  const int m = 3, k = 5;
  std::vector<float> x = {1.0f, -2.5f, 300.0f, kInf, 0.0f, 1e-8f, -kInf, 7.0f, 1000.0f,
                          -0.0f, 0.5f, 0.25f, -3.0f, 100.0f, 2.0f};
  std::vector<uint8_t> q(m * k, 0xAA), qt(m * k, 0xAA);
  float scale = 2.0f, scale_inv = 0.0f, amax = -1.0f;
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {m, k});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {m, k});
  out.set(TE_SLOT_COLUMNWISE_DATA, qt.data(), TE_DTYPE_FLOAT8_E4M3, {k, m});
  out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_AMAX, &amax, TE_DTYPE_FLOAT32, {1});
  CHECK(te_quantize(in, out, nullptr, nullptr) == TE_SUCCESS);
  for (int r = 0; r < m; ++r) {
    for (int c = 0; c < k; ++c) {
      CHECK(q[r * k + c] == te::float_to_e4m3(x[r * k + c] * 2.0f));
      CHECK(qt[c * m + r] == q[r * k + c]);
    }
  }
  CHECK(scale_inv == 0.5f);
  CHECK(std::isinf(amax));
  x[4] = kNaN;
  CHECK(te_quantize(in, out, nullptr, nullptr) == TE_SUCCESS);
  CHECK(std::isnan(amax));
  CHECK(q[4] == te::kFp8NaN);
}

// The cast of one [rows, cols] fp32 input with a scale, as te_quantize_many's tests use it.
struct Cast {
  std::vector<float> x;
  std::vector<uint8_t> q, qt;
  float scale, scale_inv = 0.0f, amax = 0.0f;
  TensorHandle in, out;
  Cast(int rows, int cols, float s, bool transpose, float seed) : x(rows * cols), q(rows * cols, 0xAA), qt(rows * cols, 0xAA), scale(s) {
    for (int i = 0; i < rows * cols; ++i) x[i] = seed * static_cast<float>((i * 37) % 23 - 11);
    in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {rows, cols});
    out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {rows, cols});
    if (transpose) out.set(TE_SLOT_COLUMNWISE_DATA, qt.data(), TE_DTYPE_FLOAT8_E4M3, {cols, rows});
    out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
    out.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
    out.set(TE_SLOT_AMAX, &amax, TE_DTYPE_FLOAT32, {1});
  }
};

TEST_CASE(quantize_many_equals_one_call_each) {
  Cast a(4, 6, 2.0f, true, 0.75f), b(3, 8, 0.5f, false, 9.0f), a1(4, 6, 2.0f, true, 0.75f), b1(3, 8, 0.5f, false, 9.0f);
  a.amax = a1.amax = 100.0f;  // raised with accumulate_amax: stays
  te_quantize_config acc{0, 0.0f, 1};
  const te_tensor *ins[] = {a.in, b.in};
  te_tensor *outs[] = {a.out, b.out};
  CHECK(te_quantize_many(ins, outs, 2, &acc, nullptr) == TE_SUCCESS);
  CHECK(te_quantize(a1.in, a1.out, &acc, nullptr) == TE_SUCCESS);
  CHECK(te_quantize(b1.in, b1.out, &acc, nullptr) == TE_SUCCESS);
  CHECK(a.q == a1.q && a.qt == a1.qt && a.scale_inv == a1.scale_inv && a.amax == 100.0f && a1.amax == 100.0f);
  CHECK(b.q == b1.q && b.qt == b1.qt && b.scale_inv == b1.scale_inv && b.amax == b1.amax && b.amax == 99.0f);
  CHECK(te_quantize_many(nullptr, nullptr, 0, nullptr, nullptr) == TE_SUCCESS);  // nothing to do
}

TEST_CASE(quantize_many_checks_all_before_writing) {
  Cast a(4, 6, 2.0f, true, 0.75f), b(3, 8, 0.5f, false, 9.0f);
  const te_tensor *ins[] = {a.in, b.in};
  te_tensor *outs[] = {a.out, b.out};
  // Tensor 1 writes its amax into tensor 0's input: rejected, and tensor 0 is not cast either.
  b.out.set(TE_SLOT_AMAX, &a.x[0], TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(te_quantize_many(ins, outs, 2, nullptr, nullptr), TE_ERROR_VALUE, "quantize_many",
              "tensor 1 output.amax must not overlap tensor 0 input.data");
  CHECK(a.q == std::vector<uint8_t>(24, 0xAA) && a.scale_inv == 0.0f && a.x[0] == 0.75f * -11.0f);
  // A bad argument names its tensor.
  b.out.set(TE_SLOT_AMAX, &b.amax, TE_DTYPE_FLOAT32, {1});
  b.out.set(TE_SLOT_DATA, b.q.data(), TE_DTYPE_FLOAT8_E4M3, {4, 8});
  CHECK_ERROR(te_quantize_many(ins, outs, 2, nullptr, nullptr), TE_ERROR_VALUE, "quantize_many (tensor 1)",
              "output.data");
  CHECK(a.q == std::vector<uint8_t>(24, 0xAA));
  CHECK_ERROR(te_quantize_many(nullptr, outs, 2, nullptr, nullptr), TE_ERROR_VALUE, "arrays of count (2)");
}

TEST_CASE(quantize_accumulates_amax_when_asked) {
  // Slot 0 of a [2, 2] amax history, as delayed scaling passes it.
  std::vector<float> x = {1.0f, -3.0f, 2.0f, 0.5f};
  std::vector<uint8_t> q(4), qt(4);
  std::vector<float> history = {5.0f, 9.0f, 11.0f, 13.0f};
  float scale = 4.0f, scale_inv = 0.0f;
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {2, 2});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {2, 2});
  out.set(TE_SLOT_COLUMNWISE_DATA, qt.data(), TE_DTYPE_FLOAT8_E4M3, {2, 2});
  out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_AMAX, &history[0], TE_DTYPE_FLOAT32, {1});
  te_quantize_config acc{0, 0.0f, 1};
  CHECK(te_quantize(in, out, &acc, nullptr) == TE_SUCCESS);
  CHECK(history[0] == 5.0f);  // 3 < 5: kept
  CHECK(history[1] == 9.0f && history[2] == 11.0f && history[3] == 13.0f);  // nothing else
  CHECK(scale_inv == 0.25f && q[1] == te::float_to_e4m3(-12.0f) && qt[2] == q[1]);
  x[1] = -7.5f;
  CHECK(te_quantize(in, out, &acc, nullptr) == TE_SUCCESS && history[0] == 7.5f);  // raised
  CHECK(te_quantize(in, out, nullptr, nullptr) == TE_SUCCESS && history[0] == 7.5f);
  x[1] = -1.0f;
  CHECK(te_quantize(in, out, nullptr, nullptr) == TE_SUCCESS && history[0] == 2.0f);  // default: overwritten
  x[2] = kNaN;
  CHECK(te_quantize(in, out, &acc, nullptr) == TE_SUCCESS && std::isnan(history[0]));
  x[2] = 2.0f;
  CHECK(te_quantize(in, out, &acc, nullptr) == TE_SUCCESS && std::isnan(history[0]));  // NaN stays
  // An empty input leaves the amax as it was.
  history[0] = 6.0f;
  TensorHandle empty_in, empty_out;
  empty_in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {0, 2});
  empty_out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {0, 2});
  empty_out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  empty_out.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  empty_out.set(TE_SLOT_AMAX, &history[0], TE_DTYPE_FLOAT32, {1});
  CHECK(te_quantize(empty_in, empty_out, &acc, nullptr) == TE_SUCCESS && history[0] == 6.0f);
  // Block modes raise the whole input's amax the same way.
  std::vector<float> sinv(2);
  TensorHandle block(TE_SCALING_BLOCK_1X128);
  block.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {2, 2});
  block.set(TE_SLOT_SCALE_INV, sinv.data(), TE_DTYPE_FLOAT32, {2, 1});
  block.set(TE_SLOT_AMAX, &history[0], TE_DTYPE_FLOAT32, {1});
  CHECK(te_quantize(in, block, &acc, nullptr) == TE_SUCCESS && history[0] == 6.0f);
  x[0] = -8.0f;
  CHECK(te_quantize(in, block, &acc, nullptr) == TE_SUCCESS && history[0] == 8.0f);
}

TEST_CASE(quantize_rejects_bad_arguments_and_writes_nothing) {
  std::vector<float> x(12, 1.0f);
  std::vector<uint8_t> q(12, 0xAA);
  float scale = 1.0f, scale_inv = 7.0f;
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {3, 4});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {3, 4});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_VALUE, "quantize", "output.scale must be set");
  out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT16, {1});
  out.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_TYPE, "output.scale must be float32", "float16 [1]");
  out.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {4, 3});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_VALUE, "output.data must have shape [3, 4]", "[4, 3]");
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_BFLOAT16, {3, 4});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_TYPE, "output.data must be float8_e4m3 or float8_e5m2");
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {3, 4});
  out.set(TE_SLOT_COLUMNWISE_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {3, 4});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_VALUE, "columnwise_data must be the transpose, shape [4, 3]");
  out.set(TE_SLOT_COLUMNWISE_DATA, nullptr, TE_DTYPE_FLOAT8_E4M3, {0});
  te_tensor_set(out, TE_SLOT_COLUMNWISE_DATA, nullptr);
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_INT32, {3, 4});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_TYPE, "input.data must be float32, float16 or bfloat16");
  CHECK_ERROR(te_quantize(nullptr, out, nullptr, nullptr), TE_ERROR_VALUE, "input must be a tensor handle");
  for (uint8_t v : q) CHECK(v == 0xAA);
  CHECK(scale_inv == 7.0f);
  if (!te_built_with_cuda()) {
    TensorHandle cin;
    te_buffer b = te_test::cpu_buffer(x.data(), TE_DTYPE_FLOAT32, {3, 4});
    b.device = TE_DEVICE_CUDA;
    te_tensor_set(cin, TE_SLOT_DATA, &b);
    TensorHandle amax_out;
    float amax = 0;
    b = te_test::cpu_buffer(&amax, TE_DTYPE_FLOAT32, {1});
    b.device = TE_DEVICE_CUDA;
    te_tensor_set(amax_out, TE_SLOT_AMAX, &b);
    CHECK_ERROR(te_compute_amax(cin, amax_out, nullptr), TE_ERROR_UNSUPPORTED, "compute_amax", "no CUDA kernels");
  }
}

TEST_CASE(block_1x128_scales_each_row_block) {
  const int m = 2, k = 130;  // two blocks per row, the second ragged (2 elements)
  std::vector<float> x(m * k);
  for (int i = 0; i < m * k; ++i) x[i] = static_cast<float>((i % 7) - 3) * (i < k ? 1.0f : 10.0f);
  std::vector<uint8_t> q(m * k);
  std::vector<float> sinv(m * 2);
  TensorHandle in, out(TE_SCALING_BLOCK_1X128);
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {m, k});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {m, k});
  out.set(TE_SLOT_SCALE_INV, sinv.data(), TE_DTYPE_FLOAT32, {m, 2});
  CHECK(te_quantize(in, out, nullptr, nullptr) == TE_SUCCESS);
  CHECK(sinv[0] == 1.0f / (448.0f / 3.0f));   // row 0, block 0: amax 3
  CHECK(sinv[1] == 1.0f / 448.0f);            // row 0, block 1: the 2 ragged elements -1, 0
  CHECK(sinv[2] == 1.0f / (448.0f / 30.0f));  // row 1, block 0: amax 30
  // The largest magnitude of a block maps to the FP8 maximum: x[0] = -3.
  CHECK(q[0] == 0xFE);
  te_quantize_config pow2{1, 0.0f};
  CHECK(te_quantize(in, out, &pow2, nullptr) == TE_SUCCESS);
  for (float s : sinv) CHECK((te::float_bits(s) & 0x7FFFFFu) == 0);  // powers of two
  TensorHandle bad(TE_SCALING_BLOCK_1X128);
  bad.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {m, k});
  bad.set(TE_SLOT_SCALE_INV, sinv.data(), TE_DTYPE_FLOAT32, {m, 1});
  CHECK_ERROR(te_quantize(in, bad, nullptr, nullptr), TE_ERROR_VALUE, "output.scale_inv must have shape [2, 2]");
}

TEST_CASE(delayed_scaling_update_edge_cases) {
  // Three groups: a normal one, a zero amax (scale kept), a denormal amax (FLT_MAX clamp).
  std::vector<float> h0 = {2.0f, 8.0f, 4.0f};  // [H=3]
  std::vector<float> h1 = {0.0f};
  std::vector<float> h2 = {1e-40f, kNaN};  // [H=2, n=1]: NaN in the history keeps the scale
  std::vector<float> h3 = {1e-40f};
  float s0 = 1, s1 = 5, s2 = 3, s3 = 1, i0 = 0, i1 = 0, i2 = 0, i3 = 0;
  TensorHandle H0, H1, H2, H3, S0, S1, S2, S3, I0, I1, I2, I3;
  H0.set(TE_SLOT_DATA, h0.data(), TE_DTYPE_FLOAT32, {3});
  H1.set(TE_SLOT_DATA, h1.data(), TE_DTYPE_FLOAT32, {1});
  H2.set(TE_SLOT_DATA, h2.data(), TE_DTYPE_FLOAT32, {2, 1});
  H3.set(TE_SLOT_DATA, h3.data(), TE_DTYPE_FLOAT32, {1, 1});
  for (auto [t, p] : {std::pair{&S0, &s0}, {&S1, &s1}, {&S2, &s2}, {&S3, &s3}, {&I0, &i0},
                      {&I1, &i1}, {&I2, &i2}, {&I3, &i3}}) {
    t->set(TE_SLOT_DATA, p, TE_DTYPE_FLOAT32, {1});
  }
  te_tensor *hs[] = {H0, H1, H2, H3}, *ss[] = {S0, S1, S2, S3}, *is[] = {I0, I1, I2, I3};
  CHECK(te_delayed_scaling_update(hs, ss, is, 4, TE_DTYPE_FLOAT8_E4M3, TE_AMAX_COMPUTE_MAX, 1, nullptr) == TE_SUCCESS);
  CHECK(s0 == (448.0f / 8.0f) / 2.0f && i0 == 1.0f / s0);
  CHECK(h0[0] == 0.0f && h0[1] == 4.0f && h0[2] == 2.0f);  // rolled, slot 0 zeroed
  CHECK(s1 == 5.0f && i1 == 0.2f);
  CHECK(s2 == 3.0f && std::isnan(h2[0]) == false && h2[0] == 0.0f && h2[1] == 1e-40f);
  CHECK(s3 == FLT_MAX);
  h0 = {6.0f, 8.0f, 4.0f};
  CHECK(te_delayed_scaling_update(hs, ss, is, 1, TE_DTYPE_FLOAT8_E5M2, TE_AMAX_COMPUTE_MOST_RECENT, 0, nullptr) == TE_SUCCESS);
  CHECK(s0 == 57344.0f / 6.0f);
  CHECK_ERROR(te_delayed_scaling_update(hs, ss, is, 1, TE_DTYPE_FLOAT32, TE_AMAX_COMPUTE_MAX, 0, nullptr),
              TE_ERROR_TYPE, "delayed_scaling_update", "fp8_dtype");
  CHECK_ERROR(te_delayed_scaling_update(hs, ss, is, 1, TE_DTYPE_FLOAT8_E4M3, TE_AMAX_COMPUTE_MAX, -1, nullptr),
              TE_ERROR_VALUE, "margin");
  te_tensor *bad_s[] = {S0, S1};  // group 1 has a [1] history; give it the wrong scale size
  std::vector<float> two(2);
  TensorHandle S2wide;
  S2wide.set(TE_SLOT_DATA, two.data(), TE_DTYPE_FLOAT32, {2});
  bad_s[1] = S2wide;
  CHECK_ERROR(te_delayed_scaling_update(hs, bad_s, is, 2, TE_DTYPE_FLOAT8_E4M3, TE_AMAX_COMPUTE_MAX, 0, nullptr),
              TE_ERROR_VALUE, "scales[1] must have 1 element");
}

TEST_CASE(delayed_scaling_update_with_amaxes) {
  // Two groups of two formats in one call, each recording its step's amax into slot 0 first.
  std::vector<float> h0 = {3.0f, 1.0f, 2.0f}, h1 = {0.0f, 1.0f};
  float a0 = 5.0f, a1 = kNaN, s0 = 1, s1 = 2, i0 = 0, i1 = 0;
  TensorHandle H0, H1, A0, A1, S0, S1, I0, I1;
  H0.set(TE_SLOT_DATA, h0.data(), TE_DTYPE_FLOAT32, {3});
  H1.set(TE_SLOT_DATA, h1.data(), TE_DTYPE_FLOAT32, {2});
  for (auto [t, p] : {std::pair{&A0, &a0}, {&A1, &a1}, {&S0, &s0}, {&S1, &s1}, {&I0, &i0}, {&I1, &i1}}) {
    t->set(TE_SLOT_DATA, p, TE_DTYPE_FLOAT32, {1});
  }
  te_tensor *hs[] = {H0, H1}, *as[] = {A0, A1}, *ss[] = {S0, S1}, *is[] = {I0, I1};
  const te_dtype dtypes[] = {TE_DTYPE_FLOAT8_E4M3, TE_DTYPE_FLOAT8_E5M2};
  CHECK(te_delayed_scaling_update_with_amaxes(hs, as, ss, is, dtypes, 2, TE_AMAX_COMPUTE_MAX, 0, nullptr) ==
        TE_SUCCESS);
  CHECK(s0 == 448.0f / 5.0f && h0[0] == 0.0f && h0[1] == 2.0f && h0[2] == 5.0f);
  CHECK(s1 == 2.0f && i1 == 0.5f && std::isnan(h1[1]));  // a NaN step keeps the scale
  const te_dtype bad[] = {TE_DTYPE_FLOAT8_E4M3, TE_DTYPE_BFLOAT16};
  h0 = {3.0f, 1.0f, 2.0f};
  CHECK_ERROR(te_delayed_scaling_update_with_amaxes(hs, as, ss, is, bad, 2, TE_AMAX_COMPUTE_MAX, 0, nullptr),
              TE_ERROR_TYPE, "delayed_scaling_update_with_amaxes", "fp8_dtypes[1]");
  te_tensor *aliased[] = {S0, A1};  // a step amax that is a written scale
  CHECK(te_delayed_scaling_update_with_amaxes(hs, aliased, ss, is, dtypes, 2, TE_AMAX_COMPUTE_MAX, 0, nullptr) !=
        TE_SUCCESS);
  CHECK(h0[0] == 3.0f && h0[2] == 2.0f);  // nothing written on failure
}

TEST_CASE(current_scaling_scale) {
  float amax = 2.0f, scale = 0, scale_inv = 0;
  uint8_t q = 0;
  TensorHandle t;
  t.set(TE_SLOT_DATA, &q, TE_DTYPE_FLOAT8_E4M3, {1});
  t.set(TE_SLOT_AMAX, &amax, TE_DTYPE_FLOAT32, {1});
  t.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  t.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  CHECK(te_compute_scale_from_amax(t, nullptr, nullptr) == TE_SUCCESS && scale == 224.0f);
  te_quantize_config pow2{1, 0.0f};
  CHECK(te_compute_scale_from_amax(t, &pow2, nullptr) == TE_SUCCESS && scale == 128.0f &&
        scale_inv == 1.0f / 128.0f);
  amax = 0.0f;
  CHECK(te_compute_scale_from_amax(t, nullptr, nullptr) == TE_SUCCESS && scale == 1.0f);
  te_quantize_config eps{0, 4.0f};
  CHECK(te_compute_scale_from_amax(t, &eps, nullptr) == TE_SUCCESS && scale == 112.0f);
  amax = kNaN;
  CHECK(te_compute_scale_from_amax(t, nullptr, nullptr) == TE_SUCCESS && scale == 1.0f);
  te_quantize_config neg{0, -1.0f};
  CHECK_ERROR(te_compute_scale_from_amax(t, &neg, nullptr), TE_ERROR_VALUE, "amax_epsilon");
}

#if defined(__x86_64__)
TEST_CASE(results_do_not_depend_on_the_callers_flush_to_zero_mode) {
  // A subnormal amax: 448 / 2^-140 overflows to infinity, so the scale is FLT_MAX. With
  // subnormals flushed the amax would read as 0 and give scale 1; the core runs in IEEE mode.
  float amax = std::ldexp(1.0f, -140), scale = 0, scale_inv = 0;
  uint8_t q = 0;
  TensorHandle t;
  t.set(TE_SLOT_DATA, &q, TE_DTYPE_FLOAT8_E4M3, {1});
  t.set(TE_SLOT_AMAX, &amax, TE_DTYPE_FLOAT32, {1});
  t.set(TE_SLOT_SCALE, &scale, TE_DTYPE_FLOAT32, {1});
  t.set(TE_SLOT_SCALE_INV, &scale_inv, TE_DTYPE_FLOAT32, {1});
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | (1u << 15) | (1u << 6));  // FTZ and DAZ, as XLA's CPU runtime sets them
  const te_status s = te_compute_scale_from_amax(t, nullptr, nullptr);
  const unsigned after = _mm_getcsr();
  _mm_setcsr(saved);
  CHECK(s == TE_SUCCESS && scale == FLT_MAX);
  CHECK(after == (saved | (1u << 15) | (1u << 6)));  // the caller's mode is back
}
#endif

TEST_CASE(transpose_of_bytes) {
  std::vector<uint8_t> a = {1, 2, 3, 4, 5, 6}, b(6);
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, a.data(), TE_DTYPE_FLOAT8_E4M3, {2, 3});
  out.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT8_E4M3, {3, 2});
  CHECK(te_transpose(in, out, nullptr) == TE_SUCCESS);
  CHECK((b == std::vector<uint8_t>{1, 4, 2, 5, 3, 6}));
  out.set(TE_SLOT_DATA, b.data(), TE_DTYPE_FLOAT8_E4M3, {2, 3});
  CHECK_ERROR(te_transpose(in, out, nullptr), TE_ERROR_VALUE, "transpose", "[3, 2]");
}

TEST_CASE(overlapping_outputs_are_rejected) {
  std::vector<float> x(8, 1.0f);
  std::vector<uint8_t> q(8, 0xAA);
  float buf[2] = {2.0f, 0.0f};  // scale and scale_inv side by side; amax aliasing scale_inv
  TensorHandle in, out;
  in.set(TE_SLOT_DATA, x.data(), TE_DTYPE_FLOAT32, {2, 4});
  out.set(TE_SLOT_DATA, q.data(), TE_DTYPE_FLOAT8_E4M3, {2, 4});
  out.set(TE_SLOT_SCALE, &buf[0], TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_SCALE_INV, &buf[1], TE_DTYPE_FLOAT32, {1});
  CHECK(te_quantize(in, out, nullptr, nullptr) == TE_SUCCESS);  // adjacent is fine
  out.set(TE_SLOT_AMAX, &buf[1], TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_VALUE, "quantize",
              "output.scale_inv must not overlap output.amax");
  te_tensor_set(out, TE_SLOT_AMAX, nullptr);
  out.set(TE_SLOT_SCALE_INV, &buf[0], TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_VALUE, "must not overlap the input output.scale");
  out.set(TE_SLOT_SCALE_INV, &buf[1], TE_DTYPE_FLOAT32, {1});
  out.set(TE_SLOT_DATA, reinterpret_cast<uint8_t *>(x.data()), TE_DTYPE_FLOAT8_E4M3, {2, 4});
  CHECK_ERROR(te_quantize(in, out, nullptr, nullptr), TE_ERROR_VALUE, "output.data must not overlap the input input.data");
  // Two delayed-scaling groups sharing one scale buffer.
  float h0 = 1, h1 = 2, s = 1, i0 = 0, i1 = 0;
  TensorHandle H0, H1, S, I0, I1;
  H0.set(TE_SLOT_DATA, &h0, TE_DTYPE_FLOAT32, {1});
  H1.set(TE_SLOT_DATA, &h1, TE_DTYPE_FLOAT32, {1});
  S.set(TE_SLOT_DATA, &s, TE_DTYPE_FLOAT32, {1});
  I0.set(TE_SLOT_DATA, &i0, TE_DTYPE_FLOAT32, {1});
  I1.set(TE_SLOT_DATA, &i1, TE_DTYPE_FLOAT32, {1});
  te_tensor *hs[] = {H0, H1}, *ss[] = {S, S}, *is[] = {I0, I1};
  CHECK_ERROR(te_delayed_scaling_update(hs, ss, is, 2, TE_DTYPE_FLOAT8_E4M3, TE_AMAX_COMPUTE_MAX, 0, nullptr),
              TE_ERROR_VALUE, "scales[0] must not overlap scales[1]");
  CHECK(h0 == 1 && h1 == 2 && s == 1);
}

int main() { return te_test::run_all(); }
