/* Transformer Engine core: LayerNorm and RMSNorm, forward and backward.
 *
 * The input is viewed as a matrix [M, N] (N = the last dimension, normalized over). With
 * g = gamma, or 1 + gamma when zero_centered_gamma is set:
 *   LayerNorm: mu = mean(x), rsigma = 1 / sqrt(mean((x - mu)^2) + eps),
 *              y = ((x - mu) * rsigma) * g + beta
 *   RMSNorm:   rsigma = 1 / sqrt(mean(x^2) + eps),  y = (x * rsigma) * g
 * Statistics and y are computed in fp32 from the decoded input. Row sums are taken in one fixed
 * order (the same on the CPU and CUDA), so every output is bit-identical across devices:
 * element i of a row goes to lane (i / 8) % 128, lanes accumulate in increasing i, and the 128
 * lanes are added pairwise (lane l += lane l + s for s = 64, 32, ..., 1). A NaN is written as
 * the one pattern of its dtype, whatever arithmetic made it (fp32 0x7FC00000, bf16 0x7FC0,
 * fp16 0x7E00, FP8 0x7F): outputs, statistics, amax and the gradients alike.
 */
#ifndef TRANSFORMER_ENGINE_NORM_H_
#define TRANSFORMER_ENGINE_NORM_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TE_NORM_LAYERNORM = 0,
  TE_NORM_RMSNORM = 1,
} te_norm_type;

typedef struct {
  te_norm_type type;
  float eps;                   /* added to the variance (LayerNorm) or mean square (RMSNorm); >= 0 */
  int32_t zero_centered_gamma; /* nonzero: gamma is stored as g - 1 (better precision near 1) */
  int32_t accumulate_amax;     /* forward: nonzero raises output_fp8's AMAX to max(itself, max|y|)
                                  instead of overwriting it (delayed scaling's amax history) */
} te_norm_config;

/* Forward.
 * [in] input: DATA [.., N] fp32/fp16/bf16.
 * [in] gamma: DATA [N], the input's dtype or fp32. [in] beta: DATA [N] like gamma (LayerNorm;
 *   must be NULL for RMSNorm).
 * [out] output: DATA, the input's shape, fp32/fp16/bf16; may be NULL.
 * [out] output_fp8: FP8 per-tensor (TENSOR mode) y * scale: DATA (the input's shape) and, when
 *   set, COLUMNWISE_DATA (the transpose [N, M]; needs DATA too); reads SCALE, writes SCALE_INV
 *   and, when set, AMAX = max|y|; may be NULL. At least one of output and output_fp8 is given;
 *   both are computed from the same fp32 y.
 * [out] mu: DATA [M] fp32 (LayerNorm; NULL for RMSNorm). [out] rsigma: DATA [M] fp32. */
te_status te_norm_forward(const te_norm_config *config, const te_tensor *input, const te_tensor *gamma,
                          const te_tensor *beta, te_tensor *output, te_tensor *output_fp8,
                          te_tensor *mu, te_tensor *rsigma, te_stream stream);

/* Bytes of CUDA workspace te_norm_backward needs for an [rows, cols] input (the partial sums
 * of grad_gamma and grad_beta); the CPU path needs none. */
size_t te_norm_backward_workspace_size(int64_t rows, int64_t cols);

/* Backward, with xhat = (x - mu) * rsigma (LayerNorm) or x * rsigma (RMSNorm) and dyg = dy * g:
 *   grad_input = rsigma * (dyg - mean(dyg) - xhat * mean(dyg * xhat))   (LayerNorm)
 *   grad_input = rsigma * (dyg - xhat * mean(dyg * xhat))               (RMSNorm)
 *   grad_gamma = sum over rows of dy * xhat;  grad_beta = sum over rows of dy (LayerNorm)
 * The row sums are taken as in the forward; the column sums in groups of 32 rows (in row
 * order), then over the groups in order: deterministic, and identical on the CPU and CUDA.
 * [in] grad_output, input: DATA, the same shape and dtype (fp32/fp16/bf16);
 * [in] mu (LayerNorm; NULL for RMSNorm), rsigma: DATA [M] fp32, as the forward wrote them;
 * [in] gamma: DATA [N], the input's dtype or fp32;
 * [in] grad_input_add: DATA like grad_input (shape and dtype), or NULL: a gradient that reaches
 *   the input by another path (a residual connection), added in: grad_input is then
 *   rounded(rounded(dx) + grad_input_add) with dx the formula above, each rounding to
 *   grad_input's dtype: the bits of writing dx and adding the two in a separate step;
 * [out] grad_input: DATA, the input's shape, fp32/fp16/bf16;
 * [out] grad_gamma: DATA [N], gamma's dtype; [out] grad_beta: DATA [N], gamma's dtype
 *   (LayerNorm; NULL for RMSNorm);
 * [in] workspace, workspace_size: CUDA device memory of te_norm_backward_workspace_size bytes
 *   (CUDA path only). */
te_status te_norm_backward(const te_norm_config *config, const te_tensor *grad_output,
                           const te_tensor *input, const te_tensor *mu, const te_tensor *rsigma,
                           const te_tensor *gamma, const te_tensor *grad_input_add,
                           te_tensor *grad_input, te_tensor *grad_gamma, te_tensor *grad_beta,
                           void *workspace, size_t workspace_size, te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_NORM_H_ */
