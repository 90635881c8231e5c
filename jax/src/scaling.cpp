// XLA FFI handler of the delayed-scaling update (te_delayed_scaling_update_with_amaxes): n amax
// histories, optionally the n amaxes of the step that just ran, and n scales in; the updated
// histories, scales and scale_invs out; one core call (one launch) for groups of any formats.
//
// The core updates histories and scales in place. Here the caller aliases each history and
// scale argument to its result (ffi_call's input_output_aliases), so XLA hands the handler
// result buffers that already hold the arguments' values (copying them first when the
// arguments are still needed), and the core updates those: no input array is ever written.
// The step amaxes are read only: the core records each into its history's slot 0 itself, so
// the caller needs no write of the history before the call.
#include <vector>

#include "ffi_common.h"
#include "handlers.h"

namespace te_jax {
namespace {

ffi::Error DelayedScalingUpdateImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    ffi::Span<const int32_t> fp8_dtypes, int32_t algo,
                                    int32_t margin, Device dev) {
  constexpr const char *op = "delayed_scaling_update";
  const size_t n = rets.size() / 3;
  const bool with_amaxes = args.size() == 3 * n;
  if (rets.size() != 3 * n || (args.size() != 2 * n && !with_amaxes) || fp8_dtypes.size() != n) {
    return invalid(op, "expects n histories, optionally n step amaxes, and n scales in, n "
                       "histories, scales and scale_invs out, and n fp8_dtypes, got " +
                       std::to_string(args.size()) + " arguments, " + std::to_string(rets.size()) +
                       " results and " + std::to_string(fp8_dtypes.size()) + " fp8_dtypes");
  }
  std::vector<Tensor> owned(4 * n);
  std::vector<te_tensor *> histories(n), amaxes(n), scales(n), scale_invs(n);
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
  for (size_t i = 0; with_amaxes && i < n; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> a = args.get<ffi::AnyBuffer>(n + i);
    if (a.has_error()) return a.error();
    TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "step_amax", *a, dev, &owned[3 * n + i]));
    amaxes[i] = owned[3 * n + i].get();
  }
  std::vector<te_dtype> dtypes(n);
  for (size_t i = 0; i < n; ++i) dtypes[i] = static_cast<te_dtype>(fp8_dtypes[i]);
  return from_status(te_delayed_scaling_update_with_amaxes(
      histories.data(), with_amaxes ? amaxes.data() : nullptr, scales.data(), scale_invs.data(),
      dtypes.data(), n, static_cast<te_amax_compute_algo>(algo), margin, dev.stream));
}

auto TeDelayedScalingUpdateBinding() {
  return ffi::Ffi::Bind()
      .RemainingArgs()  // n histories fp32 [H] or [H, m], [n step amaxes fp32 [m]], n scales [m]
      .RemainingRets()  // the n updated histories and scales (aliased), then n scale_invs
      .Attr<ffi::Span<const int32_t>>("fp8_dtypes")
      .Attr<int32_t>("algo")
      .Attr<int32_t>("margin");
}

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeDelayedScalingUpdate, DelayedScalingUpdateImpl);

}  // namespace te_jax
