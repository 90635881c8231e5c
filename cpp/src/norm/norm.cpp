// C entry points te_norm_forward and te_norm_backward: validate every argument against norm.h,
// then dispatch to the CPU reference or the CUDA kernels by the device of the buffers.
#include <cmath>
#include <string>

#include "common/internal.h"
#include "norm/norm_impl.h"
#include "transformer_engine/norm.h"

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool check_config(Checker &check, const te_norm_config *config) {
  if (config == nullptr) return check.fail(TE_ERROR_VALUE, "config must be a pointer, got NULL");
  if (config->type != TE_NORM_LAYERNORM && config->type != TE_NORM_RMSNORM) {
    return check.fail(TE_ERROR_VALUE, "config.type must be TE_NORM_LAYERNORM or TE_NORM_RMSNORM, got " +
                                          num(static_cast<int>(config->type)));
  }
  if (!(config->eps >= 0.0f) || !std::isfinite(config->eps)) {
    return check.fail(TE_ERROR_VALUE, "config.eps must be finite and >= 0, got " + std::to_string(config->eps));
  }
  return true;
}

// A [n] vector slot (gamma, beta, grads) in dtype `dtype`, or the input's dtype or fp32 when
// dtype is TE_DTYPE_COUNT.
bool check_vector(Checker &check, const te_tensor *t, const char *what, int64_t n, te_dtype input_dtype,
                  te_dtype *dtype) {
  if (!check.handle(t, what)) return false;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  const std::string name = std::string(what) + ".data";
  if (!check.present(b, name.c_str()) || !check.same_device(*b, name.c_str())) return false;
  if (*dtype == TE_DTYPE_COUNT) {
    if (b->dtype != input_dtype && b->dtype != TE_DTYPE_FLOAT32) {
      return check.fail(TE_ERROR_TYPE, name + " must be " + te_dtype_name(input_dtype) +
                                           " (the input's dtype) or float32, got " + describe(*b));
    }
    *dtype = b->dtype;
  } else if (!check.dtype_is(*b, name.c_str(), *dtype)) {
    return false;
  }
  if (b->ndim != 1 || b->shape[0] != n) {
    return check.fail(TE_ERROR_VALUE, name + " must have shape [" + num(n) + "], got " + describe(*b));
  }
  return true;
}

// mu / rsigma: [rows] fp32.
bool check_stats(Checker &check, const te_tensor *t, const char *what, int64_t rows) {
  if (!check.handle(t, what)) return false;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  const std::string name = std::string(what) + ".data";
  return check.present(b, name.c_str()) && check.same_device(*b, name.c_str()) &&
         check.dtype_is(*b, name.c_str(), TE_DTYPE_FLOAT32) && check.numel_is(*b, name.c_str(), rows);
}

// Present only for LayerNorm.
bool check_layernorm_only(Checker &check, const void *t, const char *what, bool layernorm) {
  if (layernorm || t == nullptr) return true;
  return check.fail(TE_ERROR_VALUE, std::string(what) + " must be NULL for RMSNorm, got a tensor");
}

