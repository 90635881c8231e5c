// CPU reference of attention and of the scaled masked softmax: fp32 math, one query row at a
// time, in the words of attention.h. It is the CPU backend of both frameworks and the oracle of
// the CUDA paths. FP8 inputs are decoded with their descale, and the intermediates that the
// fused kernels quantize are rounded the same way: the forward rounds p through E4M3 with the
// softmax factors; the backward rounds p again so (dv is the gradient of the o the forward
// wrote) and rounds ds, the gradient of the logits, to an FP8 d_o's format with the dp factors
// before the dq and dk products, recording max |ds| as the dp amax.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/attention_math.h"
#include "common/elementwise.h"
#include "common/internal.h"

namespace te {
namespace {

// Reads element i of a buffer as fp32: high precision as is, FP8 times its descale.
struct Reader {
  const void *data;
  te_dtype dtype;
  float descale;
  float operator()(int64_t i) const {
    if (is_fp8(dtype)) return from_fp8(static_cast<const uint8_t *>(data)[i], dtype) * descale;
    return load_hp(data, i, dtype);
  }
};

Reader reader(const void *data, te_dtype dtype, const float *descale) {
  return Reader{data, dtype, descale != nullptr ? *descale : 1.0f};
}

void write(void *data, int64_t i, te_dtype dtype, float v, const float *scale) {
  if (is_fp8(dtype)) {
    static_cast<uint8_t *>(data)[i] = to_fp8(v * *scale, dtype);
  } else {
    store_hp(data, i, dtype, v);
  }
}

// v through an FP8 format and back: what a kernel that stores v with this scale then reads.
float round_fp8(float v, te_dtype dtype, float scale, float descale) {
  return from_fp8(to_fp8(v * scale, dtype), dtype) * descale;
}

void note_amax(float *amax, float v) {
  if (amax != nullptr) *amax = std::max(*amax, std::fabs(v));
}

float dot(const Reader &a, int64_t ia, const Reader &b, int64_t ib, int64_t n) {
  float acc = 0.0f;
  for (int64_t d = 0; d < n; ++d) acc += a(ia + d) * b(ib + d);
  return acc;
}

// Offsets of one (b, h) pair's rows: of q, k, v (`op`) as strided in the call, and dense ones
// (of o, d_o and the gradients' fp32 sums).
struct RowIndex {
  const AttentionShape &s;
  AttnLayout layout;
  int64_t at(AttnOperand op, int64_t b, int64_t pos, int64_t start, int64_t h) const {
    return operand_offset(s, layout, op, b, pos, start, h);
  }
  int64_t q(int64_t b, int64_t i, int64_t start, int64_t h, int64_t dim) const {
    return dense_offset(s, layout, true, s.heads_q, dim, b, i, start, h);
  }
  int64_t kv(int64_t b, int64_t j, int64_t start, int64_t g, int64_t dim) const {
    return dense_offset(s, layout, false, s.heads_kv, dim, b, j, start, g);
  }
};

}  // namespace

void attention_forward_ref(const AttentionForwardArgs &a) {
  const AttentionShape &s = a.shape;
  const AttentionFp8 &f = a.fp8;
  const bool fp8 = is_fp8(a.qkv_dtype);
  const Reader q = reader(a.q, a.qkv_dtype, f.descale_q), k = reader(a.k, a.qkv_dtype, f.descale_k),
               v = reader(a.v, a.qkv_dtype, f.descale_v);
  const float *scale_o = is_fp8(a.o_dtype) ? f.scale_o : nullptr;
  const int64_t group = s.heads_q / s.heads_kv, dv = s.head_dim_v;
  const float keep_scale = a.dropout > 0.0f ? 1.0f / (1.0f - a.dropout) : 1.0f;
  const uint64_t seed = a.dropout > 0.0f ? static_cast<uint64_t>(a.rng_state[0]) : 0;
  const uint64_t offset = a.dropout > 0.0f ? static_cast<uint64_t>(a.rng_state[1]) : 0;
  const int64_t o_elems = s.total_q * s.heads_q * dv;
  for (int64_t e = 0; e < o_elems; ++e) write(a.o, e, a.o_dtype, 0.0f, scale_o);
  const int64_t lse_elems = s.batch * s.heads_q * s.seqlen_q;
  if (a.softmax_lse != nullptr) {  // (none in inference)
    std::fill(a.softmax_lse, a.softmax_lse + lse_elems, -std::numeric_limits<float>::infinity());
  }
  if (f.amax_s != nullptr) *f.amax_s = 0.0f;
  if (f.amax_o != nullptr) *f.amax_o = 0.0f;
  const RowIndex idx{s, a.layout};
  std::vector<float> p(static_cast<size_t>(s.seqlen_kv)), acc(static_cast<size_t>(dv));
  for (int64_t b = 0; b < s.batch; ++b) {
    const SeqLens L = seq_lens(s, a.mask.padding, a.cu_seqlens_q, a.cu_seqlens_kv, b);
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < L.q; ++i) {
        int64_t lo, hi;
        allowed_keys(a.mask, i, L.q, L.kv, &lo, &hi);
        if (lo > hi) continue;
        const int64_t qi = idx.at(kOperandQ, b, i, L.q_start, h);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j <= hi; ++j) {
          p[j] = a.softmax_scale * dot(q, qi, k, idx.at(kOperandK, b, j, L.kv_start, g), s.head_dim_qk);
          m = std::max(m, p[j]);
        }
        float sum = 0.0f;
        for (int64_t j = lo; j <= hi; ++j) sum += std::exp(p[j] - m);
        const float lse = m + std::log(sum);
        if (a.softmax_lse != nullptr) a.softmax_lse[(b * s.heads_q + h) * s.seqlen_q + i] = lse;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = lo; j <= hi; ++j) {
          float pj = std::exp(p[j] - lse);
          if (fp8) {
            note_amax(f.amax_s, pj);
            pj = round_fp8(pj, TE_DTYPE_FLOAT8_E4M3, *f.scale_s, *f.descale_s);
          }
          if (a.dropout > 0.0f) {
            pj = dropout_keep(seed, offset, s, b, h, i, j, a.dropout) ? pj * keep_scale : 0.0f;
          }
          if (pj == 0.0f) continue;
          const int64_t vj = idx.at(kOperandV, b, j, L.kv_start, g);
          for (int64_t d = 0; d < dv; ++d) acc[d] += pj * v(vj + d);
        }
        const int64_t oi = idx.q(b, i, L.q_start, h, dv);
        for (int64_t d = 0; d < dv; ++d) {
          note_amax(f.amax_o, acc[d]);
          write(a.o, oi + d, a.o_dtype, acc[d], scale_o);
        }
      }
    }
  }
}

