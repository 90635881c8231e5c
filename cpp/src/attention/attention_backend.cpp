// Config and problem checks, backend choice and workspace sizes of attention (see the header),
// and the C entry points te_attention_backend / te_attention_workspace_size.
#include "attention/attention_backend.h"

#include <cmath>
#include <cstring>
#include <string>

#include "attention/attention_math.h"
#ifdef TE_WITH_CUDNN
#include "attention/cudnn/attention_cudnn.h"
#endif

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool is_padding(te_attn_mask_type m) {
  return m == TE_ATTN_MASK_PADDING || m == TE_ATTN_MASK_PADDING_CAUSAL ||
         m == TE_ATTN_MASK_PADDING_CAUSAL_BOTTOM_RIGHT;
}

bool is_causal(te_attn_mask_type m) {
  return m == TE_ATTN_MASK_CAUSAL || m == TE_ATTN_MASK_CAUSAL_BOTTOM_RIGHT || m == TE_ATTN_MASK_PADDING_CAUSAL ||
         m == TE_ATTN_MASK_PADDING_CAUSAL_BOTTOM_RIGHT;
}

bool is_bottom_right(te_attn_mask_type m) {
  return m == TE_ATTN_MASK_CAUSAL_BOTTOM_RIGHT || m == TE_ATTN_MASK_PADDING_CAUSAL_BOTTOM_RIGHT;
}

bool hp_dtype(te_dtype d) { return is_high_precision(d); }

AttentionShape shape_of(const te_attention_config &c, const te_attention_problem &p) {
  AttentionShape s{p.batch, p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim_qk, p.head_dim_v,
                   p.total_q, p.total_kv};
  if (c.layout != TE_ATTN_LAYOUT_THD) {
    s.total_q = p.batch * p.seqlen_q;
    s.total_kv = p.batch * p.seqlen_kv;
  }
  const int64_t heads[3] = {p.heads_q, p.heads_kv, p.heads_kv};
  const int64_t dims[3] = {p.head_dim_qk, p.head_dim_qk, p.head_dim_v};
  for (int i = 0; i < 3; ++i) {
    const bool dense = c.row_stride[i] == 0 && c.head_stride[i] == 0;
    s.row_stride[i] = dense ? heads[i] * dims[i] : c.row_stride[i];
    s.head_stride[i] = dense ? dims[i] : c.head_stride[i];
  }
  return s;
}

AttentionMask mask_of(const te_attention_config &c) {
  AttentionMask m;
  m.padding = is_padding(c.mask_type) || c.layout == TE_ATTN_LAYOUT_THD;
  m.bottom_right = is_bottom_right(c.mask_type);
  m.window_left = c.window_left;
  m.window_right = is_causal(c.mask_type) ? 0 : c.window_right;
  return m;
}

// The reasons of the two non-cuDNN backends, which depend only on the device and the build.
void device_reasons(te_device_type device, std::string reasons[]) {
  if (device == TE_DEVICE_CPU) {
    reasons[TE_ATTN_BACKEND_CUDNN] = "cuDNN needs CUDA tensors, got CPU tensors";
    reasons[TE_ATTN_BACKEND_CUDA_MATH] = "the CUDA math path needs CUDA tensors, got CPU tensors";
    reasons[TE_ATTN_BACKEND_CPU] = "";
    return;
  }
  reasons[TE_ATTN_BACKEND_CPU] = "the CPU reference needs CPU tensors, got CUDA tensors";
  reasons[TE_ATTN_BACKEND_CUDA_MATH] = te_built_with_cuda() ? "" : "this build of the core has no CUDA kernels";
#ifndef TE_WITH_CUDNN
  reasons[TE_ATTN_BACKEND_CUDNN] = "this build has no cuDNN";
#endif
}

