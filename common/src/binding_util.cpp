// Conversion of Python arrays into C handles for the binding (binding_util.h).
#include "binding_util.h"

#include <stdexcept>

namespace te_binding {

// DLPack type codes of the FP8 formats (DLPack >= 1.0).
constexpr uint8_t kDLFloat8E4M3FN = 10;
constexpr uint8_t kDLFloat8E5M2 = 12;
constexpr uint8_t kDLFloat8E8M0FNU = 14;

void raise_status(te_status status, const std::string &message) {
  switch (status) {
    case TE_ERROR_TYPE: throw nb::type_error(message.c_str());
    case TE_ERROR_VALUE: throw nb::value_error(message.c_str());
    default: throw std::runtime_error(message);
  }
}

void check_status(te_status status) {
  if (status != TE_SUCCESS) raise_status(status, te_last_error());
}

static std::string array_description(const nb::ndarray<nb::ro> &a) {
  std::string s = "[";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

// The te_dtype of an array: its own element type, or `fp8` when the array holds bytes that
// are FP8 data (uint8/int8) or scales of MXFP8 (E8M0).
static te_dtype dtype_of(const char *op, const std::string &what, const nb::dlpack::dtype &dt,
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

// The fast form of an array, for framework layers that have checked it themselves (torch
// tensors cost ~7 us each to export through DLPack, the tuple ~1 us to build):
//   (data_ptr: int, dtype: DType, shape: tuple[int, ...], device: int)
// with device -1 for the CPU and the CUDA device index otherwise. The memory must be
// C-contiguous and, for outputs, writable; nothing here can check that.
static te_buffer raw_to_buffer(const char *op, const std::string &what, nb::handle obj,
                        std::optional<te_dtype> bytes_as) {
  nb::tuple t = nb::borrow<nb::tuple>(obj);
  te_dtype dtype;
  nb::tuple shape;
  if (t.size() != 4 || !nb::isinstance<nb::int_>(t[0]) || !nb::try_cast(t[1], dtype) ||
      !nb::isinstance<nb::tuple>(t[2]) || !nb::isinstance<nb::int_>(t[3])) {
    throw nb::type_error((std::string(op) + ": " + what +
                          " must be an array or a (data_ptr, DType, shape tuple, device) tuple, "
                          "got a tuple of another form")
                             .c_str());
  }
  shape = nb::borrow<nb::tuple>(t[2]);
  if (shape.size() > TE_MAX_DIMS) {
    throw nb::value_error((std::string(op) + ": " + what + " must have at most " +
                           std::to_string(TE_MAX_DIMS) + " dimensions, got " + std::to_string(shape.size()))
                              .c_str());
  }
  te_buffer b{};
  b.data = reinterpret_cast<void *>(nb::cast<uintptr_t>(t[0]));
  b.dtype = dtype;
  if (bytes_as && (dtype == TE_DTYPE_UINT8 || dtype == TE_DTYPE_INT8)) b.dtype = *bytes_as;
  b.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) b.shape[i] = nb::cast<int64_t>(shape[i]);
  const int device = nb::cast<int>(t[3]);
  b.device = device < 0 ? TE_DEVICE_CPU : TE_DEVICE_CUDA;
  b.device_id = device < 0 ? 0 : device;
  return b;
}

// Converts a Python array into a te_buffer: C-contiguous, on the CPU or a CUDA device, and
// writable when it is an output.
te_buffer to_buffer(const char *op, const std::string &what, nb::handle obj, bool writable,
                    std::optional<te_dtype> bytes_as) {
  if (nb::isinstance<nb::tuple>(obj)) return raw_to_buffer(op, what, obj, bytes_as);
  // One export of the array (each costs microseconds): writable when it must be.
  nb::ndarray<nb::ro> a;
  void *data = nullptr;
  if (writable) {
    nb::ndarray<> w;
    if (!nb::try_cast(obj, w, /*convert=*/false)) {
      if (nb::try_cast(obj, a, /*convert=*/false)) {
        throw nb::value_error((std::string(op) + ": " + what + " must be a writable array, got a read-only " +
                               array_description(a) + " array")
                                  .c_str());
      }
      throw nb::type_error((std::string(op) + ": " + what +
                            " must be an array (DLPack or buffer protocol), got " + nb::inst_name(obj).c_str())
                               .c_str());
    }
    data = w.data();
    a = nb::ndarray<nb::ro>(w);
  } else {
    if (!nb::try_cast(obj, a, /*convert=*/false)) {
      throw nb::type_error((std::string(op) + ": " + what +
                            " must be an array (DLPack or buffer protocol), got " + nb::inst_name(obj).c_str())
                               .c_str());
    }
    data = const_cast<void *>(a.data());
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
                                               "scale_inv", "columnwise_scale_inv", "amax",
                                               "gate"};

// make_handle for an optional argument: None gives an empty handle (a NULL tensor to the core).
Handle optional_handle(const char *op, const char *name, nb::handle obj, unsigned writable_slots) {
  return obj.is_none() ? Handle() : make_handle(op, name, obj, writable_slots);
}

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


Handle plain_handle(const char *op, const std::string &what, nb::handle obj, bool writable) {
  te_tensor *raw = nullptr;
  check_status(te_tensor_create(TE_SCALING_TENSOR, &raw));
  Handle h(raw);
  const te_buffer b = to_buffer(op, what, obj, writable, std::nullopt);
  check_status(te_tensor_set(h.get(), TE_SLOT_DATA, &b));
  return h;
}

void *workspace_of(const char *op, nb::handle workspace, size_t *bytes) {
  *bytes = 0;
  if (workspace.is_none()) return nullptr;
  const te_buffer w = to_buffer(op, "workspace", workspace, true, std::nullopt);
  int64_t n = 1;
  for (int i = 0; i < w.ndim; ++i) n *= w.shape[i];
  *bytes = static_cast<size_t>(n) * te_dtype_size(w.dtype);
  return w.data;
}

}  // namespace te_binding
