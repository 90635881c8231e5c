// transformer_engine.pytorch._linear_fast: te.Linear's FP8 forward under per-tensor scaling
// (delayed and current) as one compiled autograd function, for eager mode.
//
// Why it exists: a small layer's forward is bound by host time, and in Python that time is
// spent around the kernels, not in them (benchmarks/results/host_probes.md): the autograd
// Function, the op wrappers and their tensor bookkeeping. Here the forward is one call: the
// input and weight casts and the GEMM go straight to the core's C API with outputs from
// torch's allocator, and the autograd node is made in C++.
//
// It computes exactly what linear_fn.Fp8LinearFunction computes under those recipes (the
// same core calls with the same arguments, so the same bits), for the cases te.Linear sends it
// (fast_linear.usable): plain input and weight, bias in the input's dtype or none, recorded
// amaxes. The backward is not host-bound at the sizes where the
// forward is, so it calls back into Python (fast_linear.py, backward), which shares
// Fp8LinearFunction's backward.
#include <torch/extension.h>

#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <algorithm>
#include <string>
#include <vector>

#include "transformer_engine/gemm.h"
#include "transformer_engine/quantize.h"
#include "transformer_engine/scaling.h"
#include "transformer_engine/tensor.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check(te_status status) { TORCH_CHECK(status == TE_SUCCESS, "te.Linear: ", te_last_error()); }

te_dtype core_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return TE_DTYPE_FLOAT32;
    case at::kHalf: return TE_DTYPE_FLOAT16;
    case at::kBFloat16: return TE_DTYPE_BFLOAT16;
    case at::kByte: return TE_DTYPE_UINT8;
    default: TORCH_CHECK(false, "te.Linear: no core dtype for ", t);
  }
}

// The core's view of a contiguous tensor (dtype: the core's, e.g. FP8 for uint8 bytes).
te_buffer buffer_of(const at::Tensor &t, te_dtype dtype) {
  te_buffer b{};
  b.data = t.data_ptr();
  b.dtype = dtype;
  b.ndim = static_cast<int32_t>(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) b.shape[i] = t.size(i);
  b.device = t.is_cuda() ? TE_DEVICE_CUDA : TE_DEVICE_CPU;
  b.device_id = t.is_cuda() ? t.get_device() : 0;
  return b;
}

// Float element i of a contiguous tensor as a [1] buffer (a scale, an amax history slot, a
// scale_inv in a byte buffer).
te_buffer element_of(const at::Tensor &t, int64_t i) {
  te_buffer b = buffer_of(t, TE_DTYPE_FLOAT32);
  b.data = static_cast<float *>(t.data_ptr()) + i;
  b.ndim = 1;
  b.shape[0] = 1;
  return b;
}

// An owning te_tensor handle (the buffers stay torch's).
class Handle {
 public:
  Handle() { check(te_tensor_create(TE_SCALING_TENSOR, &t_)); }
  ~Handle() { te_tensor_destroy(t_); }
  Handle(const Handle &) = delete;
  Handle &operator=(const Handle &) = delete;
  Handle &set(te_tensor_slot slot, const te_buffer &b) {
    check(te_tensor_set(t_, slot, &b));
    return *this;
  }
  te_tensor *get() const { return t_; }

 private:
  te_tensor *t_ = nullptr;
};

// torch's current stream on t's CUDA device (the core's kernels are ordered with torch's and
// captured by a CUDA graph), null on the CPU. Through c10's device-generic interface, so that
// this file builds against CPU and CUDA builds of torch alike.
te_stream stream_of(const at::Tensor &t) {
  if (!t.is_cuda()) return nullptr;
  const auto *impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return static_cast<te_stream>(impl->getStream(t.device()).native_handle());
}

// The cast of the matrix x with `scale` into `data` (and `col`, the column-wise copy, unless
// null), its scale_inv into `scale_inv`, raising `amax` unless null, as the handles of one
// te_quantize_many entry.
void describe_cast(Handle &in, Handle &out, const at::Tensor &x, const te_buffer &data, const te_buffer *col,
                   const te_buffer &scale, const te_buffer &scale_inv, const te_buffer *amax) {
  in.set(TE_SLOT_DATA, buffer_of(x, core_dtype(x.scalar_type())));
  out.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv);
  if (amax != nullptr) out.set(TE_SLOT_AMAX, *amax);
  if (col != nullptr) out.set(TE_SLOT_COLUMNWISE_DATA, *col);
}

