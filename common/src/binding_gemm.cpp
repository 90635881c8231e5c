// Binding of gemm.h.
#include <string>
#include <vector>

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

  m.def(
      "grouped_gemm",
      [](nb::sequence a, nb::sequence b, nb::sequence d, nb::handle bias, bool transpose_a,
         bool transpose_b, bool accumulate, bool use_split_accumulator, nb::handle workspace,
         uintptr_t stream) {
        const char *op = "grouped_gemm";
        const size_t groups = nb::len(a);
        if (nb::len(b) != groups || nb::len(d) != groups ||
            (!bias.is_none() && nb::len(nb::borrow<nb::sequence>(bias)) != groups)) {
          throw nb::value_error(
              (std::string(op) + ": a, b, d (and bias, when given) must have one entry per "
               "group, got " + std::to_string(groups) + ", " + std::to_string(nb::len(b)) + ", " +
               std::to_string(nb::len(d)) +
               (bias.is_none() ? std::string() : ", " + std::to_string(nb::len(
                   nb::borrow<nb::sequence>(bias)))))
                  .c_str());
        }
        std::vector<Handle> ha, hb, hd, hbias;
        for (size_t i = 0; i < groups; ++i) {
          ha.push_back(make_handle(op, "a", a[i], 0));
          hb.push_back(make_handle(op, "b", b[i], 0));
          hd.push_back(make_handle(op, "d", d[i], kAllSlots & ~(1u << TE_SLOT_SCALE)));
          nb::handle bi = bias.is_none() ? nb::handle(nb::none()) : nb::handle(bias[i]);
          hbias.push_back(bi.is_none() ? Handle() : make_handle(op, "bias", bi, 0));
        }
        std::vector<const te_tensor *> pa, pb, pbias;
        std::vector<te_tensor *> pd;
        for (size_t i = 0; i < groups; ++i) {
          pa.push_back(ha[i].get());
          pb.push_back(hb[i].get());
          pd.push_back(hd[i].get());
          pbias.push_back(hbias[i].get());
        }
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        const te_gemm_config config{transpose_a ? 1 : 0, transpose_b ? 1 : 0, accumulate ? 1 : 0,
                                    use_split_accumulator ? 1 : 0, 0};
        nb::gil_scoped_release release;
        check_status(te_grouped_gemm(pa.data(), pb.data(), pd.data(),
                                     bias.is_none() ? nullptr : pbias.data(), groups, &config, ws,
                                     ws_size, as_stream(stream)));
      },
      "a"_a, "b"_a, "d"_a, nb::kw_only(), "bias"_a = nb::none(), "transpose_a"_a = false,
      "transpose_b"_a = true, "accumulate"_a = false, "use_split_accumulator"_a = false,
      "workspace"_a = nb::none(), "stream"_a = 0,
      "D_g = op(a_g) @ op(b_g) (+ bias_g) for every group, in one call (lists of one entry per "
      "group; bias None or a list whose entries may be None); see the core's gemm.h.");

  m.def(
      "grouped_gemm_ragged",
      [](nb::handle a, nb::handle b, nb::handle d, nb::handle group_sizes, nb::handle bias,
         bool transpose_a, bool transpose_b, bool accumulate, bool use_split_accumulator,
         nb::handle workspace, uintptr_t stream) {
        const char *op = "grouped_gemm_ragged";
        Handle ha = make_handle(op, "a", a, 0);
        Handle hb = make_handle(op, "b", b, 0);
        Handle hd = make_handle(op, "d", d, kAllSlots);
        Handle hs = make_handle(op, "group_sizes", group_sizes, 0);
        Handle hbias = bias.is_none() ? Handle() : make_handle(op, "bias", bias, 0);
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        const te_gemm_config config{transpose_a ? 1 : 0, transpose_b ? 1 : 0, accumulate ? 1 : 0,
                                    use_split_accumulator ? 1 : 0, 0};
        nb::gil_scoped_release release;
        check_status(te_grouped_gemm_ragged(ha.get(), hb.get(), hd.get(), hbias.get(), hs.get(),
                                            &config, ws, ws_size, as_stream(stream)));
      },
      "a"_a, "b"_a, "d"_a, "group_sizes"_a, nb::kw_only(), "bias"_a = nb::none(),
      "transpose_a"_a = false, "transpose_b"_a = true, "accumulate"_a = false,
      "use_split_accumulator"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
      "The groups stacked in a (rows by group_sizes): d[rows g] = a[rows g] @ op(b[g]), or with "
      "transpose_a d[g] = a[rows g]^T @ b[rows g]; see the core's gemm.h.");

  m.def("gemm_workspace_size", []() { return te_gemm_workspace_size(); },
        "Bytes of CUDA workspace that gemm wants (pass it as a uint8 device array).");
}

}  // namespace te_binding
