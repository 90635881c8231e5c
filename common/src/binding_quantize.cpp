// Binding of quantize.h, scaling.h and transpose.h.
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

namespace {

// The handles of a delayed-scaling call's groups: histories, step amaxes (when given), scales
// and scale_invs, one entry each per group (checked here, by name).
struct DelayedGroups {
  std::vector<Handle> owned;
  std::vector<te_tensor *> h, a, s, si;
  DelayedGroups(const char *op, const std::vector<nb::object> &histories,
                const std::vector<nb::object> *step_amaxes, const std::vector<nb::object> &scales,
                const std::vector<nb::object> &scale_invs) {
    const size_t n = histories.size();
    if (scales.size() != n || scale_invs.size() != n || (step_amaxes && step_amaxes->size() != n)) {
      throw nb::value_error((std::string(op) + ": " + (step_amaxes ? "step_amaxes, " : "") +
                             "scales and scale_invs must have one entry per amax history (" + std::to_string(n) +
                             "), got " + (step_amaxes ? std::to_string(step_amaxes->size()) + ", " : "") +
                             std::to_string(scales.size()) + " and " + std::to_string(scale_invs.size()))
                                .c_str());
    }
    auto add = [&](std::vector<te_tensor *> &to, const char *name, const nb::object &o, size_t i, bool writable) {
      owned.push_back(plain_handle(op, std::string(name) + "[" + std::to_string(i) + "]", o, writable));
      to.push_back(owned.back().get());
    };
    owned.reserve(4 * n);
    for (size_t i = 0; i < n; ++i) {
      add(h, "amax_histories", histories[i], i, true);
      if (step_amaxes) add(a, "step_amaxes", (*step_amaxes)[i], i, false);
      add(s, "scales", scales[i], i, true);
      add(si, "scale_invs", scale_invs[i], i, true);
    }
  }
};

}  // namespace