// Current scaling's scale of x's cast: `amax` = max|x|, then `scale` and `scale_inv` from it
// (the first two core calls of ops.quantize_current; the cast is the third).
void current_scale(const at::Tensor &x, const te_buffer &data, const te_buffer *col, const te_buffer &scale,
                   const te_buffer &scale_inv, const te_buffer &amax, bool pow2, double epsilon, te_stream stream) {
  Handle in, reduced, scaled;
  in.set(TE_SLOT_DATA, buffer_of(x, core_dtype(x.scalar_type())));
  reduced.set(TE_SLOT_AMAX, amax);
  check(te_compute_amax(in.get(), reduced.get(), stream));
  scaled.set(TE_SLOT_DATA, data).set(TE_SLOT_SCALE, scale).set(TE_SLOT_SCALE_INV, scale_inv).set(TE_SLOT_AMAX, amax);
  if (col != nullptr) scaled.set(TE_SLOT_COLUMNWISE_DATA, *col);
  te_quantize_config config{};
  config.force_pow2_scales = pow2 ? 1 : 0;
  config.amax_epsilon = static_cast<float>(epsilon);
  check(te_compute_scale_from_amax(scaled.get(), &config, stream));
}

// Byte counts rounded up to 256, so that each piece of a shared buffer starts as aligned as
// a fresh allocation would (cuBLASLt picks its kernels by the operands' alignment).
int64_t aligned(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// The [rows, cols] piece of the byte buffer `buf` that starts `offset` bytes in.
te_buffer piece(const at::Tensor &buf, int64_t offset, int64_t rows, int64_t cols, te_dtype dtype) {
  te_buffer b = buffer_of(buf, dtype);
  b.data = static_cast<uint8_t *>(buf.data_ptr()) + offset;
  b.ndim = 2;
  b.shape[0] = rows;
  b.shape[1] = cols;
  return b;
}

// The Python side of the backward: fast_linear.backward, looked up at each call (on the module,
// which is kept for the process's life: it must not be released after the interpreter is gone).
pybind11::object python_backward() {
  static PyObject *module = pybind11::module_::import("transformer_engine.pytorch.fast_linear").release().ptr();
  return pybind11::reinterpret_borrow<pybind11::object>(module).attr("backward");
}

at::Tensor tensor_or_undefined(const pybind11::handle &h) { return h.is_none() ? at::Tensor() : h.cast<at::Tensor>(); }

// The forward's `keep` buffer: a 256-byte header per operand (input, then weight) holding its
// scale_inv at byte 0 and, under current scaling, its scale at 64 and amax at 128; then the
// column-wise copies from byte 512, each piece at an allocation's alignment. (The GEMM takes
// the scale_invs as cuBLASLt scale pointers, which must be aligned: 4 bytes apart fails with
// NOT_SUPPORTED.)
constexpr int64_t kKeepWeightScaleInv = 256;  // the weight's header
constexpr int64_t kKeepHeader = 512;
enum Operand : int64_t { kInput = 0, kWeight = 1 };
enum HeaderSlot : int64_t { kScaleInv = 0, kScale = 64, kAmax = 128 };  // byte offsets

te_buffer header(const at::Tensor &keep, Operand operand, HeaderSlot slot) {
  return element_of(keep, (operand * kKeepWeightScaleInv + slot) / 4);
}

// FP8 tensor cores work on 16x16 granules: every GEMM dimension must be a multiple of 16.
constexpr int64_t kGranule = 16;

// te.Linear's recipes that take this path (fast_linear.py passes the code).
enum Scaling : int64_t { kDelayed = 0, kCurrent = 1 };

struct LinearFp8 : public torch::autograd::Function<LinearFp8> {
  // scaling: a Scaling. Delayed scaling casts with scales[0] (input) and scales[1] (weight)
  // and raises history[0, 0] and history[0, 1]; current scaling computes each scale from its
  // tensor's amax (pow2, epsilon as the recipe says) and ignores scales and history.
  // fwd_dtype / bwd_dtype: te_dtype values of the FP8 formats; bwd_meta: the backward's
  // (history, scale, scale_inv), which a delayed backward updates in place (kept as data, not
  // as saved tensors, like Fp8LinearFunction's ctx.bwd_meta).
  static at::Tensor forward(AutogradContext *ctx, const at::Tensor &input, const at::Tensor &weight,
                            const c10::optional<at::Tensor> &bias, int64_t scaling, const at::Tensor &scales,
                            const at::Tensor &history, bool pow2, double epsilon, const at::Tensor &workspace,
                            std::vector<at::Tensor> bwd_meta, int64_t fwd_dtype, int64_t bwd_dtype, int64_t margin,
                            std::string algo, bool need_dgrad, bool need_wgrad) {
    const auto fp8 = static_cast<te_dtype>(fwd_dtype);
    const int64_t k = input.size(-1), n = weight.size(0);
    const at::Tensor x = input.dim() == 2 ? input.contiguous() : input.reshape({-1, k}).contiguous();
    const int64_t m = x.size(0);
    const te_stream stream = stream_of(input);
    // Two allocations for the five FP8 pieces (each allocation costs host time, and at small
    // sizes host time is the forward's cost). `rows`: the row-wise copies, which only the GEMM
    // reads. `keep`, what the backward needs: both scale_invs (bytes 0 and 256), then the
    // column-wise input (for wgrad) and weight (for dgrad) that it saves instead of the
    // activation.
    const auto bytes = x.options().dtype(at::kByte);
    const int64_t w_row_at = aligned(m * k);
    const at::Tensor rows = at::empty({w_row_at + n * k}, bytes);
    const int64_t x_col_at = kKeepHeader, w_col_at = x_col_at + (need_wgrad ? aligned(m * k) : 0);
    const at::Tensor keep = at::empty({w_col_at + (need_dgrad ? n * k : 0)}, bytes);
    const te_buffer x_data = piece(rows, 0, m, k, fp8), w_data = piece(rows, w_row_at, n, k, fp8);
    const te_buffer x_sinv = header(keep, kInput, kScaleInv), w_sinv = header(keep, kWeight, kScaleInv);
    const te_buffer x_col = piece(keep, x_col_at, k, m, fp8), w_col = piece(keep, w_col_at, k, n, fp8);
    // Both casts in one core call: on the GPU one kernel launch where both have a transposed
    // copy and the same input dtype (a training step's forward), each launch being host time.
    const at::Tensor w = weight.contiguous();
    const te_buffer *x_col_out = need_wgrad ? &x_col : nullptr, *w_col_out = need_dgrad ? &w_col : nullptr;
    Handle x_in, x_out, w_in, w_out;
    te_quantize_config cast_config{};
    if (scaling == kDelayed) {
      const te_buffer x_amax = element_of(history, 0), w_amax = element_of(history, 1);
      describe_cast(x_in, x_out, x, x_data, x_col_out, element_of(scales, 0), x_sinv, &x_amax);
      describe_cast(w_in, w_out, w, w_data, w_col_out, element_of(scales, 1), w_sinv, &w_amax);
      cast_config.accumulate_amax = 1;  // the step's forwards keep the largest amax
    } else {
      const te_buffer x_scale = header(keep, kInput, kScale), w_scale = header(keep, kWeight, kScale);
      const te_buffer x_amax = header(keep, kInput, kAmax), w_amax = header(keep, kWeight, kAmax);
      current_scale(x, x_data, x_col_out, x_scale, x_sinv, x_amax, pow2, epsilon, stream);
      current_scale(w, w_data, w_col_out, w_scale, w_sinv, w_amax, pow2, epsilon, stream);
      // The amaxes are known: the casts need not reduce them again.
      describe_cast(x_in, x_out, x, x_data, x_col_out, x_scale, x_sinv, nullptr);
      describe_cast(w_in, w_out, w, w_data, w_col_out, w_scale, w_sinv, nullptr);
    }
    const te_tensor *cast_in[] = {x_in.get(), w_in.get()};
    te_tensor *cast_out[] = {x_out.get(), w_out.get()};
    check(te_quantize_many(cast_in, cast_out, 2, &cast_config, stream));
    // The output in its final shape (not a view made here: autograd forbids in-place ops on a
    // custom function's views), which the core sees as the matrix [M, N].
    std::vector<int64_t> shape = input.sizes().vec();
    shape.back() = n;
    at::Tensor out = at::empty(shape, input.options());
    te_buffer out_matrix = buffer_of(out, core_dtype(out.scalar_type()));
    out_matrix.ndim = 2;
    out_matrix.shape[0] = m;
    out_matrix.shape[1] = n;
    Handle a, b, d, bias_handle;
    a.set(TE_SLOT_DATA, x_data).set(TE_SLOT_SCALE_INV, x_sinv);
    b.set(TE_SLOT_DATA, w_data).set(TE_SLOT_SCALE_INV, w_sinv);
    d.set(TE_SLOT_DATA, out_matrix);
    const bool has_bias = bias.has_value() && bias->defined();
    // The bias rides in the GEMM's epilogue for a bf16/fp16 output; cuBLASLt takes only a bf16
    // bias beside FP8 operands and an fp32 output, so there it is added afterwards, in fp32
    // (as linear_fn.fp8_gemm does).
    const bool fused_bias = has_bias && out.scalar_type() != at::kFloat;
    const at::Tensor bias_data = has_bias ? bias->contiguous() : at::Tensor();  // alive across the GEMM
    if (fused_bias) bias_handle.set(TE_SLOT_DATA, buffer_of(bias_data, core_dtype(bias_data.scalar_type())));
    te_gemm_config config{};
    config.transpose_b = 1;  // both operands K-major ("TN"); fast accumulation in the forward
    void *ws = workspace.numel() > 0 ? workspace.data_ptr() : nullptr;
    check(te_gemm(a.get(), b.get(), d.get(), fused_bias ? bias_handle.get() : nullptr, nullptr, &config, ws,
                  static_cast<size_t>(workspace.numel()), stream));
    if (has_bias && !fused_bias) out.add_(bias_data);
    // The FP8 column-wise input is all the backward keeps of the activation.
    ctx->save_for_backward({keep});
    ctx->saved_data["bwd_meta"] = std::move(bwd_meta);
    ctx->saved_data["config"] = std::vector<int64_t>{scaling,
                                                     fwd_dtype,
                                                     bwd_dtype,
                                                     margin,
                                                     need_dgrad,
                                                     need_wgrad,
                                                     has_bias,
                                                     static_cast<int64_t>(input.scalar_type()),
                                                     static_cast<int64_t>(weight.scalar_type()),
                                                     static_cast<int64_t>(has_bias ? bias->scalar_type() : at::kFloat),
                                                     m,
                                                     n,
                                                     k,
                                                     x_col_at,
                                                     w_col_at,
                                                     pow2};
    ctx->saved_data["epsilon"] = epsilon;
    ctx->saved_data["algo"] = std::move(algo);
    ctx->saved_data["input_shape"] = input.sizes().vec();
    return out;
  }

  static variable_list backward(AutogradContext *ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto meta = ctx->saved_data["bwd_meta"].toTensorVector();
    const auto c = ctx->saved_data["config"].toIntVector();
    // Empty tensors carry the dtypes of input, weight and bias to Python.
    const auto carrier = [&](int i) { return at::empty({0}, at::TensorOptions().dtype(static_cast<at::ScalarType>(c[i]))); };
    pybind11::gil_scoped_acquire gil;
    // The plan's fields (quantization.Plan): kind, formats, pow2, epsilon, algo, margin.
    const auto plan = pybind11::make_tuple(c[0] == kDelayed ? "delayed" : "current", te_dtype_name(static_cast<te_dtype>(c[1])),
                                           te_dtype_name(static_cast<te_dtype>(c[2])), static_cast<bool>(c[15]),
                                           ctx->saved_data["epsilon"].toDouble(), ctx->saved_data["algo"].toStringRef(), c[3]);
    const pybind11::object result = python_backward()(
        grads[0], saved[0], pybind11::make_tuple(c[10], c[11], c[12], kKeepWeightScaleInv, c[13], c[14]), meta[0], meta[1],
        meta[2], plan, static_cast<bool>(c[4]), static_cast<bool>(c[5]), static_cast<bool>(c[6]), carrier(7), carrier(8),
        c[6] ? pybind11::cast(carrier(9)) : pybind11::none(), ctx->saved_data["input_shape"].toIntVector());
    const auto t = result.cast<pybind11::tuple>();
    // One gradient per forward argument: input, weight, bias, then the non-differentiable rest.
    variable_list out(17);
    for (int i = 0; i < 3; ++i) out[i] = tensor_or_undefined(t[i]);
    return out;
  }
};

// Whether the compiled forward takes this call, checked before anything runs. It declines
// (and te.Linear's Python path takes the call, raising the errors where the input is wrong)
// anything that path would treat otherwise: shapes the FP8 GEMM cannot take, tensors on
// different devices, dtypes other than fp32/bf16/fp16, a bias of another dtype than the input
// (added in fp32 there), an input torch.autocast would cast, an active dispatch mode (a
// tracer or fake tensors).
bool takes(const at::Tensor &input, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
           const at::Tensor &scales, const at::Tensor &history) {
  const auto floating = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; };
  if (input.dim() == 0 || weight.dim() != 2 || input.size(-1) != weight.size(1)) return false;
  const int64_t k = weight.size(1), n = weight.size(0), m = input.numel() / std::max<int64_t>(k, 1);
  if (k % kGranule != 0 || n % kGranule != 0 || m % kGranule != 0) return false;
  if (!floating(input.scalar_type()) || !floating(weight.scalar_type())) return false;
  const c10::Device device = input.device();
  if (weight.device() != device || scales.device() != device || history.device() != device) return false;
  if (bias.has_value() && bias->defined() &&
      (bias->scalar_type() != input.scalar_type() || bias->device() != device || bias->dim() != 1 || bias->size(0) != n))
    return false;
  if (at::autocast::is_autocast_enabled(device.type()) &&
      at::autocast::get_autocast_dtype(device.type()) != input.scalar_type())
    return false;
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0;
}

