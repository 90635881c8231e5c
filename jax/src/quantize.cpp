// XLA FFI handlers of quantization: te_quantize (+ fused transpose, + amax), te_dequantize,
// te_compute_amax and te_compute_scale_from_amax.
//
// XLA allocates every result. Results that a call does not want (say, the column-wise copy
// of a tensor that only needs its row-wise data) come as empty buffers and are left out of
// the core's tensor handle, so the core neither checks nor writes them.
#include "ffi_common.h"
#include "handlers.h"

namespace te_jax {
namespace {

ffi::Error QuantizeImpl(ffi::AnyBuffer input, ffi::AnyBuffer scale, ffi::AnyBuffer amax_in,
                        ffi::Result<ffi::AnyBuffer> data, ffi::Result<ffi::AnyBuffer> columnwise_data,
                        ffi::Result<ffi::AnyBuffer> scale_inv,
                        ffi::Result<ffi::AnyBuffer> columnwise_scale_inv,
                        ffi::Result<ffi::AnyBuffer> amax, int32_t scaling_mode, bool rowwise,
                        bool columnwise, bool compute_amax, bool force_pow2_scales,
                        float amax_epsilon, Device dev) {
  constexpr const char *op = "quantize";
  const std::optional<te_scaling_mode> mode = scaling_mode_of(scaling_mode);
  if (!mode) return invalid(op, "scaling_mode must be 0..3, got " + std::to_string(scaling_mode));
  if (!rowwise && !columnwise) return invalid(op, "rowwise or columnwise must be true, got neither");
  Tensor in, out;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "input", input, dev, &in));
  TE_JAX_RETURN_IF_ERROR(out.init(op, *mode));
  if (rowwise) TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_DATA, "data", *data, dev));
  if (columnwise) {
    TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_COLUMNWISE_DATA, "columnwise_data", *columnwise_data, dev));
  }
  if (*mode == TE_SCALING_TENSOR) {
    TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_SCALE, "scale", scale, dev));
    TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_SCALE_INV, "scale_inv", *scale_inv, dev));
  } else {
    if (rowwise) TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_SCALE_INV, "scale_inv", *scale_inv, dev));
    if (columnwise) {
      TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_COLUMNWISE_SCALE_INV, "columnwise_scale_inv",
                                     *columnwise_scale_inv, dev));
    }
  }
  if (compute_amax) TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_AMAX, "amax", *amax, dev));
  bool accumulate = false;
  TE_JAX_RETURN_IF_ERROR(amax_accumulation(op, amax_in, compute_amax, *amax, &accumulate));
  const te_quantize_config config{force_pow2_scales ? 1 : 0, amax_epsilon, accumulate ? 1 : 0};
  return from_status(te_quantize(in.get(), out.get(), &config, dev.stream));
}

auto TeQuantizeBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // input: fp32/fp16/bf16
      .Arg<ffi::AnyBuffer>()  // scale: fp32 [1] (TENSOR mode; ignored by the block modes)
      .Arg<ffi::AnyBuffer>()  // amax_in: fp32 [1] raised by this call (aliased to amax), or empty
      .Ret<ffi::AnyBuffer>()  // data: FP8, the input's shape (empty unless rowwise)
      .Ret<ffi::AnyBuffer>()  // columnwise_data: FP8 transpose [K, M] (empty unless columnwise)
      .Ret<ffi::AnyBuffer>()  // scale_inv: [1], or the row-wise block scales
      .Ret<ffi::AnyBuffer>()  // columnwise_scale_inv: the column-wise block scales, or empty
      .Ret<ffi::AnyBuffer>()  // amax: fp32 [1] (empty unless compute_amax)
      .Attr<int32_t>("scaling_mode")
      .Attr<bool>("rowwise")
      .Attr<bool>("columnwise")
      .Attr<bool>("compute_amax")
      .Attr<bool>("force_pow2_scales")
      .Attr<float>("amax_epsilon");
}

