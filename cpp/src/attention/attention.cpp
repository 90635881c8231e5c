// C entry points te_attention_forward / te_attention_backward: every buffer checked against
// attention.h, the problem derived from the shapes, then the backend that te_attention_backend
// would pick runs it.
#include <string>

#include "attention/attention_backend.h"
#include "attention/attention_math.h"
#ifdef TE_WITH_CUDNN
#include "attention/cudnn/attention_cudnn.h"
#endif

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool qkv_dtype_ok(te_dtype d) { return is_high_precision(d) || d == TE_DTYPE_FLOAT8_E4M3; }
bool any_float(te_dtype d) { return is_high_precision(d) || is_fp8(d); }

// The sizes of one of q, k, v, o in a layout; batch and seqlen are -1 for THD.
struct Dims {
  int64_t batch, seqlen, heads, dim, rows;
};

bool layout_dims(Checker &check, const te_buffer &b, const std::string &what, te_attn_layout layout, Dims *d) {
  if (layout == TE_ATTN_LAYOUT_THD) {
    if (b.ndim != 3) {
      return check.fail(TE_ERROR_VALUE, what + " must have 3 dimensions [tokens, heads, head_dim] for the thd "
                                               "layout, got " + describe(b));
    }
    *d = Dims{-1, -1, b.shape[1], b.shape[2], b.shape[0]};
    return true;
  }
  const bool bshd = layout == TE_ATTN_LAYOUT_BSHD;
  if (b.ndim != 4) {
    return check.fail(TE_ERROR_VALUE, what + " must have 4 dimensions " +
                                          (bshd ? "[batch, seqlen, heads, head_dim] for the bshd"
                                                : "[seqlen, batch, heads, head_dim] for the sbhd") +
                                          " layout, got " + describe(b));
  }
  const int64_t batch = bshd ? b.shape[0] : b.shape[1], seqlen = bshd ? b.shape[1] : b.shape[0];
  *d = Dims{batch, seqlen, b.shape[2], b.shape[3], batch * seqlen};
  return true;
}

// A data buffer that must be present, on the call's device, of an accepted dtype.
const te_buffer *data_of(Checker &check, const te_tensor *t, const char *name, bool (*pred)(te_dtype),
                         const char *expected) {
  if (!check.handle(t, name)) return nullptr;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  const std::string what = std::string(name) + ".data";
  if (!check.present(b, what.c_str()) || !check.same_device(*b, what.c_str()) ||
      !check.dtype_in(*b, what.c_str(), pred, expected)) {
    return nullptr;
  }
  return b;
}

bool shape_is(Checker &check, const te_buffer &b, const std::string &what, const int64_t *shape, int ndim,
              const std::string &why) {
  bool same = b.ndim == ndim;
  for (int i = 0; same && i < ndim; ++i) same = b.shape[i] == shape[i];
  if (same) return true;
  return check.fail(TE_ERROR_VALUE, what + " must have shape " + shape_string(shape, ndim) + " (" + why + "), got " +
                                        describe(b));
}

// k and v against q; fills the problem's sizes.
bool check_qkv(Checker &check, const te_attention_config &c, const te_buffer &q, const te_buffer &k,
               const te_buffer &v, Dims *dq, Dims *dk, Dims *dv) {
  if (!layout_dims(check, q, "q.data", c.layout, dq) || !layout_dims(check, k, "k.data", c.layout, dk) ||
      !layout_dims(check, v, "v.data", c.layout, dv)) {
    return false;
  }
  if (!check.dtype_is(k, "k.data", q.dtype) || !check.dtype_is(v, "v.data", q.dtype)) return false;
  if (dk->dim != dq->dim) {
    return check.fail(TE_ERROR_VALUE, "k.data must have q's head dim " + num(dq->dim) +
                                          " (q and k share head_dim_qk), got " + describe(k));
  }
  if (dk->batch != dq->batch) {
    return check.fail(TE_ERROR_VALUE, "k.data must have q's batch " + num(dq->batch) + ", got " + describe(k));
  }
  if (dv->heads != dk->heads || dv->rows != dk->rows || dv->batch != dk->batch) {
    return check.fail(TE_ERROR_VALUE, "v.data must have k's batch, sequence length and heads " +
                                          shape_string(k.shape, k.ndim - 1) + ", got " + describe(v));
  }
  return true;
}

