// C entry points te_activation_forward and te_activation_backward: validate every argument,
// then dispatch to the CPU reference or the CUDA kernels by the device of the buffers.
#include <cmath>
#include <string>

#include "activation/activation_impl.h"
#include "common/internal.h"
#include "transformer_engine/activation.h"

namespace te {
namespace {

const char *const kActivationNames[TE_ACTIVATION_COUNT] = {
    "identity", "gelu", "relu", "silu", "qgelu", "srelu", "geglu", "swiglu", "reglu",
    "qgeglu", "sreglu", "glu", "clamped_swiglu"};

bool check_act(Checker &check, te_activation act) {
  if (static_cast<unsigned>(act) < TE_ACTIVATION_COUNT) return true;
  return check.fail(TE_ERROR_VALUE, "act must be a te_activation in [0, " +
                                        std::to_string(TE_ACTIVATION_COUNT) + "), got " +
                                        std::to_string(static_cast<int>(act)));
}

// The parameters of act: present and in range where act takes them (activation.h).
bool check_params(Checker &check, te_activation act, const te_activation_params *params,
                  ActivationArgs *args) {
  if (te_activation_has_params(act) == 0) return true;
  const std::string name = kActivationNames[act];
  if (params == nullptr) return check.fail(TE_ERROR_VALUE, "params must be set for " + name + ", got NULL");
  auto positive = [&](float v, const char *field) {
    if (std::isfinite(v) && v > 0.0f) return true;
    return check.fail(TE_ERROR_VALUE, std::string("params.") + field + " must be finite and > 0 for " + name +
                                          ", got " + std::to_string(v));
  };
  if (!positive(params->limit, "limit") || !positive(params->alpha, "alpha")) return false;
  if (!std::isfinite(params->linear_offset)) {
    return check.fail(TE_ERROR_VALUE, "params.linear_offset must be finite for " + name + ", got " +
                                          std::to_string(params->linear_offset));
  }
  args->params = act::make_params(act, params);
  return true;
}

// The high-precision DATA of an input handle, on the call's device.
const te_buffer *check_hp_input(Checker &check, const te_tensor *t, const char *name,
                                const char *what) {
  if (!check.handle(t, name)) return nullptr;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  if (!check.present(b, what) || !check.same_device(*b, what) ||
      !check.dtype_in(*b, what, is_high_precision, "float32, float16 or bfloat16")) {
    return nullptr;
  }
  return b;
}

// The output (forward) or grad_input (backward): high-precision DATA [rows, cols], or FP8
// DATA and/or COLUMNWISE_DATA [cols, rows] with SCALE and SCALE_INV; AMAX optional.
bool check_output(Checker &check, te_tensor *out, const char *name, int64_t rows, int64_t cols,
                  ActivationArgs *args) {
  if (!check.handle(out, name)) return false;
  const std::string n(name);
  const te_buffer *row = slot(out, TE_SLOT_DATA);
  const te_buffer *col = slot(out, TE_SLOT_COLUMNWISE_DATA);
  if (row == nullptr && col == nullptr) {
    // Neither: an amax-only call (the first pass of current scaling), computed in high
    // precision and written nowhere else.
    const te_buffer *amax = slot(out, TE_SLOT_AMAX);
    if (amax == nullptr) {
      return check.fail(TE_ERROR_VALUE, n + ".data, " + n + ".columnwise_data or " + n +
                                            ".amax must be set, got none");
    }
    const std::string a = n + ".amax";
    if (!check.fp32_scalar(amax, a.c_str())) return false;
    args->out_dtype = args->in_dtype;
    args->amax = static_cast<float *>(amax->data);
    return true;
  }
  if (out->scaling_mode != TE_SCALING_TENSOR) {
    return check.fail(TE_ERROR_UNSUPPORTED, n + " must have scaling mode tensor, got " +
                                                scaling_mode_name(out->scaling_mode));
  }
  if (row != nullptr) {
    const std::string what = n + ".data";
    if (!check.same_device(*row, what.c_str())) return false;
    if (!is_high_precision(row->dtype) && !is_fp8(row->dtype)) {
      return check.fail(TE_ERROR_TYPE, what + " must be float32, float16, bfloat16, float8_e4m3 or "
                                              "float8_e5m2, got " + describe(*row));
    }
    if (!check.matrix_is(*row, what.c_str(), rows, cols)) return false;
    args->out = row->data;
    args->out_dtype = row->dtype;
    if (is_high_precision(row->dtype) && col != nullptr) {
      return check.fail(TE_ERROR_VALUE, n + ".columnwise_data must be unset when " + what +
                                            " is high precision (" + te_dtype_name(row->dtype) +
                                            "), got " + describe(*col));
    }
  }
  if (col != nullptr) {
    const std::string what = n + ".columnwise_data";
    if (!check.same_device(*col, what.c_str()) ||
        !check.dtype_in(*col, what.c_str(), is_fp8, "float8_e4m3 or float8_e5m2")) {
      return false;
    }
    if (row != nullptr && col->dtype != row->dtype) {
      return check.fail(TE_ERROR_TYPE, what + " must have the dtype of " + n + ".data (" +
                                           te_dtype_name(row->dtype) + "), got " + describe(*col));
    }
    if (col->ndim < 1 || col->shape[0] != cols || numel(*col) != rows * cols) {
      return check.fail(TE_ERROR_VALUE, what + " must be the transpose, shape [" + std::to_string(cols) +
                                            ", " + std::to_string(rows) + "], got " + describe(*col));
    }
    args->out_t = static_cast<uint8_t *>(col->data);
    args->out_dtype = col->dtype;
  }
  if (args->fp8_out()) {
    const std::string s = n + ".scale", si = n + ".scale_inv";
    const te_buffer *scale = slot(out, TE_SLOT_SCALE);
    const te_buffer *scale_inv = slot(out, TE_SLOT_SCALE_INV);
    if (!check.fp32_scalar(scale, s.c_str()) || !check.fp32_scalar(scale_inv, si.c_str())) return false;
    args->scale = static_cast<const float *>(scale->data);
    args->scale_inv = static_cast<float *>(scale_inv->data);
  }
  const te_buffer *amax = slot(out, TE_SLOT_AMAX);
  if (amax != nullptr) {
    const std::string a = n + ".amax";
    if (!check.fp32_scalar(amax, a.c_str())) return false;
    args->amax = static_cast<float *>(amax->data);
  }
  return true;
}

// The gate of the output handle (tensor.h), once the call's other outputs are known.
bool check_gate(Checker &check, const te_tensor *out, const std::string &n, ActivationArgs *args) {
  return check.gate_of(out, n.c_str(), args->amax != nullptr, args->accumulate_amax,
                       args->out_t != nullptr || args->dbias != nullptr, &args->gate);
}

// The written buffers of the output handle, for the overlap check.
std::vector<Checker::Named> written(const te_tensor *out, const std::string &n, bool fp8) {
  return {{slot(out, TE_SLOT_DATA), n + ".data"},
          {slot(out, TE_SLOT_COLUMNWISE_DATA), n + ".columnwise_data"},
          {fp8 ? slot(out, TE_SLOT_SCALE_INV) : nullptr, n + ".scale_inv"},
          {slot(out, TE_SLOT_AMAX), n + ".amax"}};
}

bool check_forward(Checker &check, te_activation act, const te_activation_params *params,
                   const te_tensor *input, te_tensor *output, ActivationArgs *args) {
  *args = ActivationArgs{};
  if (!check_act(check, act) || !check_params(check, act, params, args)) return false;
  const te_buffer *in = check_hp_input(check, input, "input", "input.data");
  if (in == nullptr) return false;
  args->act = act;
  args->gated = te_activation_is_gated(act) != 0;
  args->rows = rows_of(*in);
  const int64_t k = cols_of(*in);
  if (args->gated && k % 2 != 0) {
    return check.fail(TE_ERROR_VALUE, std::string("input.data must have an even last dimension [a, b] for ") +
                                          kActivationNames[act] + ", got " + describe(*in));
  }
  args->n = args->gated ? k / 2 : k;
  args->in_dtype = in->dtype;
  args->input = in->data;
  if (!check_output(check, output, "output", args->rows, args->n, args)) return false;
  return check.disjoint(written(output, "output", args->fp8_out()),
                        {{in, "input.data"}, {args->fp8_out() ? slot(output, TE_SLOT_SCALE) : nullptr, "output.scale"}});
}

bool check_backward(Checker &check, te_activation act, const te_activation_params *params,
                    const te_tensor *grad_output, const te_tensor *input, te_tensor *grad_input,
                    te_tensor *dbias, ActivationArgs *args) {
  *args = ActivationArgs{};
  if (!check_act(check, act) || !check_params(check, act, params, args)) return false;
  const te_buffer *g = check_hp_input(check, grad_output, "grad_output", "grad_output.data");
  if (g == nullptr) return false;
  args->act = act;
  args->backward = true;
  args->gated = te_activation_is_gated(act) != 0;
  args->rows = rows_of(*g);
  args->n = cols_of(*g);
  args->in_dtype = g->dtype;
  args->grad_output = g->data;
  const te_buffer *in = nullptr;
  if (input != nullptr || act != TE_ACTIVATION_IDENTITY) {
    in = check_hp_input(check, input, "input", "input.data");
    if (in == nullptr || !check.dtype_is(*in, "input.data", g->dtype) ||
        !check.matrix_is(*in, "input.data", args->rows, args->in_cols())) {
      return false;
    }
    args->input = act == TE_ACTIVATION_IDENTITY ? nullptr : in->data;
  }
  const int64_t k = args->out_cols();
  if (!check_output(check, grad_input, "grad_input", args->rows, k, args)) return false;
  const te_buffer *db = nullptr;
  if (dbias != nullptr) {
    db = slot(dbias, TE_SLOT_DATA);
    if (!check.present(db, "dbias.data") || !check.same_device(*db, "dbias.data") ||
        !check.dtype_in(*db, "dbias.data", is_high_precision, "float32, float16 or bfloat16")) {
      return false;
    }
    if (db->ndim != 1 || db->shape[0] != k) {
      return check.fail(TE_ERROR_VALUE, "dbias.data must have shape [" + std::to_string(k) + "], got " +
                                            describe(*db));
    }
    args->dbias = db->data;
    args->dbias_dtype = db->dtype;
  }
  std::vector<Checker::Named> outs = written(grad_input, "grad_input", args->fp8_out());
  outs.push_back({db, "dbias.data"});
  return check.disjoint(outs, {{g, "grad_output.data"},
                               {in, "input.data"},
                               {args->fp8_out() ? slot(grad_input, TE_SLOT_SCALE) : nullptr, "grad_input.scale"}});
}

te_status run(const Checker &check, const ActivationArgs &args, te_stream stream) {
  if (check.device() == TE_DEVICE_CUDA) {
    CudaDeviceScope on_device(check.device_id());
    return activation_cuda(args, stream);
  }
  if (gate_shut_on_cpu(args.gate, args.amax)) return TE_SUCCESS;
  activation_ref(args);
  return TE_SUCCESS;
}

}  // namespace
}  // namespace te