// d_o has o's dtype, except that an FP8 o may take its gradient in either FP8 format: the
// HYBRID recipe keeps the forward in E4M3 and the gradients in E5M2, whose range they need.
bool check_do_dtype(Checker &check, const te_attention_problem &p, bool fp8) {
  const bool fp8_o = fp8 && is_fp8(p.o_dtype);
  if (fp8_o ? is_fp8(p.do_dtype) : p.do_dtype == p.o_dtype) return true;
  const std::string expected = fp8_o ? std::string("float8_e4m3 or float8_e5m2 (o is FP8)")
                                     : std::string(te_dtype_name(p.o_dtype)) + " (o's dtype)";
  return check.fail(TE_ERROR_TYPE, "d_o must be " + expected + ", got " + te_dtype_name(p.do_dtype));
}

te_attn_backend pick(Checker &check, const te_attention_config &config, const std::string reasons[],
                     const char *direction) {
  if (config.backend != TE_ATTN_BACKEND_AUTO) {
    if (reasons[config.backend].empty()) return config.backend;
    check.fail(TE_ERROR_UNSUPPORTED, std::string("config.backend ") + te_attn_backend_name(config.backend) +
                                         " cannot run this " + direction + ": " + reasons[config.backend]);
    return TE_ATTN_BACKEND_AUTO;
  }
  for (int b = 0; b < TE_ATTN_BACKEND_COUNT; ++b) {
    if (reasons[b].empty()) return static_cast<te_attn_backend>(b);
  }
  std::string all;
  for (int b = 0; b < TE_ATTN_BACKEND_COUNT; ++b) {
    all += std::string(b ? "; " : "") + te_attn_backend_name(static_cast<te_attn_backend>(b)) + ": " + reasons[b];
  }
  check.fail(TE_ERROR_UNSUPPORTED, std::string("no backend can run this ") + direction + " (" + all + ")");
  return TE_ATTN_BACKEND_AUTO;
}

}  // namespace

const char *attn_layout_name(te_attn_layout layout) {
  switch (layout) {
    case TE_ATTN_LAYOUT_BSHD: return "bshd";
    case TE_ATTN_LAYOUT_SBHD: return "sbhd";
    case TE_ATTN_LAYOUT_THD: return "thd";
    default: return "invalid";
  }
}