// cu_seqlens: [batch + 1] int32 on the call's device; on the CPU also its values.
bool check_cu_seqlens(Checker &check, const te_tensor *t, const char *name, int64_t batch, int64_t max_len,
                      int64_t rows, bool thd, const int32_t **out) {
  const std::string what = std::string(name) + ".data";
  if (!check.handle(t, name)) return false;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  if (!check.present(b, what.c_str()) || !check.same_device(*b, what.c_str()) ||
      !check.dtype_is(*b, what.c_str(), TE_DTYPE_INT32)) {
    return false;
  }
  if (b->ndim != 1 || b->shape[0] != batch + 1) {
    return check.fail(TE_ERROR_VALUE, what + " must have shape [" + num(batch + 1) + "] (batch + 1), got " +
                                          describe(*b));
  }
  const int32_t *cu = static_cast<const int32_t *>(b->data);
  *out = cu;
  if (b->device != TE_DEVICE_CPU) return true;  // reading CUDA memory here would synchronize
  if (cu[0] != 0) return check.fail(TE_ERROR_VALUE, std::string(name) + " must start at 0, got " + num(cu[0]));
  for (int64_t i = 0; i < batch; ++i) {
    if (cu[i + 1] < cu[i]) {
      return check.fail(TE_ERROR_VALUE, std::string(name) + " must be non-decreasing (cumulative lengths), got " +
                                            name + "[" + num(i + 1) + "] = " + num(cu[i + 1]) + " after " + name +
                                            "[" + num(i) + "] = " + num(cu[i]));
    }
    if (cu[i + 1] - cu[i] > max_len) {
      return check.fail(TE_ERROR_VALUE, std::string(name) + " must give lengths <= " + num(max_len) +
                                            (thd ? " (the config's max_seqlen)" : " (the padded sequence length)") +
                                            ", got " + num(cu[i + 1] - cu[i]) + " for sequence " + num(i));
    }
  }
  if (thd && cu[batch] > rows) {
    return check.fail(TE_ERROR_VALUE, std::string(name) + "[batch] must be <= the tokens of the thd buffer (" +
                                          num(rows) + "), got " + num(cu[batch]));
  }
  return true;
}

const float *fp32_slot(Checker &check, const te_tensor *t, te_tensor_slot s, const std::string &what,
                       bool required) {
  const te_buffer *b = slot(t, s);
  if (b == nullptr && !required) return nullptr;
  if (!check.fp32_scalar(b, what.c_str())) return nullptr;
  return static_cast<const float *>(b->data);
}

float *fp32_out(Checker &check, const te_tensor *t, te_tensor_slot s, const std::string &what, bool required) {
  return const_cast<float *>(fp32_slot(check, t, s, what, required));
}

// The memory that operand i (q, k, v; the buffer b, of sizes d) spans under the config's
// strides, as a 1-d buffer for the overlap checks (b itself when dense).
te_buffer operand_extent(const te_attention_config &c, int i, const te_buffer &b, const Dims &d) {
  if (c.row_stride[i] == 0 && c.head_stride[i] == 0) return b;
  te_buffer e = b;
  e.ndim = 1;
  e.shape[0] = d.rows == 0 || d.heads == 0 ? 0 : (d.rows - 1) * c.row_stride[i] + (d.heads - 1) * c.head_stride[i] + d.dim;
  return e;
}

bool strided(const te_attention_config &c) {
  for (int i = 0; i < 3; ++i) {
    if (c.row_stride[i] != 0 || c.head_stride[i] != 0) return true;
  }
  return false;
}

// What forward and backward share: q/k/v, the problem, cu_seqlens and rng_state.
struct Common {
  const te_buffer *q, *k, *v;
  Dims dq, dk, dv;
  te_attention_problem problem;
  const int32_t *cu_q = nullptr, *cu_kv = nullptr;
  const int64_t *rng = nullptr;
};

