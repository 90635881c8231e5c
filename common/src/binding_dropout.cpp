// Binding of dropout.h.
#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

void register_dropout(nb::module_ &m) {
  m.def(
      "dropout_add_forward",
      [](float p, nb::handle x, nb::handle residual, nb::handle rng_state, nb::handle y, uintptr_t stream) {
        const char *op = "dropout_add_forward";
        Handle hx = make_handle(op, "x", x, 0), hrng = make_handle(op, "rng_state", rng_state, 0);
        Handle hr = optional_handle(op, "residual", residual, 0);
        Handle hy = make_handle(op, "y", y, 0);
        nb::gil_scoped_release release;
        check_status(te_dropout_add_forward(p, hx.get(), hr.get(), hrng.get(), hy.get(), as_stream(stream)));
      },
      "p"_a, "x"_a, "residual"_a.none(), "rng_state"_a, "y"_a, nb::kw_only(), "stream"_a = 0,
      "y = residual + dropout(x) (residual None: dropout(x)); the mask is a function of rng_state "
      "(int64 [2]: seed, offset) and each element's index (dropout.h).");
  m.def(
      "dropout_backward",
      [](float p, nb::handle dy, nb::handle rng_state, nb::handle dx, uintptr_t stream) {
        const char *op = "dropout_backward";
        Handle hdy = make_handle(op, "dy", dy, 0), hrng = make_handle(op, "rng_state", rng_state, 0);
        Handle hdx = make_handle(op, "dx", dx, 0);
        nb::gil_scoped_release release;
        check_status(te_dropout_backward(p, hdy.get(), hrng.get(), hdx.get(), as_stream(stream)));
      },
      "p"_a, "dy"_a, "rng_state"_a, "dx"_a, nb::kw_only(), "stream"_a = 0,
      "dx = dy where the forward with this p and rng_state kept an element, times 1 / (1 - p); 0 "
      "where it dropped one.");
}

}  // namespace te_binding
