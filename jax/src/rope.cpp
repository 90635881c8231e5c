// XLA FFI handlers of the core's rotary position embedding (te_rope_forward,
// te_rope_backward): one call each way, the layout and pairing as attributes.
//
// cu_seqlens (THD) and start_positions are optional in the core; XLA has no absent operand,
// so the Python side passes zero-size int32 arrays in their places and says with
// `with_cu_seqlens` / `with_start_positions` whether they count. freqs is the fp32 matrix
// [P, R] of angles by position and rotated feature.
#include "ffi_common.h"
#include "handlers.h"
#include "transformer_engine/rope.h"

namespace te_jax {
namespace {

ffi::Error rope_call(const char *op, bool backward, ffi::AnyBuffer x, ffi::AnyBuffer freqs,
                     ffi::AnyBuffer cu_seqlens, ffi::AnyBuffer start_positions,
                     ffi::Result<ffi::AnyBuffer> y, int32_t format, bool interleaved,
                     bool with_cu_seqlens, bool with_start_positions, const Device &dev) {
  if (format != TE_ROPE_SBHD && format != TE_ROPE_BSHD && format != TE_ROPE_THD) {
    return invalid(op, "format must be 0 (SBHD), 1 (BSHD) or 2 (THD), got " + std::to_string(format));
  }
  const te_rope_config config{static_cast<te_rope_format>(format), interleaved ? 1 : 0};
  Tensor tx, tf, tcu, tstart, ty;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, backward ? "grad_output" : "input", x, dev, &tx));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "freqs", freqs, dev, &tf));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, backward ? "grad_input" : "output", *y, dev, &ty));
  if (with_cu_seqlens) TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "cu_seqlens", cu_seqlens, dev, &tcu));
  if (with_start_positions) {
    TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "start_positions", start_positions, dev, &tstart));
  }
  te_tensor *cu = with_cu_seqlens ? tcu.get() : nullptr;
  te_tensor *start = with_start_positions ? tstart.get() : nullptr;
  return from_status(backward ? te_rope_backward(&config, tx.get(), tf.get(), cu, start, ty.get(), dev.stream)
                              : te_rope_forward(&config, tx.get(), tf.get(), cu, start, ty.get(), dev.stream));
}

ffi::Error RopeForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer freqs, ffi::AnyBuffer cu_seqlens,
                           ffi::AnyBuffer start_positions, ffi::Result<ffi::AnyBuffer> y,
                           int32_t format, bool interleaved, bool with_cu_seqlens,
                           bool with_start_positions, Device dev) {
  return rope_call("rope_forward", false, x, freqs, cu_seqlens, start_positions, y, format,
                   interleaved, with_cu_seqlens, with_start_positions, dev);
}

ffi::Error RopeBackwardImpl(ffi::AnyBuffer dy, ffi::AnyBuffer freqs, ffi::AnyBuffer cu_seqlens,
                            ffi::AnyBuffer start_positions, ffi::Result<ffi::AnyBuffer> dx,
                            int32_t format, bool interleaved, bool with_cu_seqlens,
                            bool with_start_positions, Device dev) {
  return rope_call("rope_backward", true, dy, freqs, cu_seqlens, start_positions, dx, format,
                   interleaved, with_cu_seqlens, with_start_positions, dev);
}

auto rope_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // x (forward) or dy (backward): [S, B, H, D], [B, S, H, D] or [T, H, D]
      .Arg<ffi::AnyBuffer>()  // freqs fp32 [P, R]
      .Arg<ffi::AnyBuffer>()  // cu_seqlens int32 [B + 1] (THD; else zero-size)
      .Arg<ffi::AnyBuffer>()  // start_positions int32 [B] (or zero-size)
      .Ret<ffi::AnyBuffer>()  // y (forward) or dx (backward), x's shape and dtype
      .Attr<int32_t>("format")
      .Attr<bool>("interleaved")
      .Attr<bool>("with_cu_seqlens")
      .Attr<bool>("with_start_positions");
}

auto TeRopeForwardBinding() { return rope_binding(); }
auto TeRopeBackwardBinding() { return rope_binding(); }

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeRopeForward, RopeForwardImpl);
TE_JAX_DEFINE_HANDLERS(TeRopeBackward, RopeBackwardImpl);

}  // namespace te_jax
