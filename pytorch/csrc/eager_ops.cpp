// The torch operators of the eager FP8 fast paths, on the LibTorch stable ABI.
//
// Why compiled code: a small layer's step is bound by host time, and in Python that time is
// spent around the kernels, not in them (benchmarks/results/host_probes.md). Here te.Linear's
// FP8 forward (both casts and the GEMM), a norm with the FP8 GEMM after it (LayerNormLinear,
// LayerNormMLP's first half), an activation with the FP8 GEMM after it (LayerNormMLP's second
// half), the backward of any per-tensor FP8 linear layer (the grad_output
// cast, the scale update, both GEMMs) and delayed scaling's scale update are each one call
// into the core's C API, with outputs from torch's allocator.
//
// Why the stable ABI: this file includes only torch/csrc/stable and torch/headeronly, and is
// compiled with TORCH_TARGET_VERSION set to the oldest supported torch release (setup.py), so
// one binary loads under that release and every later one. The autograd node stays in Python
// (fast_linear.py): the stable ABI has no C++ autograd.
//
// te_eager::linear_fp8_forward computes what linear_fn.Fp8LinearFunction's forward computes
// under per-tensor delayed or current scaling (the same core calls with the same arguments, so
// the same bits) for the inputs fast_linear.takes accepts; it checks them again here and fails
// (never writes) on anything else. Failures come back as a status (see `caught` below).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <tuple>
#include <vector>

#include "transformer_engine/activation.h"
#include "transformer_engine/gemm.h"
#include "transformer_engine/norm.h"
#include "transformer_engine/quantize.h"
#include "transformer_engine/scaling.h"
#include "transformer_engine/tensor.h"

namespace {

using torch::stable::Tensor;
using torch::headeronly::ScalarType;

// Error messages are made with std::to_string and concatenation, not with torch's checks'
// ostream formatting: where the C++ runtime is linked in statically, its streams may not be
// set up, and a message would come out cut short.
void append(std::string &s, const char *v) { s += v; }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string &s, T v) {
  s += std::to_string(v);
}
template <class... A>
[[noreturn]] void fail(const A &...parts) {
  std::string message;
  (append(message, parts), ...);
  throw std::runtime_error(message);
}
#define TE_EAGER_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

void check(te_status status, const char *op) { TE_EAGER_CHECK(status == TE_SUCCESS, op, ": ", te_last_error()); }

te_dtype core_dtype(ScalarType t, const char *op) {
  switch (t) {
    case ScalarType::Float: return TE_DTYPE_FLOAT32;
    case ScalarType::Half: return TE_DTYPE_FLOAT16;
    case ScalarType::BFloat16: return TE_DTYPE_BFLOAT16;
    case ScalarType::Byte: return TE_DTYPE_UINT8;
    default: TE_EAGER_CHECK(false, op, ": tensors must be float32, float16, bfloat16 or uint8");
  }
  return TE_DTYPE_FLOAT32;
}

// The core's view of a contiguous tensor as the matrix (or vector) of `shape`, with the core's
// dtype (an FP8 format for uint8 bytes).
te_buffer buffer(void *data, te_dtype dtype, std::initializer_list<int64_t> shape, const Tensor &on) {
  te_buffer b{};
  b.data = data;
  b.dtype = dtype;
  b.ndim = static_cast<int32_t>(shape.size());
  int i = 0;
  for (int64_t s : shape) b.shape[i++] = s;
  b.device = on.is_cuda() ? TE_DEVICE_CUDA : TE_DEVICE_CPU;
  b.device_id = on.is_cuda() ? on.get_device_index() : 0;
  return b;
}

// Float element i of a contiguous fp32 tensor as a [1] buffer (a scale, an amax history slot).
te_buffer element(const Tensor &t, int64_t i) {
  return buffer(static_cast<float *>(t.data_ptr()) + i, TE_DTYPE_FLOAT32, {1}, t);
}

// An owning te_tensor handle (the buffers stay torch's).
class Handle {
 public:
  explicit Handle(const char *op) : op_(op) { check(te_tensor_create(TE_SCALING_TENSOR, &t_), op_); }
  ~Handle() { te_tensor_destroy(t_); }
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  Handle &set(te_tensor_slot slot, const te_buffer &b) {
    check(te_tensor_set(t_, slot, &b), op_);
    return *this;
  }
  te_tensor *get() const { return t_; }