void attention_backward_ref(const AttentionBackwardArgs &a) {
  const AttentionShape &s = a.shape;
  const AttentionFp8 &f = a.fp8;
  const Reader q = reader(a.q, a.qkv_dtype, f.descale_q), k = reader(a.k, a.qkv_dtype, f.descale_k),
               v = reader(a.v, a.qkv_dtype, f.descale_v), d_o = reader(a.d_o, a.do_dtype, f.descale_do),
               o = reader(a.o, a.o_dtype, f.descale_o);
  const bool fp8 = is_fp8(a.qkv_dtype), fp8_ds = fp8 && is_fp8(a.do_dtype);
  const int64_t group = s.heads_q / s.heads_kv, dqk = s.head_dim_qk, dv = s.head_dim_v;
  const float keep_scale = a.dropout > 0.0f ? 1.0f / (1.0f - a.dropout) : 1.0f;
  const uint64_t seed = a.dropout > 0.0f ? static_cast<uint64_t>(a.rng_state[0]) : 0;
  const uint64_t offset = a.dropout > 0.0f ? static_cast<uint64_t>(a.rng_state[1]) : 0;
  std::vector<float> dq(static_cast<size_t>(s.total_q * s.heads_q * dqk), 0.0f);
  std::vector<float> dk(static_cast<size_t>(s.total_kv * s.heads_kv * dqk), 0.0f);
  std::vector<float> dvv(static_cast<size_t>(s.total_kv * s.heads_kv * dv), 0.0f);
  std::vector<float> p(static_cast<size_t>(s.seqlen_kv)), dp(static_cast<size_t>(s.seqlen_kv));
  if (f.amax_dp != nullptr) *f.amax_dp = 0.0f;
  const RowIndex idx{s, a.layout};
  for (int64_t b = 0; b < s.batch; ++b) {
    const SeqLens L = seq_lens(s, a.mask.padding, a.cu_seqlens_q, a.cu_seqlens_kv, b);
    for (int64_t h = 0; h < s.heads_q; ++h) {
      const int64_t g = h / group;
      for (int64_t i = 0; i < L.q; ++i) {
        int64_t lo, hi;
        allowed_keys(a.mask, i, L.q, L.kv, &lo, &hi);
        if (lo > hi) continue;
        const float lse = a.softmax_lse[(b * s.heads_q + h) * s.seqlen_q + i];
        // q, k, v read where the call's strides put them; the gradients summed densely
        const int64_t qi = idx.at(kOperandQ, b, i, L.q_start, h), oi = idx.q(b, i, L.q_start, h, dv);
        // sum_j p_j dp_j over the whole row, taken as dot(d_o_i, o_i) from the o given, as
        // the fused kernels and the CUDA math path take it (attention.h): so a call over some
        // of a row's keys, given the whole row's o and lse, gives those keys' share of the
        // gradients (ring attention).
        const float row_dot = dot(d_o, oi, o, oi, dv);
        for (int64_t j = lo; j <= hi; ++j) {
          const float sj = a.softmax_scale * dot(q, qi, k, idx.at(kOperandK, b, j, L.kv_start, g), dqk);
          p[j] = std::exp(sj - lse);
          const bool keep = a.dropout <= 0.0f || dropout_keep(seed, offset, s, b, h, i, j, a.dropout);
          const float dpd = dot(d_o, oi, v, idx.at(kOperandV, b, j, L.kv_start, g), dv);  // grad of dropped p
          dp[j] = keep ? dpd * keep_scale : 0.0f;
          // dv_j += dropout(p_j) d_o_i, with p rounded as the forward rounded it
          const float pr = fp8 ? round_fp8(p[j], TE_DTYPE_FLOAT8_E4M3, *f.scale_s, *f.descale_s) : p[j];
          const float pd = keep ? pr * keep_scale : 0.0f;
          if (pd != 0.0f) {
            float *dvj = &dvv[idx.kv(b, j, L.kv_start, g, dv)];
            for (int64_t d = 0; d < dv; ++d) dvj[d] += pd * d_o(oi + d);
          }
        }
        float *dqi = &dq[idx.q(b, i, L.q_start, h, dqk)];
        for (int64_t j = lo; j <= hi; ++j) {
          float ds = a.softmax_scale * p[j] * (dp[j] - row_dot);
          note_amax(f.amax_dp, ds);
          if (fp8_ds) ds = round_fp8(ds, a.do_dtype, *f.scale_dp, *f.descale_dp);
          if (ds == 0.0f) continue;
          const int64_t kj = idx.at(kOperandK, b, j, L.kv_start, g);
          float *dkj = &dk[idx.kv(b, j, L.kv_start, g, dqk)];
          for (int64_t d = 0; d < dqk; ++d) {
            dqi[d] += ds * k(kj + d);
            dkj[d] += ds * q(qi + d);
          }
        }
      }
    }
  }
  struct Out {
    void *data;
    const std::vector<float> &values;
    const float *scale;
    float *amax;
    AttnOperand op;
    int64_t heads, dim;
  };
  const bool fp8_grads = is_fp8(a.grad_dtype);
  for (const Out &out : {Out{a.dq, dq, f.scale_dq, f.amax_dq, kOperandQ, s.heads_q, dqk},
                         Out{a.dk, dk, f.scale_dk, f.amax_dk, kOperandK, s.heads_kv, dqk},
                         Out{a.dv, dvv, f.scale_dv, f.amax_dv, kOperandV, s.heads_kv, dv}}) {
    if (fp8_grads && out.amax != nullptr) *out.amax = 0.0f;
    for (size_t e = 0; e < out.values.size(); ++e) {
      if (fp8_grads) note_amax(out.amax, out.values[e]);
      const int64_t at = strided_element(static_cast<int64_t>(e), out.heads, out.dim, s.row_stride[out.op],
                                         s.head_stride[out.op]);
      write(out.data, at, a.grad_dtype, out.values[e], out.scale);
    }
  }
}

