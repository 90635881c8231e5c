/* Transformer Engine core: dot-product attention, forward and backward, and the scaled masked
 * softmax of the unfused path.
 *
 * Attention of one (batch b, query head h), with kv head g = h / (heads_q / heads_kv) (GQA/MQA):
 *   s[i][j] = softmax_scale * dot(q[b, i, h], k[b, j, g])
 *   p[i][j] = exp(s[i][j] - lse[i]) over the allowed keys j of query i, 0 elsewhere
 *   lse[i]  = log(sum over the allowed j of exp(s[i][j]))            (natural log)
 *   o[b, i, h] = sum over j of dropout(p[i][j]) * v[b, j, g]
 * Allowed keys of query i in a sequence of lengths sq (queries) and skv (keys), with
 * off = 0 (top-left diagonal) or skv - sq (bottom-right diagonal):
 *   window: i + off - window_left <= j <= i + off + window_right (-1: that side unbounded);
 *   the causal masks set window_right = 0 (and keep the given window_left).
 * A query row with no allowed key gives o = 0 and lse = -inf. Padding masks (and the THD
 * layout, which always has them) take each sequence's lengths from cu_seqlens: sequence b has
 * sq(b) = cu_seqlens_q[b + 1] - cu_seqlens_q[b] queries, likewise for keys; positions at or
 * past them are neither queries nor keys, and their rows of o (and of dq, dk, dv) are 0.
 * Dropout with probability p keeps an element with probability 1 - p and scales it by
 * 1 / (1 - p); which elements drop is a pure function of rng_state (seed, offset) and the
 * element's (b, h, i, j) on one backend (backends need not agree with each other).
 *
 * Layouts of q (k and v alike, with their own head counts and head dims):
 *   BSHD [batch, seqlen, heads, dim], SBHD [seqlen, batch, heads, dim],
 *   THD  [total_tokens, heads, dim]: the sequences back to back, sequence b at rows
 *        cu_seqlens[b] .. cu_seqlens[b + 1] - 1.
 * softmax_lse is [batch, heads_q, max_seqlen_q] fp32 in every layout.
 *
 * Backends: cuDNN's fused kernels (when the build has cuDNN and cuDNN takes the call), the
 * core's plain CUDA math path (any mask, slow: for what cuDNN rejects), and the CPU reference
 * (fp32 math, the CPU backend and the test oracle). te_attention_backend says which one a call
 * would run and why each other one was passed over.
 */
#ifndef TRANSFORMER_ENGINE_ATTENTION_H_
#define TRANSFORMER_ENGINE_ATTENTION_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TE_ATTN_MASK_NO_MASK = 0,
  TE_ATTN_MASK_CAUSAL = 1,                       /* top-left diagonal */
  TE_ATTN_MASK_CAUSAL_BOTTOM_RIGHT = 2,          /* diagonal through the last query and key */
  TE_ATTN_MASK_PADDING = 3,                      /* per-sequence lengths from cu_seqlens */
  TE_ATTN_MASK_PADDING_CAUSAL = 4,               /* both, top-left per sequence */
  TE_ATTN_MASK_PADDING_CAUSAL_BOTTOM_RIGHT = 5,  /* both, bottom-right per sequence */
  TE_ATTN_MASK_COUNT = 6
} te_attn_mask_type;

typedef enum {
  TE_ATTN_LAYOUT_BSHD = 0,
  TE_ATTN_LAYOUT_SBHD = 1,
  TE_ATTN_LAYOUT_THD = 2,
  TE_ATTN_LAYOUT_COUNT = 3
} te_attn_layout;

typedef enum {
  TE_ATTN_BACKEND_AUTO = -1, /* config only: the first backend, in this order, that takes it */
  TE_ATTN_BACKEND_CUDNN = 0,
  TE_ATTN_BACKEND_CUDA_MATH = 1,
  TE_ATTN_BACKEND_CPU = 2,
  TE_ATTN_BACKEND_COUNT = 3
} te_attn_backend;

/* Bytes of each reason that te_attention_backend writes (with the terminating NUL). */
#define TE_ATTN_REASON_SIZE 256

