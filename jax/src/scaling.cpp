// XLA FFI handler of the delayed-scaling update (te_delayed_scaling_update): n amax histories
// and their scales in, the updated histories, scales and scale_invs out, one core call.
//
// The core updates histories and scales in place. Here the caller aliases each history and
// scale argument to its result (ffi_call's input_output_aliases), so XLA hands the handler
// result buffers that already hold the arguments' values (copying them first when the
// arguments are still needed), and the core updates those: no input array is ever written.
#include <vector>

#include "ffi_common.h"
#include "handlers.h"

namespace te_jax {
namespace {

ffi::Error DelayedScalingUpdateImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    int32_t fp8_dtype, int32_t algo, int32_t margin, Device dev) {
  constexpr const char *op = "delayed_scaling_update";
  const size_t n = args.size() / 2;
  if (args.size() != 2 * n || rets.size() != 3 * n) {
    return invalid(op, "expects n histories and n scales in, n histories, scales and scale_invs "
                       "out, got " + std::to_string(args.size()) + " arguments and " +
                       std::to_string(rets.size()) + " results");
  }
  std::vector<Tensor> owned(3 * n);
  std::vector<te_tensor *> histories(n), scales(n), scale_invs(n);
  const char *names[3] = {"amax_history", "scale", "scale_inv"};
  std::vector<te_tensor *> *groups[3] = {&histories, &scales, &scale_invs};
  for (size_t g = 0; g < 3; ++g) {
    for (size_t i = 0; i < n; ++i) {
      ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r = rets.get<ffi::AnyBuffer>(g * n + i);
      if (r.has_error()) return r.error();
      Tensor &t = owned[g * n + i];
      TE_JAX_RETURN_IF_ERROR(plain_tensor(op, names[g], **r, dev, &t));
      (*groups[g])[i] = t.get();
    }
  }
  return from_status(te_delayed_scaling_update(
      histories.data(), scales.data(), scale_invs.data(), n, static_cast<te_dtype>(fp8_dtype),
      static_cast<te_amax_compute_algo>(algo), margin, dev.stream));
}

auto TeDelayedScalingUpdateBinding() {
  return ffi::Ffi::Bind()
      .RemainingArgs()  // n amax histories fp32 [H] or [H, m], then n scales fp32 [m]
      .RemainingRets()  // the n updated histories and scales (aliased), then n scale_invs
      .Attr<int32_t>("fp8_dtype")
      .Attr<int32_t>("algo")
      .Attr<int32_t>("margin");
}

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeDelayedScalingUpdate, DelayedScalingUpdateImpl);

}  // namespace te_jax