 private:
  const char *op_;
  te_tensor *t_ = nullptr;
};

// Row-major strides of `shape`.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t> &shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

// An uninitialized contiguous tensor on `like`'s device (the C shim's allocation: no
// dispatcher on the way). Each allocation costs microseconds of host time, so the ops below
// allocate a few buffers and hand out pieces of them (`piece`).
Tensor empty(const std::vector<int64_t> &shape, int32_t dtype, const Tensor &like) {
  const std::vector<int64_t> strides = contiguous_strides(shape);
  const int32_t device_type = like.is_cuda() ? aoti_torch_device_type_cuda() : aoti_torch_device_type_cpu();
  AtenTensorHandle handle = nullptr;
  TE_EAGER_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(shape.size()), shape.data(), strides.data(), dtype,
                                           device_type, like.is_cuda() ? like.get_device_index() : 0,
                                           &handle) == AOTI_TORCH_SUCCESS,
                  "te_eager: allocation of ", shape.size(), "-d tensor failed");
  return Tensor(handle);
}

// The contiguous [shape] piece of the 1-d tensor `whole` that starts `offset` elements in: a
// tensor of its own that shares whole's storage (and keeps it alive).
Tensor piece(const Tensor &whole, const std::vector<int64_t> &shape, int64_t offset) {
  const std::vector<int64_t> strides = contiguous_strides(shape);
  AtenTensorHandle handle = nullptr;
  TE_EAGER_CHECK(aoti_torch__reinterpret_tensor(whole.get(), static_cast<int64_t>(shape.size()), shape.data(),
                                                 strides.data(), offset, &handle) == AOTI_TORCH_SUCCESS,
                  "te_eager: a view of a buffer failed");
  return Tensor(handle);
}

// The C shim's code of a float dtype (float32 for anything else: callers pass float dtypes).
int32_t torch_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return aoti_torch_dtype_float16();
    case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
    default: return aoti_torch_dtype_float32();
  }
}

// Byte counts rounded up to 256, so that each piece of a shared buffer starts as aligned as a
// fresh allocation would (cuBLASLt picks its kernels by the operands' alignment).
int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// FP8 tensor cores work on 16x16 granules: every GEMM dimension must be a multiple of 16.
constexpr int64_t kGranule = 16;
constexpr const char *kLinear = "te_eager.linear_fp8_forward";
constexpr int64_t kScalarRow = 64;  // floats: 256 bytes, an allocation's alignment

bool floating(ScalarType t) { return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half; }

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

// Current scaling's scale of x's cast: amax = max|x|, then scale and scale_inv from it (the first
// two core calls of ops.quantize_current; the cast is the third).
void current_scale(const te_buffer &x, const te_buffer &data, const te_buffer *col, const te_buffer &scale,
                   const te_buffer &scale_inv, const te_buffer &amax, bool pow2, double epsilon, te_stream stream) {
  Handle in(kLinear), reduced(kLinear), scaled(kLinear);
  in.set(TE_SLOT_DATA, x);
  reduced.set(TE_SLOT_AMAX, amax);
  check(te_compute_amax(in.get(), reduced.get(), stream), kLinear);
  scaled.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv).set(TE_SLOT_AMAX, amax);
  if (col != nullptr) scaled.set(TE_SLOT_COLUMNWISE_DATA, *col);
  te_quantize_config config{};
  config.force_pow2_scales = pow2 ? 1 : 0;
  config.amax_epsilon = static_cast<float>(epsilon);
  check(te_compute_scale_from_amax(scaled.get(), &config, stream), kLinear);
}