typedef struct {
  te_attn_layout layout;
  te_attn_mask_type mask_type;
  int64_t window_left;  /* -1: unbounded (the default); >= 0 otherwise */
  int64_t window_right; /* -1: unbounded; ignored (0) for causal masks */
  float softmax_scale;  /* > 0 and finite; usually 1 / sqrt(head_dim_qk) */
  float dropout;        /* probability in [0, 1) */
  int64_t max_seqlen_q; /* THD: upper bound of the query lengths (softmax_lse's last dim); else ignored */
  int64_t max_seqlen_kv; /* THD: upper bound of the key lengths; else ignored */
  int32_t deterministic; /* backward: nonzero asks for a deterministic dk/dv reduction */
  te_attn_backend backend; /* TE_ATTN_BACKEND_AUTO or the one to run (an error if it cannot) */
  int32_t inference; /* forward: nonzero computes o only: softmax_lse must be NULL (a forward
                      * that no backward follows; cuDNN's FP8 forward is faster without it) */
  /* Strides of q, k, v ([0], [1], [2]), which dq, dk, dv share in the backward, in elements:
   * row_stride between consecutive tokens (rows of the layout: b * seqlen + s for BSHD,
   * s * batch + b for SBHD), head_stride between consecutive heads; a head's elements are
   * adjacent. 0 in both means dense (heads * head_dim, head_dim), the default. They let q, k
   * and v be column slices of one projection output [tokens, F] read in place, and dq, dk,
   * dv be written into one gradient of it (whose elements they must not share: a caller that
   * sets strides vouches that dq, dk and dv do not overlap). BSHD and SBHD without a padding
   * mask only; head_stride >= head_dim and row_stride >= (heads - 1) * head_stride +
   * head_dim. o, d_o and softmax_lse stay dense. */
  int64_t row_stride[3];
  int64_t head_stride[3];
} te_attention_config;

/* The sizes and dtypes that decide which backend can run a call, without any buffer (the
 * framework layers ask before they allocate). Lengths as in te_attention_config: for BSHD and
 * SBHD seqlen_* are the padded lengths; for THD the maximum lengths, and total_* the rows of
 * q and of k/v (ignored for the other layouts). */
typedef struct {
  int64_t batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim_qk, head_dim_v;
  int64_t total_q, total_kv;
  te_dtype qkv_dtype;  /* fp32, fp16, bf16, or float8_e4m3 (FP8 attention) */
  te_dtype o_dtype;    /* qkv_dtype, or fp16/bf16 for FP8 attention with a high-precision o */
  te_dtype do_dtype;   /* backward: dtype of d_o: o_dtype, or for an E4M3 o E4M3 or E5M2 (the
                        * HYBRID recipe's gradients); ignored by the forward */
  te_dtype grad_dtype; /* backward: dtype of dq, dk, dv (qkv_dtype; for FP8 fp32, fp16, bf16,
                        * E4M3 or E5M2; cuDNN writes FP8 ones only) */
  te_device_type device;
  int32_t device_id;
} te_attention_problem;

/* Which backend runs a call. [in] config, problem; [in] backward: nonzero for the backward;
 * [out] backend: the one that runs (config->backend when it is not AUTO and can run it);
 * [out] reasons (may be NULL): for each backend, "" when it takes the call, else why not
 * ("this build has no cuDNN", "the CPU backend needs CPU tensors", ...).
 * Returns TE_ERROR_VALUE for an invalid request, TE_ERROR_UNSUPPORTED when no backend (or not
 * the one asked for) can run it; the message then lists the reasons. */
te_status te_attention_backend(const te_attention_config *config, const te_attention_problem *problem,
                               int32_t backward, te_attn_backend *backend,
                               char reasons[TE_ATTN_BACKEND_COUNT][TE_ATTN_REASON_SIZE]);

/* [out] *bytes: CUDA workspace of the call on the backend that te_attention_backend picks
 * (0 on the CPU). */
te_status te_attention_workspace_size(const te_attention_config *config,
                                      const te_attention_problem *problem, int32_t backward,
                                      size_t *bytes);

/* Forward.
 * [in] q, k, v: DATA in config->layout, fp32/fp16/bf16 (all one dtype) or float8_e4m3 (FP8:
 *   each also sets SCALE_INV [1] fp32, its descale); q and k share head_dim_qk, k and v share
 *   their heads and rows; heads_q must be a multiple of heads_kv.
 * [out] o: DATA, q's layout with v's head dim, qkv dtype (FP8: E4M3 with SCALE [1] and
 *   optionally AMAX [1] written as max |o| before scaling, or fp16/bf16).
 * [out] softmax_lse: DATA [batch, heads_q, max_seqlen_q] fp32; NULL exactly when
 *   config->inference is set.
 * [in] cu_seqlens_q, cu_seqlens_kv: DATA [batch + 1] int32, non-decreasing from 0, for the
 *   padding masks and THD; NULL otherwise. (Checked on the CPU; CUDA callers vouch for them.)
 * [in] rng_state: DATA [2] int64 (seed, offset) when config->dropout > 0, else may be NULL.
 * [in,out] softmax_fp8: FP8 only: a handle without data whose SCALE [1], SCALE_INV [1] are the
 *   scale and descale of the probabilities p inside the kernel and whose AMAX [1] (optional)
 *   gets max p. NULL otherwise.
 * [in] workspace: te_attention_workspace_size bytes of CUDA memory (NULL on the CPU). */
