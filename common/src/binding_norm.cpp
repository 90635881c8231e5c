// Binding of norm.h.
#include <string>

#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

void register_norm(nb::module_ &m) {
  nb::enum_<te_norm_type>(m, "Norm", "The normalization of norm_forward / norm_backward.")
      .value("layernorm", TE_NORM_LAYERNORM)
      .value("rmsnorm", TE_NORM_RMSNORM);

  m.def(
      "norm_forward",
      [](te_norm_type norm, nb::handle input, nb::handle gamma, nb::handle beta, nb::handle output,
         nb::handle output_fp8, nb::handle mu, nb::handle rsigma, float eps, bool zero_centered_gamma,
         bool accumulate_amax, uintptr_t stream) {
        const char *op = "norm_forward";
        Handle in = make_handle(op, "input", input, 0);
        Handle g = make_handle(op, "gamma", gamma, 0);
        Handle b = optional_handle(op, "beta", beta, 0);
        Handle out = optional_handle(op, "output", output, kAllSlots);
        Handle q = optional_handle(op, "output_fp8", output_fp8, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle hm = optional_handle(op, "mu", mu, kAllSlots);
        Handle hr = make_handle(op, "rsigma", rsigma, kAllSlots);
        const te_norm_config config{norm, eps, zero_centered_gamma ? 1 : 0, accumulate_amax ? 1 : 0};
        nb::gil_scoped_release release;
        check_status(te_norm_forward(&config, in.get(), g.get(), b.get(), out.get(), q.get(), hm.get(),
                                     hr.get(), as_stream(stream)));
      },
      "norm"_a, "input"_a, "gamma"_a, "beta"_a = nb::none(), nb::kw_only(), "output"_a = nb::none(),
      "output_fp8"_a = nb::none(), "mu"_a = nb::none(), "rsigma"_a, "eps"_a = 1e-5f,
      "zero_centered_gamma"_a = false, "accumulate_amax"_a = false, "stream"_a = 0,
      "LayerNorm / RMSNorm forward into output (high precision) and/or output_fp8 (an FP8 Tensor, "
      "with its transpose when it has columnwise_data); writes mu (LayerNorm) and rsigma; with "
      "accumulate_amax, output_fp8's amax is raised, not overwritten.");

  m.def(
      "norm_backward",
      [](te_norm_type norm, nb::handle grad_output, nb::handle input, nb::handle mu, nb::handle rsigma,
         nb::handle gamma, nb::handle grad_input, nb::handle grad_gamma, nb::handle grad_beta,
         nb::handle grad_input_add, bool zero_centered_gamma, nb::handle workspace, uintptr_t stream) {
        const char *op = "norm_backward";
        Handle dy = make_handle(op, "grad_output", grad_output, 0);
        Handle x = make_handle(op, "input", input, 0);
        Handle hm = optional_handle(op, "mu", mu, 0);
        Handle hr = make_handle(op, "rsigma", rsigma, 0);
        Handle g = make_handle(op, "gamma", gamma, 0);
        Handle dx = make_handle(op, "grad_input", grad_input, kAllSlots);
        Handle dg = make_handle(op, "grad_gamma", grad_gamma, kAllSlots);
        Handle db = optional_handle(op, "grad_beta", grad_beta, kAllSlots);
        Handle add = optional_handle(op, "grad_input_add", grad_input_add, 0);
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        const te_norm_config config{norm, 0.0f, zero_centered_gamma ? 1 : 0, 0};
        nb::gil_scoped_release release;
        check_status(te_norm_backward(&config, dy.get(), x.get(), hm.get(), hr.get(), g.get(), add.get(),
                                      dx.get(), dg.get(), db.get(), ws, ws_size, as_stream(stream)));
      },
      "norm"_a, "grad_output"_a, "input"_a, "mu"_a.none(), "rsigma"_a, "gamma"_a, nb::kw_only(),
      "grad_input"_a, "grad_gamma"_a, "grad_beta"_a = nb::none(), "grad_input_add"_a = nb::none(),
      "zero_centered_gamma"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
      "LayerNorm / RMSNorm backward: grad_input, grad_gamma and (LayerNorm) grad_beta; with "
      "grad_input_add (grad_input's shape and dtype: a residual gradient), grad_input is "
      "rounded(rounded(dx) + grad_input_add).");

  m.def("norm_backward_workspace_size", &te_norm_backward_workspace_size, "rows"_a, "cols"_a,
        "Bytes of CUDA workspace norm_backward needs for an [rows, cols] input.");
}

}  // namespace te_binding
