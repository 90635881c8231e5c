// TMA descriptors (CUtensorMap) of FP8 GEMM operands, made on the host for the hand-written
// Hopper kernel (block_scaled_wgmma.cu), through the driver entry point the CUDA runtime hands
// out (no link to libcuda).
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_TMA_OPERAND_H_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_TMA_OPERAND_H_

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "transformer_engine/tensor.h"  // te_status

namespace te {
namespace hopper {

// The TMA map of an FP8 [rows, k] row-major operand at data, loaded in boxes of box_rows rows
// and 128 bytes of K with the 128-byte swizzle that the WGMMA descriptors expect; boxes past
// the ends read zeros. Errors name op and the operand (name).
te_status make_fp8_operand_map(const char *op, const char *name, CUtensorMap *map, const void *data,
                               int64_t rows, int64_t k, uint32_t box_rows);

}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_TMA_OPERAND_H_
