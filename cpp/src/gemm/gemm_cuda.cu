// The CUDA path of te_gemm: which implementation runs a call.
//
// Block-scaled FP8 GEMMs of the DeepSeek-V3 recipe (A with 1x128 scales, B with 128x128) have
// two: our Hopper kernel (hopper/block_scaled_gemm.cu, built with CUTLASS) and cuBLASLt's. The
// rule, measured on an H200 at 0d54781 (benchmarks/results/gemm.json and
// hopper_gemm_tests.txt):
//
//   M * N * K < 2^34: our kernel; from 2^34 on: cuBLASLt.
//
//   shape (M x N x K)      ours        cuBLASLt    (CUDA-graph replay unless noted)
//   2048 x 3072 x 768      16.0 us     19.3 us     4.8e9
//   2048 x 2048 x 4096     33.0 us     33.3 us     2^34 (launches, bf16 D): a tie
//   8192 x 3072 x 768      53.8 us     51.6 us     1.9e10
//   4096 x 4096 x 4096     147.4 us    134.7 us    6.9e10
//   8192 x 8192 x 8192     1.19 ms     1.02 ms     5.5e11
//
// cuBLASLt's path first rewrites both operands' scales into its layouts (two small kernels,
// gemm_cublaslt.cu) and its kernel is faster on large problems; ours reads the scales as they
// are stored, so it wins where those fixed microseconds weigh. Everything else (per-tensor
// FP8, high precision, the 1x128 x 1x128 weight-gradient GEMM, E5M2 operands, GELU, amax, FP8
// output: hopper_block_scaled_gemm_support says what ours refuses) goes to cuBLASLt, and so
// does every call on a device that is not an sm_90 or in a build without CUTLASS.
#include <cuda_runtime.h>

#include "common/internal.h"
#include "gemm/gemm_impl.h"
#ifdef TE_WITH_CUTLASS
#include "gemm/hopper/block_scaled_gemm.h"
#endif

namespace te {
namespace {

#ifdef TE_WITH_CUTLASS
constexpr double kHopperBlockScaledMaxWork = 17179869184.0;  // 2^34: M * N * K below it

// Without a workspace the call goes to cuBLASLt, which refuses it as gemm.h says (block-scaled
// GEMMs need the workspace), so that the answer does not depend on the problem's size.
bool use_hopper_block_scaled(const GemmArgs &g) {
  return g.fp8 && g.a.mode == TE_SCALING_BLOCK_1X128 && g.b.mode == TE_SCALING_BLOCK_128X128 &&
         g.workspace != nullptr &&
         static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k) <
             kHopperBlockScaledMaxWork &&
         device_sm(g.device) == 90 && hopper_block_scaled_gemm_supports(g);
}
#endif

}  // namespace

te_status gemm_cuda(const GemmArgs &g, te_stream stream) {
#ifdef TE_WITH_CUTLASS
  if (use_hopper_block_scaled(g)) return hopper_block_scaled_gemm(g, stream);
#endif
  return gemm_cublaslt(g, stream);
}

}  // namespace te