ffi::Error DequantizeImpl(ffi::AnyBuffer data, ffi::AnyBuffer scale_inv,
                          ffi::Result<ffi::AnyBuffer> output, int32_t scaling_mode, Device dev) {
  constexpr const char *op = "dequantize";
  const std::optional<te_scaling_mode> mode = scaling_mode_of(scaling_mode);
  if (!mode) return invalid(op, "scaling_mode must be 0..3, got " + std::to_string(scaling_mode));
  Tensor in, out;
  TE_JAX_RETURN_IF_ERROR(in.init(op, *mode));
  TE_JAX_RETURN_IF_ERROR(in.set(TE_SLOT_DATA, "data", data, dev));
  TE_JAX_RETURN_IF_ERROR(in.set(TE_SLOT_SCALE_INV, "scale_inv", scale_inv, dev));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "output", *output, dev, &out));
  return from_status(te_dequantize(in.get(), out.get(), dev.stream));
}

auto TeDequantizeBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // data: FP8
      .Arg<ffi::AnyBuffer>()  // scale_inv: by scaling mode
      .Ret<ffi::AnyBuffer>()  // output: fp32/fp16/bf16, data's shape
      .Attr<int32_t>("scaling_mode");
}

ffi::Error ComputeAmaxImpl(ffi::AnyBuffer input, ffi::AnyBuffer gate, ffi::Result<ffi::AnyBuffer> amax,
                           Device dev) {
  constexpr const char *op = "compute_amax";
  Tensor in, out;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "input", input, dev, &in));
  TE_JAX_RETURN_IF_ERROR(out.init(op, TE_SCALING_TENSOR));
  TE_JAX_RETURN_IF_ERROR(out.set(TE_SLOT_AMAX, "amax", *amax, dev));
  TE_JAX_RETURN_IF_ERROR(out.set_gate(gate, dev));
  return from_status(te_compute_amax(in.get(), out.get(), dev.stream));
}

auto TeComputeAmaxBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()   // input: fp32/fp16/bf16
      .Arg<ffi::AnyBuffer>()   // gate: fp32 [1], or empty for none (tensor.h)
      .Ret<ffi::AnyBuffer>();  // amax: fp32 [1]
}

ffi::Error ScaleFromAmaxImpl(ffi::AnyBuffer amax, ffi::Result<ffi::AnyBuffer> scale,
                             ffi::Result<ffi::AnyBuffer> scale_inv, int32_t fp8_dtype,
                             bool force_pow2_scales, float amax_epsilon, Device dev) {
  constexpr const char *op = "compute_scale_from_amax";
  if (fp8_dtype != TE_DTYPE_FLOAT8_E4M3 && fp8_dtype != TE_DTYPE_FLOAT8_E5M2) {
    return invalid(op, "fp8_dtype must be float8_e4m3 (3) or float8_e5m2 (4), got " +
                           std::to_string(fp8_dtype));
  }
  Tensor t;
  TE_JAX_RETURN_IF_ERROR(t.init(op, TE_SCALING_TENSOR));
  // The FP8 format comes from the tensor's data slot: an empty buffer of that dtype.
  te_buffer format{};
  format.dtype = static_cast<te_dtype>(fp8_dtype);
  format.ndim = 1;
  format.device = dev.type;
  format.device_id = dev.id;
  TE_JAX_RETURN_IF_ERROR(t.set(TE_SLOT_DATA, format));
  TE_JAX_RETURN_IF_ERROR(t.set(TE_SLOT_AMAX, "amax", amax, dev));
  TE_JAX_RETURN_IF_ERROR(t.set(TE_SLOT_SCALE, "scale", *scale, dev));
  TE_JAX_RETURN_IF_ERROR(t.set(TE_SLOT_SCALE_INV, "scale_inv", *scale_inv, dev));
  const te_quantize_config config{force_pow2_scales ? 1 : 0, amax_epsilon, 0};
  return from_status(te_compute_scale_from_amax(t.get(), &config, dev.stream));
}

auto TeScaleFromAmaxBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // amax: fp32 [1]
      .Ret<ffi::AnyBuffer>()  // scale: fp32 [1]
      .Ret<ffi::AnyBuffer>()  // scale_inv: fp32 [1]
      .Attr<int32_t>("fp8_dtype")
      .Attr<bool>("force_pow2_scales")
      .Attr<float>("amax_epsilon");
}

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeQuantize, QuantizeImpl);
TE_JAX_DEFINE_HANDLERS(TeDequantize, DequantizeImpl);
TE_JAX_DEFINE_HANDLERS(TeComputeAmax, ComputeAmaxImpl);
TE_JAX_DEFINE_HANDLERS(TeScaleFromAmax, ScaleFromAmaxImpl);

}  // namespace te_jax
