// CudaDeviceScope (internal.h) for CUDA builds.
#include <cuda_runtime.h>

#include "common/internal.h"

namespace te {

CudaDeviceScope::CudaDeviceScope(int device) {
  int current = 0;
  if (cudaGetDevice(&current) == cudaSuccess && current != device &&
      cudaSetDevice(device) == cudaSuccess) {
    previous_ = current;
  }
}

CudaDeviceScope::~CudaDeviceScope() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

}  // namespace te