bool check_common(Checker &check, const te_attention_config &c, const te_tensor *q, const te_tensor *k,
                  const te_tensor *v, const te_tensor *cu_q, const te_tensor *cu_kv, const te_tensor *rng,
                  Common *m) {
  const char *qkv_expected = "float32, float16, bfloat16 or float8_e4m3";
  if (!(m->q = data_of(check, q, "q", qkv_dtype_ok, qkv_expected)) ||
      !(m->k = data_of(check, k, "k", qkv_dtype_ok, qkv_expected)) ||
      !(m->v = data_of(check, v, "v", qkv_dtype_ok, qkv_expected)) ||
      !check_qkv(check, c, *m->q, *m->k, *m->v, &m->dq, &m->dk, &m->dv)) {
    return false;
  }
  const bool thd = c.layout == TE_ATTN_LAYOUT_THD;
  const bool padding = thd || c.mask_type == TE_ATTN_MASK_PADDING || c.mask_type == TE_ATTN_MASK_PADDING_CAUSAL ||
                       c.mask_type == TE_ATTN_MASK_PADDING_CAUSAL_BOTTOM_RIGHT;
  te_attention_problem &p = m->problem;
  p = te_attention_problem{};
  p.heads_q = m->dq.heads;
  p.heads_kv = m->dk.heads;
  p.head_dim_qk = m->dq.dim;
  p.head_dim_v = m->dv.dim;
  p.total_q = m->dq.rows;
  p.total_kv = m->dk.rows;
  p.qkv_dtype = m->q->dtype;
  p.device = check.device();
  p.device_id = check.device_id();
  if (thd) {
    if (!check.handle(cu_q, "cu_seqlens_q")) return false;
    const te_buffer *b = slot(cu_q, TE_SLOT_DATA);
    if (!check.present(b, "cu_seqlens_q.data")) return false;
    if (b->ndim != 1 || b->shape[0] < 2) {
      return check.fail(TE_ERROR_VALUE, "cu_seqlens_q.data must have shape [batch + 1] with batch >= 1, got " +
                                            describe(*b));
    }
    p.batch = b->shape[0] - 1;
    p.seqlen_q = c.max_seqlen_q;
    p.seqlen_kv = c.max_seqlen_kv;
    if (c.max_seqlen_q < 1 || c.max_seqlen_kv < 1) {
      return check.fail(TE_ERROR_VALUE, "config.max_seqlen_q and max_seqlen_kv must be >= 1 for the thd layout, "
                                        "got " + num(c.max_seqlen_q) + " and " + num(c.max_seqlen_kv));
    }
  } else {
    p.batch = m->dq.batch;
    p.seqlen_q = m->dq.seqlen;
    p.seqlen_kv = m->dk.seqlen;
  }
  if (padding) {
    if (!check_cu_seqlens(check, cu_q, "cu_seqlens_q", p.batch, p.seqlen_q, p.total_q, thd, &m->cu_q) ||
        !check_cu_seqlens(check, cu_kv, "cu_seqlens_kv", p.batch, p.seqlen_kv, p.total_kv, thd, &m->cu_kv)) {
      return false;
    }
  } else if (cu_q != nullptr || cu_kv != nullptr) {
    return check.fail(TE_ERROR_VALUE, std::string("cu_seqlens_q and cu_seqlens_kv must be NULL without a padding "
                                                  "mask, got a tensor for mask ") + attn_mask_name(c.mask_type));
  }
  if (c.dropout > 0.0f) {
    if (!check.handle(rng, "rng_state")) return false;
    const te_buffer *b = slot(rng, TE_SLOT_DATA);
    if (!check.present(b, "rng_state.data") || !check.same_device(*b, "rng_state.data") ||
        !check.dtype_is(*b, "rng_state.data", TE_DTYPE_INT64) || !check.numel_is(*b, "rng_state.data", 2)) {
      return false;
    }
    m->rng = static_cast<const int64_t *>(b->data);
  }
  return true;
}