bool check_forward(Checker &check, const te_norm_config *config, const te_tensor *input,
                   const te_tensor *gamma, const te_tensor *beta, te_tensor *output, te_tensor *output_fp8,
                   te_tensor *mu, te_tensor *rsigma, NormForwardArgs *a) {
  if (!check_config(check, config) || !check.handle(input, "input")) return false;
  const bool ln = config->type == TE_NORM_LAYERNORM;
  const te_buffer *in = slot(input, TE_SLOT_DATA);
  if (!check.present(in, "input.data") || !check.same_device(*in, "input.data") ||
      !check.dtype_in(*in, "input.data", is_high_precision, "float32, float16 or bfloat16")) {
    return false;
  }
  if (in->ndim < 1) return check.fail(TE_ERROR_VALUE, "input.data must have at least 1 dimension, got a scalar");
  *a = NormForwardArgs{};
  a->type = config->type;
  a->eps = config->eps;
  a->zero_centered = config->zero_centered_gamma != 0;
  a->input = in->data;
  a->input_dtype = in->dtype;
  a->rows = rows_of(*in);
  a->cols = cols_of(*in);
  if (a->cols == 0 && a->rows > 0) {
    return check.fail(TE_ERROR_VALUE, "input.data must have a non-empty last dimension (the one "
                                      "normalized over), got " + describe(*in));
  }
  a->weight_dtype = TE_DTYPE_COUNT;
  if (!check_vector(check, gamma, "gamma", a->cols, in->dtype, &a->weight_dtype)) return false;
  a->gamma = slot(gamma, TE_SLOT_DATA)->data;
  if (ln) {
    if (!check_vector(check, beta, "beta", a->cols, in->dtype, &a->weight_dtype)) return false;
    a->beta = slot(beta, TE_SLOT_DATA)->data;
  } else if (!check_layernorm_only(check, beta, "beta", ln)) {
    return false;
  }
  if (output == nullptr && output_fp8 == nullptr) {
    return check.fail(TE_ERROR_VALUE, "output or output_fp8 must be given, got neither");
  }
  const te_buffer *out = nullptr, *q = nullptr, *qt = nullptr, *scale = nullptr, *sinv = nullptr,
                  *amax = nullptr;
  if (output != nullptr) {
    out = slot(output, TE_SLOT_DATA);
    if (!check.present(out, "output.data") || !check.same_device(*out, "output.data") ||
        !check.dtype_in(*out, "output.data", is_high_precision, "float32, float16 or bfloat16") ||
        !check.matrix_is(*out, "output.data", a->rows, a->cols)) {
      return false;
    }
    a->output = out->data;
    a->output_dtype = out->dtype;
  }
  if (output_fp8 != nullptr) {
    if (output_fp8->scaling_mode != TE_SCALING_TENSOR) {
      return check.fail(TE_ERROR_VALUE, std::string("output_fp8 must have tensor (per-tensor) scaling, got ") +
                                            scaling_mode_name(output_fp8->scaling_mode));
    }
    q = slot(output_fp8, TE_SLOT_DATA);
    qt = slot(output_fp8, TE_SLOT_COLUMNWISE_DATA);
    if (!check.present(q, "output_fp8.data") || !check.same_device(*q, "output_fp8.data") ||
        !check.dtype_in(*q, "output_fp8.data", is_fp8, "float8_e4m3 or float8_e5m2") ||
        !check.matrix_is(*q, "output_fp8.data", a->rows, a->cols)) {
      return false;
    }
    if (qt != nullptr) {
      if (!check.same_device(*qt, "output_fp8.columnwise_data") ||
          !check.dtype_is(*qt, "output_fp8.columnwise_data", q->dtype) ||
          !check.matrix_is(*qt, "output_fp8.columnwise_data", a->cols, a->rows)) {
        return false;
      }
      a->fp8_transpose = static_cast<uint8_t *>(qt->data);
    }
    scale = slot(output_fp8, TE_SLOT_SCALE);
    sinv = slot(output_fp8, TE_SLOT_SCALE_INV);
    amax = slot(output_fp8, TE_SLOT_AMAX);
    if (!check.fp32_scalar(scale, "output_fp8.scale") || !check.fp32_scalar(sinv, "output_fp8.scale_inv") ||
        (amax != nullptr && !check.fp32_scalar(amax, "output_fp8.amax"))) {
      return false;
    }
    a->has_fp8 = true;
    a->fp8 = static_cast<uint8_t *>(q->data);
    a->fp8_dtype = q->dtype;
    a->scale = static_cast<const float *>(scale->data);
    a->scale_inv = static_cast<float *>(sinv->data);
    a->amax = amax != nullptr ? static_cast<float *>(amax->data) : nullptr;
    a->accumulate_amax = config->accumulate_amax != 0;
    if (!check.gate_of(output_fp8, "output_fp8", amax != nullptr, a->accumulate_amax,
                       qt != nullptr || out != nullptr, &a->gate)) {
      return false;
    }
  }
  if (ln) {
    if (!check_stats(check, mu, "mu", a->rows)) return false;
    a->mu = static_cast<float *>(slot(mu, TE_SLOT_DATA)->data);
  } else if (!check_layernorm_only(check, mu, "mu", ln)) {
    return false;
  }
  if (!check_stats(check, rsigma, "rsigma", a->rows)) return false;
  a->rsigma = static_cast<float *>(slot(rsigma, TE_SLOT_DATA)->data);
  const te_buffer *mu_b = ln ? slot(mu, TE_SLOT_DATA) : nullptr;
  return check.disjoint({{out, "output.data"},
                         {q, "output_fp8.data"},
                         {qt, "output_fp8.columnwise_data"},
                         {sinv, "output_fp8.scale_inv"},
                         {amax, "output_fp8.amax"},
                         {mu_b, "mu.data"},
                         {slot(rsigma, TE_SLOT_DATA), "rsigma.data"}},
                        {{in, "input.data"},
                         {slot(gamma, TE_SLOT_DATA), "gamma.data"},
                         {ln ? slot(beta, TE_SLOT_DATA) : nullptr, "beta.data"},
                         {scale, "output_fp8.scale"}});
}

