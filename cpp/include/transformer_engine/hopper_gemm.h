/* Transformer Engine core: our own Hopper (sm_90a) GEMM kernels, built on CUTLASS, callable on
 * their own beside te_gemm and te_grouped_gemm (gemm.h) so that tests and benchmarks can run and
 * time them against cuBLASLt. te_gemm and te_grouped_gemm do not dispatch to them: each entry
 * point here runs its kernel and nothing else (no environment variable, no fallback to
 * cuBLASLt, no CPU path), with every buffer on one CUDA device of compute capability 9.0.
 *
 * The kernels are compiled only into CUDA builds that target sm_90a and found CUTLASS's headers
 * (cpp/cmake/cutlass.cmake). Every other build (CPU-only, or CUDA without them) has these entry
 * points too, so that callers link and load the same way everywhere: there they check nothing,
 * write nothing and fail with TE_ERROR_UNSUPPORTED and te_last_error() =
 * "<op>: this build of the core has no Hopper kernels: built without CUTLASS or not for sm_90a".
 * te_hopper_gemm_available() tells the two kinds of build apart.
 */
#ifndef TRANSFORMER_ENGINE_HOPPER_GEMM_H_
#define TRANSFORMER_ENGINE_HOPPER_GEMM_H_

#include "transformer_engine/gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this build of the core has the Hopper kernels, else 0. It says nothing about the
 * machine: with 1 the calls still fail (TE_ERROR_UNSUPPORTED) on a device that is not an sm_90. */
int te_hopper_gemm_available(void);

/* The block-scaled FP8 GEMM of the DeepSeek-V3 recipe, with te_gemm's arguments (pre_gelu_out
 * is not taken: GELU is refused with block scaling), validated by te_gemm's rules for
 * block-scaled operands:
 *   D [M, N] = A [M, K] @ B [N, K]^T (+ bias [N]) (+ D with config->accumulate)
 * A E4M3 with BLOCK_1X128 scale_inv, B E4M3 with BLOCK_128X128 scale_inv (tensor.h's layouts);
 * config->transpose_a = 0 and config->transpose_b = 1 (NULL config: those, the rest 0); D fp32
 * or bf16; bias NULL or bf16; M, N, K multiples of 16; A, B and D 16-byte aligned.
 * A call the kernel does not take fails with TE_ERROR_UNSUPPORTED and the reason.
 * [in] workspace, workspace_size: CUDA device memory for CUTLASS, as for te_gemm; less than
 *   CUTLASS asks for fails with TE_ERROR_VALUE (a workspace of te_gemm_workspace_size() bytes
 *   is the one to pass). */
te_status te_hopper_block_scaled_gemm(const te_tensor *a, const te_tensor *b, te_tensor *d,
                                      const te_tensor *bias, const te_gemm_config *config,
                                      void *workspace, size_t workspace_size, te_stream stream);

/* Every group of te_grouped_gemm in one kernel launch, with te_grouped_gemm's arguments: each
 * group validated by te_gemm's rules and the groups together by te_grouped_gemm's (one device,
 * no output overlapping any group's buffers). The kernel takes "TN" groups (transpose_a = 0,
 * transpose_b = 1), all of one kind: E4M3 x E4M3 with per-tensor scales (each group its own)
 * into bf16 or fp32, or bf16 x bf16 into bf16; a bf16 bias [N] in every group with rows or in
 * none; no accumulation, no GELU, no amax; K > 0, K and N multiples of 16. Groups with M = 0 or
 * N = 0 are skipped. Any other call fails with TE_ERROR_UNSUPPORTED and the reason, naming
 * the group. config->use_split_accumulator may be either: the FP8 kernel promotes its partial
 * sums to fp32 every 128 of K.
 * [in] workspace: CUDA device memory, 256-byte aligned, of at least
 *   te_hopper_grouped_gemm_workspace_size(groups) bytes (the kernel's TMA descriptors and
 *   argument arrays), not used by other work while the call runs. */
te_status te_hopper_grouped_gemm(const te_tensor *const *a, const te_tensor *const *b,
                                 te_tensor *const *d, const te_tensor *const *bias, size_t groups,
                                 const te_gemm_config *config, void *workspace,
                                 size_t workspace_size, te_stream stream);

/* Bytes of workspace that te_hopper_grouped_gemm needs for `groups` groups (empty groups
 * included): 128 KiB plus about 84 bytes per group, a small part of te_gemm_workspace_size()
 * in a CUDA build. Needs no device. 0 in a build without the kernels: the figure includes what
 * CUTLASS's kernel asks for, which only a build with CUTLASS can compute (and such a build has
 * no kernel to size). */
size_t te_hopper_grouped_gemm_workspace_size(size_t groups);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_HOPPER_GEMM_H_ */