void scaled_softmax_forward_ref(const SoftmaxForwardArgs &a) {
  std::vector<float> row(static_cast<size_t>(a.sk));
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t h = 0; h < a.heads; ++h) {
      for (int64_t i = 0; i < a.sq; ++i) {
        const int64_t base = ((b * a.heads + h) * a.sq + i) * a.sk;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < a.sk; ++j) {
          row[j] = softmax_masked(a, b, h, i, j) ? -std::numeric_limits<float>::infinity()
                                                 : a.scale * load_hp(a.x, base + j, a.dtype);
          m = std::max(m, row[j]);
        }
        const bool empty = m == -std::numeric_limits<float>::infinity();
        float sum = 0.0f;
        for (int64_t j = 0; j < a.sk && !empty; ++j) sum += std::exp(row[j] - m);
        for (int64_t j = 0; j < a.sk; ++j) {
          store_hp(a.y, base + j, a.dtype, empty ? 0.0f : std::exp(row[j] - m) / sum);
        }
      }
    }
  }
}

void scaled_softmax_backward_ref(const SoftmaxBackwardArgs &a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    const int64_t base = r * a.cols;
    float row_dot = 0.0f;
    for (int64_t j = 0; j < a.cols; ++j) row_dot += load_hp(a.dy, base + j, a.dtype) * load_hp(a.y, base + j, a.dtype);
    for (int64_t j = 0; j < a.cols; ++j) {
      const float y = load_hp(a.y, base + j, a.dtype);
      store_hp(a.dx, base + j, a.dtype, a.scale * y * (load_hp(a.dy, base + j, a.dtype) - row_dot));
    }
  }
}

}  // namespace te