bool check_backward(Checker &check, const te_norm_config *config, const te_tensor *grad_output,
                    const te_tensor *input, const te_tensor *mu, const te_tensor *rsigma, const te_tensor *gamma,
                    const te_tensor *grad_input_add, te_tensor *grad_input, te_tensor *grad_gamma,
                    te_tensor *grad_beta, NormBackwardArgs *a) {
  if (!check_config(check, config) || !check.handle(grad_output, "grad_output") ||
      !check.handle(input, "input") || !check.handle(grad_input, "grad_input")) {
    return false;
  }
  const bool ln = config->type == TE_NORM_LAYERNORM;
  const te_buffer *dy = slot(grad_output, TE_SLOT_DATA), *x = slot(input, TE_SLOT_DATA);
  if (!check.present(x, "input.data") || !check.same_device(*x, "input.data") ||
      !check.dtype_in(*x, "input.data", is_high_precision, "float32, float16 or bfloat16")) {
    return false;
  }
  if (x->ndim < 1) return check.fail(TE_ERROR_VALUE, "input.data must have at least 1 dimension, got a scalar");
  *a = NormBackwardArgs{};
  a->type = config->type;
  a->zero_centered = config->zero_centered_gamma != 0;
  a->rows = rows_of(*x);
  a->cols = cols_of(*x);
  if (!check.present(dy, "grad_output.data") || !check.same_device(*dy, "grad_output.data") ||
      !check.dtype_is(*dy, "grad_output.data", x->dtype) ||
      !check.matrix_is(*dy, "grad_output.data", a->rows, a->cols)) {
    return false;
  }
  const te_buffer *dx = slot(grad_input, TE_SLOT_DATA);
  if (!check.present(dx, "grad_input.data") || !check.same_device(*dx, "grad_input.data") ||
      !check.dtype_in(*dx, "grad_input.data", is_high_precision, "float32, float16 or bfloat16") ||
      !check.matrix_is(*dx, "grad_input.data", a->rows, a->cols)) {
    return false;
  }
  const te_buffer *add = nullptr;
  if (grad_input_add != nullptr) {
    if (!check.handle(grad_input_add, "grad_input_add")) return false;
    add = slot(grad_input_add, TE_SLOT_DATA);
    if (!check.present(add, "grad_input_add.data") || !check.same_device(*add, "grad_input_add.data") ||
        !check.dtype_is(*add, "grad_input_add.data", dx->dtype) ||
        !check.matrix_is(*add, "grad_input_add.data", a->rows, a->cols)) {
      return false;
    }
  }
  a->weight_dtype = TE_DTYPE_COUNT;
  if (!check_vector(check, gamma, "gamma", a->cols, x->dtype, &a->weight_dtype) ||
      !check_vector(check, grad_gamma, "grad_gamma", a->cols, x->dtype, &a->weight_dtype)) {
    return false;
  }
  if (ln) {
    if (!check_vector(check, grad_beta, "grad_beta", a->cols, x->dtype, &a->weight_dtype) ||
        !check_stats(check, mu, "mu", a->rows)) {
      return false;
    }
  } else if (!check_layernorm_only(check, grad_beta, "grad_beta", ln) ||
             !check_layernorm_only(check, mu, "mu", ln)) {
    return false;
  }
  if (!check_stats(check, rsigma, "rsigma", a->rows)) return false;
  const te_buffer *gg = slot(grad_gamma, TE_SLOT_DATA);
  const te_buffer *gb = ln ? slot(grad_beta, TE_SLOT_DATA) : nullptr;
  if (!check.disjoint({{dx, "grad_input.data"}, {gg, "grad_gamma.data"}, {gb, "grad_beta.data"}},
                      {{dy, "grad_output.data"},
                       {x, "input.data"},
                       {ln ? slot(mu, TE_SLOT_DATA) : nullptr, "mu.data"},
                       {slot(rsigma, TE_SLOT_DATA), "rsigma.data"},
                       {slot(gamma, TE_SLOT_DATA), "gamma.data"},
                       {add, "grad_input_add.data"}})) {
    return false;
  }
  a->grad_output = dy->data;
  a->grad_add = add != nullptr ? add->data : nullptr;
  a->input = x->data;
  a->input_dtype = x->dtype;
  a->mu = ln ? static_cast<const float *>(slot(mu, TE_SLOT_DATA)->data) : nullptr;
  a->rsigma = static_cast<const float *>(slot(rsigma, TE_SLOT_DATA)->data);
  a->gamma = slot(gamma, TE_SLOT_DATA)->data;
  a->grad_input = dx->data;
  a->grad_input_dtype = dx->dtype;
  a->grad_gamma = gg->data;
  a->grad_beta = gb != nullptr ? gb->data : nullptr;
  return true;
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_norm_forward(const te_norm_config *config, const te_tensor *input, const te_tensor *gamma,
                          const te_tensor *beta, te_tensor *output, te_tensor *output_fp8,
                          te_tensor *mu, te_tensor *rsigma, te_stream stream) {
  return te::guarded("norm_forward", [&]() -> te_status {
    te::Checker check("norm_forward");
    te::NormForwardArgs args;
    if (!te::check_forward(check, config, input, gamma, beta, output, output_fp8, mu, rsigma, &args)) {
      return check.status();
    }
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::norm_forward_cuda(args, stream);
    }
    if (te::gate_shut_on_cpu(args.gate, args.amax)) return TE_SUCCESS;
    te::norm_forward_ref(args);
    return TE_SUCCESS;
  });
}

