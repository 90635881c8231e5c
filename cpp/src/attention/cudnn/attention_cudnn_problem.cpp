// The problem of a cuDNN attention call and the checks made before any graph is built.
#include "attention/cudnn/attention_cudnn_problem.h"

#include <cuda_runtime.h>

#include <array>
#include <cstring>
#include <utility>

#include "attention/cudnn/cudnn_library.h"

namespace te {
namespace cudnn_attention {
namespace {

constexpr int64_t kMaxHeadDim = 256;    // cuDNN's SDPA kernels on sm_90 (sm_80: 128 for some versions)
constexpr uintptr_t kOperandAlign = 16;  // cuDNN loads q/k/v/o with 16-byte vectors and TMA

AttentionMask normalized(AttentionMask m, const AttentionShape &s) {
  const int64_t reach = s.seqlen_q + s.seqlen_kv;
  if (m.window_left < 0 || m.window_left >= reach) m.window_left = -1;
  if (m.window_right < 0 || m.window_right >= reach) m.window_right = -1;
  if (m.window_left < 0 && m.window_right < 0) m.bottom_right = false;  // no band to align
  return m;
}

}  // namespace

Problem problem_of(const AttentionForwardArgs &a) {
  Problem p;
  p.layout = a.layout;
  p.shape = a.shape;
  p.mask = normalized(a.mask, a.shape);
  p.softmax_scale = a.softmax_scale;
  p.dropout = a.dropout;
  p.qkv = a.qkv_dtype;
  p.o = a.o_dtype;
  p.d_o = a.o_dtype;  // no d_o in a forward
  p.grad = a.o_dtype;
  p.inference = a.inference;
  p.device = a.device;
  return p;
}

Problem problem_of(const AttentionBackwardArgs &a) {
  Problem p;
  p.backward = true;
  p.layout = a.layout;
  p.shape = a.shape;
  p.mask = normalized(a.mask, a.shape);
  p.softmax_scale = a.softmax_scale;
  p.dropout = a.dropout;
  p.qkv = a.qkv_dtype;
  p.o = a.o_dtype;
  p.d_o = a.do_dtype;
  p.grad = a.grad_dtype;
  p.deterministic = a.deterministic;
  p.device = a.device;
  return p;
}

Key key_of(const Problem &p, int sm) {
  auto bits = [](float f) {
    uint32_t u = 0;
    std::memcpy(&u, &f, sizeof(u));
    return static_cast<int64_t>(u);
  };
  const AttentionShape &s = p.shape;
  return {p.backward, static_cast<int64_t>(p.layout), s.batch, s.heads_q, s.heads_kv, s.seqlen_q, s.seqlen_kv,
          s.head_dim_qk, s.head_dim_v, p.wide_offsets(), p.padding(), p.mask.bottom_right, p.mask.window_left,
          p.mask.window_right, bits(p.softmax_scale), bits(p.dropout), p.qkv, p.o, p.d_o, p.grad, p.deterministic,
          p.inference, p.device, sm, s.row_stride[0], s.row_stride[1], s.row_stride[2], s.head_stride[0],
          s.head_stride[1], s.head_stride[2]};
}

AuxLayout aux_layout(const Problem &p) {
  AuxLayout l;
  const size_t batch = static_cast<size_t>(p.shape.batch);
  auto take = [&l](size_t n) {
    const size_t at = l.bytes;
    l.bytes = round_up(at + n, kAlign);
    return at;
  };
  if (p.padding()) {
    l.seqlen_q = take(batch * sizeof(int32_t));
    l.seqlen_kv = take(batch * sizeof(int32_t));
  }
  if (p.thd()) {
    const size_t width = p.wide_offsets() ? sizeof(int64_t) : sizeof(int32_t);
    for (size_t &offset : l.offsets) offset = take((batch + 1) * width);
  }
  if (p.backward) {
    l.stats = take(static_cast<size_t>(p.shape.batch * p.shape.heads_q * p.shape.seqlen_q) * sizeof(float));
  }
  return l;
}

namespace {

std::string head_dim_reason(const char *name, int64_t d, int64_t multiple, int64_t limit) {
  if (d % multiple != 0) {
    return std::string(name) + " " + std::to_string(d) + " is not a multiple of " + std::to_string(multiple) +
           ", as cuDNN needs";
  }
  if (d > limit) return std::string(name) + " " + std::to_string(d) + " is over cuDNN's limit of " + std::to_string(limit);
  return "";
}

std::array<std::pair<const char *, int64_t>, 2> head_dims(const AttentionShape &s) {
  return {{{"head_dim_qk", s.head_dim_qk}, {"head_dim_v", s.head_dim_v}}};
}

}  // namespace

std::string problem_reason(const Problem &p, int sm) {
  const AttentionShape &s = p.shape;
  if (p.device < 0) return "cuDNN runs CUDA tensors only";
  if (!cudnn_library_error().empty()) return cudnn_library_error();
  if (sm < 0) return "the compute capability of cuda:" + std::to_string(p.device) + " could not be queried";
  const std::string got_sm = "got sm_" + std::to_string(sm);
  if (sm < 80) return "cuDNN fused attention needs sm_80 or newer, " + got_sm;
  if (p.fp8()) {
    if (sm < 90) return "FP8 attention needs sm_90 or newer, " + got_sm;
    if (p.qkv != TE_DTYPE_FLOAT8_E4M3) return std::string("FP8 attention takes q/k/v in float8_e4m3, got ") + te_dtype_name(p.qkv);
    if (!is_fp8(p.o) && sm < 100) return "FP8 attention with a high-precision o needs sm_100 or newer, " + got_sm;
    if (p.mask.bottom_right && sm < 100) return "FP8 attention with a bottom-right diagonal needs sm_100 or newer, " + got_sm;
    // cuDNN's FP8 forward kernel for sm_90 with dropout writes shared memory out of bounds
    // (compute-sanitizer, cuDNN 9.19 on an H200, causal bshd/sbhd at head_dim 128): a fault
    // that would end the process, so such a call is refused here, not launched.
    if (p.dropout_on() && sm / 10 == 9) {
      return "FP8 attention with dropout is not run on sm_90 (cuDNN's FP8 kernel with dropout faults there), "
             "got dropout " + std::to_string(p.dropout);
    }
    // cuDNN writes fp16/bf16 gradients of an FP8 backward only on sm_100 with cuDNN 9.13 or
    // newer; the graph here asks for FP8 ones (with their scales and amaxes) everywhere.
    if (p.backward && !is_fp8(p.grad)) return std::string("FP8 attention backward writes FP8 gradients, got ") + te_dtype_name(p.grad);
    // Its FP8 backward quantizes ds in d_o's format: d_o must be FP8 itself.
    if (p.backward && !is_fp8(p.d_o)) {
      return std::string("FP8 attention backward takes an FP8 d_o, got ") + te_dtype_name(p.d_o);
    }
    for (const auto &[name, d] : head_dims(s)) {
      if (std::string r = head_dim_reason(name, d, 16, kMaxHeadDim); !r.empty()) return r;
      if (p.backward && sm / 10 == 9 && d != 128) {
        return std::string("FP8 attention backward on sm_90 needs ") + name + " 128, got " + std::to_string(d);
      }
    }
  } else {
    if (p.qkv != TE_DTYPE_BFLOAT16 && p.qkv != TE_DTYPE_FLOAT16) {
      return std::string("cuDNN fused attention takes bfloat16, float16 or float8_e4m3, got ") + te_dtype_name(p.qkv);
    }
    if (p.backward && p.d_o != p.o) {
      return std::string("cuDNN fused attention takes d_o in o's dtype ") + te_dtype_name(p.o) + ", got " +
             te_dtype_name(p.d_o);
    }
    if (p.o != p.qkv || p.grad != p.qkv) {
      return std::string("cuDNN fused attention writes o") + (p.backward ? ", dq, dk and dv" : "") + " in qkv_dtype " +
             te_dtype_name(p.qkv) + ", got " + te_dtype_name(p.o != p.qkv ? p.o : p.grad);
    }
    for (const auto &[name, d] : head_dims(s)) {
      if (std::string r = head_dim_reason(name, d, 8, kMaxHeadDim); !r.empty()) return r;
    }
  }
  if (s.heads_kv <= 0 || s.heads_q % s.heads_kv != 0) {
    return "heads_q " + std::to_string(s.heads_q) + " must be a multiple of heads_kv " + std::to_string(s.heads_kv);
  }
  if (!(p.dropout >= 0.0f && p.dropout < 1.0f)) return "dropout must be in [0, 1), got " + std::to_string(p.dropout);
  if (s.seqlen_q > INT32_MAX || s.seqlen_kv > INT32_MAX) return "sequence lengths must fit in int32";
  const int64_t size = static_cast<int64_t>(te_dtype_size(p.qkv));
  for (int i = 0; i < 3; ++i) {
    if ((s.row_stride[i] * size) % 16 != 0 || (s.head_stride[i] * size) % 16 != 0) {
      return std::string("strided ") + "qkv"[i] + " needs row and head strides of a multiple of 16 bytes, got " +
             std::to_string(s.row_stride[i]) + " and " + std::to_string(s.head_stride[i]) + " elements";
    }
  }
  return "";
}

namespace {

bool misaligned(const void *p) { return reinterpret_cast<uintptr_t>(p) % kOperandAlign != 0; }

// Pointers that cuDNN needs (the problem's checks passed).
std::string pointer_reason(const Problem &p, const std::vector<std::pair<const char *, const void *>> &operands,
                           const int32_t *cu_q, const int32_t *cu_kv, const int64_t *rng_state,
                           const std::vector<std::pair<const char *, const void *>> &fp8) {
  for (const auto &[name, ptr] : operands) {
    if (misaligned(ptr)) return std::string(name) + " must be 16-byte aligned for cuDNN";
  }
  if (p.padding() && (cu_q == nullptr || cu_kv == nullptr)) return "padding needs cu_seqlens_q and cu_seqlens_kv";
  if (p.dropout_on() && rng_state == nullptr) return "dropout needs rng_state";
  if (p.fp8()) {
    for (const auto &[name, ptr] : fp8) {
      if (ptr == nullptr) return std::string("FP8 attention needs fp8.") + name;
    }
  }
  return "";
}

}  // namespace

std::string pointer_reason(const Problem &p, const AttentionForwardArgs &a) {
  const AttentionFp8 &f = a.fp8;
  return pointer_reason(p, {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"o", a.o}}, a.cu_seqlens_q, a.cu_seqlens_kv,
                        a.rng_state,
                        {{"descale_q", f.descale_q}, {"descale_k", f.descale_k}, {"descale_v", f.descale_v},
                         {"descale_s", f.descale_s}, {"scale_s", f.scale_s}, {"scale_o", f.scale_o},
                         {"amax_s", f.amax_s}, {"amax_o", f.amax_o}});
}

std::string pointer_reason(const Problem &p, const AttentionBackwardArgs &a) {
  const AttentionFp8 &f = a.fp8;
  return pointer_reason(
      p, {{"q", a.q}, {"k", a.k}, {"v", a.v}, {"o", a.o}, {"d_o", a.d_o}, {"dq", a.dq}, {"dk", a.dk}, {"dv", a.dv}},
      a.cu_seqlens_q, a.cu_seqlens_kv, a.rng_state,
      {{"descale_q", f.descale_q}, {"descale_k", f.descale_k}, {"descale_v", f.descale_v}, {"descale_o", f.descale_o},
       {"descale_do", f.descale_do}, {"descale_s", f.descale_s}, {"descale_dp", f.descale_dp}, {"scale_s", f.scale_s},
       {"scale_dp", f.scale_dp}, {"scale_dq", f.scale_dq}, {"scale_dk", f.scale_dk}, {"scale_dv", f.scale_dv},
       {"amax_dp", f.amax_dp}, {"amax_dq", f.amax_dq}, {"amax_dk", f.amax_dk}, {"amax_dv", f.amax_dv}});
}

}  // namespace cudnn_attention
}  // namespace te
