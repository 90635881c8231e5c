// Shared pieces of the XLA FFI handlers: the device a call runs on (decoded from XLA's
// execution context), FFI buffers as core buffers, tensor handles, and core statuses as
// ffi::Error.
//
// Every op has one implementation `<Op>Impl(..., Device)` and two handler symbols that differ
// only in how that last parameter is decoded: `.Ctx<CpuDevice>()` (host buffers, no stream)
// or `.Ctx<CudaDevice>()` (XLA's CUDA stream and device ordinal). The CUDA stream is taken as an
// opaque pointer, so no CUDA header is needed here.
#ifndef TE_JAX_FFI_COMMON_H_
#define TE_JAX_FFI_COMMON_H_

#include <memory>
#include <optional>
#include <string>

#include "transformer_engine/transformer_engine.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax {

namespace ffi = xla::ffi;

struct Device {
  te_device_type type = TE_DEVICE_CPU;
  int32_t id = 0;
  te_stream stream = nullptr;
};

// Context tags: `.Ctx<CpuDevice>()` and `.Ctx<CudaDevice>()` both give the handler a Device.
struct CpuDevice {};
struct CudaDevice {};

// An error of this extension (not of the core) with the op's name in front.
inline ffi::Error invalid(const char *op, const std::string &message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// The core's last error as an ffi::Error (its message already names the op and argument).
inline ffi::Error from_status(te_status status) {
  if (status == TE_SUCCESS) return ffi::Error::Success();
  const std::string message = te_last_error();
  switch (status) {
    case TE_ERROR_TYPE:
    case TE_ERROR_VALUE: return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
    case TE_ERROR_UNSUPPORTED: return ffi::Error(ffi::ErrorCode::kUnimplemented, message);
    default: return ffi::Error(ffi::ErrorCode::kInternal, message);
  }
}

#define TE_JAX_RETURN_IF_ERROR(expr)          \
  do {                                        \
    ffi::Error te_jax_error_ = (expr);        \
    if (!te_jax_error_.success()) return te_jax_error_; \
  } while (0)

// The core's dtype of an XLA element type, if the core has one.
inline std::optional<te_dtype> core_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return TE_DTYPE_FLOAT32;
    case ffi::DataType::F16: return TE_DTYPE_FLOAT16;
    case ffi::DataType::BF16: return TE_DTYPE_BFLOAT16;
    case ffi::DataType::F8E4M3FN: return TE_DTYPE_FLOAT8_E4M3;
    case ffi::DataType::F8E5M2: return TE_DTYPE_FLOAT8_E5M2;
    case ffi::DataType::F8E8M0FNU: return TE_DTYPE_FLOAT8_E8M0;
    case ffi::DataType::S8: return TE_DTYPE_INT8;
    case ffi::DataType::U8: return TE_DTYPE_UINT8;
    case ffi::DataType::S16: return TE_DTYPE_INT16;
    case ffi::DataType::S32: return TE_DTYPE_INT32;
    case ffi::DataType::S64: return TE_DTYPE_INT64;
    default: return std::nullopt;
  }
}

// Describes an XLA buffer (an argument or a result) to the core.
inline ffi::Error to_buffer(const char *op, const char *what, const ffi::AnyBuffer &b,
                            const Device &dev, te_buffer *out) {
  const std::optional<te_dtype> dtype = core_dtype(b.element_type());
  if (!dtype) {
    return invalid(op, std::string(what) + " must have a dtype of the core (float32, float16, "
                       "bfloat16, float8_e4m3fn, float8_e5m2, float8_e8m0fnu or an integer), got "
                       "XLA element type " + std::to_string(static_cast<int>(b.element_type())));
  }
  const auto dims = b.dimensions();
  if (dims.size() > TE_MAX_DIMS) {
    return invalid(op, std::string(what) + " must have at most " + std::to_string(TE_MAX_DIMS) +
                           " dimensions, got " + std::to_string(dims.size()));
  }
  *out = te_buffer{};
  out->data = b.untyped_data();
  out->dtype = *dtype;
  out->ndim = static_cast<int32_t>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) out->shape[i] = dims[i];
  out->device = dev.type;
  out->device_id = dev.id;
  return ffi::Error::Success();
}

// An owned te_tensor handle whose slots point at XLA buffers.
class Tensor {
 public:
  Tensor() = default;

  ffi::Error init(const char *op, te_scaling_mode mode) {
    op_ = op;
    te_tensor *raw = nullptr;
    TE_JAX_RETURN_IF_ERROR(from_status(te_tensor_create(mode, &raw)));
    handle_.reset(raw);
    return ffi::Error::Success();
  }

  ffi::Error set(te_tensor_slot slot, const char *what, const ffi::AnyBuffer &b, const Device &dev) {
    te_buffer buffer;
    TE_JAX_RETURN_IF_ERROR(to_buffer(op_, what, b, dev, &buffer));
    return from_status(te_tensor_set(handle_.get(), slot, &buffer));
  }

  // The gate (tensor.h): a [1] fp32 buffer sets the slot, an empty one (no gate) leaves it.
  ffi::Error set_gate(const ffi::AnyBuffer &gate, const Device &dev) {
    if (gate.element_count() == 0) return ffi::Error::Success();
    return set(TE_SLOT_GATE, "gate", gate, dev);
  }
  ffi::Error set(te_tensor_slot slot, const te_buffer &buffer) {
    return from_status(te_tensor_set(handle_.get(), slot, &buffer));
  }

