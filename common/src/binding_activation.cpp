// Binding of activation.h.
#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

void register_activation(nb::module_ &m) {
  nb::enum_<te_activation>(m, "Activation",
                           "Activations of the MLP block (see the core's activation.h); the gated "
                           "ones (geglu, swiglu, reglu, qgeglu, sreglu, glu) split their input's last "
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
      .value("glu", TE_ACTIVATION_GLU);

  m.def(
      "activation_forward",
      [](te_activation act, nb::handle input, nb::handle output, bool accumulate_amax, uintptr_t stream) {
        const char *op = "activation_forward";
        Handle in = make_handle(op, "input", input, 0);
        Handle out = make_handle(op, "output", output, kAllSlots & ~(1u << TE_SLOT_SCALE));
        nb::gil_scoped_release release;
        check_status(te_activation_forward(act, in.get(), out.get(), accumulate_amax ? 1 : 0, as_stream(stream)));
      },
      "act"_a, "input"_a, "output"_a, nb::kw_only(), "accumulate_amax"_a = false, "stream"_a = 0,
      "output = act(input): output is a high-precision array or Tensor, or an FP8 Tensor "
      "(data and/or the transposed columnwise_data, scale read, scale_inv and amax written; "
      "with accumulate_amax the amax is raised, not overwritten).");

  m.def(
      "activation_backward",
      [](te_activation act, nb::handle grad_output, nb::handle input, nb::handle grad_input,
         nb::handle dbias, bool accumulate_amax, uintptr_t stream) {
        const char *op = "activation_backward";
        Handle g = make_handle(op, "grad_output", grad_output, 0);
        Handle in = input.is_none() ? Handle() : make_handle(op, "input", input, 0);
        Handle gi = make_handle(op, "grad_input", grad_input, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle db = dbias.is_none() ? Handle() : make_handle(op, "dbias", dbias, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_activation_backward(act, g.get(), in.get(), gi.get(), db.get(), accumulate_amax ? 1 : 0,
                                            as_stream(stream)));
      },
      "act"_a, "grad_output"_a, "input"_a.none(), "grad_input"_a, nb::kw_only(),
      "dbias"_a = nb::none(), "accumulate_amax"_a = false, "stream"_a = 0,
      "grad_input = act'(input) * grad_output (gated: both halves), with the optional fp32 column "
      "sums of grad_input in dbias; input may be None for identity.");
}

}  // namespace te_binding
