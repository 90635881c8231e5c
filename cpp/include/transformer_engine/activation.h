/* Transformer Engine core: fused activations of the MLP block, forward and backward, with the
 * FP8 cast (+ transpose + amax) of their result and, backward, the bias gradient, in one pass.
 *
 * Tensors are viewed as matrices: K is the last dimension, M the product of the rest. Every
 * activation is computed in fp32 from the decoded input with the core's own exp (range
 * reduction and a fixed polynomial, no libm), so the CPU and CUDA paths give identical bits:
 * the FP8 bytes, the high-precision outputs, amax, scale_inv and dbias.
 *
 * Activations act(x), and gated ones on an input [M, 2N] split into a = x[:, :N], b = x[:, N:]:
 *   IDENTITY  x
 *   GELU      0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (the tanh approximation)
 *   RELU      max(x, 0)
 *   SILU      x sigmoid(x)
 *   QGELU     x sigmoid(1.702 x)                                 ("quick GELU")
 *   SRELU     max(x, 0)^2                                        (squared ReLU)
 *   GEGLU     gelu(a) * b,  SWIGLU  silu(a) * b,  REGLU  relu(a) * b    -> output [M, N]
 *   QGEGLU    qgelu(a) * b, SREGLU  srelu(a) * b, GLU    sigmoid(a) * b
 *   CLAMPED_SWIGLU  g sigmoid(alpha g) * (u + linear_offset), with g = min(a, limit) and
 *             u = clamp(b, -limit, limit): SwiGLU with both halves clamped (as in GPT-OSS),
 *             the one activation that takes parameters (te_activation_params). Its gradient
 *             is zero where a clamp is active (a > limit, |b| > limit) and passes at the
 *             bounds themselves, as torch.clamp's does.
 * The gated forms compute act(a) as an fp32 value, then the product: srelu(a) overflows to
 * inf for |a| >= 2^64 even where srelu(a) * b would not.
 * A NaN operand makes NaN every value computed from it (forward and backward); an infinite
 * input gives the function's limit (gelu(-inf) = -0, silu(+inf) = +inf, d gelu/dx at -inf = 0,
 * ...), and products of the gated forms follow IEEE rules (inf * 0 = NaN). A NaN written as
 * fp32 is the quiet NaN 0x7FC00000. Accuracy: within a few fp32 ulp of the exact function,
 * plus the conditioning of exp(z) at large |z| (z is rounded in fp32 and exp amplifies that:
 * a few ulp per unit of |z|).
 */
#ifndef TRANSFORMER_ENGINE_ACTIVATION_H_
#define TRANSFORMER_ENGINE_ACTIVATION_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TE_ACTIVATION_IDENTITY = 0,
  TE_ACTIVATION_GELU = 1,
  TE_ACTIVATION_RELU = 2,
  TE_ACTIVATION_SILU = 3,
  TE_ACTIVATION_QGELU = 4,
  TE_ACTIVATION_SRELU = 5,
  TE_ACTIVATION_GEGLU = 6,  /* gated: the input holds [a, b] along its last dimension */
  TE_ACTIVATION_SWIGLU = 7,
  TE_ACTIVATION_REGLU = 8,
  TE_ACTIVATION_QGEGLU = 9,
  TE_ACTIVATION_SREGLU = 10,
  TE_ACTIVATION_GLU = 11,
  TE_ACTIVATION_CLAMPED_SWIGLU = 12,
  TE_ACTIVATION_COUNT = 13
} te_activation;

/* The parameters of a parametrized activation (CLAMPED_SWIGLU: limit finite and > 0, alpha
 * finite and > 0, linear_offset finite). The others take none: they ignore this. */
typedef struct {
  float limit;
  float alpha;
  float linear_offset;
} te_activation_params;

/* 1 when act is gated (GEGLU, SWIGLU, REGLU, QGEGLU, SREGLU, GLU, CLAMPED_SWIGLU), else 0
 * (also for out-of-range values). */
