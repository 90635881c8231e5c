// Staging of a launch's argument arrays (pointers, shapes, strides) for the Hopper grouped GEMM:
// copy_arguments (argument_staging.h).
//
// The arrays go to the device with one cudaMemcpyAsync from pinned host memory: from pageable
// memory the copy would be staged by the driver and may wait for the device. The pinned buffer
// must stay as it is until the copy has read it, which is later than the call returns: each
// buffer carries an event recorded after the copy that reads it, and is reused only once that
// event has completed (a query, not a wait). Buffers are per device (the event's) and kept for
// the life of the process (freeing pinned memory can synchronize the device, and at exit could
// run after the runtime's teardown). Only when a device has kMaxStaging buffers all still in
// flight (the host that many calls ahead of the device) does a call wait for one of them.
//
// Under stream capture the copy becomes a graph node that reads the host buffer at every
// replay, for as long as the graph lives, which this code cannot know: a captured call gets a
// buffer of its own, never reused or freed (16 KiB per captured call, for the process's life).
#include "gemm/hopper/argument_staging.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "common/cuda_utils.cuh"
#include "common/internal.h"

namespace te {
namespace hopper {
namespace {

constexpr const char *kOp = "hopper_grouped_gemm";

struct Staging {
  uint8_t *host = nullptr;       // pinned, portable
  size_t capacity = 0;
  int device = -1;
  cudaEvent_t copied = nullptr;  // recorded after the last copy from it (none for captured ones)
  bool in_flight = false;        // copied has been recorded and not yet seen complete
};

constexpr size_t kStagingMin = 16u << 10;
constexpr size_t kMaxStaging = 64;

std::mutex &staging_mutex() {
  static std::mutex *m = new std::mutex();
  return *m;
}

std::vector<Staging *> &staging_pool() {
  static std::vector<Staging *> *pool = new std::vector<Staging *>();
  return *pool;
}

// A new pinned buffer of at least `bytes` (with an event unless captured). This thread's
// capture mode is relaxed meanwhile: under a global-mode capture, allocating is otherwise
// refused (it is not a stream operation, and the buffer outlives the capture anyway).
te_status new_staging(size_t bytes, int device, bool with_event, Staging **out) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (te_status st = cuda_status(kOp, cudaThreadExchangeStreamCaptureMode(&mode))) return st;
  auto *s = new Staging();
  s->capacity = std::max((bytes + 4095) / 4096 * 4096, kStagingMin);
  s->device = device;
  cudaError_t err = cudaHostAlloc(reinterpret_cast<void **>(&s->host), s->capacity, cudaHostAllocPortable);
  if (err == cudaSuccess && with_event) err = cudaEventCreateWithFlags(&s->copied, cudaEventDisableTiming);
  cudaStreamCaptureMode previous = mode;
  cudaThreadExchangeStreamCaptureMode(&previous);  // back to the caller's mode
  if (err != cudaSuccess) {
    if (s->host != nullptr) cudaFreeHost(s->host);
    delete s;
    return cuda_status(kOp, err);
  }
  *out = s;
  return TE_SUCCESS;
}

// Whether the last copy from s has run; clears the "not ready" answer so that a later
// cudaGetLastError (launch_status) does not take it for an error.
te_status staging_idle(Staging *s, bool *idle) {
  *idle = true;
  if (!s->in_flight) return TE_SUCCESS;
  const cudaError_t q = cudaEventQuery(s->copied);
  if (q == cudaErrorNotReady) {
    if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
    *idle = false;
    return TE_SUCCESS;
  }
  if (q != cudaSuccess) return cuda_status(kOp, q);
  s->in_flight = false;
  return TE_SUCCESS;
}

}  // namespace

te_status copy_arguments(void *dst, size_t bytes, int device, cudaStream_t stream,
                         const std::function<void(uint8_t *)> &fill) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (te_status st = cuda_status(kOp, cudaStreamIsCapturing(stream, &capture))) return st;
  if (capture != cudaStreamCaptureStatusNone) {
    Staging *own = nullptr;  // never freed: the graph reads it at every replay
    if (te_status st = new_staging(bytes, device, false, &own)) return st;
    fill(own->host);
    return cuda_status(kOp, cudaMemcpyAsync(dst, own->host, bytes, cudaMemcpyHostToDevice, stream));
  }
  std::lock_guard<std::mutex> lock(staging_mutex());
  std::vector<Staging *> &pool = staging_pool();
  Staging *use = nullptr, *wait_for = nullptr;
  size_t mine = 0;
  for (Staging *s : pool) {
    if (s->device != device) continue;
    ++mine;
    if (s->capacity < bytes) continue;
    bool idle = false;
    if (te_status st = staging_idle(s, &idle)) return st;
    if (idle) {
      use = s;
      break;
    }
    if (wait_for == nullptr) wait_for = s;
  }
  if (use == nullptr && mine >= kMaxStaging && wait_for != nullptr) {
    if (te_status st = cuda_status(kOp, cudaEventSynchronize(wait_for->copied))) return st;
    wait_for->in_flight = false;
    use = wait_for;
  }
  if (use == nullptr) {
    if (te_status st = new_staging(bytes, device, true, &use)) return st;
    pool.push_back(use);
  }
  fill(use->host);
  if (te_status st = cuda_status(kOp, cudaMemcpyAsync(dst, use->host, bytes, cudaMemcpyHostToDevice, stream))) {
    return st;
  }
  if (te_status st = cuda_status(kOp, cudaEventRecord(use->copied, stream))) return st;
  use->in_flight = true;
  return TE_SUCCESS;
}

}  // namespace hopper
}  // namespace te
