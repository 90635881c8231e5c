/* Transformer Engine core: matrix multiplication (cuBLASLt on CUDA, a blocked FP32 loop on
 * the CPU).
 *
 *   D = op(A) @ op(B) [+ bias] [then GELU]      (row-major, every matrix C-contiguous)
 *
 * op(A) is A when transpose_a is 0 (A stored [M, K]) and A^T when it is 1 (A stored [K, M]);
 * op(B) is B^T when transpose_b is 1 (B stored [N, K]) and B when it is 0 (B stored [K, N]).
 * A may have more than two dimensions when transpose_a is 0: it is then viewed as [M, K]
 * (M = product of all dimensions but the last), and D as [M, N].
 *
 * The three GEMMs of a linear layer (output = input @ weight^T) in this form:
 *   forward  output[M, N]     = input[M, K]  @ weight[N, K]^T          A = input,       B = weight
 *   dgrad    grad_input[M, K] = grad_output[M, N] @ weight[N, K]       A = grad_output, B = weight^T [K, N]
 *   wgrad    grad_weight[N, K] = grad_output^T @ input                 A = grad_output^T [N, M], B = input^T [K, M]
 * With transpose_a = 0 and transpose_b = 1 every operand is K-major ("TN"), the only layout
 * Hopper's FP8 tensor cores take: FP8 GEMMs require it, and get the transposed operands from
 * the column-wise data that quantization writes (never from a transpose of high-precision data).
 *
 * Operands (slot DATA of a and b):
 *   - high precision: both fp32, both fp16 or both bf16; D has their dtype, or fp32;
 *   - FP8: E4M3 x E4M3, E4M3 x E5M2 or E5M2 x E4M3 (E5M2 x E5M2 has no tensor-core kernel),
 *     each with its SCALE_INV by the tensor's scaling mode:
 *       TENSOR x TENSOR:          scale_inv [1] fp32 each; D in fp32/bf16/fp16, or FP8 (E5M2
 *                                 only when an operand is E5M2);
 *       BLOCK_1X128 x BLOCK_128X128, BLOCK_1X128 x BLOCK_1X128 (a x b): scale_inv in the
 *         layout of tensor.h for the stored [rows, K] matrix; D in fp32 or bf16 (Hopper only).
 *     M, N and K must be multiples of 16 for FP8 (the tensor cores' granule; the error names
 *     the dimension). Accumulation is in fp32.
 * D (slot DATA of d): [M, N]. When D is FP8, d's SCALE [1] is read (D = scale * result,
 * rounded to nearest even and saturated) and, when set, d's SCALE_INV receives 1/scale. When
 * d's AMAX slot is set ([1] fp32) it receives max|result|: of the fp32 result before the cast
 * for an FP8 D, of D as stored for a high-precision D (FP8 operands only).
 * bias (may be NULL): [N], added to every row. Its dtype: D's dtype when D is fp16/bf16; bf16
 * when the operands are FP8 and D is fp32 or FP8 (cuBLASLt's rule); fp32 for fp32 operands.
 * pre_gelu_out (may be NULL; required with config.gelu): [M, N] in D's dtype (D must then be
 * high precision): receives op(A) @ op(B) + bias, before GELU (the tanh approximation).
 */
#ifndef TRANSFORMER_ENGINE_GEMM_H_
#define TRANSFORMER_ENGINE_GEMM_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int32_t transpose_a;           /* 0: A is [M, K]; 1: A is [K, M] (high precision only) */
  int32_t transpose_b;           /* 1: B is [N, K] (FP8 requires it); 0: B is [K, N] */
  int32_t accumulate;            /* nonzero: D += result (D high precision; weight-gradient accumulation) */
  int32_t use_split_accumulator; /* FP8: promote partial sums to fp32 often (more accurate, a bit
                                    slower; TE uses it for dgrad and wgrad); 0 = fast accumulation */
  int32_t gelu;                  /* nonzero: D = gelu(result + bias), pre_gelu_out = result + bias */
} te_gemm_config;

/* Bytes of CUDA workspace that te_gemm wants (cuBLASLt's heuristics and the block-scale
 * layouts); the CPU path needs none. */
size_t te_gemm_workspace_size(void);