te_status te_attention_forward(const te_attention_config *config, const te_tensor *q, const te_tensor *k,
                               const te_tensor *v, te_tensor *o, te_tensor *softmax_lse,
                               const te_tensor *cu_seqlens_q, const te_tensor *cu_seqlens_kv,
                               const te_tensor *rng_state, te_tensor *softmax_fp8, void *workspace,
                               size_t workspace_size, te_stream stream);

/* Backward: the gradients of the forward with the same config, inputs and rng_state.
 * [in] q, k, v, o, softmax_lse, cu_seqlens_q, cu_seqlens_kv, rng_state: as the forward had and
 *   wrote them (FP8: o also sets SCALE_INV, its descale).
 *   Every backend takes the row term sum over j of p_j dp_j as dot(d_o_i, o_i) from the o
 *   given, and p from the lse given. So a call over some of a row's keys (a block of k and v),
 *   given the whole row's o and lse, returns that block's share of dq and its dk, dv: the
 *   backward of ring attention, which adds the blocks' shares.
 * [in] d_o: DATA, o's shape; o's dtype, or for an E4M3 o E4M3 or E5M2 (each FP8 d_o also sets
 *   SCALE_INV, its descale).
 * [in] softmax_fp8: FP8 only: the forward's softmax_fp8 (SCALE and SCALE_INV of p; the fused
 *   kernels quantize p with them again for dv, and the CPU and CUDA math paths round p as the
 *   forward did); NULL otherwise.
 * [out] dq, dk, dv: DATA, the shapes of q, k, v, one dtype: q's, or for FP8 q/k/v fp32, fp16,
 *   bf16 or FP8 (E4M3/E5M2, each with SCALE and optional AMAX; the only kind cuDNN writes).
 * [in,out] dp_fp8: FP8 only: SCALE, SCALE_INV and optional AMAX of the gradient of the logits
 *   ds = softmax_scale * p * (dp - sum over j of p_j dp_j), which the FP8 kernels round to an
 *   FP8 d_o's format before the dq and dk products (AMAX gets max |ds| before scaling); NULL
 *   otherwise. */
te_status te_attention_backward(const te_attention_config *config, const te_tensor *q, const te_tensor *k,
                                const te_tensor *v, const te_tensor *o, const te_tensor *d_o,
                                const te_tensor *softmax_lse, const te_tensor *cu_seqlens_q,
                                const te_tensor *cu_seqlens_kv, const te_tensor *rng_state,
                                const te_tensor *softmax_fp8, te_tensor *dq, te_tensor *dk, te_tensor *dv,
                                te_tensor *dp_fp8, void *workspace, size_t workspace_size, te_stream stream);

/* Scaled masked softmax of the unfused path, over the last dimension of x [batch, heads, sq, sk]:
 *   y[..., i, j] = exp(scale * x[i][j] - m) / sum over unmasked j' of exp(scale * x[i][j'] - m)
 * for unmasked (i, j), 0 for masked ones; a row with every key masked is all 0. */
typedef enum {
  TE_SOFTMAX_MASK_NONE = 0,
  TE_SOFTMAX_MASK_CAUSAL = 1,              /* j > i masked */
  TE_SOFTMAX_MASK_CAUSAL_BOTTOM_RIGHT = 2, /* j > i + sk - sq masked */
  TE_SOFTMAX_MASK_ARBITRARY = 3,           /* the mask tensor's nonzero entries masked */
  TE_SOFTMAX_MASK_COUNT = 4
} te_softmax_mask_type;

/* [in] x: DATA [batch, heads, sq, sk] fp32/fp16/bf16; [in] mask: for ARBITRARY, DATA uint8
 * [batch or 1, heads or 1, sq, sk] (broadcast over the size-1 dims), else NULL;
 * [out] y: DATA, x's shape and dtype. scale: finite. */
te_status te_scaled_softmax_forward(te_softmax_mask_type mask_type, float scale, const te_tensor *x,
                                    const te_tensor *mask, te_tensor *y, te_stream stream);

/* dx = scale * y * (dy - sum over j of dy * y), row by row (masked entries have y = 0, so dx = 0).
 * [in] dy, y: DATA, the same shape [.., sk] and dtype; [out] dx: DATA, y's shape and dtype. */
te_status te_scaled_softmax_backward(float scale, const te_tensor *dy, const te_tensor *y, te_tensor *dx,
                                     te_stream stream);

/* Name of a backend ("cudnn", "cuda_math", "cpu"), "auto", or "invalid". */
const char *te_attn_backend_name(te_attn_backend backend);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_ATTENTION_H_ */
