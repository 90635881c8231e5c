// The CUDA device facts of internal.h for CUDA builds: CudaDeviceScope and device_sm.
#include <cuda_runtime.h>

#include <atomic>

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

int device_sm(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();  // clear it: a failed query is no error of the next call
    return -1;
  }
  const int sm = major * 10 + minor;
  if (cacheable) cache[device].store(sm, std::memory_order_relaxed);
  return sm;
}

}  // namespace te
