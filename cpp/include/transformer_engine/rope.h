/* Transformer Engine core: rotary position embedding (RoPE), forward and backward.
 *
 * The input holds one feature vector of D elements per (token, head): [S, B, H, D] (SBHD),
 * [B, S, H, D] (BSHD) or [T, H, D] (THD: the B sequences packed one after another, sequence b
 * being tokens cu_seqlens[b] .. cu_seqlens[b+1] - 1). Token i of sequence b (i counted from 0
 * within its sequence) has position p = i, or p = start_positions[b] + i when start_positions
 * is given (decoding with a KV cache). freqs [P, R] holds the rotation angle of each position
 * (row) and feature (column); the first R features of every head are rotated, the other D - R
 * are copied unchanged (partial rotary).
 *
 * Features pair up as (j, j + R/2) for j < R/2 ("rotate half"), or as (2j, 2j + 1) when
 * interleaved. With a = freqs[p, i] and k the partner of feature i, the forward writes
 *   y_i = x_i cos(a_i) - x_k sin(a_i)   for the first feature of a pair,
 *   y_i = x_i cos(a_i) + x_k sin(a_i)   for the second;
 * with the usual angle layouts ([f_0 .. f_{R/2-1}, f_0 .. f_{R/2-1}], or [f_0, f_0, f_1, f_1, ..]
 * when interleaved) both features of a pair share one angle and this rotates the pair by it.
 * The backward is the transpose of that linear map: dx_i = dy_i cos(a_i) + dy_k sin(a_k) for the
 * first feature of a pair and dy_i cos(a_i) - dy_k sin(a_k) for the second, which for a shared
 * angle is the rotation of the gradient by -a.
 *
 * Numerics: inputs are decoded to fp32 and every product and sum is taken in fp32, in the order
 * written above (no fused multiply-add). cos and sin come from the core's own fixed evaluation
 * (range reduction by pi/2 and a polynomial, in double precision, then one rounding to fp32),
 * within 1e-16 + |angle| 2^-52 of the exact values before that rounding, so the CPU and CUDA
 * paths write identical bits. An angle that is not finite, or of magnitude 2^30 or more (where
 * fp32 angles are 64 radians apart), gives NaN. NaN results are written as one quiet NaN; the
 * copied features keep their bits.
 *
 * Positions: on the CPU, cu_seqlens and start_positions are checked (cu_seqlens starts at 0,
 * never decreases and ends at T; every position used lies in [0, P)) and a bad value fails the
 * call before anything is written. The CUDA path cannot read them without a device
 * synchronization, so it does not check them: a token whose position falls outside [0, P) gets
 * NaN in its R rotated features (never a read outside freqs).
 */
#ifndef TRANSFORMER_ENGINE_ROPE_H_
#define TRANSFORMER_ENGINE_ROPE_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TE_ROPE_SBHD = 0, /* [S, B, H, D] */
  TE_ROPE_BSHD = 1, /* [B, S, H, D] */
  TE_ROPE_THD = 2,  /* [T, H, D], sequences bounded by cu_seqlens */
} te_rope_format;

typedef struct {
  te_rope_format format;
  int32_t interleaved; /* nonzero: features (2j, 2j + 1) pair up, else (j, j + R/2) */
} te_rope_config;

/* output = the rotation of input by the angles of freqs (see above).
 *   [in]  config           layout and pairing.
 *   [in]  input            DATA fp32/fp16/bf16, [S, B, H, D], [B, S, H, D] or [T, H, D].
 *   [in]  freqs            DATA fp32 [P, R] or [P, 1, 1, R]: R even, 0 < R <= D; row p holds
 *                          the angles of position p. Without start_positions, SBHD and BSHD
 *                          need P >= S.
 *   [in]  cu_seqlens       DATA int32 [B + 1] for THD (NULL otherwise): the sequences' offsets.
 *   [in]  start_positions  NULL, or DATA int32 [B]: the position of each sequence's first token.
 *   [out] output           DATA, input's shape and dtype; must not overlap any input.
 *   [in]  stream           CUDA stream (ignored on the CPU).
 * All buffers live on one device. */
te_status te_rope_forward(const te_rope_config *config, const te_tensor *input,
                          const te_tensor *freqs, const te_tensor *cu_seqlens,
                          const te_tensor *start_positions, te_tensor *output, te_stream stream);

/* grad_input = the transpose of te_rope_forward's map applied to grad_output (the features
 * beyond R are copied). Arguments as te_rope_forward's, with
 *   [in]  grad_output  in place of input, and
 *   [out] grad_input   in place of output. */
te_status te_rope_backward(const te_rope_config *config, const te_tensor *grad_output,
                           const te_tensor *freqs, const te_tensor *cu_seqlens,
                           const te_tensor *start_positions, te_tensor *grad_input,
                           te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_ROPE_H_ */
