// What the CPU reference and the CUDA math path of attention share: the indexing of the three
// layouts, the allowed key range of a query, the dropout mask, and their entry points. The
// cuDNN backend has its own dropout generator (attention.h lets backends differ there).
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_MATH_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_MATH_H_

#include <cstdint>

#include "attention/attention_impl.h"
#include "common/hash.h"
#include "common/numerics.h"
#include "transformer_engine/attention.h"

namespace te {

// Lengths of sequence b and the first row of it in a THD buffer.
struct SeqLens {
  int64_t q, kv, q_start, kv_start;
};

TE_HOST_DEVICE SeqLens seq_lens(const AttentionShape &s, bool padding, const int32_t *cu_q,
                                const int32_t *cu_kv, int64_t b) {
  SeqLens r{s.seqlen_q, s.seqlen_kv, 0, 0};
  if (padding) {
    r.q = cu_q[b + 1] - cu_q[b];
    r.kv = cu_kv[b + 1] - cu_kv[b];
    r.q_start = cu_q[b];
    r.kv_start = cu_kv[b];
  }
  return r;
}

// Element offset of (b, position, head, 0) in a buffer whose rows (tokens) are row_stride and
// heads head_stride elements apart (dense: heads * dim and dim). THD positions count from the
// sequence's first row, `start`.
TE_HOST_DEVICE int64_t attn_offset(AttnLayout layout, int64_t batch, int64_t seqlen, int64_t row_stride,
                                   int64_t head_stride, int64_t b, int64_t pos, int64_t start, int64_t h) {
  int64_t row;
  switch (layout) {
    case AttnLayout::BSHD: row = b * seqlen + pos; break;
    case AttnLayout::SBHD: row = pos * batch + b; break;
    default: row = start + pos; break;
  }
  return row * row_stride + h * head_stride;
}

// Offset of row (b, pos) and head h of q, k or v (`op`) under the call's strides.
TE_HOST_DEVICE int64_t operand_offset(const AttentionShape &s, AttnLayout layout, AttnOperand op, int64_t b,
                                      int64_t pos, int64_t start, int64_t h) {
  return attn_offset(layout, s.batch, op == kOperandQ ? s.seqlen_q : s.seqlen_kv, s.row_stride[op],
                     s.head_stride[op], b, pos, start, h);
}

// The same row and head in a dense buffer of `heads` heads of `dim` (o, d_o, the gradients'
// fp32 sums); `query`: a row of q's sequence, else of k/v's.
TE_HOST_DEVICE int64_t dense_offset(const AttentionShape &s, AttnLayout layout, bool query, int64_t heads,
                                    int64_t dim, int64_t b, int64_t pos, int64_t start, int64_t h) {
  return attn_offset(layout, s.batch, query ? s.seqlen_q : s.seqlen_kv, heads * dim, dim, b, pos, start, h);
}

// Where element e of a dense [rows, heads, dim] operand sits under (row_stride, head_stride).
TE_HOST_DEVICE int64_t strided_element(int64_t e, int64_t heads, int64_t dim, int64_t row_stride,
                                       int64_t head_stride) {
  const int64_t row = e / (heads * dim), rest = e % (heads * dim);
  return row * row_stride + (rest / dim) * head_stride + rest % dim;
}

// The allowed keys [*lo, *hi] of query i (empty when *lo > *hi).
TE_HOST_DEVICE void allowed_keys(const AttentionMask &m, int64_t i, int64_t sq, int64_t skv, int64_t *lo,
                                 int64_t *hi) {
  const int64_t d = i + (m.bottom_right ? skv - sq : 0);
  int64_t a = 0, z = skv - 1;
  if (m.window_left >= 0 && d - m.window_left > a) a = d - m.window_left;
  if (m.window_right >= 0 && d + m.window_right < z) z = d + m.window_right;
  *lo = a;
  *hi = z;
}

// True when element (b, h, i, j) of the probabilities is kept: its counter
// offset + ((b * heads + h) * seqlen_q + i) * seqlen_kv + j, hashed with the seed, gives a
// uniform 24-bit u (common/hash.h); the element drops when u < p.
TE_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, const AttentionShape &s, int64_t b, int64_t h,
                                 int64_t i, int64_t j, float p) {
  const uint64_t counter =
      offset + static_cast<uint64_t>(((b * s.heads_q + h) * s.seqlen_q + i) * s.seqlen_kv + j);
  return uniform24(counter, seed) >= p;
}

// The resolved arguments of te_scaled_softmax_forward / backward.
struct SoftmaxForwardArgs {
  te_softmax_mask_type mask_type;
  float scale;
  const void *x;
  void *y;
  te_dtype dtype;
  int64_t batch, heads, sq, sk;
  const uint8_t *mask;             // ARBITRARY: [mask_batch, mask_heads, sq, sk]
  int64_t mask_batch, mask_heads;  // 1 or batch / heads
};

struct SoftmaxBackwardArgs {
  float scale;
  const void *dy, *y;
  void *dx;
  te_dtype dtype;
  int64_t rows, cols;
};

TE_HOST_DEVICE bool softmax_masked(const SoftmaxForwardArgs &a, int64_t b, int64_t h, int64_t i, int64_t j) {
  switch (a.mask_type) {
    case TE_SOFTMAX_MASK_CAUSAL: return j > i;
    case TE_SOFTMAX_MASK_CAUSAL_BOTTOM_RIGHT: return j > i + a.sk - a.sq;
    case TE_SOFTMAX_MASK_ARBITRARY: {
      const int64_t mb = a.mask_batch == 1 ? 0 : b, mh = a.mask_heads == 1 ? 0 : h;
      return a.mask[((mb * a.mask_heads + mh) * a.sq + i) * a.sk + j] != 0;
    }
    default: return false;
  }
}

// CPU reference (attention_ref.cpp).
void attention_forward_ref(const AttentionForwardArgs &args);
void attention_backward_ref(const AttentionBackwardArgs &args);
void scaled_softmax_forward_ref(const SoftmaxForwardArgs &args);
void scaled_softmax_backward_ref(const SoftmaxBackwardArgs &args);

// CUDA math path and softmax kernels (attention.cu, softmax.cu; stubs in a CPU-only build).
te_status attention_forward_cuda(const AttentionForwardArgs &args, te_stream stream);
te_status attention_backward_cuda(const AttentionBackwardArgs &args, te_stream stream);
size_t attention_backward_cuda_workspace_size(const AttentionShape &shape);
te_status scaled_softmax_forward_cuda(const SoftmaxForwardArgs &args, te_stream stream);
te_status scaled_softmax_backward_cuda(const SoftmaxBackwardArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_MATH_H_