// out [M, N] = a [M, K] @ w [N, K]^T (+ bias), FP8 operands, as linear_fn.fp8_gemm computes it
// (fast accumulation). The bias rides in the GEMM's epilogue for a bf16/fp16 output; cuBLASLt
// takes only a bf16 bias beside FP8 operands and an fp32 output, so there it is added
// afterwards, in fp32. Returns the output (a new tensor in that case).
Tensor forward_gemm(const te_buffer &a_data, const te_buffer &a_sinv, const te_buffer &w_data, const te_buffer &w_sinv,
                    const std::optional<Tensor> &bias, Tensor out, int64_t m, int64_t n, const Tensor &workspace,
                    te_stream stream, const char *op) {
  const te_dtype out_dtype = core_dtype(out.scalar_type(), op);
  Handle a(op), b(op), d(op), bias_handle(op);
  a.set(TE_SLOT_DATA, a_data).set(TE_SLOT_SCALE_INV, a_sinv);
  b.set(TE_SLOT_DATA, w_data).set(TE_SLOT_SCALE_INV, w_sinv);
  d.set(TE_SLOT_DATA, buffer(out.data_ptr(), out_dtype, {m, n}, out));
  const bool fused_bias = bias.has_value() && out_dtype != TE_DTYPE_FLOAT32;
  if (fused_bias) bias_handle.set(TE_SLOT_DATA, buffer(bias->data_ptr(), out_dtype, {n}, out));
  te_gemm_config config{};
  config.transpose_b = 1;  // both operands K-major ("TN"); fast accumulation in the forward
  void *ws = workspace.numel() > 0 ? workspace.data_ptr() : nullptr;
  check(te_gemm(a.get(), b.get(), d.get(), fused_bias ? bias_handle.get() : nullptr, nullptr, &config, ws,
                static_cast<size_t>(workspace.numel()), stream),
        op);
  // out - (-1) * bias = out + bias, exactly (the stable ABI has no in-place add).
  if (bias.has_value() && !fused_bias) out = torch::stable::subtract(out, *bias, -1.0);
  return out;
}

// input [..., K] @ weight[N, K]^T (+ bias) with both operands cast to `fp8_dtype` (a te_dtype
// code) as the GEMM's row-wise operands and, where the backward needs them, as column-wise
// copies. Delayed scaling (current = false) casts with scales[0] (input) and scales[1] (weight)
// and raises history[0, 0] and history[0, 1]; current scaling takes each scale from its
// tensor's amax (pow2, epsilon as the recipe says) and reads neither.
//
// Returns (output [..., N], input scale_inv [1], weight scale_inv [1], column-wise input [K, M]
// or [0] unless need_wgrad, column-wise weight [K, N] or [0] unless need_dgrad): the output and
// what the backward keeps instead of the activation.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> linear_fp8_forward_impl(
    Tensor input, Tensor weight, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad, int64_t stream_handle) {
  check_linear(input, weight, bias);
  const auto fp8 = static_cast<te_dtype>(fp8_dtype);
  const te_stream stream = reinterpret_cast<te_stream>(stream_handle);
  const int64_t k = weight.size(1), n = weight.size(0), m = k > 0 ? input.numel() / k : 0;
  const int32_t u8 = aoti_torch_dtype_uint8(), f32 = aoti_torch_dtype_float32();
  // Four allocations (each costs host time, and at small sizes host time is the forward's
  // cost): the row-wise copies, which only the GEMM reads; the output; the scalars, one row of
  // kScalarRow floats per operand (scale_inv, then current scaling's scale and amax), each row
  // at a fresh allocation's alignment (cuBLASLt takes the scale_invs as pointers, and 4 bytes
  // apart fails); the column-wise copies.
  const int64_t w_row_at = aligned(m * k);
  const Tensor rows = empty({w_row_at + n * k}, u8, input);
  auto *row_bytes = static_cast<uint8_t *>(rows.data_ptr());
  const te_buffer x_data = buffer(row_bytes, fp8, {m, k}, input), w_data = buffer(row_bytes + w_row_at, fp8, {n, k}, input);
  const Tensor scalars = empty({2 * kScalarRow}, f32, input);
  const Tensor x_sinv_t = piece(scalars, {1}, 0), w_sinv_t = piece(scalars, {1}, kScalarRow);
  const int64_t x_col_size = need_wgrad ? aligned(k * m) : 0;
  const Tensor cols = empty({x_col_size + (need_dgrad ? k * n : 0)}, u8, input);
  const Tensor x_col_t = piece(cols, {need_wgrad ? k : 0, m}, 0);
  const Tensor w_col_t = piece(cols, {need_dgrad ? k : 0, n}, x_col_size);
  const te_buffer x_sinv = element(scalars, 0), w_sinv = element(scalars, kScalarRow);
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
    const te_buffer x_scale = element(scalars, 1), w_scale = element(scalars, kScalarRow + 1);
    current_scale(x, x_data, x_col_out, x_scale, x_sinv, element(scalars, 2), pow2, epsilon, stream);
    current_scale(w, w_data, w_col_out, w_scale, w_sinv, element(scalars, kScalarRow + 2), pow2, epsilon, stream);
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
}

