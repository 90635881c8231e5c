// What the te_eager operators are made of: the core's view of torch's tensors, allocation
// through the C shim, errors that never leave as C++ exceptions, and the casts and the forward
// GEMM that several operators share. Only torch/csrc/stable and torch/headeronly are included
// (library.cpp says why).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "transformer_engine/activation.h"
#include "transformer_engine/gemm.h"
#include "transformer_engine/norm.h"
#include "transformer_engine/quantize.h"
#include "transformer_engine/scaling.h"
#include "transformer_engine/tensor.h"

namespace te_eager {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Error messages are made with std::to_string and concatenation, not with torch's checks'
// ostream formatting: where the C++ runtime is linked in statically, its streams may not be
// set up, and a message would come out cut short.
inline void append(std::string &s, const char *v) { s += v; }
template <class T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append(std::string &s, T v) {
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

inline void check(te_status status, const char *op) { TE_EAGER_CHECK(status == TE_SUCCESS, op, ": ", te_last_error()); }

inline te_dtype core_dtype(ScalarType t, const char *op) {
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
inline te_buffer buffer(void *data, te_dtype dtype, std::initializer_list<int64_t> shape, const Tensor &on) {
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

// A whole contiguous tensor's buffer, in its own shape.
inline te_buffer whole(const Tensor &t, te_dtype dtype) {
  te_buffer b = buffer(t.data_ptr(), dtype, {}, t);
  b.ndim = static_cast<int32_t>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) b.shape[d] = t.size(d);
  return b;
}

// Float element i of a contiguous fp32 tensor as a [1] buffer (a scale, an amax history slot).
inline te_buffer element(const Tensor &t, int64_t i) {
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
inline std::vector<int64_t> contiguous_strides(const std::vector<int64_t> &shape) {
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
inline Tensor empty(const std::vector<int64_t> &shape, int32_t dtype, const Tensor &like) {
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
inline Tensor piece(const Tensor &whole, const std::vector<int64_t> &shape, int64_t offset) {
  const std::vector<int64_t> strides = contiguous_strides(shape);
  AtenTensorHandle handle = nullptr;
  TE_EAGER_CHECK(aoti_torch__reinterpret_tensor(whole.get(), static_cast<int64_t>(shape.size()), shape.data(),
                                                 strides.data(), offset, &handle) == AOTI_TORCH_SUCCESS,
                  "te_eager: a view of a buffer failed");
  return Tensor(handle);
}

// The C shim's code of a float dtype (float32 for anything else: callers pass float dtypes).
inline int32_t torch_dtype(ScalarType t) {
  switch (t) {
    case ScalarType::Half: return aoti_torch_dtype_float16();
    case ScalarType::BFloat16: return aoti_torch_dtype_bfloat16();
    default: return aoti_torch_dtype_float32();
  }
}

// Byte counts rounded up to 256, so that each piece of a shared buffer starts as aligned as a
// fresh allocation would (cuBLASLt picks its kernels by the operands' alignment).
inline int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// FP8 tensor cores work on 16x16 granules: every GEMM dimension must be a multiple of 16.
constexpr int64_t kGranule = 16;

inline bool floating(ScalarType t) { return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half; }

// Current scaling's scale of x's cast: amax = max|x|, then scale and scale_inv from it (the first
// two core calls of ops.quantize_current; the cast is the third).
inline void current_scale(const te_buffer &x, const te_buffer &data, const te_buffer *col, const te_buffer &scale,
                          const te_buffer &scale_inv, const te_buffer &amax, bool pow2, double epsilon,
                          te_stream stream, const char *op) {
  Handle in(op), reduced(op), scaled(op);
  in.set(TE_SLOT_DATA, x);
  reduced.set(TE_SLOT_AMAX, amax);
  check(te_compute_amax(in.get(), reduced.get(), stream), op);
  scaled.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv).set(TE_SLOT_AMAX, amax);
  if (col != nullptr) scaled.set(TE_SLOT_COLUMNWISE_DATA, *col);
  te_quantize_config config{};
  config.force_pow2_scales = pow2 ? 1 : 0;
  config.amax_epsilon = static_cast<float>(epsilon);
  check(te_compute_scale_from_amax(scaled.get(), &config, stream), op);
}

// Current scaling's scale of an activation's output (forward: act(h); backward, with dy:
// act'(h) * dy) from its own amax, without writing it: the activation's amax-only call, then
// the scale (ops.activation_scale / activation_backward_scale; the FP8 pass with that scale
// follows). `data` names the FP8 format, as in current_scale.
inline void activation_current_scale(te_activation act, const te_buffer *dy, const te_buffer &h, const te_buffer &data,
                                     const te_buffer &scale, const te_buffer &scale_inv, const te_buffer &amax,
                                     bool pow2, double epsilon, te_stream stream, const char *op) {
  Handle in(op), reduced(op), scaled(op);
  in.set(TE_SLOT_DATA, h);
  reduced.set(TE_SLOT_AMAX, amax);
  if (dy == nullptr) {
    check(te_activation_forward(act, nullptr, in.get(), reduced.get(), 0, stream), op);
  } else {
    Handle g(op);
    g.set(TE_SLOT_DATA, *dy);
    check(te_activation_backward(act, nullptr, g.get(), in.get(), reduced.get(), nullptr, 0, stream), op);
  }
  scaled.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv).set(TE_SLOT_AMAX, amax);
  te_quantize_config config{};
  config.force_pow2_scales = pow2 ? 1 : 0;
  config.amax_epsilon = static_cast<float>(epsilon);
  check(te_compute_scale_from_amax(scaled.get(), &config, stream), op);
}

// Current scaling's FP8 cast of x (both copies as asked) with its scale from its own amax: the
// three core calls of ops.quantize_current.
inline void quantize_current(const te_buffer &x, const te_buffer *data, const te_buffer *col, const te_buffer &scale,
                      const te_buffer &scale_inv, const te_buffer &amax, bool pow2, double epsilon, te_stream stream,
                      const char *op) {
  const te_buffer &fmt = data != nullptr ? *data : *col;
  current_scale(x, fmt, nullptr, scale, scale_inv, amax, pow2, epsilon, stream, op);
  Handle in(op), out(op);
  in.set(TE_SLOT_DATA, x);
  if (data != nullptr) out.set(TE_SLOT_DATA, *data);
  if (col != nullptr) out.set(TE_SLOT_COLUMNWISE_DATA, *col);
  out.set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv);
  check(te_quantize(in.get(), out.get(), nullptr, stream), op);
}

// out [M, N] = a [M, K] @ w [N, K]^T (+ bias), FP8 operands, as linear_fn.fp8_gemm computes it
// (fast accumulation). The bias rides in the GEMM's epilogue for a bf16/fp16 output; cuBLASLt
// takes only a bf16 bias beside FP8 operands and an fp32 output, so there it is added
// afterwards, in fp32. Returns the output (a new tensor in that case).
inline Tensor forward_gemm(const te_buffer &a_data, const te_buffer &a_sinv, const te_buffer &w_data, const te_buffer &w_sinv,
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

// Errors leave the operators as a status, not as a C++ exception. An exception would have to
// cross from this library into libtorch, and where the toolchain links the C++ runtime into
// the library statically (some compiler setups do by default) it cannot be caught there: the
// process dies instead of raising. So each operator catches everything here and returns a
// nonzero status with empty tensors; its Python caller then raises last_error() (_compiled.py).
int64_t caught(const char *op);  // (library.cpp: the message for last_error())

template <size_t... I>
auto with_status(int64_t status, const Tensor &none, std::index_sequence<I...>) {
  return std::make_tuple(status, ((void)I, none)...);
}

// body() -> std::tuple<Tensor...>, run so that an error becomes (status, empty tensors) and a
// success (0, body's tensors). `like` gives the empty tensors' device.
template <class Body>
auto guarded(const char *op, const Tensor &like, Body body) {
  using Outputs = decltype(body());
  using Result = decltype(std::tuple_cat(std::tuple<int64_t>{}, std::declval<Outputs>()));
  try {
    return Result(std::tuple_cat(std::tuple<int64_t>{0}, body()));
  } catch (...) {
    const int64_t status = caught(op);
    return Result(with_status(status, empty({0}, aoti_torch_dtype_uint8(), like),
                              std::make_index_sequence<std::tuple_size_v<Outputs>>{}));
  }
}

}  // namespace te_eager
