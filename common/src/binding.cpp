// The Python binding of the core's C API: `transformer_engine.common._core`.
//
// It takes any array that speaks DLPack or the buffer protocol (torch, jax, numpy, cupy), on
// the CPU or a CUDA device, and compiles against no framework. Arrays are checked here for
// what only the binding can see (contiguity, writability, device kind); the C API checks the
// rest (dtypes, shapes, how the buffers fit together) and its message becomes the exception.
// Nothing is written unless every check passed.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "transformer_engine/transformer_engine.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// DLPack type codes of the FP8 formats (DLPack >= 1.0).
constexpr uint8_t kDLFloat8E4M3FN = 10;
constexpr uint8_t kDLFloat8E5M2 = 12;
constexpr uint8_t kDLFloat8E8M0FNU = 14;

// A quantized (or plain) tensor as Python sees it: the arrays of its slots, kept alive here,
// and the FP8 format of its data when the arrays hold raw bytes (uint8).
struct Tensor {
  nb::object slots[TE_SLOT_COUNT];
  std::optional<te_dtype> dtype;
  te_scaling_mode scaling_mode = TE_SCALING_TENSOR;
};

struct HandleDeleter {
  void operator()(te_tensor *t) const { te_tensor_destroy(t); }
};
using Handle = std::unique_ptr<te_tensor, HandleDeleter>;

[[noreturn]] void raise_status(te_status status, const std::string &message) {
  switch (status) {
    case TE_ERROR_TYPE: throw nb::type_error(message.c_str());
    case TE_ERROR_VALUE: throw nb::value_error(message.c_str());
    default: throw std::runtime_error(message);
  }
}

void check_status(te_status status) {
  if (status != TE_SUCCESS) raise_status(status, te_last_error());
}

