// XLA FFI handlers of the core's LayerNorm and RMSNorm (te_norm_forward, te_norm_backward).
//
// The forward writes y in x's dtype, or y as per-tensor FP8 (with its transpose and amax, the
// operand of an FP8 GEMM), or both from the same fp32 y, in one pass; FP8 results that a call
// does not want are empty buffers, left out of the core's handle.
//
// The input is viewed as [M, N] (N its last dimension). RMSNorm has no mu and no beta: the
// Python side passes and receives zero-size buffers in their places, which are not read or
// written here. The CUDA workspace of the backward pass (partial column sums of dgamma and
// dbeta) is an extra result of the call, as in gemm.cpp, so that XLA plans it like any
// temporary; the CPU path ignores it.
#include "ffi_common.h"
#include "handlers.h"
#include "transformer_engine/norm.h"

namespace te_jax {
namespace {

ffi::Error norm_config(const char *op, int32_t norm_type, float eps, bool zero_centered_gamma,
                       te_norm_config *config) {
  if (norm_type != TE_NORM_LAYERNORM && norm_type != TE_NORM_RMSNORM) {
    return invalid(op, "norm_type must be 0 (LayerNorm) or 1 (RMSNorm), got " +
                           std::to_string(norm_type));
  }
  *config = te_norm_config{};
  config->type = static_cast<te_norm_type>(norm_type);
  config->eps = eps;
  config->zero_centered_gamma = zero_centered_gamma ? 1 : 0;
  return ffi::Error::Success();
}

ffi::Error NormForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer beta,
                           ffi::AnyBuffer scale, ffi::AnyBuffer gate, ffi::AnyBuffer amax_in,
                           ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::AnyBuffer> mu, ffi::Result<ffi::AnyBuffer> rsigma,
                           ffi::Result<ffi::AnyBuffer> y_fp8,
                           ffi::Result<ffi::AnyBuffer> y_fp8_columnwise,
                           ffi::Result<ffi::AnyBuffer> scale_inv,
                           ffi::Result<ffi::AnyBuffer> amax, int32_t norm_type, float eps,
                           bool zero_centered_gamma, bool write_output, bool fp8, bool columnwise,
                           bool compute_amax, Device dev) {
  constexpr const char *op = "norm_forward";
  te_norm_config config;
  TE_JAX_RETURN_IF_ERROR(norm_config(op, norm_type, eps, zero_centered_gamma, &config));
  if (!write_output && !fp8) return invalid(op, "write_output or fp8 must be true, got neither");
  if (!fp8 && (columnwise || compute_amax)) {
    return invalid(op, "columnwise and compute_amax need fp8 (they describe the FP8 output)");
  }
  bool accumulate = false;
  TE_JAX_RETURN_IF_ERROR(amax_accumulation(op, amax_in, compute_amax, *amax, &accumulate));
  config.accumulate_amax = accumulate ? 1 : 0;
  const bool ln = config.type == TE_NORM_LAYERNORM;
  Tensor tx, tgamma, tbeta, ty, tq, tmu, trsigma;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "x", x, dev, &tx));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "gamma", gamma, dev, &tgamma));
  if (write_output) TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "y", *y, dev, &ty));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "rsigma", *rsigma, dev, &trsigma));
  if (ln) {
    TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "beta", beta, dev, &tbeta));
    TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "mu", *mu, dev, &tmu));
  }
  if (fp8) {
    TE_JAX_RETURN_IF_ERROR(tq.init(op, TE_SCALING_TENSOR));
    TE_JAX_RETURN_IF_ERROR(tq.set(TE_SLOT_DATA, "y_fp8", *y_fp8, dev));
    if (columnwise) {
      TE_JAX_RETURN_IF_ERROR(
          tq.set(TE_SLOT_COLUMNWISE_DATA, "y_fp8_columnwise", *y_fp8_columnwise, dev));
    }
    TE_JAX_RETURN_IF_ERROR(tq.set(TE_SLOT_SCALE, "scale", scale, dev));
    TE_JAX_RETURN_IF_ERROR(tq.set(TE_SLOT_SCALE_INV, "scale_inv", *scale_inv, dev));
    if (compute_amax) TE_JAX_RETURN_IF_ERROR(tq.set(TE_SLOT_AMAX, "amax", *amax, dev));
    TE_JAX_RETURN_IF_ERROR(tq.set_gate(gate, dev));
  }
  return from_status(te_norm_forward(&config, tx.get(), tgamma.get(), ln ? tbeta.get() : nullptr,
                                     write_output ? ty.get() : nullptr, fp8 ? tq.get() : nullptr,
                                     ln ? tmu.get() : nullptr, trsigma.get(), dev.stream));
}

