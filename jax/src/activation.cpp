// XLA FFI handlers of the core's fused activations (te_activation_forward,
// te_activation_backward): the activation or its gradient, written in high precision or as
// per-tensor FP8 (row-wise data and/or the transpose, scale_inv, amax) in one pass, and,
// backward, the bias gradient of the result in the same pass.
//
// Which kind of output a call writes follows the dtypes of its results, as in the core: an
// FP8 `output` or a non-empty `columnwise_output` makes it FP8 (TENSOR scaling, the scale
// read from the `scale` argument); otherwise `output` is high precision and the transpose
// stays empty. Results a call does not want are empty buffers, left out of the handle.
// Every call carries the parameters of a parametrized activation (limit, alpha,
// linear_offset); the activations without parameters ignore them.
#include "ffi_common.h"
#include "handlers.h"
#include "transformer_engine/activation.h"

namespace te_jax {
namespace {

bool is_fp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

// The parameters the core reads, for the activations that take them (else none).
const te_activation_params *params_of(te_activation a, float limit, float alpha,
                                      float linear_offset, te_activation_params *storage) {
  if (te_activation_has_params(a) == 0) return nullptr;
  *storage = te_activation_params{limit, alpha, linear_offset};
  return storage;
}

ffi::Error activation_of(const char *op, int32_t act, te_activation *out) {
  if (act < 0 || act >= TE_ACTIVATION_COUNT) {
    return invalid(op, "act must be 0.." + std::to_string(TE_ACTIVATION_COUNT - 1) +
                           " (te_activation), got " + std::to_string(act));
  }
  *out = static_cast<te_activation>(act);
  return ffi::Error::Success();
}

// The result handle (forward output or backward grad_input) from the call's results.
ffi::Error result_tensor(const char *op, const char *name, const ffi::AnyBuffer &scale,
                         const ffi::AnyBuffer &data, const ffi::AnyBuffer &columnwise_data,
                         const ffi::AnyBuffer &scale_inv, const ffi::AnyBuffer &amax,
                         const ffi::AnyBuffer &gate, bool rowwise, bool columnwise, bool compute_amax, const Device &dev,
                         Tensor *t) {
  if (!rowwise && !columnwise && !compute_amax) {
    return invalid(op, "rowwise, columnwise or compute_amax must be true, got none");
  }
  // Neither copy: an amax-only call (current scaling's first pass; the core writes the amax
  // alone), high precision.
  const bool fp8 = columnwise || (rowwise && is_fp8(data.element_type()));
  if (columnwise && rowwise && !is_fp8(data.element_type())) {
    return invalid(op, std::string(name) + " must be FP8 when columnwise is set, got XLA "
                       "element type " + std::to_string(static_cast<int>(data.element_type())));
  }
  TE_JAX_RETURN_IF_ERROR(t->init(op, TE_SCALING_TENSOR));
  if (rowwise) TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_DATA, name, data, dev));
  if (columnwise) {
    TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_COLUMNWISE_DATA, "columnwise_data", columnwise_data, dev));
  }
  if (fp8) {
    TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_SCALE, "scale", scale, dev));
    TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_SCALE_INV, "scale_inv", scale_inv, dev));
  }
  if (compute_amax) TE_JAX_RETURN_IF_ERROR(t->set(TE_SLOT_AMAX, "amax", amax, dev));
  return t->set_gate(gate, dev);
}

ffi::Error ActivationForwardImpl(ffi::AnyBuffer input, ffi::AnyBuffer scale, ffi::AnyBuffer gate,
                                 ffi::AnyBuffer amax_in, ffi::Result<ffi::AnyBuffer> output,
                                 ffi::Result<ffi::AnyBuffer> columnwise_output,
                                 ffi::Result<ffi::AnyBuffer> scale_inv,
                                 ffi::Result<ffi::AnyBuffer> amax, int32_t act, bool rowwise,
                                 bool columnwise, bool compute_amax, float limit, float alpha,
                                 float linear_offset, Device dev) {
  constexpr const char *op = "activation_forward";
  te_activation a;
  TE_JAX_RETURN_IF_ERROR(activation_of(op, act, &a));
  Tensor in, out;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "input", input, dev, &in));
  TE_JAX_RETURN_IF_ERROR(result_tensor(op, "output", scale, *output, *columnwise_output,
                                       *scale_inv, *amax, gate, rowwise, columnwise, compute_amax,
                                       dev, &out));
  bool accumulate = false;
  TE_JAX_RETURN_IF_ERROR(amax_accumulation(op, amax_in, compute_amax, *amax, &accumulate));
  te_activation_params storage{};
  const te_activation_params *params = params_of(a, limit, alpha, linear_offset, &storage);
  return from_status(te_activation_forward(a, params, in.get(), out.get(), accumulate ? 1 : 0, dev.stream));
}

