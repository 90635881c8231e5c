// Binding of activation.h.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>

#include <tuple>

#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

namespace {

// (limit, alpha, linear_offset) of a parametrized activation, or None.
using Params = std::optional<std::tuple<float, float, float>>;

const te_activation_params *params_of(const Params &params, te_activation_params *storage) {
  if (!params.has_value()) return nullptr;
  *storage = te_activation_params{std::get<0>(*params), std::get<1>(*params), std::get<2>(*params)};
  return storage;
}

}  // namespace

void register_activation(nb::module_ &m) {
  nb::enum_<te_activation>(m, "Activation",
                           "Activations of the MLP block (see the core's activation.h); the gated "
                           "ones (geglu, swiglu, reglu, qgeglu, sreglu, glu, clamped_swiglu) split their input's last "
                           "dimension [a, b].")
      .value("identity", TE_ACTIVATION_IDENTITY)
      .value("gelu", TE_ACTIVATION_GELU)
      .value("relu", TE_ACTIVATION_RELU)
      .value("silu", TE_ACTIVATION_SILU)
      .value("qgelu", TE_ACTIVATION_QGELU)
      .value("srelu", TE_ACTIVATION_SRELU)
      .value("geglu", TE_ACTIVATION_GEGLU)
      .value("swiglu", TE_ACTIVATION_SWIGLU)
      .value("reglu", TE_ACTIVATION_REGLU)
      .value("qgeglu", TE_ACTIVATION_QGEGLU)
      .value("sreglu", TE_ACTIVATION_SREGLU)
      .value("glu", TE_ACTIVATION_GLU)
      .value("clamped_swiglu", TE_ACTIVATION_CLAMPED_SWIGLU);

  m.def(
      "activation_forward",
      [](te_activation act, nb::handle input, nb::handle output, bool accumulate_amax, const Params &params,
         uintptr_t stream) {
        const char *op = "activation_forward";
        Handle in = make_handle(op, "input", input, 0);
        Handle out = make_handle(op, "output", output, kAllSlots & ~(1u << TE_SLOT_SCALE));
        te_activation_params storage{};
        const te_activation_params *p = params_of(params, &storage);
        nb::gil_scoped_release release;
        check_status(te_activation_forward(act, p, in.get(), out.get(), accumulate_amax ? 1 : 0, as_stream(stream)));
      },
      "act"_a, "input"_a, "output"_a, nb::kw_only(), "accumulate_amax"_a = false, "params"_a = nb::none(),
      "stream"_a = 0,
      "output = act(input): output is a high-precision array or Tensor, or an FP8 Tensor "
      "(data and/or the transposed columnwise_data, scale read, scale_inv and amax written; "
      "with accumulate_amax the amax is raised, not overwritten). params: (limit, alpha, "
      "linear_offset) of clamped_swiglu, else None.");

  m.def(
      "activation_backward",
      [](te_activation act, nb::handle grad_output, nb::handle input, nb::handle grad_input,
         nb::handle dbias, bool accumulate_amax, const Params &params, uintptr_t stream) {
        const char *op = "activation_backward";
        Handle g = make_handle(op, "grad_output", grad_output, 0);
        Handle in = optional_handle(op, "input", input, 0);
        Handle gi = make_handle(op, "grad_input", grad_input, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle db = optional_handle(op, "dbias", dbias, kAllSlots);
        te_activation_params storage{};
        const te_activation_params *p = params_of(params, &storage);
        nb::gil_scoped_release release;
        check_status(te_activation_backward(act, p, g.get(), in.get(), gi.get(), db.get(), accumulate_amax ? 1 : 0,
                                            as_stream(stream)));
      },
      "act"_a, "grad_output"_a, "input"_a.none(), "grad_input"_a, nb::kw_only(),
      "dbias"_a = nb::none(), "accumulate_amax"_a = false, "params"_a = nb::none(), "stream"_a = 0,
      "grad_input = act'(input) * grad_output (gated: both halves), with the optional fp32 column "
      "sums of grad_input in dbias; input may be None for identity.");
}

}  // namespace te_binding