bool check_lse(Checker &check, const te_tensor *lse, const te_attention_problem &p, const te_buffer **out) {
  if (!check.handle(lse, "softmax_lse")) return false;
  const te_buffer *b = slot(lse, TE_SLOT_DATA);
  if (!check.present(b, "softmax_lse.data") || !check.same_device(*b, "softmax_lse.data") ||
      !check.dtype_is(*b, "softmax_lse.data", TE_DTYPE_FLOAT32)) {
    return false;
  }
  const int64_t shape[3] = {p.batch, p.heads_q, p.seqlen_q};
  *out = b;
  return shape_is(check, *b, "softmax_lse.data", shape, 3, "batch, heads_q, max_seqlen_q");
}

// The shape of o (and d_o): q's with v's head dim.
void o_shape(const te_buffer &q, int64_t dim_v, int64_t *shape) {
  for (int i = 0; i < q.ndim; ++i) shape[i] = q.shape[i];
  shape[q.ndim - 1] = dim_v;
}

bool check_workspace(Checker &check, size_t need, size_t have) {
  if (have >= need) return true;
  return check.fail(TE_ERROR_VALUE, "workspace must have at least " + std::to_string(need) +
                                        " bytes (te_attention_workspace_size), got " + std::to_string(have));
}

bool check_forward(Checker &check, const te_attention_config *config, const te_tensor *q, const te_tensor *k,
                   const te_tensor *v, te_tensor *o, te_tensor *lse, const te_tensor *cu_q, const te_tensor *cu_kv,
                   const te_tensor *rng, te_tensor *s_fp8, AttentionForwardArgs *a) {
  Common m;
  if (!check_attention_config(check, config) || !check_common(check, *config, q, k, v, cu_q, cu_kv, rng, &m)) {
    return false;
  }
  const te_buffer *ob = data_of(check, o, "o", any_float, "a floating-point dtype");
  if (ob == nullptr) return false;
  int64_t shape[TE_MAX_DIMS];
  o_shape(*m.q, m.dv.dim, shape);
  if (!shape_is(check, *ob, "o.data", shape, m.q->ndim, "q's shape with v's head dim")) return false;
  m.problem.o_dtype = ob->dtype;
  const te_buffer *lb = nullptr;
  if (!check_attention_problem(check, *config, m.problem, false)) return false;
  if (config->inference != 0) {
    if (lse != nullptr) {
      return check.fail(TE_ERROR_VALUE, "softmax_lse must be NULL when config.inference is set, got a tensor");
    }
  } else if (!check_lse(check, lse, m.problem, &lb)) {
    return false;
  }
  *a = forward_args(*config, m.problem);
  a->q = m.q->data;
  a->k = m.k->data;
  a->v = m.v->data;
  a->o = ob->data;
  a->softmax_lse = lb != nullptr ? static_cast<float *>(lb->data) : nullptr;
  a->cu_seqlens_q = m.cu_q;
  a->cu_seqlens_kv = m.cu_kv;
  a->rng_state = m.rng;
  if (is_fp8(a->qkv_dtype)) {
    AttentionFp8 &f = a->fp8;
    if (!(f.descale_q = fp32_slot(check, q, TE_SLOT_SCALE_INV, "q.scale_inv", true)) ||
        !(f.descale_k = fp32_slot(check, k, TE_SLOT_SCALE_INV, "k.scale_inv", true)) ||
        !(f.descale_v = fp32_slot(check, v, TE_SLOT_SCALE_INV, "v.scale_inv", true))) {
      return false;
    }
    if (is_fp8(a->o_dtype)) {
      if (!(f.scale_o = fp32_slot(check, o, TE_SLOT_SCALE, "o.scale", true))) return false;
      f.amax_o = fp32_out(check, o, TE_SLOT_AMAX, "o.amax", false);
    }
    if (!check.handle(s_fp8, "softmax_fp8") ||
        !(f.scale_s = fp32_slot(check, s_fp8, TE_SLOT_SCALE, "softmax_fp8.scale", true)) ||
        !(f.descale_s = fp32_slot(check, s_fp8, TE_SLOT_SCALE_INV, "softmax_fp8.scale_inv", true))) {
      return false;
    }
    f.amax_s = fp32_out(check, s_fp8, TE_SLOT_AMAX, "softmax_fp8.amax", false);
  } else if (s_fp8 != nullptr) {
    return check.fail(TE_ERROR_VALUE, "softmax_fp8 must be NULL unless q, k and v are FP8, got a tensor");
  }
  if (check.status() != TE_SUCCESS) return false;
  const te_buffer eq = operand_extent(*config, 0, *m.q, m.dq), ek = operand_extent(*config, 1, *m.k, m.dk),
                  ev = operand_extent(*config, 2, *m.v, m.dv);
  return check.disjoint({{ob, "o.data"}, {lb, "softmax_lse.data"}, {slot(o, TE_SLOT_AMAX), "o.amax"},
                         {slot(s_fp8, TE_SLOT_AMAX), "softmax_fp8.amax"}},
                        {{&eq, "q.data"}, {&ek, "k.data"}, {&ev, "v.data"}});
}