std::string array_description(const nb::ndarray<nb::ro> &a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// The te_dtype of an array: its own element type, or `fp8` when the array holds bytes that
// are FP8 data (uint8/int8) or scales of MXFP8 (E8M0).
te_dtype dtype_of(const char *op, const std::string &what, const nb::dlpack::dtype &dt,
                  std::optional<te_dtype> bytes_as) {
  using code = nb::dlpack::dtype_code;
  const auto c = static_cast<code>(dt.code);
  std::optional<te_dtype> d;
  if (dt.lanes == 1) {
    if (c == code::Float && dt.bits == 32) d = TE_DTYPE_FLOAT32;
    if (c == code::Float && dt.bits == 16) d = TE_DTYPE_FLOAT16;
    if (c == code::Bfloat && dt.bits == 16) d = TE_DTYPE_BFLOAT16;
    if (c == code::Int && dt.bits == 8) d = TE_DTYPE_INT8;
    if (c == code::UInt && dt.bits == 8) d = TE_DTYPE_UINT8;
    if (c == code::Int && dt.bits == 16) d = TE_DTYPE_INT16;
    if (c == code::Int && dt.bits == 32) d = TE_DTYPE_INT32;
    if (c == code::Int && dt.bits == 64) d = TE_DTYPE_INT64;
    if (dt.bits == 8 && dt.code == kDLFloat8E4M3FN) d = TE_DTYPE_FLOAT8_E4M3;
    if (dt.bits == 8 && dt.code == kDLFloat8E5M2) d = TE_DTYPE_FLOAT8_E5M2;
    if (dt.bits == 8 && dt.code == kDLFloat8E8M0FNU) d = TE_DTYPE_FLOAT8_E8M0;
  }
  if (!d) {
    const char *kind = c == code::Float   ? "float"
                       : c == code::Int   ? "int"
                       : c == code::UInt  ? "uint"
                       : c == code::Bool  ? "bool"
                       : c == code::Complex ? "complex"
                                            : "dlpack-code-";
    std::string got = std::string(kind) + (kind[0] == 'd' ? std::to_string(dt.code) + "-" : "") +
                      std::to_string(dt.bits);
    if (dt.lanes != 1) got += "x" + std::to_string(dt.lanes);
    throw nb::type_error((std::string(op) + ": " + what +
                          " must have a supported dtype (float32, float16, bfloat16, float8, "
                          "int8/16/32/64, uint8), got " + got)
                             .c_str());
  }
  if (bytes_as && *d != *bytes_as) {
    if (*d != TE_DTYPE_UINT8 && *d != TE_DTYPE_INT8) {
      throw nb::type_error((std::string(op) + ": " + what + " must hold " +
                            te_dtype_name(*bytes_as) + " data, as raw bytes (uint8) or natively, got " +
                            te_dtype_name(*d))
                               .c_str());
    }
    d = bytes_as;
  }
  return *d;
}

// Converts a Python array into a te_buffer: C-contiguous, on the CPU or a CUDA device, and
// writable when it is an output.
te_buffer to_buffer(const char *op, const std::string &what, nb::handle obj, bool writable,
                    std::optional<te_dtype> bytes_as) {
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    throw nb::type_error((std::string(op) + ": " + what +
                          " must be an array (DLPack or buffer protocol), got " +
                          nb::inst_name(obj).c_str())
                             .c_str());
  }
  void *data = const_cast<void *>(a.data());
  if (writable) {
    nb::ndarray<> w;
    if (!nb::try_cast(obj, w, /*convert=*/false)) {
      throw nb::value_error((std::string(op) + ": " + what + " must be a writable array, got a read-only " +
                             array_description(a) + " array")
                                .c_str());
    }
    data = w.data();
  }
  if (a.ndim() > TE_MAX_DIMS) {
    throw nb::value_error((std::string(op) + ": " + what + " must have at most " +
                           std::to_string(TE_MAX_DIMS) + " dimensions, got " + std::to_string(a.ndim()))
                              .c_str());
  }
  // An empty array has no layout to speak of (frameworks give it arbitrary strides).
  bool empty = false;
  for (size_t i = 0; i < a.ndim(); ++i) empty = empty || a.shape(i) == 0;
  int64_t expected_stride = 1;
  for (size_t i = a.ndim(); !empty && i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected_stride) {
      throw nb::value_error((std::string(op) + ": " + what + " must be C-contiguous, got shape " +
                             array_description(a) + " with non-contiguous strides")
                                .c_str());
    }
    expected_stride *= static_cast<int64_t>(a.shape(i));
  }
  te_buffer b{};
  b.data = data;
  b.dtype = dtype_of(op, what, a.dtype(), bytes_as);
  b.ndim = static_cast<int32_t>(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) b.shape[i] = static_cast<int64_t>(a.shape(i));
  if (a.device_type() == nb::device::cpu::value) {
    b.device = TE_DEVICE_CPU;
  } else if (a.device_type() == nb::device::cuda::value) {
    b.device = TE_DEVICE_CUDA;
    b.device_id = a.device_id();
  } else {
    throw nb::value_error((std::string(op) + ": " + what +
                           " must be on the CPU or a CUDA device, got DLPack device type " +
                           std::to_string(a.device_type()))
                              .c_str());
  }
  return b;
}

const char *const kSlotNames[TE_SLOT_COUNT] = {"data",      "columnwise_data",      "scale",
                                               "scale_inv", "columnwise_scale_inv", "amax"};

// Which slots an op writes, by role: the C API documents them; the binding only needs to
// know which arrays must be writable.
constexpr unsigned kAllSlots = (1u << TE_SLOT_COUNT) - 1;

