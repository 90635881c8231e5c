// Binding of rope.h.
#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

namespace {

// Forward and backward take the same arguments; only the roles of the arrays differ.
void rope(bool backward, te_rope_format format, nb::handle input, nb::handle freqs, nb::handle output,
          bool interleaved, nb::handle cu_seqlens, nb::handle start_positions, uintptr_t stream) {
  const char *op = backward ? "rope_backward" : "rope_forward";
  Handle in = make_handle(op, backward ? "grad_output" : "input", input, 0);
  Handle f = make_handle(op, "freqs", freqs, 0);
  Handle out = make_handle(op, backward ? "grad_input" : "output", output, kAllSlots);
  Handle cu = optional_handle(op, "cu_seqlens", cu_seqlens);
  Handle start = optional_handle(op, "start_positions", start_positions);
  const te_rope_config config{format, interleaved ? 1 : 0};
  nb::gil_scoped_release release;
  const te_stream s = as_stream(stream);
  check_status(backward ? te_rope_backward(&config, in.get(), f.get(), cu.get(), start.get(), out.get(), s)
                        : te_rope_forward(&config, in.get(), f.get(), cu.get(), start.get(), out.get(), s));
}

}  // namespace

void register_rope(nb::module_ &m) {
  nb::enum_<te_rope_format>(m, "RopeFormat", "Layouts of rope_forward / rope_backward (see rope.h).")
      .value("sbhd", TE_ROPE_SBHD)
      .value("bshd", TE_ROPE_BSHD)
      .value("thd", TE_ROPE_THD);

  m.def(
      "rope_forward",
      [](te_rope_format format, nb::handle input, nb::handle freqs, nb::handle output, bool interleaved,
         nb::handle cu_seqlens, nb::handle start_positions, uintptr_t stream) {
        rope(false, format, input, freqs, output, interleaved, cu_seqlens, start_positions, stream);
      },
      "format"_a, "input"_a, "freqs"_a, "output"_a, nb::kw_only(), "interleaved"_a = false,
      "cu_seqlens"_a = nb::none(), "start_positions"_a = nb::none(), "stream"_a = 0,
      "output = input with its first R = freqs.shape[-1] features of each head rotated by the angles "
      "of freqs (fp32 [P, R] or [P, 1, 1, R]) at each token's position; cu_seqlens (int32 [B + 1]) "
      "for thd, start_positions (int32 [B]) optional.");

  m.def(
      "rope_backward",
      [](te_rope_format format, nb::handle grad_output, nb::handle freqs, nb::handle grad_input,
         bool interleaved, nb::handle cu_seqlens, nb::handle start_positions, uintptr_t stream) {
        rope(true, format, grad_output, freqs, grad_input, interleaved, cu_seqlens, start_positions, stream);
      },
      "format"_a, "grad_output"_a, "freqs"_a, "grad_input"_a, nb::kw_only(), "interleaved"_a = false,
      "cu_seqlens"_a = nb::none(), "start_positions"_a = nb::none(), "stream"_a = 0,
      "grad_input = the transpose of rope_forward's rotation applied to grad_output (for angles "
      "shared within each pair: the rotation by minus the angle).");
}

}  // namespace te_binding