// The FP8 factors of a backward with FP8 q/k/v (the dtypes are checked already).
bool check_backward_fp8(Checker &check, const te_tensor *q, const te_tensor *k, const te_tensor *v,
                        const te_tensor *o, const te_tensor *d_o, const te_tensor *s_fp8, te_tensor *dq,
                        te_tensor *dk, te_tensor *dv, te_tensor *dp_fp8, AttentionBackwardArgs *a) {
  AttentionFp8 &f = a->fp8;
  if (!(f.descale_q = fp32_slot(check, q, TE_SLOT_SCALE_INV, "q.scale_inv", true)) ||
      !(f.descale_k = fp32_slot(check, k, TE_SLOT_SCALE_INV, "k.scale_inv", true)) ||
      !(f.descale_v = fp32_slot(check, v, TE_SLOT_SCALE_INV, "v.scale_inv", true))) {
    return false;
  }
  if (is_fp8(a->o_dtype) && !(f.descale_o = fp32_slot(check, o, TE_SLOT_SCALE_INV, "o.scale_inv", true))) {
    return false;
  }
  if (is_fp8(a->do_dtype) && !(f.descale_do = fp32_slot(check, d_o, TE_SLOT_SCALE_INV, "d_o.scale_inv", true))) {
    return false;
  }
  if (is_fp8(a->grad_dtype)) {
    if (!(f.scale_dq = fp32_slot(check, dq, TE_SLOT_SCALE, "dq.scale", true)) ||
        !(f.scale_dk = fp32_slot(check, dk, TE_SLOT_SCALE, "dk.scale", true)) ||
        !(f.scale_dv = fp32_slot(check, dv, TE_SLOT_SCALE, "dv.scale", true))) {
      return false;
    }
    f.amax_dq = fp32_out(check, dq, TE_SLOT_AMAX, "dq.amax", false);
    f.amax_dk = fp32_out(check, dk, TE_SLOT_AMAX, "dk.amax", false);
    f.amax_dv = fp32_out(check, dv, TE_SLOT_AMAX, "dv.amax", false);
  }
  // Every backend reads the forward's softmax factors: the fused kernels quantize p with them,
  // the CPU and CUDA math paths round p as the forward did.
  if (!check.handle(s_fp8, "softmax_fp8") ||
      !(f.scale_s = fp32_slot(check, s_fp8, TE_SLOT_SCALE, "softmax_fp8.scale", true)) ||
      !(f.descale_s = fp32_slot(check, s_fp8, TE_SLOT_SCALE_INV, "softmax_fp8.scale_inv", true))) {
    return false;
  }
  if (!check.handle(dp_fp8, "dp_fp8") ||
      !(f.scale_dp = fp32_slot(check, dp_fp8, TE_SLOT_SCALE, "dp_fp8.scale", true)) ||
      !(f.descale_dp = fp32_slot(check, dp_fp8, TE_SLOT_SCALE_INV, "dp_fp8.scale_inv", true))) {
    return false;
  }
  f.amax_dp = fp32_out(check, dp_fp8, TE_SLOT_AMAX, "dp_fp8.amax", false);
  return check.status() == TE_SUCCESS;
}

