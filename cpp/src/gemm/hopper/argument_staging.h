// One cudaMemcpyAsync of a launch's argument arrays from pinned host memory that outlives the
// copy (argument_staging.cu says how), for the Hopper grouped GEMM.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_ARGUMENT_STAGING_H_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_ARGUMENT_STAGING_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "transformer_engine/tensor.h"

namespace te {
namespace hopper {

// Writes `bytes` of arguments (fill, into a pinned staging buffer) and copies them to device
// memory dst on the stream. device: the current device (the stream's).
te_status copy_arguments(void *dst, size_t bytes, int device, cudaStream_t stream,
                         const std::function<void(uint8_t *)> &fill);

}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_ARGUMENT_STAGING_H_