extern "C" {

int te_activation_is_gated(te_activation act) {
  return act == TE_ACTIVATION_GEGLU || act == TE_ACTIVATION_SWIGLU || act == TE_ACTIVATION_REGLU ||
         act == TE_ACTIVATION_QGEGLU || act == TE_ACTIVATION_SREGLU || act == TE_ACTIVATION_GLU ||
         act == TE_ACTIVATION_CLAMPED_SWIGLU;
}

int te_activation_has_params(te_activation act) { return act == TE_ACTIVATION_CLAMPED_SWIGLU; }

te_status te_activation_forward(te_activation act, const te_activation_params *params,
                                const te_tensor *input, te_tensor *output,
                                int32_t accumulate_amax, te_stream stream) {
  return te::guarded("activation_forward", [&]() -> te_status {
    te::Checker check("activation_forward");
    te::ActivationArgs args;
    if (!te::check_forward(check, act, params, input, output, &args)) return check.status();
    args.accumulate_amax = accumulate_amax != 0;
    if (!te::check_gate(check, output, "output", &args)) return check.status();
    return te::run(check, args, stream);
  });
}

te_status te_activation_backward(te_activation act, const te_activation_params *params,
                                 const te_tensor *grad_output, const te_tensor *input,
                                 te_tensor *grad_input, te_tensor *dbias,
                                 int32_t accumulate_amax, te_stream stream) {
  return te::guarded("activation_backward", [&]() -> te_status {
    te::Checker check("activation_backward");
    te::ActivationArgs args;
    if (!te::check_backward(check, act, params, grad_output, input, grad_input, dbias, &args)) {
      return check.status();
    }
    args.accumulate_amax = accumulate_amax != 0;
    if (!te::check_gate(check, grad_input, "grad_input", &args)) return check.status();
    return te::run(check, args, stream);
  });
}

}  // extern "C"
