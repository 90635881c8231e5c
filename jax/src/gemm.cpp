// XLA FFI handler of the core GEMM (te_gemm): D = op(A) @ op(B) (+ bias), high precision or
// FP8 with per-tensor or block scales, optionally with the amax of D.
//
// The CUDA workspace is a third result of the call, never read by the caller: XLA's buffer
// assignment then allocates (and reuses) it like any temporary, which works inside command
// buffers too (XLA's own GEMMs do the same). The CPU path ignores it.
#include "ffi_common.h"
#include "handlers.h"
#include "transformer_engine/gemm.h"

namespace te_jax {
namespace {

bool is_fp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

// An operand of op: its data, and its scale_inv when the data is FP8.
ffi::Error operand(const char *op, const char *what, const ffi::AnyBuffer &data,
                   const ffi::AnyBuffer &scale_inv, int32_t scaling_mode, const Device &dev,
                   Tensor *t) {
  const std::optional<te_scaling_mode> mode = scaling_mode_of(scaling_mode);
  if (!mode) return invalid(op, std::string(what) + " scaling_mode must be 0..3, got " +
                                    std::to_string(scaling_mode));
  TE_JAX_RETURN_IF_ERROR(t->init(op, *mode));
  TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_DATA, what, data, dev));
  if (is_fp8(data.element_type())) {
    TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_SCALE_INV, "scale_inv", scale_inv, dev));
  }
  return ffi::Error::Success();
}

te_gemm_config gemm_config(bool transpose_a, bool transpose_b, bool use_split_accumulator) {
  te_gemm_config config{};
  config.transpose_a = transpose_a ? 1 : 0;
  config.transpose_b = transpose_b ? 1 : 0;
  config.use_split_accumulator = use_split_accumulator ? 1 : 0;
  return config;
}

ffi::Error GemmImpl(ffi::AnyBuffer a,
                    ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b, ffi::AnyBuffer b_scale_inv,
                    ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> d,
                    ffi::Result<ffi::AnyBuffer> d_amax, ffi::Result<ffi::AnyBuffer> workspace,
                    bool transpose_a, bool transpose_b, int32_t a_scaling_mode,
                    int32_t b_scaling_mode, bool use_bias, bool compute_amax,
                    bool use_split_accumulator, Device dev) {
  constexpr const char *op = "gemm";
  Tensor ta, tb, td, tbias;
  TE_JAX_RETURN_IF_ERROR(operand(op, "a", a, a_scale_inv, a_scaling_mode, dev, &ta));
  TE_JAX_RETURN_IF_ERROR(operand(op, "b", b, b_scale_inv, b_scaling_mode, dev, &tb));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "d", *d, dev, &td));
  if (compute_amax) TE_JAX_RETURN_IF_ERROR(td.set(TE_SLOT_AMAX, "d_amax", *d_amax, dev));
  if (use_bias) TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "bias", bias, dev, &tbias));
  const te_gemm_config config = gemm_config(transpose_a, transpose_b, use_split_accumulator);
  const Workspace ws = workspace_of(*workspace, dev);
  return from_status(te_gemm(ta.get(), tb.get(), td.get(), use_bias ? tbias.get() : nullptr,
                             nullptr, &config, ws.data, ws.bytes, dev.stream));
}

auto TeGemmBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // a
      .Arg<ffi::AnyBuffer>()  // a_scale_inv (read when a is FP8)
      .Arg<ffi::AnyBuffer>()  // b
      .Arg<ffi::AnyBuffer>()  // b_scale_inv (read when b is FP8)
      .Arg<ffi::AnyBuffer>()  // bias [N] (read when use_bias)
      .Ret<ffi::AnyBuffer>()  // d [M, N] (or a's leading dims and N)
      .Ret<ffi::AnyBuffer>()  // d_amax fp32 [1] (written when compute_amax)
      .Ret<ffi::AnyBuffer>()  // workspace uint8 [te_gemm_workspace_size()] (CUDA scratch)
      .Attr<bool>("transpose_a")
      .Attr<bool>("transpose_b")
      .Attr<int32_t>("a_scaling_mode")
      .Attr<int32_t>("b_scaling_mode")
      .Attr<bool>("use_bias")
      .Attr<bool>("compute_amax")
      .Attr<bool>("use_split_accumulator");
}

// te_grouped_gemm_ragged: the groups stacked by rows in a (sizes in group_sizes, on the
// device), with b [G, ..] (forward, dgrad) or d [G, K, N] (weight gradients, transpose_a);
// high precision, or FP8 with per-tensor scales (b's one per group or one for all).
ffi::Error GroupedGemmImpl(ffi::AnyBuffer a, ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b,
                           ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer group_sizes,
                           ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> d,
                           ffi::Result<ffi::AnyBuffer> workspace, bool transpose_a,
                           bool transpose_b, bool use_bias, bool use_split_accumulator,
                           Device dev) {
  constexpr const char *op = "grouped_gemm";
  Tensor ta, tb, ts, td, tbias;
  TE_JAX_RETURN_IF_ERROR(operand(op, "a", a, a_scale_inv, TE_SCALING_TENSOR, dev, &ta));
  TE_JAX_RETURN_IF_ERROR(operand(op, "b", b, b_scale_inv, TE_SCALING_TENSOR, dev, &tb));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "group_sizes", group_sizes, dev, &ts));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "d", *d, dev, &td));
  if (use_bias) TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "bias", bias, dev, &tbias));
  const te_gemm_config config = gemm_config(transpose_a, transpose_b, use_split_accumulator);
  const Workspace ws = workspace_of(*workspace, dev);
  return from_status(te_grouped_gemm_ragged(ta.get(), tb.get(), td.get(),
                                            use_bias ? tbias.get() : nullptr, ts.get(), &config,
                                            ws.data, ws.bytes, dev.stream));
}

auto TeGroupedGemmBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // a [M, K], the groups' rows stacked
      .Arg<ffi::AnyBuffer>()  // a_scale_inv [1] (read when a is FP8)
      .Arg<ffi::AnyBuffer>()  // b [G, N, K] / [G, K, N], or [M, N] with transpose_a
      .Arg<ffi::AnyBuffer>()  // b_scale_inv [1] or [G] (read when b is FP8)
      .Arg<ffi::AnyBuffer>()  // group_sizes int32 [G]
      .Arg<ffi::AnyBuffer>()  // bias [G, N] (read when use_bias)
      .Ret<ffi::AnyBuffer>()  // d [M, N], or [G, K, N] with transpose_a
      .Ret<ffi::AnyBuffer>()  // workspace uint8 [te_gemm_workspace_size()] (CUDA scratch)
      .Attr<bool>("transpose_a")
      .Attr<bool>("transpose_b")
      .Attr<bool>("use_bias")
      .Attr<bool>("use_split_accumulator");
}

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeGemm, GemmImpl);
TE_JAX_DEFINE_HANDLERS_OUTSIDE_GRAPHS(TeGroupedGemm, GroupedGemmImpl);

}  // namespace te_jax
