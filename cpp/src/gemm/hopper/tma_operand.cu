// TMA descriptors of the hand-written Hopper GEMM's FP8 operands (tma_operand.h).
#include "gemm/hopper/tma_operand.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <string>

#include "common/cuda_utils.cuh"
#include "common/internal.h"

namespace te {
namespace hopper {

namespace {

// The driver's cuTensorMapEncodeTiled, through the runtime (no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

}  // namespace

te_status make_fp8_operand_map(const char *op, const char *name, CUtensorMap *map, const void *data,
                           int64_t rows, int64_t k, uint32_t box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) {
    return fail(TE_ERROR_RUNTIME, op, "the driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12)");
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(k)};  // bytes from one row to the next
  const cuuint32_t box[2] = {128, box_rows};  // 128 bytes of K: one swizzle row
  const cuuint32_t steps[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void *>(data), dims,
                            strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return fail(TE_ERROR_RUNTIME, op,
                std::string("cuTensorMapEncodeTiled failed for ") + name + " (CUresult " +
                    std::to_string(static_cast<int>(r)) + ")");
  }
  return TE_SUCCESS;
}

}  // namespace hopper
}  // namespace te