bool check_backward(Checker &check, const te_attention_config *config, const te_tensor *q, const te_tensor *k,
                    const te_tensor *v, const te_tensor *o, const te_tensor *d_o, const te_tensor *lse,
                    const te_tensor *cu_q, const te_tensor *cu_kv, const te_tensor *rng, const te_tensor *s_fp8,
                    te_tensor *dq, te_tensor *dk, te_tensor *dv, te_tensor *dp_fp8, AttentionBackwardArgs *a) {
  Common m;
  if (!check_attention_config(check, config) || !check_common(check, *config, q, k, v, cu_q, cu_kv, rng, &m)) {
    return false;
  }
  const te_buffer *ob = data_of(check, o, "o", any_float, "a floating-point dtype");
  const te_buffer *dob = ob ? data_of(check, d_o, "d_o", any_float, "a floating-point dtype") : nullptr;
  if (dob == nullptr) return false;
  int64_t shape[TE_MAX_DIMS];
  o_shape(*m.q, m.dv.dim, shape);
  if (!shape_is(check, *ob, "o.data", shape, m.q->ndim, "q's shape with v's head dim") ||
      !shape_is(check, *dob, "d_o.data", shape, m.q->ndim, "o's shape")) {
    return false;
  }
  const te_buffer *g[3];
  const char *names[3] = {"dq", "dk", "dv"};
  const te_tensor *grads[3] = {dq, dk, dv};
  const te_buffer *like[3] = {m.q, m.k, m.v};
  for (int i = 0; i < 3; ++i) {
    if (!(g[i] = data_of(check, grads[i], names[i], any_float, "a floating-point dtype")) ||
        !shape_is(check, *g[i], std::string(names[i]) + ".data", like[i]->shape, like[i]->ndim,
                  std::string("the shape of ") + (names[i] + 1)) ||
        !check.dtype_is(*g[i], (std::string(names[i]) + ".data").c_str(), g[0]->dtype)) {
      return false;
    }
  }
  m.problem.o_dtype = ob->dtype;
  m.problem.do_dtype = dob->dtype;  // checked against o's by check_attention_problem
  m.problem.grad_dtype = g[0]->dtype;
  const te_buffer *lb = nullptr;
  if (!check_attention_problem(check, *config, m.problem, true) || !check_lse(check, lse, m.problem, &lb)) {
    return false;
  }
  *a = backward_args(*config, m.problem);
  a->q = m.q->data;
  a->k = m.k->data;
  a->v = m.v->data;
  a->o = ob->data;
  a->d_o = dob->data;
  a->softmax_lse = static_cast<const float *>(lb->data);
  a->dq = g[0]->data;
  a->dk = g[1]->data;
  a->dv = g[2]->data;
  a->cu_seqlens_q = m.cu_q;
  a->cu_seqlens_kv = m.cu_kv;
  a->rng_state = m.rng;
  if (is_fp8(a->qkv_dtype)) {
    if (!check_backward_fp8(check, q, k, v, o, d_o, s_fp8, dq, dk, dv, dp_fp8, a)) return false;
  } else if (s_fp8 != nullptr || dp_fp8 != nullptr) {
    return check.fail(TE_ERROR_VALUE, std::string(s_fp8 != nullptr ? "softmax_fp8" : "dp_fp8") +
                                          " must be NULL unless q, k and v are FP8, got a tensor");
  }
  if (check.status() != TE_SUCCESS) return false;
  const te_buffer eq = operand_extent(*config, 0, *m.q, m.dq), ek = operand_extent(*config, 1, *m.k, m.dk),
                  ev = operand_extent(*config, 2, *m.v, m.dv);
  const te_buffer edq = operand_extent(*config, 0, *g[0], m.dq), edk = operand_extent(*config, 1, *g[1], m.dk),
                  edv = operand_extent(*config, 2, *g[2], m.dv);
  const std::vector<Checker::Named> inputs = {{&eq, "q.data"},  {&ek, "k.data"},    {&ev, "v.data"},
                                              {ob, "o.data"},   {dob, "d_o.data"}, {lb, "softmax_lse.data"}};
  if (strided(*config)) {
    // Strided gradients may interleave in one buffer (attention.h: the caller vouches that
    // their elements differ); each is still checked against the inputs and dp's amax.
    return check.disjoint({{&edq, "dq.data"}, {slot(dp_fp8, TE_SLOT_AMAX), "dp_fp8.amax"}}, inputs) &&
           check.disjoint({{&edk, "dk.data"}, {slot(dp_fp8, TE_SLOT_AMAX), "dp_fp8.amax"}}, inputs) &&
           check.disjoint({{&edv, "dv.data"}, {slot(dp_fp8, TE_SLOT_AMAX), "dp_fp8.amax"}}, inputs);
  }
  return check.disjoint({{g[0], "dq.data"}, {g[1], "dk.data"}, {g[2], "dv.data"},
                         {slot(dp_fp8, TE_SLOT_AMAX), "dp_fp8.amax"}},
                        inputs);
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_attention_forward(const te_attention_config *config, const te_tensor *q, const te_tensor *k,
                               const te_tensor *v, te_tensor *o, te_tensor *softmax_lse,
                               const te_tensor *cu_seqlens_q, const te_tensor *cu_seqlens_kv,
                               const te_tensor *rng_state, te_tensor *softmax_fp8, void *workspace,
                               size_t workspace_size, te_stream stream) {
  return te::guarded("attention_forward", [&]() -> te_status {
    te::Checker check("attention_forward");
    te::AttentionForwardArgs args;
    if (!te::check_forward(check, config, q, k, v, o, softmax_lse, cu_seqlens_q, cu_seqlens_kv, rng_state,
                           softmax_fp8, &args)) {
      return check.status();
    }
    std::string reasons[TE_ATTN_BACKEND_COUNT];
    const te_attn_backend backend = te::choose_forward_backend(check, *config, args, reasons);
    if (backend == TE_ATTN_BACKEND_AUTO) return check.status();
    args.workspace = workspace;
    args.workspace_size = workspace != nullptr ? workspace_size : 0;
    if (!te::check_workspace(check, te::forward_workspace_size(backend, args), args.workspace_size)) {
      return check.status();
    }
    if (backend == TE_ATTN_BACKEND_CPU) {
      te::attention_forward_ref(args);
      return TE_SUCCESS;
    }
    te::CudaDeviceScope on_device(args.device);
#ifdef TE_WITH_CUDNN
    if (backend == TE_ATTN_BACKEND_CUDNN) return te::cudnn_attention_forward(args, stream);
#endif
    return te::attention_forward_cuda(args, stream);
  });
}

te_status te_attention_backward(const te_attention_config *config, const te_tensor *q, const te_tensor *k,
                                const te_tensor *v, const te_tensor *o, const te_tensor *d_o,
                                const te_tensor *softmax_lse, const te_tensor *cu_seqlens_q,
                                const te_tensor *cu_seqlens_kv, const te_tensor *rng_state,
                                const te_tensor *softmax_fp8, te_tensor *dq, te_tensor *dk, te_tensor *dv,
                                te_tensor *dp_fp8, void *workspace, size_t workspace_size, te_stream stream) {
  return te::guarded("attention_backward", [&]() -> te_status {
    te::Checker check("attention_backward");
    te::AttentionBackwardArgs args;
    if (!te::check_backward(check, config, q, k, v, o, d_o, softmax_lse, cu_seqlens_q, cu_seqlens_kv, rng_state,
                            softmax_fp8, dq, dk, dv, dp_fp8, &args)) {
      return check.status();
    }
    std::string reasons[TE_ATTN_BACKEND_COUNT];
    const te_attn_backend backend = te::choose_backward_backend(check, *config, args, reasons);
    if (backend == TE_ATTN_BACKEND_AUTO) return check.status();
    args.workspace = workspace;
    args.workspace_size = workspace != nullptr ? workspace_size : 0;
    if (!te::check_workspace(check, te::backward_workspace_size(backend, args), args.workspace_size)) {
      return check.status();
    }
    if (backend == TE_ATTN_BACKEND_CPU) {
      te::attention_backward_ref(args);
      return TE_SUCCESS;
    }
    te::CudaDeviceScope on_device(args.device);
#ifdef TE_WITH_CUDNN
    if (backend == TE_ATTN_BACKEND_CUDNN) return te::cudnn_attention_backward(args, stream);
#endif
    return te::attention_backward_cuda(args, stream);
  });
}

}  // extern "C"
