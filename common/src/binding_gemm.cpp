// Binding of gemm.h and hopper_gemm.h.
#include <string>
#include <utility>
#include <vector>

#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

namespace {

// The handles of a grouped call's lists (a, b, d: one entry per group; bias None or such a list
// whose entries may be None), and the pointer arrays that the C API takes. Shared by
// grouped_gemm and hopper_grouped_gemm, which take the same lists.
struct GroupHandles {
  const char *op;
  size_t groups;
  bool has_bias;
  std::vector<Handle> owned;  // keeps the handles alive while the pointers below are in use
  std::vector<const te_tensor *> a, b, bias;
  std::vector<te_tensor *> d;

  GroupHandles(const char *op_, nb::sequence sa, nb::sequence sb, nb::sequence sd, nb::handle sbias)
      : op(op_), groups(nb::len(sa)), has_bias(!sbias.is_none()) {
    const size_t nbias = has_bias ? nb::len(nb::borrow<nb::sequence>(sbias)) : groups;
    if (nb::len(sb) != groups || nb::len(sd) != groups || nbias != groups) {
      throw nb::value_error((std::string(op) + ": a, b, d (and bias, when given) must have one "
                             "entry per group, got " + std::to_string(groups) + ", " +
                             std::to_string(nb::len(sb)) + ", " + std::to_string(nb::len(sd)) +
                             (has_bias ? ", " + std::to_string(nbias) : std::string()))
                                .c_str());
    }
    for (size_t i = 0; i < groups; ++i) {
      a.push_back(keep(make_handle(op, "a", sa[i], 0)));
      b.push_back(keep(make_handle(op, "b", sb[i], 0)));
      d.push_back(keep(make_handle(op, "d", sd[i], kAllSlots & ~(1u << TE_SLOT_SCALE))));
      nb::handle bi = has_bias ? nb::handle(sbias[i]) : nb::handle(nb::none());
      bias.push_back(bi.is_none() ? nullptr : keep(make_handle(op, "bias", bi, 0)));
    }
  }

  const te_tensor *const *bias_or_null() const { return has_bias ? bias.data() : nullptr; }

 private:
  te_tensor *keep(Handle h) {
    owned.push_back(std::move(h));
    return owned.back().get();
  }
};

}  // namespace

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
        Handle hbias = optional_handle(op, "bias", bias, 0);
        Handle hpre = optional_handle(op, "pre_gelu_out", pre_gelu_out, kAllSlots);
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
        GroupHandles g("grouped_gemm", a, b, d, bias);
        size_t ws_size = 0;
        void *ws = workspace_of(g.op, workspace, &ws_size);
        const te_gemm_config config{transpose_a ? 1 : 0, transpose_b ? 1 : 0, accumulate ? 1 : 0,
                                    use_split_accumulator ? 1 : 0, 0};
        nb::gil_scoped_release release;
        check_status(te_grouped_gemm(g.a.data(), g.b.data(), g.d.data(), g.bias_or_null(),
                                     g.groups, &config, ws, ws_size, as_stream(stream)));
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
        Handle hbias = optional_handle(op, "bias", bias, 0);
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

  // Our Hopper kernels (hopper_gemm.h) on their own, beside gemm and grouped_gemm (cuBLASLt),
  // for tests and benchmarks. Every build has them: without the kernels the calls raise
  // RuntimeError with the reason, and hopper_gemm_available() is False.
  m.def("hopper_gemm_available", []() { return te_hopper_gemm_available() != 0; },
        "Whether this build of the core has the Hopper (sm_90a, CUTLASS) GEMM kernels; the "
        "machine is not looked at.");

  m.def(
      "hopper_gemm",
      [](nb::handle a, nb::handle b, nb::handle d, nb::handle bias, bool accumulate,
         bool use_split_accumulator, nb::handle workspace, uintptr_t stream) {
        const char *op = "hopper_gemm";
        Handle ha = make_handle(op, "a", a, 0);
        Handle hb = make_handle(op, "b", b, 0);
        Handle hd = make_handle(op, "d", d, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle hbias = optional_handle(op, "bias", bias, 0);
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        // transpose_b = 1: the kernel takes B [N, K] only (K-major, as every FP8 GEMM).
        const te_gemm_config config{0, 1, accumulate ? 1 : 0, use_split_accumulator ? 1 : 0, 0};
        nb::gil_scoped_release release;
        check_status(te_hopper_block_scaled_gemm(ha.get(), hb.get(), hd.get(), hbias.get(), &config,
                                                 ws, ws_size, as_stream(stream)));
      },
      "a"_a, "b"_a, "d"_a, nb::kw_only(), "bias"_a = nb::none(), "accumulate"_a = false,
      "use_split_accumulator"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
      "D = a @ b^T (+ bias) into d on the Hopper block-scaled FP8 kernel (a block_1x128, b "
      "block_128x128, E4M3), nothing else; see the core's hopper_gemm.h.");

  m.def(
      "hopper_grouped_gemm",
      [](nb::sequence a, nb::sequence b, nb::sequence d, nb::handle bias,
         bool use_split_accumulator, nb::handle workspace, uintptr_t stream) {
        GroupHandles g("hopper_grouped_gemm", a, b, d, bias);
        size_t ws_size = 0;
        void *ws = workspace_of(g.op, workspace, &ws_size);
        // The kernel takes "TN" groups without accumulation only (hopper_gemm.h).
        const te_gemm_config config{0, 1, 0, use_split_accumulator ? 1 : 0, 0};
        nb::gil_scoped_release release;
        check_status(te_hopper_grouped_gemm(g.a.data(), g.b.data(), g.d.data(), g.bias_or_null(),
                                            g.groups, &config, ws, ws_size, as_stream(stream)));
      },
      "a"_a, "b"_a, "d"_a, nb::kw_only(), "bias"_a = nb::none(),
      "use_split_accumulator"_a = false, "workspace"_a = nb::none(), "stream"_a = 0,
      "D_g = a_g @ b_g^T (+ bias_g) for every group in one launch of the Hopper grouped kernel, "
      "nothing else (the lists of grouped_gemm); workspace: at least "
      "hopper_grouped_gemm_workspace_size(groups) bytes. See the core's hopper_gemm.h.");

  m.def("hopper_grouped_gemm_workspace_size",
        [](size_t groups) { return te_hopper_grouped_gemm_workspace_size(groups); }, "groups"_a,
        "Bytes of CUDA workspace that hopper_grouped_gemm needs for this many groups (0 in a "
        "build without the kernels).");
}

}  // namespace te_binding