auto TeActivationForwardBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // input [.., K] fp32/fp16/bf16 (gated: K = 2N)
      .Arg<ffi::AnyBuffer>()  // scale fp32 [1] (read when the output is FP8)
      .Arg<ffi::AnyBuffer>()  // gate fp32 [1] of the output, or empty for none (tensor.h)
      .Arg<ffi::AnyBuffer>()  // amax_in: fp32 [1] raised by this call (aliased to amax), or empty
      .Ret<ffi::AnyBuffer>()  // output [.., N]: high precision or FP8 (empty unless rowwise)
      .Ret<ffi::AnyBuffer>()  // columnwise_output: FP8 transpose [N, M] (empty unless columnwise)
      .Ret<ffi::AnyBuffer>()  // scale_inv fp32 [1] (FP8 output; else empty)
      .Ret<ffi::AnyBuffer>()  // amax fp32 [1] (empty unless compute_amax)
      .Attr<int32_t>("act")
      .Attr<bool>("rowwise")
      .Attr<bool>("columnwise")
      .Attr<bool>("compute_amax")
      .Attr<float>("limit")
      .Attr<float>("alpha")
      .Attr<float>("linear_offset");
}

ffi::Error ActivationBackwardImpl(ffi::AnyBuffer grad_output, ffi::AnyBuffer input,
                                  ffi::AnyBuffer scale, ffi::AnyBuffer gate, ffi::AnyBuffer amax_in,
                                  ffi::Result<ffi::AnyBuffer> grad_input,
                                  ffi::Result<ffi::AnyBuffer> columnwise_grad_input,
                                  ffi::Result<ffi::AnyBuffer> scale_inv,
                                  ffi::Result<ffi::AnyBuffer> amax,
                                  ffi::Result<ffi::AnyBuffer> dbias, int32_t act, bool rowwise,
                                  bool columnwise, bool compute_amax, bool compute_dbias,
                                  float limit, float alpha, float linear_offset, Device dev) {
  constexpr const char *op = "activation_backward";
  te_activation a;
  TE_JAX_RETURN_IF_ERROR(activation_of(op, act, &a));
  Tensor tdy, tx, tdx, tdbias;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "grad_output", grad_output, dev, &tdy));
  // IDENTITY reads no input: the caller passes an empty one.
  const bool reads_input = a != TE_ACTIVATION_IDENTITY;
  if (reads_input) TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "input", input, dev, &tx));
  TE_JAX_RETURN_IF_ERROR(result_tensor(op, "grad_input", scale, *grad_input,
                                       *columnwise_grad_input, *scale_inv, *amax, gate, rowwise,
                                       columnwise, compute_amax, dev, &tdx));
  if (compute_dbias) TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dbias", *dbias, dev, &tdbias));
  bool accumulate = false;
  TE_JAX_RETURN_IF_ERROR(amax_accumulation(op, amax_in, compute_amax, *amax, &accumulate));
  te_activation_params storage{};
  const te_activation_params *params = params_of(a, limit, alpha, linear_offset, &storage);
  return from_status(te_activation_backward(a, params, tdy.get(), reads_input ? tx.get() : nullptr,
                                            tdx.get(), compute_dbias ? tdbias.get() : nullptr,
                                            accumulate ? 1 : 0, dev.stream));
}

auto TeActivationBackwardBinding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // grad_output [.., N]
      .Arg<ffi::AnyBuffer>()  // input [.., K], the forward's (empty for IDENTITY)
      .Arg<ffi::AnyBuffer>()  // scale fp32 [1] (read when grad_input is FP8)
      .Arg<ffi::AnyBuffer>()  // gate fp32 [1] of grad_input, or empty for none (tensor.h)
      .Arg<ffi::AnyBuffer>()  // amax_in: fp32 [1] raised by this call (aliased to amax), or empty
      .Ret<ffi::AnyBuffer>()  // grad_input [.., K]: high precision or FP8 (empty unless rowwise)
      .Ret<ffi::AnyBuffer>()  // columnwise_grad_input: FP8 transpose [K, M] (empty unless columnwise)
      .Ret<ffi::AnyBuffer>()  // scale_inv fp32 [1] (FP8 grad_input; else empty)
      .Ret<ffi::AnyBuffer>()  // amax fp32 [1] (empty unless compute_amax)
      .Ret<ffi::AnyBuffer>()  // dbias [K] (empty unless compute_dbias)
      .Attr<int32_t>("act")
      .Attr<bool>("rowwise")
      .Attr<bool>("columnwise")
      .Attr<bool>("compute_amax")
      .Attr<bool>("compute_dbias")
      .Attr<float>("limit")
      .Attr<float>("alpha")
      .Attr<float>("linear_offset");
}

// The same op with dbias, under a target of its own that stays outside XLA's graphs (its
// partial sums come from the core's stream-ordered pool: ffi_common.h).
auto TeActivationBackwardDbiasBinding() { return TeActivationBackwardBinding(); }

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeActivationForward, ActivationForwardImpl);
TE_JAX_DEFINE_HANDLERS(TeActivationBackward, ActivationBackwardImpl);
TE_JAX_DEFINE_HANDLERS_OUTSIDE_GRAPHS(TeActivationBackwardDbias, ActivationBackwardImpl);

}  // namespace te_jax
