/* Transformer Engine core: dropout, fused with the residual addition that follows it in a
 * Transformer layer (y = residual + dropout(x)), and its backward.
 *
 * Element e (its index in x, row-major) is kept when u(e) >= p, where u(e) is a uniform
 * 24-bit fraction hashed from rng_state (seed, offset) and e:
 *   u(e) = (mix64((offset + e) ^ mix64(seed)) >> 40) / 2^24,
 * mix64 being splitmix64's finalizer; a kept element is scaled by 1 / (1 - p), a dropped one
 * is 0. The mask is thus a pure function of (seed, offset, e), the same on the CPU and CUDA,
 * and the backward recomputes it: nothing is saved between forward and backward.
 *
 * Numerics: y = residual + x * keep(e) / (1 - p) and dx = dy * keep(e) / (1 - p) in fp32 (the
 * scale rounded to fp32 once, the product then the sum, no fused multiply-add), rounded once
 * to the output dtype, so both paths write identical bits.
 */
#ifndef TRANSFORMER_ENGINE_DROPOUT_H_
#define TRANSFORMER_ENGINE_DROPOUT_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y = residual + dropout(x) (residual NULL: y = dropout(x)).
 * [in] p: drop probability in [0, 1); [in] x, residual: DATA fp32/fp16/bf16, one shape and dtype;
 * [in] rng_state: DATA [2] int64 (seed, offset) on the tensors' device;
 * [out] y: DATA, x's shape and dtype (may be residual's buffer: an in-place addition). */
te_status te_dropout_add_forward(float p, const te_tensor *x, const te_tensor *residual, const te_tensor *rng_state,
                                 te_tensor *y, te_stream stream);

/* dx = dy * keep(e) / (1 - p), with the forward's p and rng_state.
 * [in] dy: DATA fp32/fp16/bf16; [out] dx: DATA, dy's shape and dtype (may be dy's buffer). */
te_status te_dropout_backward(float p, const te_tensor *dy, const te_tensor *rng_state, te_tensor *dx,
                              te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_DROPOUT_H_ */