  te_tensor *get() const { return handle_.get(); }

 private:
  struct Deleter {
    void operator()(te_tensor *t) const { te_tensor_destroy(t); }
  };
  const char *op_ = "";
  std::unique_ptr<te_tensor, Deleter> handle_;
};

// A plain (unscaled) tensor over one buffer.
inline ffi::Error plain_tensor(const char *op, const char *what, const ffi::AnyBuffer &b,
                               const Device &dev, Tensor *t) {
  TE_JAX_RETURN_IF_ERROR(t->init(op, TE_SCALING_TENSOR));
  return t->set(TE_SLOT_DATA, what, b, dev);
}

// A call's CUDA workspace (an extra result XLA plans like any temporary) as the core takes
// it: none on the CPU, whose paths need none, and none when it has no bytes.
struct Workspace {
  void *data = nullptr;
  size_t bytes = 0;
};

inline Workspace workspace_of(const ffi::AnyBuffer &ws, const Device &dev) {
  if (dev.type != TE_DEVICE_CUDA || ws.size_bytes() == 0) return {};
  return {ws.untyped_data(), ws.size_bytes()};
}

inline std::optional<te_scaling_mode> scaling_mode_of(int32_t mode) {
  if (mode < TE_SCALING_TENSOR || mode > TE_SCALING_MXFP8) return std::nullopt;
  return static_cast<te_scaling_mode>(mode);
}

// Whether a call raises an amax computed before rather than writing its own: amax_in is that
// amax ([1] fp32, aliased by the caller to the call's amax result, so XLA hands the handler
// the result buffer holding it), or empty for a call that writes its amax afresh. *accumulate
// tells which; a non-empty amax_in that is not the result's buffer is refused (the core would
// raise a buffer XLA never filled).
inline ffi::Error amax_accumulation(const char *op, const ffi::AnyBuffer &amax_in, bool compute_amax,
                                    const ffi::AnyBuffer &amax, bool *accumulate) {
  *accumulate = amax_in.element_count() > 0;
  if (!*accumulate) return ffi::Error::Success();
  if (!compute_amax) return invalid(op, "amax_in needs compute_amax (it is raised by this call's amax)");
  if (amax_in.untyped_data() != amax.untyped_data()) {
    return invalid(op, "amax_in must be aliased to the amax result (input_output_aliases)");
  }
  return ffi::Error::Success();
}

}  // namespace te_jax

namespace xla::ffi {

template <>
struct CtxDecoding<te_jax::CpuDevice> {
  using Type = te_jax::Device;
  static std::optional<Type> Decode(const XLA_FFI_Api *, XLA_FFI_ExecutionContext *,
                                    DiagnosticEngine &) {
    return te_jax::Device{};
  }
};

template <>
struct CtxDecoding<te_jax::CudaDevice> {
  using Type = te_jax::Device;
  static std::optional<Type> Decode(const XLA_FFI_Api *api, XLA_FFI_ExecutionContext *ctx,
                                    DiagnosticEngine &diagnostic) {
    std::optional<te_stream> stream =
        CtxDecoding<PlatformStream<te_stream>>::Decode(api, ctx, diagnostic);
    if (!stream) return std::nullopt;
    std::optional<int32_t> ordinal = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    if (!ordinal) return std::nullopt;
    return te_jax::Device{TE_DEVICE_CUDA, *ordinal, *stream};
  }
};

}  // namespace xla::ffi

// Defines the two handler symbols of an op, `<name>Cpu` and `<name>Cuda`, from one Impl whose
// last parameter is the Device and the op's binding `<name>Binding()` (everything but it).
//
// The CUDA handler is marked compatible with XLA's command buffers: XLA then captures it with
// the fusions and library calls around it into one CUDA graph, where each call was a launch
// of its own from the host (XLA runs a command buffer's first execution op by op, so the
// core's one-time set-up, the cuBLASLt handle and the cuDNN plans, happens outside capture).
// That holds for an op whose CUDA path only launches kernels and library calls on the stream
// into buffers XLA passes, and never waits for the device: every op's, except the two that
// TE_JAX_DEFINE_HANDLERS_OUTSIDE_GRAPHS defines.
#define TE_JAX_DEFINE_HANDLERS(name, impl)                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Cpu, impl, name##Binding().Ctx<te_jax::CpuDevice>());  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Cuda, impl, name##Binding().Ctx<te_jax::CudaDevice>(), \
                                {xla::ffi::Traits::kCmdBufferCompatible})

// The same for an op that XLA must not capture into a graph: one that waits for the device
// (the ragged grouped GEMM reads its group sizes on the host) or takes device memory of its
// own (the activation's backward with dbias allocates its partial sums from the core's
// stream-ordered pool, and a graph node that allocates cannot sit in XLA's nested graphs).
#define TE_JAX_DEFINE_HANDLERS_OUTSIDE_GRAPHS(name, impl)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Cpu, impl, name##Binding().Ctx<te_jax::CpuDevice>());  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Cuda, impl, name##Binding().Ctx<te_jax::CudaDevice>())

#endif  // TE_JAX_FFI_COMMON_H_