void register_quantize(nb::module_ &m) {
  m.def(
      "quantize",
      [](nb::handle input, nb::handle output, bool force_pow2_scales, float amax_epsilon,
         bool accumulate_amax, uintptr_t stream) {
        Handle in = make_handle("quantize", "input", input, 0);
        Handle out = make_handle("quantize", "output", output, kAllSlots & ~(1u << TE_SLOT_SCALE));
        const te_quantize_config config{force_pow2_scales ? 1 : 0, amax_epsilon, accumulate_amax ? 1 : 0};
        nb::gil_scoped_release release;
        check_status(te_quantize(in.get(), out.get(), &config, as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "force_pow2_scales"_a = false, "amax_epsilon"_a = 0.0f,
      "accumulate_amax"_a = false, "stream"_a = 0,
      "Quantizes input (array or Tensor) into the FP8 Tensor output; with accumulate_amax, "
      "output.amax is raised to max|input| instead of overwritten.");

  m.def(
      "quantize_many",
      [](std::vector<nb::handle> inputs, std::vector<nb::handle> outputs, bool accumulate_amax, uintptr_t stream) {
        if (inputs.size() != outputs.size()) {
          throw nb::value_error(("quantize_many: inputs and outputs must be as many, got " +
                                 std::to_string(inputs.size()) + " and " + std::to_string(outputs.size()))
                                    .c_str());
        }
        std::vector<Handle> ins, outs;
        std::vector<const te_tensor *> in_ptrs;
        std::vector<te_tensor *> out_ptrs;
        for (size_t i = 0; i < inputs.size(); ++i) {
          ins.push_back(make_handle("quantize_many", "input", inputs[i], 0));
          outs.push_back(make_handle("quantize_many", "output", outputs[i], kAllSlots & ~(1u << TE_SLOT_SCALE)));
          in_ptrs.push_back(ins.back().get());
          out_ptrs.push_back(outs.back().get());
        }
        te_quantize_config config{};
        config.accumulate_amax = accumulate_amax ? 1 : 0;
        nb::gil_scoped_release release;
        check_status(te_quantize_many(in_ptrs.data(), out_ptrs.data(), in_ptrs.size(), &config, as_stream(stream)));
      },
      "inputs"_a, "outputs"_a, nb::kw_only(), "accumulate_amax"_a = false, "stream"_a = 0,
      "quantize(inputs[i], outputs[i]) for every i as one batch (one kernel launch for the CUDA "
      "casts with a transposed copy that share dtypes); all checked before any runs.");

  m.def(
      "dequantize",
      [](nb::handle input, nb::handle output, uintptr_t stream) {
        Handle in = make_handle("dequantize", "input", input, 0);
        Handle out = make_handle("dequantize", "output", output, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_dequantize(in.get(), out.get(), as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "stream"_a = 0,
      "Dequantizes the FP8 Tensor input into output (array or Tensor).");

  m.def(
      "compute_amax",
      [](nb::handle input, nb::handle output, uintptr_t stream) {
        Handle in = make_handle("compute_amax", "input", input, 0);
        Handle out = make_handle("compute_amax", "output", output, 1u << TE_SLOT_AMAX);
        nb::gil_scoped_release release;
        check_status(te_compute_amax(in.get(), out.get(), as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "stream"_a = 0,
      "Writes max|input| into output.amax.");

  m.def(
      "compute_scale_from_amax",
      [](nb::handle tensor, bool force_pow2_scales, float amax_epsilon, uintptr_t stream) {
        Handle t = make_handle("compute_scale_from_amax", "tensor", tensor,
                               (1u << TE_SLOT_SCALE) | (1u << TE_SLOT_SCALE_INV));
        const te_quantize_config config{force_pow2_scales ? 1 : 0, amax_epsilon, 0};
        nb::gil_scoped_release release;
        check_status(te_compute_scale_from_amax(t.get(), &config, as_stream(stream)));
      },
      "tensor"_a, nb::kw_only(), "force_pow2_scales"_a = false, "amax_epsilon"_a = 0.0f,
      "stream"_a = 0, "Current scaling: tensor.scale and tensor.scale_inv from tensor.amax.");

  m.def(
      "transpose",
      [](nb::handle input, nb::handle output, uintptr_t stream) {
        Handle in = make_handle("transpose", "input", input, 0);
        Handle out = make_handle("transpose", "output", output, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_transpose(in.get(), out.get(), as_stream(stream)));
      },
      "input"_a, "output"_a, nb::kw_only(), "stream"_a = 0,
      "Writes the transpose of input ([M, K] view) into output ([K, M]).");

  m.def(
      "delayed_scaling_update",
      [](const std::vector<nb::object> &amax_histories, const std::vector<nb::object> &scales,
         const std::vector<nb::object> &scale_invs, te_dtype fp8_dtype, te_amax_compute_algo algo,
         int32_t margin, uintptr_t stream) {
        DelayedGroups g("delayed_scaling_update", amax_histories, nullptr, scales, scale_invs);
        nb::gil_scoped_release release;
        check_status(te_delayed_scaling_update(g.h.data(), g.s.data(), g.si.data(), g.h.size(), fp8_dtype,
                                               algo, margin, as_stream(stream)));
      },
      "amax_histories"_a, "scales"_a, "scale_invs"_a, nb::kw_only(), "fp8_dtype"_a,
      "algo"_a = TE_AMAX_COMPUTE_MAX, "margin"_a = 0, "stream"_a = 0,
      "Delayed scaling: updates the scales of many amax histories in one call.");

  m.def(
      "delayed_scaling_update_with_amaxes",
      [](const std::vector<nb::object> &amax_histories, const std::vector<nb::object> &step_amaxes,
         const std::vector<nb::object> &scales, const std::vector<nb::object> &scale_invs,
         const std::vector<te_dtype> &fp8_dtypes, te_amax_compute_algo algo, int32_t margin,
         uintptr_t stream) {
        const char *op = "delayed_scaling_update_with_amaxes";
        DelayedGroups g(op, amax_histories, &step_amaxes, scales, scale_invs);
        if (fp8_dtypes.size() != amax_histories.size()) {
          throw nb::value_error((std::string(op) + ": fp8_dtypes must have one entry per amax history (" +
                                 std::to_string(amax_histories.size()) + "), got " +
                                 std::to_string(fp8_dtypes.size()))
                                    .c_str());
        }
        nb::gil_scoped_release release;
        check_status(te_delayed_scaling_update_with_amaxes(g.h.data(), g.a.data(), g.s.data(), g.si.data(),
                                                           fp8_dtypes.data(), g.h.size(), algo, margin,
                                                           as_stream(stream)));
      },
      "amax_histories"_a, "step_amaxes"_a, "scales"_a, "scale_invs"_a, nb::kw_only(), "fp8_dtypes"_a,
      "algo"_a = TE_AMAX_COMPUTE_MAX, "margin"_a = 0, "stream"_a = 0,
      "Delayed scaling of histories of several FP8 formats, each first recording its step's amax "
      "into slot 0 (max, NaN kept): one call.");
}

}  // namespace te_binding