// The forward, or None where `takes` declines. Whether the backward needs dgrad and wgrad is
// read here, outside the autograd function (whose forward runs with grad mode off).
pybind11::object linear_fp8(const at::Tensor &input, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                            const at::Tensor &scales, const at::Tensor &history, std::vector<at::Tensor> bwd_meta,
                            const at::Tensor &workspace, int64_t scaling, bool pow2, double epsilon, int64_t fwd_dtype,
                            int64_t bwd_dtype, int64_t margin, std::string algo) {
  TORCH_CHECK(scaling == kDelayed || scaling == kCurrent, "linear_fp8: scaling must be 0 (delayed) or 1 (current), got ",
              scaling);
  TORCH_CHECK(bwd_meta.size() == 3, "linear_fp8: bwd_meta must be (history, scale, scale_inv), got ", bwd_meta.size(),
              " tensors");
  if (!takes(input, weight, bias, scales, history)) return pybind11::none();
  const bool grad = at::GradMode::is_enabled();
  const bool need_dgrad = grad && input.requires_grad(), need_wgrad = grad && weight.requires_grad();
  return pybind11::cast(LinearFp8::apply(input, weight, bias, scaling, scales, history, pow2, epsilon, workspace,
                                         std::move(bwd_meta), fwd_dtype, bwd_dtype, margin, std::move(algo), need_dgrad,
                                         need_wgrad));
}