/* D = op(A) @ op(B) (+ bias, + GELU) as described above.
 * [in] a, b: operands; [in,out] d: output (read too when config->accumulate);
 * [in] bias: may be NULL; [out] pre_gelu_out: may be NULL unless config->gelu;
 * [in] config: NULL means transpose_b = 1 and every other field 0;
 * [in] workspace, workspace_size: CUDA device memory for the CUDA path (may be NULL / 0,
 *   which limits the algorithms cuBLASLt may pick and rejects block-scaled GEMMs).
 * Every buffer must be on the same device. */
te_status te_gemm(const te_tensor *a, const te_tensor *b, te_tensor *d, const te_tensor *bias,
                  te_tensor *pre_gelu_out, const te_gemm_config *config, void *workspace,
                  size_t workspace_size, te_stream stream);

/* Grouped GEMM: D_g = op(A_g) @ op(B_g) (+ bias_g) for every group g in [0, groups), in one
 * call (the experts of a mixture-of-experts layer, each with its own tokens and weight).
 * Each group follows te_gemm's rules on its own: its dtypes, scaling modes and scales (an
 * expert's per-tensor FP8 scales are its own), and its M, N, K; config (gelu must be 0)
 * applies to every group. A group with M = 0 or N = 0 writes nothing; one with K = 0 (a
 * weight gradient of an expert that got no token) sets D_g to 0, or leaves it with
 * config->accumulate (no bias and no FP8 output then).
 * Every group is checked before any runs: an error names the group ("group 3: b.data ...")
 * and nothing is written. No output may overlap another group's output or any group's input.
 * [in] a, b, d: groups handles each; [in] bias: NULL, or groups entries each NULL or a bias;
 * workspace and stream as for te_gemm. On CUDA the groups run one after the other on the
 * stream (cuBLASLt). */
te_status te_grouped_gemm(const te_tensor *const *a, const te_tensor *const *b,
                          te_tensor *const *d, const te_tensor *const *bias, size_t groups,
                          const te_gemm_config *config, void *workspace, size_t workspace_size,
                          te_stream stream);

/* Grouped GEMM over groups stacked in one operand (the tokens of a mixture-of-experts layer
 * sorted by expert, with the sizes on the device): group g owns the group_sizes[g] rows of a
 * stacked operand that follow the rows of the groups before it. Operands both fp32, fp16 or
 * bf16 (D in their dtype or fp32), or both FP8 with per-tensor scaling (TE_SCALING_TENSOR,
 * D bf16, fp16 or fp32, te_gemm's FP8 rules per group). Two forms, by config->transpose_a:
 *   0: D[rows of g] = A[rows of g] @ op(B[g]) (+ bias[g])       (forward, dgrad)
 *      a [M, K]; b [G, N, K] with transpose_b = 1, or [G, K, N]; d [M, N]; bias NULL or
 *      [G, N] in D's dtype (or a's for an fp32 D). Rows of D past the sizes' sum are set to 0.
 *   1: D[g] = A[rows of g]^T @ B[rows of g]                      (weight gradients)
 *      a [M, K]; b [M, N] (transpose_b must be 0); d [G, K, N]; no bias. A group without rows
 *      gets D[g] = 0, or keeps D[g] with config->accumulate.
 * FP8: a.scale_inv is [1]; b.scale_inv is [1], or [G] in the first form (each group's own
 *   weight scale). The first form needs transpose_b = 1 (b [G, N, K]); the second takes a and
 *   b row-wise as above and transposes each group's rows into scratch memory first (FP8 GEMMs
 *   read both operands K-major), so a weight gradient needs no column-wise copies.
 * group_sizes: int32 or int64 [G] on a's device, each >= 0, summing to at most M. On CUDA
 * they are copied to the host first (the call waits for the stream once), then the groups
 * run one after the other through cuBLASLt. Errors name the group; nothing is written when
 * the call is refused before the sizes are read. */
te_status te_grouped_gemm_ragged(const te_tensor *a, const te_tensor *b, te_tensor *d,
                                 const te_tensor *bias, const te_tensor *group_sizes,
                                 const te_gemm_config *config, void *workspace,
                                 size_t workspace_size, te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_GEMM_H_ */
