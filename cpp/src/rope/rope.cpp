// C entry points te_rope_forward and te_rope_backward: validate every argument against rope.h,
// then dispatch to the CPU reference or the CUDA kernel by the device of the buffers.
#include <string>

#include "common/internal.h"
#include "rope/rope_impl.h"
#include "transformer_engine/rope.h"

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

// An optional int32 vector of n elements (cu_seqlens, start_positions).
bool check_index_vector(Checker &check, const te_tensor *t, const char *what, int64_t n,
                        const int32_t **data) {
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  const std::string name = std::string(what) + ".data";
  if (!check.present(b, name.c_str()) || !check.same_device(*b, name.c_str()) ||
      !check.dtype_is(*b, name.c_str(), TE_DTYPE_INT32)) {
    return false;
  }
  if (b->ndim != 1 || b->shape[0] != n) {
    return check.fail(TE_ERROR_VALUE, name + " must have shape [" + num(n) + "], got " + describe(*b));
  }
  *data = static_cast<const int32_t *>(b->data);
  return true;
}

// freqs: [P, R] or [P, 1, 1, R] fp32, R even and in (0, dim].
bool check_freqs(Checker &check, const te_tensor *freqs, int64_t dim, RopeArgs *a) {
  if (!check.handle(freqs, "freqs")) return false;
  const te_buffer *f = slot(freqs, TE_SLOT_DATA);
  if (!check.present(f, "freqs.data") || !check.same_device(*f, "freqs.data") ||
      !check.dtype_is(*f, "freqs.data", TE_DTYPE_FLOAT32)) {
    return false;
  }
  const bool matrix = f->ndim == 2, broadcast = f->ndim == 4 && f->shape[1] == 1 && f->shape[2] == 1;
  if (!matrix && !broadcast) {
    return check.fail(TE_ERROR_VALUE, "freqs.data must have shape [P, R] or [P, 1, 1, R], got " + describe(*f));
  }
  a->freq_rows = f->shape[0];
  a->rot = f->shape[f->ndim - 1];
  if (a->rot <= 0 || a->rot % 2 != 0 || a->rot > dim) {
    return check.fail(TE_ERROR_VALUE, "freqs.data's last dimension (the rotated features R) must be even, "
                                      "positive and at most the head dimension " + num(dim) + ", got " +
                                          describe(*f));
  }
  a->freqs = static_cast<const float *>(f->data);
  return true;
}

// The layout of the input (or grad_output) and the shape of its output.
bool check_layout(Checker &check, const te_rope_config *config, const te_buffer *in, const char *in_name,
                  const te_buffer *out, const char *out_name, RopeArgs *a) {
  if (!check.dtype_in(*in, in_name, is_high_precision, "float32, float16 or bfloat16")) return false;
  const bool thd = config->format == TE_ROPE_THD;
  const int rank = thd ? 3 : 4;
  if (in->ndim != rank) {
    return check.fail(TE_ERROR_VALUE, std::string(in_name) + " must have shape " +
                                          (thd ? "[T, H, D]" : config->format == TE_ROPE_SBHD ? "[S, B, H, D]"
                                                                                               : "[B, S, H, D]") +
                                          ", got " + describe(*in));
  }
  if (!check.dtype_is(*out, out_name, in->dtype)) return false;
  bool same_shape = out->ndim == in->ndim;
  for (int d = 0; same_shape && d < in->ndim; ++d) same_shape = out->shape[d] == in->shape[d];
  if (!same_shape) {
    return check.fail(TE_ERROR_VALUE, std::string(out_name) + " must have the shape " +
                                          shape_string(in->shape, in->ndim) + " of " + in_name + ", got " +
                                          describe(*out));
  }
  a->format = config->format;
  a->dtype = in->dtype;
  a->heads = in->shape[rank - 2];
  a->dim = in->shape[rank - 1];
  if (thd) {
    a->tokens = in->shape[0];
  } else {
    a->seq = config->format == TE_ROPE_SBHD ? in->shape[0] : in->shape[1];
    a->batch = config->format == TE_ROPE_SBHD ? in->shape[1] : in->shape[0];
    a->tokens = a->seq * a->batch;
  }
  return true;
}

// The values of cu_seqlens and start_positions, which only the CPU path can read here.
bool check_positions(Checker &check, const RopeArgs &a) {
  if (a.format == TE_ROPE_THD) {
    const int32_t *cu = a.cu_seqlens;
    if (cu[0] != 0) return check.fail(TE_ERROR_VALUE, "cu_seqlens.data[0] must be 0, got " + num(cu[0]));
    for (int64_t b = 0; b < a.batch; ++b) {
      if (cu[b + 1] < cu[b]) {
        return check.fail(TE_ERROR_VALUE, "cu_seqlens.data must not decrease, got " + num(cu[b]) + " then " +
                                              num(cu[b + 1]) + " at index " + num(b));
      }
    }
    if (cu[a.batch] != a.tokens) {
      return check.fail(TE_ERROR_VALUE, "cu_seqlens.data[-1] must be the token count T = " + num(a.tokens) +
                                            ", got " + num(cu[a.batch]));
    }
  }
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t len = a.format == TE_ROPE_THD ? static_cast<int64_t>(a.cu_seqlens[b + 1]) - a.cu_seqlens[b]
                                                : a.seq;
    const int64_t start = a.start_positions != nullptr ? a.start_positions[b] : 0;
    if (len == 0 || a.heads == 0) continue;
    if (start < 0) {
      return check.fail(TE_ERROR_VALUE, "start_positions.data must be >= 0, got " + num(start) + " for sequence " +
                                            num(b));
    }
    if (start + len > a.freq_rows) {
      return check.fail(TE_ERROR_VALUE, "freqs.data must have a row for every position used, up to " +
                                            num(start + len - 1) + " (sequence " + num(b) + "), got " +
                                            num(a.freq_rows) + " rows");
    }
  }
  return true;
}