// Delayed scaling's update of histories[i], scales[i], scale_invs[i] in one core call (what
// ops.delayed_scaling_update does), for the autocast exit and the backward in eager mode.
void delayed_scaling_update(const std::vector<at::Tensor> &histories, const std::vector<at::Tensor> &scales,
                            const std::vector<at::Tensor> &scale_invs, int64_t fp8_dtype, int64_t algo, int64_t margin) {
  const size_t n = histories.size();
  TORCH_CHECK(scales.size() == n && scale_invs.size() == n,
              "delayed_scaling_update: histories, scales and scale_invs must be as many, got ", n, ", ",
              scales.size(), " and ", scale_invs.size());
  if (n == 0) return;
  std::vector<Handle> handles(3 * n);
  std::vector<te_tensor *> h(n), s(n), si(n);
  for (size_t i = 0; i < n; ++i) {
    h[i] = handles[3 * i].set(TE_SLOT_DATA, buffer_of(histories[i], TE_DTYPE_FLOAT32)).get();
    s[i] = handles[3 * i + 1].set(TE_SLOT_DATA, buffer_of(scales[i], TE_DTYPE_FLOAT32)).get();
    si[i] = handles[3 * i + 2].set(TE_SLOT_DATA, buffer_of(scale_invs[i], TE_DTYPE_FLOAT32)).get();
  }
  check(te_delayed_scaling_update(h.data(), s.data(), si.data(), n, static_cast<te_dtype>(fp8_dtype),
                                  static_cast<te_amax_compute_algo>(algo), static_cast<int32_t>(margin),
                                  stream_of(histories[0])));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "te.Linear's FP8 forward under per-tensor scaling as one compiled autograd function (eager)";
  m.def("linear_fp8", &linear_fp8, pybind11::arg("input"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("scales"), pybind11::arg("history"), pybind11::arg("bwd_meta"), pybind11::arg("workspace"),
        pybind11::arg("scaling"), pybind11::arg("pow2"), pybind11::arg("epsilon"), pybind11::arg("fwd_dtype"),
        pybind11::arg("bwd_dtype"), pybind11::arg("margin"), pybind11::arg("algo"));
  m.def("delayed_scaling_update", &delayed_scaling_update, pybind11::arg("histories"), pybind11::arg("scales"),
        pybind11::arg("scale_invs"), pybind11::arg("fp8_dtype"), pybind11::arg("algo"), pybind11::arg("margin"));
  // The torch release this was compiled against (its C++ ABI is not stable across releases).
  m.attr("torch_version") = pybind11::make_tuple(TE_TORCH_MAJOR, TE_TORCH_MINOR);
}