// Current scaling's FP8 cast of x (both copies as asked) with its scale from its own amax: the
// three core calls of ops.quantize_current.
void quantize_current(const te_buffer &x, const te_buffer *data, const te_buffer *col, const te_buffer &scale,
                      const te_buffer &scale_inv, const te_buffer &amax, bool pow2, double epsilon, te_stream stream,
                      const char *op) {
  const te_buffer &fmt = data != nullptr ? *data : *col;
  current_scale(x, fmt, nullptr, scale, scale_inv, amax, pow2, epsilon, stream);
  Handle in(op), out(op);
  in.set(TE_SLOT_DATA, x);
  if (data != nullptr) out.set(TE_SLOT_DATA, *data);
  if (col != nullptr) out.set(TE_SLOT_COLUMNWISE_DATA, *col);
  out.set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv);
  check(te_quantize(in.get(), out.get(), nullptr, stream), op);
}

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
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear_fp8_forward_impl(
    Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps, bool zero_centered_gamma,
    Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col, int64_t stream_handle) {
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
  const Tensor stats = empty({(layernorm ? m : 0) + m}, f32, input);
  const Tensor mu_t = piece(stats, {layernorm ? m : 0}, 0), rsigma_t = piece(stats, {m}, layernorm ? m : 0);
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
}

constexpr const char *kActLinear = "te_eager.act_linear_fp8_forward";

