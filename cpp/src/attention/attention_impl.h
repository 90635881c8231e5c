// The resolved arguments of the attention entry points: what the C API validates and hands to a
// backend (the CPU reference, the unfused CUDA path, or cuDNN's fused kernels). Every pointer is
// a raw buffer on the call's device; shapes and layouts are already checked.
//
// Semantics shared by every backend (the public header states them for users):
//  - Logits s[i][j] = softmax_scale * dot(q_i, k_j), i < seqlen_q, j < seqlen_kv of one
//    (batch, head); the head of k/v for query head h is h / (heads_q / heads_kv) (GQA/MQA).
//  - Allowed keys of query i, with off = 0 (top-left) or seqlen_kv - seqlen_q (bottom-right)
//    using the sequence's own lengths under padding/THD:
//      window: i + off - window_left <= j <= i + off + window_right (-1: unbounded side);
//      causal masks are window_right = 0 (the backend sees the window already folded in).
//    A query row with no allowed key gives o = 0 and lse = -inf.
//  - Padding: sequence b has lengths seqlen_q(b) = cu_seqlens_q[b+1] - cu_seqlens_q[b] and
//    likewise for kv; positions at or past them are neither queries nor keys; their o rows are 0.
//  - softmax_lse [batch, heads_q, max_seqlen_q] fp32: natural-log sum-exp of the allowed scaled
//    logits of each row (the backward reads it instead of recomputing the row statistics).
//  - Dropout: p = dropout; a kept probability is scaled by 1 / (1 - p). The mask is a pure
//    function of (rng seed, rng offset, batch, head, i, j) within one backend; backends need not
//    agree with each other on which elements drop.
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_IMPL_H_

#include <cstddef>
#include <cstdint>

#include "transformer_engine/tensor.h"

namespace te {

enum class AttnLayout {
  BSHD,  // q [batch, seqlen, heads, dim], contiguous
  SBHD,  // q [seqlen, batch, heads, dim], contiguous
  THD,   // q [total_tokens, heads, dim]: the sequences packed back to back, cu_seqlens offsets
};

struct AttentionShape {
  int64_t batch, heads_q, heads_kv;
  int64_t seqlen_q, seqlen_kv;  // THD and padding: the maximum over the batch
  int64_t head_dim_qk, head_dim_v;
  int64_t total_q, total_kv;  // THD: rows of q and of k/v; otherwise batch * seqlen
  // Element strides of q, k, v (and dq, dk, dv) [0..2]: between rows (tokens) and between
  // heads, resolved (dense ones are heads * head_dim and head_dim). o and d_o are dense.
  int64_t row_stride[3], head_stride[3];
  bool dense() const {
    return row_stride[0] == heads_q * head_dim_qk && head_stride[0] == head_dim_qk &&
           row_stride[1] == heads_kv * head_dim_qk && head_stride[1] == head_dim_qk &&
           row_stride[2] == heads_kv * head_dim_v && head_stride[2] == head_dim_v;
  }
};

enum AttnOperand { kOperandQ = 0, kOperandK = 1, kOperandV = 2 };

struct AttentionMask {
  bool bottom_right;     // offset the diagonal by seqlen_kv - seqlen_q (per sequence)
  bool padding;          // cu_seqlens give each sequence's lengths (always true for THD)
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded; 0 for causal masks
};

// FP8 attention (q/k/v/o in E4M3; dO/dQ/dK/dV in E5M2 or E4M3 by their dtypes). Per-tensor
// factors, each a device pointer to one fp32: descale = the input's scale_inv, scale = the
// output's scale; amax written as max |value| before scaling. Null members when not FP8.
// "dp" is cuDNN's name for the gradient of the logits that its FP8 backward quantizes,
// ds = softmax_scale * p * (dp - rowsum(p dp)), in dO's format; the backward rounds p with the
// softmax factors again (in E4M3) for dV = dropout(p)^T dO.
struct AttentionFp8 {
  const float *descale_q, *descale_k, *descale_v;
  const float *descale_s, *scale_s;  // the softmax output P, quantized inside the kernel
  const float *scale_o;
  float *amax_s, *amax_o;
  // Backward.
  const float *descale_o, *descale_do, *descale_dp, *scale_dp;
  const float *scale_dq, *scale_dk, *scale_dv;
  float *amax_dp, *amax_dq, *amax_dk, *amax_dv;
};

struct AttentionForwardArgs {
  AttnLayout layout;
  AttentionShape shape;
  AttentionMask mask;
  float softmax_scale;
  float dropout;
  te_dtype qkv_dtype;  // bf16, fp16, fp32 (CPU/unfused), or E4M3 (FP8)
  te_dtype o_dtype;    // qkv_dtype, or bf16/fp16 for an FP8 forward with high-precision output
  const void *q, *k, *v;
  void *o;  // q's layout with head_dim_v
  float *softmax_lse;  // null for an inference forward (te_attention_config.inference)
  const int32_t *cu_seqlens_q, *cu_seqlens_kv;  // [batch + 1], on the call's device, or null
  const int64_t *rng_state;                     // [2] seed, offset, on the call's device, or null
  AttentionFp8 fp8;
  bool inference;
  void *workspace;
  size_t workspace_size;
  int device;  // CUDA ordinal, -1 for the CPU
};

struct AttentionBackwardArgs {
  AttnLayout layout;
  AttentionShape shape;
  AttentionMask mask;
  float softmax_scale;
  float dropout;
  te_dtype qkv_dtype;
  te_dtype o_dtype;     // of o
  te_dtype do_dtype;    // of d_o: o_dtype, or E4M3/E5M2 for an E4M3 o (E5M2: the HYBRID recipe)
  te_dtype grad_dtype;  // of dq, dk, dv
  const void *q, *k, *v, *o, *d_o;
  const float *softmax_lse;
  void *dq, *dk, *dv;  // the layouts of q, k, v
  const int32_t *cu_seqlens_q, *cu_seqlens_kv;
  const int64_t *rng_state;  // the forward's
  AttentionFp8 fp8;
  bool deterministic;  // ask for a deterministic dK/dV reduction where the backend has one
  void *workspace;
  size_t workspace_size;
  int device;
};

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_IMPL_H_