int te_activation_is_gated(te_activation act);

/* 1 when act takes parameters (CLAMPED_SWIGLU), else 0. */
int te_activation_has_params(te_activation act);

/* output = act(input).
 *   [in]  act     the activation.
 *   [in]  params  its parameters: required when te_activation_has_params(act), else ignored
 *                 (may be NULL).
 *   [in]  input   DATA: fp32/fp16/bf16 [M, K]; gated: K = 2N, the output has N columns.
 *   [out] output  one of two kinds, by the dtype of its DATA slot:
 *           high precision: DATA fp32/fp16/bf16 [M, N] (rounded to nearest even); optional
 *                           AMAX [1] fp32; COLUMNWISE_DATA must be unset.
 *           FP8 (TENSOR scaling mode): DATA [M, N] and/or COLUMNWISE_DATA, the transpose
 *                           [N, M], both E4M3 or both E5M2; reads SCALE [1] fp32, writes
 *                           SCALE_INV = 1/scale and, when set, AMAX.
 *           amax only:      neither DATA nor COLUMNWISE_DATA, AMAX set: only the amax is
 *                           computed (current scaling's first pass, before the scale is
 *                           known; SCALE and SCALE_INV are not read).
 *         AMAX is max |act(input)| of the fp32 values before any rounding or scaling (NaN if
 *         any is NaN; 0 when empty). FP8 bytes are those te_quantize gives for the fp32
 *         activation with the same scale.
 *   [in]  accumulate_amax  nonzero raises AMAX to max(itself, this call's amax) instead of
 *                 overwriting it (delayed scaling records into an amax history this way).
 *   [in]  stream  CUDA stream (ignored on the CPU).
 * All buffers live on one device; outputs must not overlap each other or an input. */
te_status te_activation_forward(te_activation act, const te_activation_params *params,
                                const te_tensor *input, te_tensor *output,
                                int32_t accumulate_amax, te_stream stream);

/* grad_input = d act(input) / d input * grad_output, with the bias gradient in the same pass.
 *   [in]  act          the activation.
 *   [in]  params       as for te_activation_forward.
 *   [in]  grad_output  DATA: fp32/fp16/bf16 [M, N].
 *   [in]  input        DATA: the forward's input [M, K] in the dtype of grad_output, K = N
 *                      (gated: K = 2N). May be NULL for IDENTITY, which does not read it.
 *   [out] grad_input   [M, K], of the same two kinds as te_activation_forward's output
 *                      (FP8: DATA and/or the transpose [K, M] in COLUMNWISE_DATA, SCALE read,
 *                      SCALE_INV and optional AMAX written). Gated: columns [0, N) hold
 *                      d/da = (grad_output * act'(a)) * b, columns [N, 2N) hold
 *                      d/db = grad_output * act(a) (CLAMPED_SWIGLU: b is
 *                      u + linear_offset, and d/db is zero where b's clamp is active).
 *   [out] dbias        NULL, or DATA fp32/fp16/bf16 [K]: the column sums of grad_input in
 *                      fp32, before any rounding or scaling. The order of the sums is fixed
 *                      by the shape alone, so the result is deterministic and identical on
 *                      the CPU and CUDA: within each chunk of 128 rows, the 16 runs of 8 rows
 *                      are each summed in row order, then the 16 run sums in order; then the
 *                      chunk sums in chunk order (every sum starts from +0).
 *   [in]  accumulate_amax  as for te_activation_forward, for grad_input's AMAX.
 *   [in]  stream       CUDA stream (ignored on the CPU).
 * IDENTITY makes this the "bias gradient + cast + transpose" of a linear layer's grad_output.
 * All buffers live on one device; outputs must not overlap each other or an input. */
te_status te_activation_backward(te_activation act, const te_activation_params *params,
                                 const te_tensor *grad_output, const te_tensor *input,
                                 te_tensor *grad_input, te_tensor *dbias,
                                 int32_t accumulate_amax, te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_ACTIVATION_H_ */