// act(h) @ weight^T (+ bias), the activation writing the GEMM's FP8 input (layernorm_mlp_fn:
// act_to_fp8 then fp8_gemm, with the same core calls and arguments, so the same bits), for
// LayerNormMLP's second half. h [M, K] (gated: [M, 2K]); `act` a te_activation; the weight
// already in FP8: w_data [N, K] with w_sinv. Delayed scaling casts with scales[2] and raises
// history[0, 2] (FC2's input column) in the activation's own pass; current scaling has the
// activation write high precision, then casts it with the scale of its own amax.
//
// Returns (output [M, N] in h's dtype, the activation output's FP8 scale_inv [1], its
// column-wise copy [K, M] ([0] unless need_col)).
std::tuple<Tensor, Tensor, Tensor> act_linear_fp8_forward_impl(
    Tensor h, int64_t act, Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history,
    Tensor workspace, bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col,
    int64_t stream_handle) {
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
  if (!current) {
    Handle q(op);
    q.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, element(scales, kColumn)).set(TE_SLOT_SCALE_INV, sinv);
    q.set(TE_SLOT_AMAX, element(history, kColumn));
    if (need_col) q.set(TE_SLOT_COLUMNWISE_DATA, col);
    check(te_activation_forward(activation, in.get(), q.get(), 1, stream), op);
  } else {
    const Tensor a_t = empty({m, k}, torch_dtype(h.scalar_type()), h);
    const te_buffer a = buffer(a_t.data_ptr(), h_dtype, {m, k}, h);
    Handle ah(op);
    ah.set(TE_SLOT_DATA, a);
    check(te_activation_forward(activation, in.get(), ah.get(), 0, stream), op);
    quantize_current(a, &data, need_col ? &col : nullptr, element(scalars, 1), sinv, element(scalars, 2), pow2,
                     epsilon, stream, op);
  }
  Tensor out = empty({m, n}, torch_dtype(h.scalar_type()), h);
  out = forward_gemm(data, sinv, buffer(w_data.data_ptr(), fp8, {n, k}, w_data), element(w_sinv, 0), bias, out, m, n,
                     workspace, stream, op);
  return {out, sinv_t, col_t};
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
std::tuple<Tensor, Tensor, Tensor> linear_fp8_backward_impl(
    Tensor grad_output, std::optional<Tensor> act_input, int64_t act, Tensor x_sinv, Tensor w_sinv, Tensor x_col,
    Tensor w_col, Tensor grad_history, Tensor grad_scale, Tensor grad_scale_inv, int64_t column, bool update,
    Tensor workspace, bool current, int64_t fwd_dtype, int64_t bwd_dtype, bool pow2, double epsilon, int64_t algo,
    int64_t margin, bool need_dgrad, bool need_wgrad, ScalarType input_dtype, ScalarType weight_dtype,
    std::optional<ScalarType> bias_dtype, int64_t stream_handle) {
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
    check(te_activation_backward(activation, gh.get(), identity ? nullptr : hh.get(), fp8_grad(gi).get(), db_ptr, 1,
                                 stream),
          op);
  } else if (!current) {
    Handle gi(op);
    te_quantize_config config{};
    config.accumulate_amax = 1;
    check(te_quantize(gh.get(), fp8_grad(gi).get(), &config, stream), op);
  } else if (identity && bias_dtype.has_value()) {
    // grad_output's scale first, then the same fused bias gradient + cast.
    current_scale(dy, row_out ? g_row : g_col, nullptr, scale, g_sinv, amax, pow2, epsilon, stream);
    Handle gi(op);
    check(te_activation_backward(activation, gh.get(), nullptr, fp8_grad(gi).get(), db_ptr, 0, stream), op);
  } else if (identity) {
    quantize_current(dy, row_out, col_out, scale, g_sinv, amax, pow2, epsilon, stream, op);
  } else {
    // G in high precision (with the bias gradient), then its cast with its own scale.
    const Tensor dh_t = empty({m, n}, torch_dtype(grad_output.scalar_type()), grad_output);
    const te_buffer dh = buffer(dh_t.data_ptr(), g_dtype, {m, n}, grad_output);
    Handle dhh(op);
    dhh.set(TE_SLOT_DATA, dh);
    check(te_activation_backward(activation, gh.get(), hh.get(), dhh.get(), db_ptr, 0, stream), op);
    quantize_current(dh, row_out, col_out, scale, g_sinv, amax, pow2, epsilon, stream, op);
  }
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
    d = empty({rows, cols}, torch_dtype(d_dtype), grad_output);
    Handle a(op), b(op), dh(op);
    a.set(TE_SLOT_DATA, a_data).set(TE_SLOT_SCALE_INV, g_sinv);
    b.set(TE_SLOT_DATA, b_data).set(TE_SLOT_SCALE_INV, element(b_sinv, 0));
    dh.set(TE_SLOT_DATA, buffer(d.data_ptr(), core_dtype(d_dtype, op), {rows, cols}, grad_output));
    te_gemm_config config{};
    config.transpose_b = 1;
    config.use_split_accumulator = 1;
    check(te_gemm(a.get(), b.get(), dh.get(), nullptr, nullptr, &config, ws, static_cast<size_t>(workspace.numel()),
                  stream),
          op);
  };
  // What is not needed comes back as an empty piece of a buffer (no allocation).
  const Tensor none = piece(g_scalars, {0}, 0);
  Tensor grad_input = none, grad_weight = none;
  if (need_dgrad) gemm(g_row, buffer(w_col.data_ptr(), fwd, {k, n}, w_col), w_sinv, grad_input, input_dtype, m, k);
  if (need_wgrad) gemm(g_col, buffer(x_col.data_ptr(), fwd, {k, m}, x_col), x_sinv, grad_weight, weight_dtype, n, k);
  if (!bias_dtype.has_value()) dbias = none;
  return {grad_input, grad_weight, dbias};
}

