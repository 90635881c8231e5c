// C entry points te_compute_amax, te_compute_scale_from_amax, te_delayed_scaling_update and
// te_delayed_scaling_update_with_amaxes.
#include <cmath>
#include <string>
#include <vector>

#include "common/internal.h"
#include "scaling/scaling_impl.h"
#include "transformer_engine/quantize.h"
#include "transformer_engine/scaling.h"

namespace te {
namespace {

bool check_fp32_buffer(Checker &check, const te_tensor *t, const std::string &what, int64_t n,
                       const te_buffer **out) {
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  if (!check.present(b, what.c_str()) || !check.same_device(*b, what.c_str()) ||
      !check.dtype_is(*b, what.c_str(), TE_DTYPE_FLOAT32)) {
    return false;
  }
  if (n >= 0 && !check.numel_is(*b, what.c_str(), n)) return false;
  *out = b;
  return true;
}

// The FP8 dtype of a quantized tensor: that of its data, else of its column-wise data.
bool fp8_dtype_of(Checker &check, const te_tensor *t, te_dtype *dtype) {
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  if (b == nullptr) b = slot(t, TE_SLOT_COLUMNWISE_DATA);
  if (b == nullptr) {
    return check.fail(TE_ERROR_VALUE, "tensor.data or tensor.columnwise_data must be set (it gives the FP8 format), got neither");
  }
  if (!check.dtype_in(*b, b == slot(t, TE_SLOT_DATA) ? "tensor.data" : "tensor.columnwise_data",
                      is_fp8, "float8_e4m3 or float8_e5m2")) {
    return false;
  }
  *dtype = b->dtype;
  return true;
}

// Both delayed-scaling entry points: checks every group (nothing is written on failure), then
// one update of all of them. fp8_dtypes are checked by the callers.
te_status delayed_update(Checker &check, te_tensor *const *amax_histories, te_tensor *const *step_amaxes,
                         te_tensor *const *scales, te_tensor *const *scale_invs, const te_dtype *fp8_dtypes,
                         size_t num_tensors, te_amax_compute_algo algo, int32_t margin, te_stream stream) {
  if (algo != TE_AMAX_COMPUTE_MAX && algo != TE_AMAX_COMPUTE_MOST_RECENT) {
    return check.reject(TE_ERROR_VALUE, "algo must be max (0) or most_recent (1), got " +
                                            std::to_string(static_cast<int>(algo)));
  }
  if (margin < 0 || margin > 126) {
    return check.reject(TE_ERROR_VALUE, "margin must be in [0, 126], got " + std::to_string(margin));
  }
  if (num_tensors > 0 && (amax_histories == nullptr || scales == nullptr || scale_invs == nullptr)) {
    return check.reject(TE_ERROR_VALUE, "amax_histories, scales and scale_invs must be arrays, got NULL");
  }
  std::vector<DelayedScalingGroup> groups(num_tensors);
  std::vector<Checker::Named> written;  // every history, scale and scale_inv
  std::vector<Checker::Named> read;     // every step amax
  for (size_t i = 0; i < num_tensors; ++i) {
    const std::string idx = "[" + std::to_string(i) + "]";
    if (!check.handle(amax_histories[i], ("amax_histories" + idx).c_str()) ||
        !check.handle(scales[i], ("scales" + idx).c_str()) ||
        !check.handle(scale_invs[i], ("scale_invs" + idx).c_str()) ||
        (step_amaxes != nullptr && !check.handle(step_amaxes[i], ("step_amaxes" + idx).c_str()))) {
      return check.status();
    }
    const te_buffer *h = nullptr, *s = nullptr, *si = nullptr, *a = nullptr;
    const std::string hname = "amax_histories" + idx;
    if (!check_fp32_buffer(check, amax_histories[i], hname, -1, &h)) return check.status();
    if (h->ndim != 1 && h->ndim != 2) {
      return check.reject(TE_ERROR_VALUE, hname + " must have shape [H] or [H, n], got " + describe(*h));
    }
    if (h->shape[0] < 1) {
      return check.reject(TE_ERROR_VALUE, hname + " must have a history length H >= 1, got " + describe(*h));
    }
    const int64_t n = h->ndim == 2 ? h->shape[1] : 1;
    if (!check_fp32_buffer(check, scales[i], "scales" + idx, n, &s) ||
        !check_fp32_buffer(check, scale_invs[i], "scale_invs" + idx, n, &si) ||
        (step_amaxes != nullptr && !check_fp32_buffer(check, step_amaxes[i], "step_amaxes" + idx, n, &a))) {
      return check.status();
    }
    written.push_back({h, hname});
    written.push_back({s, "scales" + idx});
    written.push_back({si, "scale_invs" + idx});
    if (a != nullptr) read.push_back({a, "step_amaxes" + idx});
    groups[i] = DelayedScalingGroup{static_cast<float *>(h->data), h->shape[0], n,
                                    static_cast<float *>(s->data), static_cast<float *>(si->data),
                                    fp8_max(fp8_dtypes[i]),
                                    a != nullptr ? static_cast<const float *>(a->data) : nullptr};
  }
  if (!check.disjoint(written, read)) return check.status();
  if (num_tensors == 0) return TE_SUCCESS;
  DelayedScalingArgs args{groups.data(), groups.size(), algo, margin};
  if (check.device() == TE_DEVICE_CUDA) {
    CudaDeviceScope on_device(check.device_id());
    return delayed_scaling_update_cuda(args, stream);
  }
  delayed_scaling_update_ref(args);
  return TE_SUCCESS;
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_compute_amax(const te_tensor *input, te_tensor *output, te_stream stream) {
  return te::guarded("compute_amax", [&]() -> te_status {
    te::Checker check("compute_amax");
    if (!check.handle(input, "input") || !check.handle(output, "output")) return check.status();
    const te_buffer *in = te::slot(input, TE_SLOT_DATA);
    if (!check.present(in, "input.data") || !check.same_device(*in, "input.data") ||
        !check.dtype_in(*in, "input.data", te::is_high_precision, "float32, float16 or bfloat16")) {
      return check.status();
    }
    const te_buffer *amax = te::slot(output, TE_SLOT_AMAX);
    if (!check.fp32_scalar(amax, "output.amax")) return check.status();
    if (!check.disjoint({{amax, "output.amax"}}, {{in, "input.data"}})) return check.status();
    const float *gate = nullptr;
    if (!check.gate_of(output, "output", true, false, false, &gate)) return check.status();
    te::AmaxArgs args{in->data, in->dtype, te::numel(*in), static_cast<float *>(amax->data), gate};
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::compute_amax_cuda(args, stream);
    }
    if (te::gate_shut_on_cpu(gate, args.amax)) return TE_SUCCESS;
    te::compute_amax_ref(args);
    return TE_SUCCESS;
  });
}

te_status te_compute_scale_from_amax(te_tensor *tensor, const te_quantize_config *config,
                                     te_stream stream) {
  return te::guarded("compute_scale_from_amax", [&]() -> te_status {
    te::Checker check("compute_scale_from_amax");
    te_dtype fp8 = TE_DTYPE_FLOAT8_E4M3;
    if (!check.handle(tensor, "tensor") || !te::fp8_dtype_of(check, tensor, &fp8)) return check.status();
    if (tensor->scaling_mode != TE_SCALING_TENSOR) {
      return check.reject(TE_ERROR_VALUE, std::string("tensor scaling mode must be tensor, got ") +
                                              te::scaling_mode_name(tensor->scaling_mode));
    }
    const te_buffer *amax = te::slot(tensor, TE_SLOT_AMAX);
    const te_buffer *scale = te::slot(tensor, TE_SLOT_SCALE);
    const te_buffer *scale_inv = te::slot(tensor, TE_SLOT_SCALE_INV);
    if (!check.fp32_scalar(amax, "tensor.amax") ||
        !check.fp32_scalar(scale, "tensor.scale") ||
        !check.fp32_scalar(scale_inv, "tensor.scale_inv")) {
      return check.status();
    }
    if (!check.disjoint({{scale, "tensor.scale"}, {scale_inv, "tensor.scale_inv"}},
                        {{amax, "tensor.amax"}})) {
      return check.status();
    }
    te::ScaleFromAmaxArgs args{static_cast<const float *>(amax->data), static_cast<float *>(scale->data),
                               static_cast<float *>(scale_inv->data), te::fp8_max(fp8), 0.0f, false};
    if (config != nullptr) {
      if (!(config->amax_epsilon >= 0.0f) || !std::isfinite(config->amax_epsilon)) {
        return check.reject(TE_ERROR_VALUE, "config.amax_epsilon must be finite and >= 0, got " +
                                                std::to_string(config->amax_epsilon));
      }
      args.epsilon = config->amax_epsilon;
      args.pow2 = config->force_pow2_scales != 0;
    }
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::scale_from_amax_cuda(args, stream);
    }
    te::scale_from_amax_ref(args);
    return TE_SUCCESS;
  });
}

te_status te_delayed_scaling_update(te_tensor *const *amax_histories, te_tensor *const *scales,
                                    te_tensor *const *scale_invs, size_t num_tensors,
                                    te_dtype fp8_dtype, te_amax_compute_algo algo, int32_t margin,
                                    te_stream stream) {
  return te::guarded("delayed_scaling_update", [&]() -> te_status {
    te::Checker check("delayed_scaling_update");
    if (!te::is_fp8(fp8_dtype)) {
      return check.reject(TE_ERROR_TYPE, std::string("fp8_dtype must be float8_e4m3 or float8_e5m2, got ") +
                                    te_dtype_name(fp8_dtype));
    }
    const std::vector<te_dtype> dtypes(num_tensors, fp8_dtype);
    return te::delayed_update(check, amax_histories, nullptr, scales, scale_invs, dtypes.data(),
                              num_tensors, algo, margin, stream);
  });
}

te_status te_delayed_scaling_update_with_amaxes(te_tensor *const *amax_histories,
                                                te_tensor *const *step_amaxes,
                                                te_tensor *const *scales, te_tensor *const *scale_invs,
                                                const te_dtype *fp8_dtypes, size_t num_tensors,
                                                te_amax_compute_algo algo, int32_t margin,
                                                te_stream stream) {
  return te::guarded("delayed_scaling_update_with_amaxes", [&]() -> te_status {
    te::Checker check("delayed_scaling_update_with_amaxes");
    if (num_tensors > 0 && fp8_dtypes == nullptr) {
      return check.reject(TE_ERROR_VALUE, "fp8_dtypes must be an array, got NULL");
    }
    for (size_t i = 0; i < num_tensors; ++i) {
      if (!te::is_fp8(fp8_dtypes[i])) {
        return check.reject(TE_ERROR_TYPE, "fp8_dtypes[" + std::to_string(i) +
                                               "] must be float8_e4m3 or float8_e5m2, got " +
                                               te_dtype_name(fp8_dtypes[i]));
      }
    }
    return te::delayed_update(check, amax_histories, step_amaxes, scales, scale_invs, fp8_dtypes,
                              num_tensors, algo, margin, stream);
  });
}

}  // extern "C"