// Builds a C handle for a Tensor (or a bare array, taken as a plain tensor's data).
Handle make_handle(const char *op, const char *name, nb::handle obj, unsigned writable_slots) {
  Tensor plain;
  const Tensor *t = &plain;
  if (nb::isinstance<Tensor>(obj)) {
    t = nb::inst_ptr<Tensor>(obj);
  } else {
    plain.slots[TE_SLOT_DATA] = nb::borrow(obj);
  }
  te_tensor *raw = nullptr;
  check_status(te_tensor_create(t->scaling_mode, &raw));
  Handle h(raw);
  for (int s = 0; s < TE_SLOT_COUNT; ++s) {
    if (!t->slots[s].is_valid() || t->slots[s].is_none()) continue;
    std::optional<te_dtype> bytes_as;
    if (s == TE_SLOT_DATA || s == TE_SLOT_COLUMNWISE_DATA) bytes_as = t->dtype;
    if ((s == TE_SLOT_SCALE_INV || s == TE_SLOT_COLUMNWISE_SCALE_INV) &&
        t->scaling_mode == TE_SCALING_MXFP8) {
      bytes_as = TE_DTYPE_FLOAT8_E8M0;
    }
    const std::string what = std::string(name) + "." + kSlotNames[s];
    const te_buffer b = to_buffer(op, what, t->slots[s], (writable_slots >> s) & 1u, bytes_as);
    check_status(te_tensor_set(h.get(), static_cast<te_tensor_slot>(s), &b));
  }
  return h;
}

te_stream as_stream(uintptr_t stream) { return reinterpret_cast<te_stream>(stream); }

Handle plain_handle(const char *op, const std::string &what, nb::handle obj, bool writable) {
  te_tensor *raw = nullptr;
  check_status(te_tensor_create(TE_SCALING_TENSOR, &raw));
  Handle h(raw);
  const te_buffer b = to_buffer(op, what, obj, writable, std::nullopt);
  check_status(te_tensor_set(h.get(), TE_SLOT_DATA, &b));
  return h;
}