// Delayed scaling's update of histories[i], scales[i], scale_invs[i] in one core call (what
// ops.delayed_scaling_update does), for the autocast exit and the backward in eager mode.
void delayed_scaling_update_impl(std::vector<Tensor> histories, std::vector<Tensor> scales, std::vector<Tensor> scale_invs,
                            int64_t fp8_dtype, int64_t algo, int64_t margin, int64_t stream_handle) {
  constexpr const char *op = "te_eager.delayed_scaling_update";
  const size_t n = histories.size();
  TE_EAGER_CHECK(scales.size() == n && scale_invs.size() == n, op,
                  ": histories, scales and scale_invs must be as many, got ", n, ", ", scales.size(), " and ",
                  scale_invs.size());
  if (n == 0) return;
  std::deque<Handle> handles;  // (a deque: handles do not move)
  std::vector<te_tensor *> h(n), s(n), si(n);
  const auto whole = [](const Tensor &t) {
    te_buffer b = buffer(t.data_ptr(), TE_DTYPE_FLOAT32, {}, t);
    b.ndim = static_cast<int32_t>(t.dim());
    for (int64_t i = 0; i < t.dim(); ++i) b.shape[i] = t.size(i);
    return b;
  };
  for (size_t i = 0; i < n; ++i) {
    for (const Tensor *t : {&histories[i], &scales[i], &scale_invs[i]}) {
      TE_EAGER_CHECK(t->scalar_type() == ScalarType::Float && t->is_contiguous(), op,
                      ": histories, scales and scale_invs must be contiguous float32 tensors");
    }
    h[i] = handles.emplace_back(op).set(TE_SLOT_DATA, whole(histories[i])).get();
    s[i] = handles.emplace_back(op).set(TE_SLOT_DATA, whole(scales[i])).get();
    si[i] = handles.emplace_back(op).set(TE_SLOT_DATA, whole(scale_invs[i])).get();
  }
  check(te_delayed_scaling_update(h.data(), s.data(), si.data(), n, static_cast<te_dtype>(fp8_dtype),
                                  static_cast<te_amax_compute_algo>(algo), static_cast<int32_t>(margin),
                                  reinterpret_cast<te_stream>(stream_handle)),
        op);
}

// Errors leave the operators as a status, not as a C++ exception. An exception would have to
// cross from this library into libtorch, and where the toolchain links the C++ runtime into
// the library statically (some compiler setups do by default) it cannot be caught there: the
// process dies instead of raising. So each operator catches everything here and returns a
// nonzero status with empty tensors; its Python caller then raises last_error() (_compiled.py).
thread_local std::string last_error_message;

int64_t caught(const char *op) {
  try {
    throw;
  } catch (const std::exception &e) {
    last_error_message = e.what();
  } catch (...) {
    last_error_message = std::string(op) + ": unknown error";
  }
  return 1;
}

std::string last_error() { return last_error_message; }

std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> linear_fp8_forward(
    Tensor input, Tensor weight, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_dgrad, bool need_wgrad, int64_t stream) {
  try {
    auto [out, x_sinv, w_sinv, x_col, w_col] = linear_fp8_forward_impl(
        input, weight, bias, scales, history, workspace, current, fp8_dtype, pow2, epsilon, need_dgrad, need_wgrad, stream);
    return {0, out, x_sinv, w_sinv, x_col, w_col};
  } catch (...) {
    const int64_t status = caught(kLinear);
    const Tensor none = empty({0}, aoti_torch_dtype_uint8(), input);
    return {status, none, none, none, none, none};
  }
}

std::tuple<int64_t, Tensor, Tensor, Tensor> linear_fp8_backward(
    Tensor grad_output, std::optional<Tensor> act_input, int64_t act, Tensor x_sinv, Tensor w_sinv, Tensor x_col,
    Tensor w_col, Tensor grad_history, Tensor grad_scale, Tensor grad_scale_inv, int64_t column, bool update,
    Tensor workspace, bool current, int64_t fwd_dtype, int64_t bwd_dtype, bool pow2, double epsilon, int64_t algo,
    int64_t margin, bool need_dgrad, bool need_wgrad, ScalarType input_dtype, ScalarType weight_dtype,
    std::optional<ScalarType> bias_dtype, int64_t stream) {
  try {
    auto [grad_input, grad_weight, grad_bias] = linear_fp8_backward_impl(
        grad_output, act_input, act, x_sinv, w_sinv, x_col, w_col, grad_history, grad_scale, grad_scale_inv, column,
        update, workspace, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin, need_dgrad, need_wgrad,
        input_dtype, weight_dtype, bias_dtype, stream);
    return {0, grad_input, grad_weight, grad_bias};
  } catch (...) {
    const int64_t status = caught(kLinearBackward);
    const Tensor none = empty({0}, aoti_torch_dtype_uint8(), grad_output);
    return {status, none, none, none};
  }
}

std::tuple<int64_t, Tensor, Tensor, Tensor, Tensor, Tensor> norm_linear_fp8_forward(
    Tensor input, Tensor gamma, std::optional<Tensor> beta, int64_t norm, double eps, bool zero_centered_gamma,
    Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history, Tensor workspace,
    bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col, int64_t stream) {
  try {
    auto [out, sinv, col, mu, rsigma] =
        norm_linear_fp8_forward_impl(input, gamma, beta, norm, eps, zero_centered_gamma, w_data, w_sinv, bias, scales,
                                     history, workspace, current, fp8_dtype, pow2, epsilon, need_col, stream);
    return {0, out, sinv, col, mu, rsigma};
  } catch (...) {
    const int64_t status = caught(kNormLinear);
    const Tensor none = empty({0}, aoti_torch_dtype_uint8(), input);
    return {status, none, none, none, none, none};
  }
}

