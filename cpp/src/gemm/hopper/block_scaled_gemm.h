// Our own Hopper (sm_90a) kernel for the block-scaled FP8 GEMM of the DeepSeek-V3 recipe: A with
// 1x128 scales, B with 128x128 scales, fp32 accumulation promoted once per 128-wide K block with
// both operands' scales. Built on CUTLASS's warp-specialized blockwise-scaling mainloop; compiled
// only when the build finds CUTLASS's headers (cmake/cutlass.cmake, which defines
// TE_WITH_CUTLASS), and only for sm_90a.
//
// te_gemm runs it for the problems of the dispatch rule in gemm_cuda.cu (measured on an H200:
// M * N * K below 2^34), cuBLASLt for the rest; te_hopper_block_scaled_gemm calls it directly.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_GEMM_H_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_GEMM_H_

#include <cstddef>
#include <string>

#include "gemm/gemm_impl.h"
#include "transformer_engine/hopper_gemm.h"  // the C entry points

namespace te {

// "" when the kernel takes these resolved te_gemm arguments, else the reason in a few words.
// It takes: A [M, K] and B [N, K] (transpose_a = 0, transpose_b = 1), both E4M3; A with
// BLOCK_1X128 and B with BLOCK_128X128 scale_inv in tensor.h's layouts; D fp32 or bf16 [M, N];
// an optional bf16 bias [N]; D += result with accumulate; no GELU, no amax; M, N, K positive,
// K and N such that rows are 16-byte multiples; A, B and D 16-byte aligned. The device is not
// looked at here (hopper_block_scaled_gemm checks that it is an sm_90).
std::string hopper_block_scaled_gemm_support(const GemmArgs &args);

inline bool hopper_block_scaled_gemm_supports(const GemmArgs &args) {
  return hopper_block_scaled_gemm_support(args).empty();
}

// Runs the kernel on the current device (which must hold the buffers) and stream. Returns
// TE_ERROR_UNSUPPORTED with the reason, and launches nothing, for a call it does not take or a
// device that is not an sm_90; TE_ERROR_VALUE when the workspace is smaller than CUTLASS asks.
te_status hopper_block_scaled_gemm(const GemmArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_BLOCK_SCALED_GEMM_H_