void init_tensor(Tensor *t, nb::object data, std::optional<te_dtype> dtype, te_scaling_mode mode,
                 nb::object scale, nb::object scale_inv, nb::object amax, nb::object columnwise_data,
                 nb::object columnwise_scale_inv) {
  new (t) Tensor();
  t->slots[TE_SLOT_DATA] = data;
  t->slots[TE_SLOT_COLUMNWISE_DATA] = columnwise_data;
  t->slots[TE_SLOT_SCALE] = scale;
  t->slots[TE_SLOT_SCALE_INV] = scale_inv;
  t->slots[TE_SLOT_COLUMNWISE_SCALE_INV] = columnwise_scale_inv;
  t->slots[TE_SLOT_AMAX] = amax;
  t->dtype = dtype;
  t->scaling_mode = mode;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Binding of the Transformer Engine core C API (internal; use the framework packages).";

  nb::enum_<te_dtype>(m, "DType", "Element types of the core.")
      .value("float32", TE_DTYPE_FLOAT32)
      .value("float16", TE_DTYPE_FLOAT16)
      .value("bfloat16", TE_DTYPE_BFLOAT16)
      .value("float8_e4m3", TE_DTYPE_FLOAT8_E4M3)
      .value("float8_e5m2", TE_DTYPE_FLOAT8_E5M2)
      .value("float8_e8m0", TE_DTYPE_FLOAT8_E8M0)
      .value("int8", TE_DTYPE_INT8)
      .value("uint8", TE_DTYPE_UINT8)
      .value("int16", TE_DTYPE_INT16)
      .value("int32", TE_DTYPE_INT32)
      .value("int64", TE_DTYPE_INT64);

  nb::enum_<te_scaling_mode>(m, "ScalingMode", "How FP8 data is scaled (see tensor.h).")
      .value("tensor", TE_SCALING_TENSOR)
      .value("block_1x128", TE_SCALING_BLOCK_1X128)
      .value("block_128x128", TE_SCALING_BLOCK_128X128)
      .value("mxfp8", TE_SCALING_MXFP8);

  nb::enum_<te_amax_compute_algo>(m, "AmaxComputeAlgo")
      .value("max", TE_AMAX_COMPUTE_MAX)
      .value("most_recent", TE_AMAX_COMPUTE_MOST_RECENT);

  nb::class_<Tensor>(m, "Tensor",
                     "A tensor as the core sees it: its arrays by role. FP8 data may be given as "
                     "uint8 arrays with `dtype` naming the format; MXFP8 scale_inv arrays are "
                     "uint8 (E8M0 bytes). The arrays are not copied.")
      .def("__init__", &init_tensor, "data"_a = nb::none(), nb::kw_only(), "dtype"_a = nb::none(),
           "scaling_mode"_a = TE_SCALING_TENSOR, "scale"_a = nb::none(), "scale_inv"_a = nb::none(),
           "amax"_a = nb::none(), "columnwise_data"_a = nb::none(),
           "columnwise_scale_inv"_a = nb::none())
      .def_prop_ro("data", [](const Tensor &t) { return t.slots[TE_SLOT_DATA]; })
      .def_prop_ro("columnwise_data", [](const Tensor &t) { return t.slots[TE_SLOT_COLUMNWISE_DATA]; })
      .def_prop_ro("scale", [](const Tensor &t) { return t.slots[TE_SLOT_SCALE]; })
      .def_prop_ro("scale_inv", [](const Tensor &t) { return t.slots[TE_SLOT_SCALE_INV]; })
      .def_prop_ro("columnwise_scale_inv",
                   [](const Tensor &t) { return t.slots[TE_SLOT_COLUMNWISE_SCALE_INV]; })
      .def_prop_ro("amax", [](const Tensor &t) { return t.slots[TE_SLOT_AMAX]; })
      .def_prop_ro("dtype", [](const Tensor &t) { return t.dtype; })
      .def_prop_ro("scaling_mode", [](const Tensor &t) { return t.scaling_mode; });

  m.def(
      "quantize",
      [](nb::handle input, nb::handle output, bool force_pow2_scales, float amax_epsilon,
         uintptr_t stream) {
        Handle in = make_handle("quantize", "input", input, 0);
        Handle out = make_handle("quantize", "output", output, kAllSlots & ~(1u << TE_SLOT_SCALE));
        const te_quantize_config config{force_pow2_scales ? 1 : 0, amax_epsilon};
        nb::gil_scoped_release release;
        check_status(te_quantize(in.get(), out.get(), &config, as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "force_pow2_scales"_a = false, "amax_epsilon"_a = 0.0f,
      "stream"_a = 0, "Quantizes input (array or Tensor) into the FP8 Tensor output.");

  m.def(
      "dequantize",
      [](nb::handle input, nb::handle output, uintptr_t stream) {
        Handle in = make_handle("dequantize", "input", input, 0);
        Handle out = make_handle("dequantize", "output", output, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_dequantize(in.get(), out.get(), as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "stream"_a = 0,
      "Dequantizes the FP8 Tensor input into output (array or Tensor).");

  m.def(
      "compute_amax",
      [](nb::handle input, nb::handle output, uintptr_t stream) {
        Handle in = make_handle("compute_amax", "input", input, 0);
        Handle out = make_handle("compute_amax", "output", output, 1u << TE_SLOT_AMAX);
        nb::gil_scoped_release release;
        check_status(te_compute_amax(in.get(), out.get(), as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "stream"_a = 0,
      "Writes max|input| into output.amax.");

  m.def(
      "compute_scale_from_amax",
      [](nb::handle tensor, bool force_pow2_scales, float amax_epsilon, uintptr_t stream) {
        Handle t = make_handle("compute_scale_from_amax", "tensor", tensor,
                               (1u << TE_SLOT_SCALE) | (1u << TE_SLOT_SCALE_INV));
        const te_quantize_config config{force_pow2_scales ? 1 : 0, amax_epsilon};
        nb::gil_scoped_release release;
        check_status(te_compute_scale_from_amax(t.get(), &config, as_stream(stream)));
      },
      "tensor"_a, nb::kw_only(), "force_pow2_scales"_a = false, "amax_epsilon"_a = 0.0f,
      "stream"_a = 0, "Current scaling: tensor.scale and tensor.scale_inv from tensor.amax.");

  m.def(
      "transpose",
      [](nb::handle input, nb::handle output, uintptr_t stream) {
        Handle in = make_handle("transpose", "input", input, 0);
        Handle out = make_handle("transpose", "output", output, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_transpose(in.get(), out.get(), as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "stream"_a = 0,
      "Writes the transpose of input ([M, K] view) into output ([K, M]).");

  m.def(
      "delayed_scaling_update",
      [](const std::vector<nb::object> &amax_histories, const std::vector<nb::object> &scales,
         const std::vector<nb::object> &scale_invs, te_dtype fp8_dtype, te_amax_compute_algo algo,
         int32_t margin, uintptr_t stream) {
        const char *op = "delayed_scaling_update";
        if (scales.size() != amax_histories.size() || scale_invs.size() != amax_histories.size()) {
          throw nb::value_error((std::string(op) + ": scales and scale_invs must have one entry per "
                                 "amax history (" + std::to_string(amax_histories.size()) + "), got " +
                                 std::to_string(scales.size()) + " and " + std::to_string(scale_invs.size()))
                                    .c_str());
        }
        std::vector<Handle> owned;
        std::vector<te_tensor *> h, s, si;
        for (size_t i = 0; i < amax_histories.size(); ++i) {
          const std::string idx = "[" + std::to_string(i) + "]";
          owned.push_back(plain_handle(op, "amax_histories" + idx, amax_histories[i], true));
          h.push_back(owned.back().get());
          owned.push_back(plain_handle(op, "scales" + idx, scales[i], true));
          s.push_back(owned.back().get());
          owned.push_back(plain_handle(op, "scale_invs" + idx, scale_invs[i], true));
          si.push_back(owned.back().get());
        }
        nb::gil_scoped_release release;
        check_status(te_delayed_scaling_update(h.data(), s.data(), si.data(), h.size(), fp8_dtype,
                                               algo, margin, as_stream(stream)));
      },
      "amax_histories"_a, "scales"_a, "scale_invs"_a, nb::kw_only(), "fp8_dtype"_a,
      "algo"_a = TE_AMAX_COMPUTE_MAX, "margin"_a = 0, "stream"_a = 0,
      "Delayed scaling: updates the scales of many amax histories in one call.");

  m.def(
      "gemm",
      [](nb::handle a, nb::handle b, nb::handle d, nb::handle bias, nb::handle pre_gelu_out,
         bool transpose_a, bool transpose_b, bool accumulate, bool use_split_accumulator, bool gelu,
         nb::handle workspace, uintptr_t stream) {
        const char *op = "gemm";
        Handle ha = make_handle(op, "a", a, 0);
        Handle hb = make_handle(op, "b", b, 0);
        Handle hd = make_handle(op, "d", d, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle hbias = bias.is_none() ? Handle() : make_handle(op, "bias", bias, 0);
        Handle hpre = pre_gelu_out.is_none() ? Handle() : make_handle(op, "pre_gelu_out", pre_gelu_out, kAllSlots);
        void *ws = nullptr;
        size_t ws_size = 0;
        if (!workspace.is_none()) {
          const te_buffer w = to_buffer(op, "workspace", workspace, true, std::nullopt);
          int64_t n = 1;
          for (int i = 0; i < w.ndim; ++i) n *= w.shape[i];
          ws = w.data;
          ws_size = static_cast<size_t>(n) * te_dtype_size(w.dtype);
        }
        const te_gemm_config config{transpose_a ? 1 : 0, transpose_b ? 1 : 0, accumulate ? 1 : 0,
                                    use_split_accumulator ? 1 : 0, gelu ? 1 : 0};
        nb::gil_scoped_release release;
        check_status(te_gemm(ha.get(), hb.get(), hd.get(), hbias.get(), hpre.get(), &config, ws,
                             ws_size, as_stream(stream)));
      },
      "a"_a, "b"_a, "d"_a, nb::kw_only(), "bias"_a = nb::none(), "pre_gelu_out"_a = nb::none(),
      "transpose_a"_a = false, "transpose_b"_a = true, "accumulate"_a = false,
      "use_split_accumulator"_a = false, "gelu"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
      "D = op(a) @ op(b) (+ bias, + GELU) into d; see the core's gemm.h for the rules.");

  m.def("gemm_workspace_size", []() { return te_gemm_workspace_size(); },
        "Bytes of CUDA workspace that gemm wants (pass it as a uint8 device array).");

  m.def("built_with_cuda", []() { return te_built_with_cuda() != 0; },
        "True when the core was compiled with its CUDA kernels.");
  m.attr("__version__") = te_version();
}