std::tuple<int64_t, Tensor, Tensor, Tensor> act_linear_fp8_forward(
    Tensor h, int64_t act, Tensor w_data, Tensor w_sinv, std::optional<Tensor> bias, Tensor scales, Tensor history,
    Tensor workspace, bool current, int64_t fp8_dtype, bool pow2, double epsilon, bool need_col, int64_t stream) {
  try {
    auto [out, sinv, col] = act_linear_fp8_forward_impl(h, act, w_data, w_sinv, bias, scales, history, workspace,
                                                        current, fp8_dtype, pow2, epsilon, need_col, stream);
    return {0, out, sinv, col};
  } catch (...) {
    const int64_t status = caught(kActLinear);
    const Tensor none = empty({0}, aoti_torch_dtype_uint8(), h);
    return {status, none, none, none};
  }
}

int64_t delayed_scaling_update(std::vector<Tensor> histories, std::vector<Tensor> scales,
                               std::vector<Tensor> scale_invs, int64_t fp8_dtype, int64_t algo, int64_t margin,
                               int64_t stream) {
  try {
    delayed_scaling_update_impl(std::move(histories), std::move(scales), std::move(scale_invs), fp8_dtype, algo,
                                margin, stream);
    return 0;
  } catch (...) {
    return caught("te_eager.delayed_scaling_update");
  }
}

}  // namespace

STABLE_TORCH_LIBRARY(te_eager, m) {
  m.def(
      "linear_fp8_forward(Tensor input, Tensor weight, Tensor? bias, Tensor scales, Tensor(a!) history, "
      "Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, float epsilon, bool need_dgrad, "
      "bool need_wgrad, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "linear_fp8_backward(Tensor grad_output, Tensor? act_input, int act, Tensor x_sinv, Tensor w_sinv, "
      "Tensor x_col, Tensor w_col, Tensor(a!) grad_history, Tensor(b!) grad_scale, Tensor(c!) grad_scale_inv, "
      "int column, bool update, Tensor(d!) workspace, bool current, int fwd_dtype, int bwd_dtype, bool pow2, "
      "float epsilon, int algo, int margin, "
      "bool need_dgrad, bool need_wgrad, ScalarType input_dtype, ScalarType weight_dtype, "
      "ScalarType? bias_dtype, int stream) -> (int, Tensor, Tensor, Tensor)");
  m.def(
      "norm_linear_fp8_forward(Tensor input, Tensor gamma, Tensor? beta, int norm, float eps, "
      "bool zero_centered_gamma, Tensor w_data, Tensor w_sinv, Tensor? bias, Tensor scales, "
      "Tensor(a!) history, Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, float epsilon, "
      "bool need_col, int stream) -> (int, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "act_linear_fp8_forward(Tensor h, int act, Tensor w_data, Tensor w_sinv, Tensor? bias, "
      "Tensor scales, Tensor(a!) history, Tensor(b!) workspace, bool current, int fp8_dtype, bool pow2, "
      "float epsilon, bool need_col, int stream) -> (int, Tensor, Tensor, Tensor)");
  m.def(
      "delayed_scaling_update(Tensor(a!)[] histories, Tensor(b!)[] scales, Tensor(c!)[] scale_invs, "
      "int fp8_dtype, int algo, int margin, int stream) -> int");
  m.def("last_error() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(te_eager, CompositeExplicitAutograd, m) {
  m.impl("linear_fp8_forward", TORCH_BOX(&linear_fp8_forward));
  m.impl("linear_fp8_backward", TORCH_BOX(&linear_fp8_backward));
  m.impl("norm_linear_fp8_forward", TORCH_BOX(&norm_linear_fp8_forward));
  m.impl("act_linear_fp8_forward", TORCH_BOX(&act_linear_fp8_forward));
  m.impl("delayed_scaling_update", TORCH_BOX(&delayed_scaling_update));
  m.impl("last_error", TORCH_BOX(&last_error));
}