auto TeNormForwardBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // x [.., N]
      .Arg<ffi::AnyBuffer>()  // gamma [N]
      .Arg<ffi::AnyBuffer>()  // beta [N] (LayerNorm; zero-size for RMSNorm)
      .Arg<ffi::AnyBuffer>()  // scale fp32 [1] of the FP8 output (read when fp8)
      .Arg<ffi::AnyBuffer>()  // gate fp32 [1] of the FP8 output, or empty for none (tensor.h)
      .Arg<ffi::AnyBuffer>()  // amax_in: fp32 [1] raised by this call (aliased to amax), or empty
      .Ret<ffi::AnyBuffer>()  // y, x's shape and dtype (empty unless write_output)
      .Ret<ffi::AnyBuffer>()  // mu fp32 [M] (LayerNorm; zero-size for RMSNorm)
      .Ret<ffi::AnyBuffer>()  // rsigma fp32 [M]
      .Ret<ffi::AnyBuffer>()  // y_fp8: FP8 y * scale, x's shape (empty unless fp8)
      .Ret<ffi::AnyBuffer>()  // y_fp8_columnwise: its transpose [N, M] (empty unless columnwise)
      .Ret<ffi::AnyBuffer>()  // scale_inv fp32 [1] (empty unless fp8)
      .Ret<ffi::AnyBuffer>()  // amax fp32 [1] = max|y| (empty unless compute_amax)
      .Attr<int32_t>("norm_type")
      .Attr<float>("eps")
      .Attr<bool>("zero_centered_gamma")
      .Attr<bool>("write_output")
      .Attr<bool>("fp8")
      .Attr<bool>("columnwise")
      .Attr<bool>("compute_amax");
}

ffi::Error NormBackwardImpl(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mu,
                            ffi::AnyBuffer rsigma, ffi::AnyBuffer gamma,
                            ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                            ffi::Result<ffi::AnyBuffer> dbeta,
                            ffi::Result<ffi::AnyBuffer> workspace, int32_t norm_type, float eps,
                            bool zero_centered_gamma, Device dev) {
  constexpr const char *op = "norm_backward";
  te_norm_config config;
  TE_JAX_RETURN_IF_ERROR(norm_config(op, norm_type, eps, zero_centered_gamma, &config));
  const bool ln = config.type == TE_NORM_LAYERNORM;
  Tensor tdy, tx, tmu, trsigma, tgamma, tdx, tdgamma, tdbeta;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dy", dy, dev, &tdy));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "x", x, dev, &tx));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "rsigma", rsigma, dev, &trsigma));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "gamma", gamma, dev, &tgamma));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dx", *dx, dev, &tdx));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dgamma", *dgamma, dev, &tdgamma));
  if (ln) {
    TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "mu", mu, dev, &tmu));
    TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dbeta", *dbeta, dev, &tdbeta));
  }
  const Workspace ws = workspace_of(*workspace, dev);
  return from_status(te_norm_backward(&config, tdy.get(), tx.get(), ln ? tmu.get() : nullptr,
                                      trsigma.get(), tgamma.get(), nullptr, tdx.get(), tdgamma.get(),
                                      ln ? tdbeta.get() : nullptr, ws.data, ws.bytes, dev.stream));
}

auto TeNormBackwardBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // dy, x's shape and dtype
      .Arg<ffi::AnyBuffer>()  // x [.., N]
      .Arg<ffi::AnyBuffer>()  // mu fp32 [M] (LayerNorm; zero-size for RMSNorm)
      .Arg<ffi::AnyBuffer>()  // rsigma fp32 [M]
      .Arg<ffi::AnyBuffer>()  // gamma [N]
      .Ret<ffi::AnyBuffer>()  // dx, x's shape
      .Ret<ffi::AnyBuffer>()  // dgamma [N], gamma's dtype
      .Ret<ffi::AnyBuffer>()  // dbeta [N], gamma's dtype (LayerNorm; zero-size for RMSNorm)
      .Ret<ffi::AnyBuffer>()  // workspace uint8 [te_norm_backward_workspace_size(M, N)]
      .Attr<int32_t>("norm_type")
      .Attr<float>("eps")
      .Attr<bool>("zero_centered_gamma");
}

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeNormForward, NormForwardImpl);
TE_JAX_DEFINE_HANDLERS(TeNormBackward, NormBackwardImpl);

}  // namespace te_jax