const char *attn_mask_name(te_attn_mask_type mask) {
  static const char *const names[] = {"no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                                      "padding_causal_bottom_right"};
  return mask >= 0 && mask < TE_ATTN_MASK_COUNT ? names[mask] : "invalid";
}

bool check_attention_config(Checker &check, const te_attention_config *c) {
  if (c == nullptr) return check.fail(TE_ERROR_VALUE, "config must be a pointer, got NULL");
  if (c->layout < 0 || c->layout >= TE_ATTN_LAYOUT_COUNT) {
    return check.fail(TE_ERROR_VALUE, "config.layout must be TE_ATTN_LAYOUT_BSHD, _SBHD or _THD, got " +
                                          num(static_cast<int>(c->layout)));
  }
  if (c->mask_type < 0 || c->mask_type >= TE_ATTN_MASK_COUNT) {
    return check.fail(TE_ERROR_VALUE, "config.mask_type must be a te_attn_mask_type, got " +
                                          num(static_cast<int>(c->mask_type)));
  }
  if (c->window_left < -1 || c->window_right < -1) {
    return check.fail(TE_ERROR_VALUE, "config.window_left and window_right must be >= -1 (-1: unbounded), got (" +
                                          num(c->window_left) + ", " + num(c->window_right) + ")");
  }
  if (!(c->softmax_scale > 0.0f) || !std::isfinite(c->softmax_scale)) {
    return check.fail(TE_ERROR_VALUE, "config.softmax_scale must be finite and > 0, got " +
                                          std::to_string(c->softmax_scale));
  }
  if (!(c->dropout >= 0.0f && c->dropout < 1.0f)) {
    return check.fail(TE_ERROR_VALUE, "config.dropout must be in [0, 1), got " + std::to_string(c->dropout));
  }
  if (c->backend < TE_ATTN_BACKEND_AUTO || c->backend >= TE_ATTN_BACKEND_COUNT) {
    return check.fail(TE_ERROR_VALUE, "config.backend must be a te_attn_backend, got " +
                                          num(static_cast<int>(c->backend)));
  }
  return true;
}

// config.row_stride / head_stride: each operand dense (both 0) or strided without overlapping
// itself; strides only where every backend takes them (no padding: the backends zero padded
// rows and read ragged offsets as if dense).
bool check_strides(Checker &check, const te_attention_config &c, const te_attention_problem &p) {
  const char *names[3] = {"q", "k", "v"};
  const int64_t heads[3] = {p.heads_q, p.heads_kv, p.heads_kv};
  const int64_t dims[3] = {p.head_dim_qk, p.head_dim_qk, p.head_dim_v};
  bool strided = false;
  for (int i = 0; i < 3; ++i) {
    const int64_t row = c.row_stride[i], head = c.head_stride[i];
    if (row == 0 && head == 0) continue;
    strided = true;
    const std::string which = std::string("config.row_stride[") + num(i) + "] and head_stride[" + num(i) + "] (" +
                              names[i] + ")";
    if (head < dims[i] || row < (heads[i] - 1) * head + dims[i]) {
      return check.fail(TE_ERROR_VALUE, which + " must be both 0 (dense) or give heads that do not overlap: "
                                        "head_stride >= head_dim (" + num(dims[i]) + ") and row_stride >= "
                                        "(heads - 1) * head_stride + head_dim, got " + num(row) + " and " +
                                        num(head));
    }
  }
  if (strided && (c.layout == TE_ATTN_LAYOUT_THD || is_padding(c.mask_type))) {
    return check.fail(TE_ERROR_UNSUPPORTED, std::string("strided q, k and v (config.row_stride, head_stride) take "
                                                        "the bshd and sbhd layouts without a padding mask, got "
                                                        "layout ") +
                                                (c.layout == TE_ATTN_LAYOUT_THD ? "thd" : "bshd/sbhd") +
                                                " and mask " + attn_mask_name(c.mask_type));
  }
  return true;
}

bool check_attention_problem(Checker &check, const te_attention_config &c, const te_attention_problem &p,
                             bool backward) {
  const bool thd = c.layout == TE_ATTN_LAYOUT_THD;
  const struct {
    int64_t value;
    const char *name;
  } dims[] = {{p.batch, "batch"},         {p.heads_q, "heads_q"},         {p.heads_kv, "heads_kv"},
              {p.seqlen_q, "seqlen_q"},   {p.seqlen_kv, "seqlen_kv"},     {p.head_dim_qk, "head_dim_qk"},
              {p.head_dim_v, "head_dim_v"}};
  for (const auto &d : dims) {
    if (d.value < 1) return check.fail(TE_ERROR_VALUE, std::string(d.name) + " must be >= 1, got " + num(d.value));
  }
  if (thd && (p.total_q < 0 || p.total_kv < 0)) {
    return check.fail(TE_ERROR_VALUE, "total_q and total_kv must be >= 0 for the thd layout, got " +
                                          num(p.total_q) + " and " + num(p.total_kv));
  }
  if (p.heads_q % p.heads_kv != 0) {
    return check.fail(TE_ERROR_VALUE, "heads_q must be a multiple of heads_kv (GQA/MQA groups), got " +
                                          num(p.heads_q) + " query heads and " + num(p.heads_kv) + " kv heads");
  }
  if (!check_strides(check, c, p)) return false;
  const bool fp8 = p.qkv_dtype == TE_DTYPE_FLOAT8_E4M3;
  if (!fp8 && !hp_dtype(p.qkv_dtype)) {
    return check.fail(TE_ERROR_TYPE, std::string("q, k and v must be float32, float16, bfloat16 or float8_e4m3, got ") +
                                         te_dtype_name(p.qkv_dtype));
  }
  if (fp8 ? !(p.o_dtype == TE_DTYPE_FLOAT8_E4M3 || p.o_dtype == TE_DTYPE_FLOAT16 || p.o_dtype == TE_DTYPE_BFLOAT16)
          : p.o_dtype != p.qkv_dtype) {
    return check.fail(TE_ERROR_TYPE, std::string("o must be ") +
                                         (fp8 ? "float8_e4m3, float16 or bfloat16 for FP8 attention"
                                              : te_dtype_name(p.qkv_dtype)) +
                                         " (q's dtype), got " + te_dtype_name(p.o_dtype));
  }
  if (backward && !check_do_dtype(check, p, fp8)) return false;
  if (backward && (fp8 ? !is_fp8(p.grad_dtype) && !hp_dtype(p.grad_dtype) : p.grad_dtype != p.qkv_dtype)) {
    return check.fail(TE_ERROR_TYPE, std::string("dq, dk and dv must be ") +
                                         (fp8 ? "FP8, float32, float16 or bfloat16" : te_dtype_name(p.qkv_dtype)) +
                                         ", got " + te_dtype_name(p.grad_dtype));
  }
  if (p.device != TE_DEVICE_CPU && p.device != TE_DEVICE_CUDA) {
    return check.fail(TE_ERROR_VALUE, "device must be TE_DEVICE_CPU or TE_DEVICE_CUDA, got " +
                                          num(static_cast<int>(p.device)));
  }
  return true;
}

AttentionForwardArgs forward_args(const te_attention_config &c, const te_attention_problem &p) {
  AttentionForwardArgs a{};
  a.layout = static_cast<AttnLayout>(c.layout);
  a.shape = shape_of(c, p);
  a.mask = mask_of(c);
  a.softmax_scale = c.softmax_scale;
  a.dropout = c.dropout;
  a.qkv_dtype = p.qkv_dtype;
  a.o_dtype = p.o_dtype;
  a.inference = c.inference != 0;
  a.device = p.device == TE_DEVICE_CUDA ? p.device_id : -1;
  return a;
}

AttentionBackwardArgs backward_args(const te_attention_config &c, const te_attention_problem &p) {
  AttentionBackwardArgs a{};
  a.layout = static_cast<AttnLayout>(c.layout);
  a.shape = shape_of(c, p);
  a.mask = mask_of(c);
  a.softmax_scale = c.softmax_scale;
  a.dropout = c.dropout;
  a.qkv_dtype = p.qkv_dtype;
  a.o_dtype = p.o_dtype;
  a.do_dtype = p.do_dtype;
  a.grad_dtype = p.grad_dtype;
  a.deterministic = c.deterministic != 0;
  a.device = p.device == TE_DEVICE_CUDA ? p.device_id : -1;
  return a;
}

te_attn_backend choose_forward_backend(Checker &check, const te_attention_config &config,
                                       const AttentionForwardArgs &args, std::string reasons[]) {
  device_reasons(args.device < 0 ? TE_DEVICE_CPU : TE_DEVICE_CUDA, reasons);
#ifdef TE_WITH_CUDNN
  if (args.device >= 0) {
    CudaDeviceScope on_device(args.device);
    reasons[TE_ATTN_BACKEND_CUDNN] = cudnn_attention_forward_support(args);
  }
#endif
  return pick(check, config, reasons, "forward");
}

te_attn_backend choose_backward_backend(Checker &check, const te_attention_config &config,
                                        const AttentionBackwardArgs &args, std::string reasons[]) {
  device_reasons(args.device < 0 ? TE_DEVICE_CPU : TE_DEVICE_CUDA, reasons);
#ifdef TE_WITH_CUDNN
  if (args.device >= 0) {
    CudaDeviceScope on_device(args.device);
    reasons[TE_ATTN_BACKEND_CUDNN] = cudnn_attention_backward_support(args);
  }
#endif
  return pick(check, config, reasons, "backward");
}

size_t forward_workspace_size(te_attn_backend backend, const AttentionForwardArgs &args) {
#ifdef TE_WITH_CUDNN
  if (backend == TE_ATTN_BACKEND_CUDNN) {
    CudaDeviceScope on_device(args.device);
    return cudnn_attention_forward_workspace_size(args);
  }
#endif
  (void)backend;
  (void)args;
  return 0;
}

size_t backward_workspace_size(te_attn_backend backend, const AttentionBackwardArgs &args) {
#ifdef TE_WITH_CUDNN
  if (backend == TE_ATTN_BACKEND_CUDNN) {
    CudaDeviceScope on_device(args.device);
    return cudnn_attention_backward_workspace_size(args);
  }
#endif
  if (backend == TE_ATTN_BACKEND_CUDA_MATH) return attention_backward_cuda_workspace_size(args.shape);
  return 0;
}

}  // namespace te