size_t te_norm_backward_workspace_size(int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) return 0;
  return te::norm_backward_workspace_bytes(rows, cols);
}

te_status te_norm_backward(const te_norm_config *config, const te_tensor *grad_output,
                           const te_tensor *input, const te_tensor *mu, const te_tensor *rsigma,
                           const te_tensor *gamma, const te_tensor *grad_input_add,
                           te_tensor *grad_input, te_tensor *grad_gamma, te_tensor *grad_beta,
                           void *workspace, size_t workspace_size, te_stream stream) {
  return te::guarded("norm_backward", [&]() -> te_status {
    te::Checker check("norm_backward");
    te::NormBackwardArgs args;
    if (!te::check_backward(check, config, grad_output, input, mu, rsigma, gamma, grad_input_add, grad_input,
                            grad_gamma, grad_beta, &args)) {
      return check.status();
    }
    args.workspace = workspace;
    args.workspace_size = workspace != nullptr ? workspace_size : 0;
    if (check.device() == TE_DEVICE_CUDA) {
      const size_t need = te::norm_backward_workspace_bytes(args.rows, args.cols);
      if (args.workspace_size < need) {
        return check.reject(TE_ERROR_VALUE, "workspace must have at least " + std::to_string(need) +
                                                " bytes (te_norm_backward_workspace_size) on CUDA, got " +
                                                std::to_string(args.workspace_size));
      }
      te::CudaDeviceScope on_device(check.device_id());
      return te::norm_backward_cuda(args, stream);
    }
    te::norm_backward_ref(args);
    return TE_SUCCESS;
  });
}

}  // extern "C"