bool check_call(Checker &check, const te_rope_config *config, const te_tensor *input, const char *in_name,
                const te_tensor *freqs, const te_tensor *cu_seqlens, const te_tensor *start_positions,
                te_tensor *output, const char *out_name, RopeArgs *a) {
  if (config == nullptr) return check.fail(TE_ERROR_VALUE, "config must be a pointer, got NULL");
  if (config->format != TE_ROPE_SBHD && config->format != TE_ROPE_BSHD && config->format != TE_ROPE_THD) {
    return check.fail(TE_ERROR_VALUE, "config.format must be TE_ROPE_SBHD, TE_ROPE_BSHD or TE_ROPE_THD, got " +
                                          num(static_cast<int>(config->format)));
  }
  if (!check.handle(input, in_name) || !check.handle(output, out_name)) return false;
  const std::string in_data = std::string(in_name) + ".data", out_data = std::string(out_name) + ".data";
  const te_buffer *in = slot(input, TE_SLOT_DATA), *out = slot(output, TE_SLOT_DATA);
  if (!check.present(in, in_data.c_str()) || !check.same_device(*in, in_data.c_str()) ||
      !check.present(out, out_data.c_str()) || !check.same_device(*out, out_data.c_str())) {
    return false;
  }
  *a = RopeArgs{};
  a->interleaved = config->interleaved != 0;
  if (!check_layout(check, config, in, in_data.c_str(), out, out_data.c_str(), a) ||
      !check_freqs(check, freqs, a->dim, a)) {
    return false;
  }
  const bool thd = config->format == TE_ROPE_THD;
  if (thd) {
    if (cu_seqlens == nullptr) return check.fail(TE_ERROR_VALUE, "cu_seqlens must be given for THD, got NULL");
    const te_buffer *cu = slot(cu_seqlens, TE_SLOT_DATA);
    if (!check.present(cu, "cu_seqlens.data")) return false;
    if (cu->ndim != 1 || cu->shape[0] < 1) {
      return check.fail(TE_ERROR_VALUE, "cu_seqlens.data must have shape [B + 1], got " + describe(*cu));
    }
    a->batch = cu->shape[0] - 1;
    if (!check_index_vector(check, cu_seqlens, "cu_seqlens", a->batch + 1, &a->cu_seqlens)) return false;
  } else if (cu_seqlens != nullptr) {
    return check.fail(TE_ERROR_VALUE, "cu_seqlens must be NULL for SBHD and BSHD, got a tensor");
  }
  if (start_positions != nullptr &&
      !check_index_vector(check, start_positions, "start_positions", a->batch, &a->start_positions)) {
    return false;
  }
  // Without start_positions, S rows are needed whatever the device.
  if (!thd && a->start_positions == nullptr && a->tokens > 0 && a->heads > 0 && a->seq > a->freq_rows) {
    return check.fail(TE_ERROR_VALUE, "freqs.data must have at least S = " + num(a->seq) + " rows, got " +
                                          num(a->freq_rows));
  }
  if (!check.disjoint({{out, out_data}},
                      {{in, in_data},
                       {slot(freqs, TE_SLOT_DATA), "freqs.data"},
                       {thd ? slot(cu_seqlens, TE_SLOT_DATA) : nullptr, "cu_seqlens.data"},
                       {slot(start_positions, TE_SLOT_DATA), "start_positions.data"}})) {
    return false;
  }
  a->input = in->data;
  a->output = out->data;
  return check.device() == TE_DEVICE_CUDA || check_positions(check, *a);
}

te_status run(const char *op, bool backward, const te_rope_config *config, const te_tensor *input,
              const char *in_name, const te_tensor *freqs, const te_tensor *cu_seqlens,
              const te_tensor *start_positions, te_tensor *output, const char *out_name, te_stream stream) {
  return guarded(op, [&]() -> te_status {
    Checker check(op);
    RopeArgs args;
    if (!check_call(check, config, input, in_name, freqs, cu_seqlens, start_positions, output, out_name, &args)) {
      return check.status();
    }
    args.backward = backward;
    if (args.tokens == 0 || args.heads == 0 || args.dim == 0) return TE_SUCCESS;
    if (check.device() == TE_DEVICE_CUDA) {
      CudaDeviceScope on_device(check.device_id());
      return rope_cuda(args, stream);
    }
    rope_ref(args);
    return TE_SUCCESS;
  });
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_rope_forward(const te_rope_config *config, const te_tensor *input, const te_tensor *freqs,
                          const te_tensor *cu_seqlens, const te_tensor *start_positions, te_tensor *output,
                          te_stream stream) {
  return te::run("rope_forward", false, config, input, "input", freqs, cu_seqlens, start_positions, output,
                 "output", stream);
}

te_status te_rope_backward(const te_rope_config *config, const te_tensor *grad_output, const te_tensor *freqs,
                           const te_tensor *cu_seqlens, const te_tensor *start_positions, te_tensor *grad_input,
                           te_stream stream) {
  return te::run("rope_backward", true, config, grad_output, "grad_output", freqs, cu_seqlens,
                 start_positions, grad_input, "grad_input", stream);
}

}  // extern "C"