extern "C" {

const char *te_attn_backend_name(te_attn_backend backend) {
  switch (backend) {
    case TE_ATTN_BACKEND_AUTO: return "auto";
    case TE_ATTN_BACKEND_CUDNN: return "cudnn";
    case TE_ATTN_BACKEND_CUDA_MATH: return "cuda_math";
    case TE_ATTN_BACKEND_CPU: return "cpu";
    default: return "invalid";
  }
}

te_status te_attention_backend(const te_attention_config *config, const te_attention_problem *problem,
                               int32_t backward, te_attn_backend *backend,
                               char reasons[TE_ATTN_BACKEND_COUNT][TE_ATTN_REASON_SIZE]) {
  return te::guarded("attention_backend", [&]() -> te_status {
    te::Checker check("attention_backend");
    if (!te::check_attention_config(check, config)) return check.status();
    if (problem == nullptr) return check.reject(TE_ERROR_VALUE, "problem must be a pointer, got NULL");
    if (backend == nullptr) return check.reject(TE_ERROR_VALUE, "backend must be a pointer, got NULL");
    if (!te::check_attention_problem(check, *config, *problem, backward != 0)) return check.status();
    std::string why[TE_ATTN_BACKEND_COUNT];
    const te_attn_backend chosen =
        backward ? te::choose_backward_backend(check, *config, te::backward_args(*config, *problem), why)
                 : te::choose_forward_backend(check, *config, te::forward_args(*config, *problem), why);
    if (reasons != nullptr) {
      for (int b = 0; b < TE_ATTN_BACKEND_COUNT; ++b) {
        std::strncpy(reasons[b], why[b].c_str(), TE_ATTN_REASON_SIZE - 1);
        reasons[b][TE_ATTN_REASON_SIZE - 1] = '\0';
      }
    }
    *backend = chosen;
    return check.status();
  });
}

te_status te_attention_workspace_size(const te_attention_config *config, const te_attention_problem *problem,
                                      int32_t backward, size_t *bytes) {
  return te::guarded("attention_workspace_size", [&]() -> te_status {
    te::Checker check("attention_workspace_size");
    if (!te::check_attention_config(check, config)) return check.status();
    if (problem == nullptr || bytes == nullptr) {
      return check.reject(TE_ERROR_VALUE, "problem and bytes must be pointers, got NULL");
    }
    if (!te::check_attention_problem(check, *config, *problem, backward != 0)) return check.status();
    std::string why[TE_ATTN_BACKEND_COUNT];
    if (backward) {
      const te::AttentionBackwardArgs args = te::backward_args(*config, *problem);
      const te_attn_backend b = te::choose_backward_backend(check, *config, args, why);
      if (b == TE_ATTN_BACKEND_AUTO) return check.status();
      *bytes = te::backward_workspace_size(b, args);
    } else {
      const te::AttentionForwardArgs args = te::forward_args(*config, *problem);
      const te_attn_backend b = te::choose_forward_backend(check, *config, args, why);
      if (b == TE_ATTN_BACKEND_AUTO) return check.status();
      *bytes = te::forward_workspace_size(b, args);
    }
    return TE_SUCCESS;
  });
}

}  // extern "C"
