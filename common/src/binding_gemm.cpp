// Binding of gemm.h.
#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

void register_gemm(nb::module_ &m) {
  m.def(
      "gemm",
      [](nb::handle a, nb::handle b, nb::handle d, nb::handle bias, nb::handle pre_gelu_out,
         bool transpose_a, bool transpose_b, bool accumulate, bool use_split_accumulator, bool gelu,
         nb::handle workspace, uintptr_t stream) {
        const char *op = "gemm";
        Handle ha = make_handle(op, "a", a, 0);
        Handle hb = make_handle(op, "b", b, 0);
        Handle hd = make_handle(op, "d", d, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle hbias = bias.is_none() ? Handle() : make_handle(op, "bias", bias, 0);
        Handle hpre = pre_gelu_out.is_none() ? Handle() : make_handle(op, "pre_gelu_out", pre_gelu_out, kAllSlots);
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        const te_gemm_config config{transpose_a ? 1 : 0, transpose_b ? 1 : 0, accumulate ? 1 : 0,
                                    use_split_accumulator ? 1 : 0, gelu ? 1 : 0};
        nb::gil_scoped_release release;
        check_status(te_gemm(ha.get(), hb.get(), hd.get(), hbias.get(), hpre.get(), &config, ws,
                             ws_size, as_stream(stream)));
      },
      "a"_a, "b"_a, "d"_a, nb::kw_only(), "bias"_a = nb::none(), "pre_gelu_out"_a = nb::none(),
      "transpose_a"_a = false, "transpose_b"_a = true, "accumulate"_a = false,
      "use_split_accumulator"_a = false, "gelu"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
      "D = op(a) @ op(b) (+ bias, + GELU) into d; see the core's gemm.h for the rules.");

  m.def("gemm_workspace_size", []() { return te_gemm_workspace_size(); },
        "Bytes of CUDA workspace that gemm wants (pass it as a uint8 device array).");
}

}  // namespace te_binding
