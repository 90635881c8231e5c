// The core's scratch pools (scratch.cuh).
#include "common/scratch.cuh"

#include <cstdint>
#include <mutex>
#include <string>

#include "common/cuda_utils.cuh"

namespace te {
namespace {

constexpr int kMaxDevices = 64;

// The pool of `device`, made on first use. Made once per device for the process (pools are
// never destroyed: memory in flight on a stream may still belong to one at exit).
te_status pool_of(const char *op, int device, cudaMemPool_t *pool) {
  static std::mutex mutex;
  static cudaMemPool_t pools[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) {
    return fail(TE_ERROR_UNSUPPORTED, op, "CUDA device " + std::to_string(device) + " is beyond the " +
                                              std::to_string(kMaxDevices) + " devices the core supports");
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (pools[device] == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t made = nullptr;
    if (te_status s = cuda_status(op, cudaMemPoolCreate(&made, &props))) return s;
    uint64_t keep_all = UINT64_MAX;  // never hand memory back at a synchronization
    if (te_status s = cuda_status(op, cudaMemPoolSetAttribute(made, cudaMemPoolAttrReleaseThreshold, &keep_all))) {
      cudaMemPoolDestroy(made);
      return s;
    }
    pools[device] = made;
  }
  *pool = pools[device];
  return TE_SUCCESS;
}

}  // namespace

te_status scratch_alloc(const char *op, size_t bytes, cudaStream_t stream, void **out) {
  *out = nullptr;
  int device = 0;
  if (te_status s = cuda_status(op, cudaGetDevice(&device))) return s;
  cudaMemPool_t pool = nullptr;
  if (te_status s = pool_of(op, device, &pool)) return s;
  return cuda_status(op, cudaMallocFromPoolAsync(out, bytes, pool, stream));
}

te_status scratch_free(const char *op, void *p, cudaStream_t stream) {
  return p == nullptr ? TE_SUCCESS : cuda_status(op, cudaFreeAsync(p, stream));
}

}  // namespace te
