// Stream-ordered scratch memory for kernels that need a temporary buffer but whose C API takes
// no workspace (the activation's dbias partial sums).
//
// Why not plain cudaMallocAsync: the device's default pool releases its memory to the driver
// at every synchronization (its release threshold is 0), so in a training loop, which syncs
// every step, each call mapped fresh memory: ~50 us of host time per call on the H200 host.
// The core's own pool per device keeps what it has (threshold: no limit), so after the first
// step an allocation is a pool lookup. Stream capture works as with cudaMallocAsync: the
// allocation becomes a node of the graph, which owns that memory.
#ifndef TRANSFORMER_ENGINE_SRC_COMMON_SCRATCH_CUH_
#define TRANSFORMER_ENGINE_SRC_COMMON_SCRATCH_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "transformer_engine/tensor.h"

namespace te {

// `bytes` of device memory on the current device, ordered on `stream`; free with scratch_free
// on the same stream.
te_status scratch_alloc(const char *op, size_t bytes, cudaStream_t stream, void **out);
te_status scratch_free(const char *op, void *p, cudaStream_t stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_COMMON_SCRATCH_CUH_
