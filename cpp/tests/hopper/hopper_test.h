// What the GPU tests of the Hopper kernels (test_block_scaled_gemm.cpp, test_grouped_gemm.cpp)
// share: the error-bound constants, tensor binding to CUDA or host buffers, reading D back,
// and a main() that runs the device-free checks, then the GPU cases or ctest's skip code.
#ifndef TE_TESTS_HOPPER_HOPPER_TEST_H_
#define TE_TESTS_HOPPER_HOPPER_TEST_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "test_util.h"

namespace hopper_test {

constexpr int kSkipped = 77;                 // ctest's SKIP_RETURN_CODE for these tests
constexpr double kU = 1.0 / 16777216.0;      // 2^-24
constexpr double kTensorCore = 1.0 / 512.0;  // 2^-9: FP8 tensor cores' in-block precision
constexpr size_t kGuard = 256;               // bytes around a D that must stay untouched
constexpr uint8_t kGuardByte = 0xA5;

#define CUDA_OK(call)                                                                             \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

inline te_buffer buffer(te_device_type device, int device_id, const void *data, te_dtype dtype,
                        std::vector<int64_t> shape) {
  te_buffer b = te_test::cpu_buffer(const_cast<void *>(data), dtype, shape);
  b.device = device;
  b.device_id = device_id;
  return b;
}

inline void bind(te_tensor *t, te_tensor_slot slot, te_device_type device, int device_id, const void *data,
                 te_dtype dtype, std::vector<int64_t> shape) {
  const te_buffer b = buffer(device, device_id, data, dtype, shape);
  CHECK(te_tensor_set(t, slot, &b) == TE_SUCCESS);
}

// Element i of a D stored as fp32 or bf16.
inline float d_value(const std::vector<uint8_t> &d, te_dtype dtype, size_t i) {
  if (dtype == TE_DTYPE_FLOAT32) {
    float v;
    std::memcpy(&v, d.data() + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, d.data() + 2 * i, 2);
  return te::bf16_to_float(h);
}

// Why the GPU cases cannot run here ("" when the current device is an sm_90).
// Milliseconds per call of call() on the default stream: 3 warm-up calls, then iters timed by
// CUDA events.
template <typename Call>
double ms_per_call(Call call, int iters) {
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) call();
  CUDA_OK(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) call();
  CUDA_OK(cudaEventRecord(stop));
  CUDA_OK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / iters;
}

// Whether our kernel's result can be compared: it ran and wrote nothing outside D. A failed run
// fails the check, with the kernel's message.
inline bool ours_ran(te_status status, const std::string &message, bool guards_intact) {
  if (status != TE_SUCCESS) {
    std::printf("    hopper failed: %s\n", message.c_str());
    CHECK(status == TE_SUCCESS);
    return false;
  }
  CHECK(guards_intact);
  return true;
}

// Whether the other GPU path (cuBLASLt) ran; when it did not, says so and why.
inline bool other_ran(const char *name, te_status status, const std::string &message) {
  if (status == TE_SUCCESS) return true;
  std::printf("    %s: not compared (%s)\n", name, message.c_str());
  return false;
}

inline std::string gpu_missing() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return std::string("no CUDA device (") + cudaGetErrorString(e) + ")";
  if (count == 0) return "no CUDA device";
  int dev = 0, major = 0, minor = 0;
  CUDA_OK(cudaGetDevice(&dev));
  CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) return "the device is sm_" + std::to_string(major * 10 + minor) + ", not sm_90";
  return "";
}

// The tests' main(): the TEST_CASEs (device-free checks), then gpu_cases() on an sm_90, or
// kSkipped without one.
inline int run(void (*gpu_cases)()) {
  const int status = te_test::run_all();
  if (status != 0) return status;
  const std::string missing = gpu_missing();
  if (!missing.empty()) {
    std::printf("GPU cases skipped: %s\n", missing.c_str());
    return kSkipped;
  }
  const int before = te_test::failures();
  gpu_cases();
  std::printf("%s gpu_cases\n%d checks failed\n", te_test::failures() == before ? "PASS" : "FAIL",
              te_test::failures());
  return te_test::failures() == 0 ? 0 : 1;
}

}  // namespace hopper_test

#endif  // TE_TESTS_HOPPER_HOPPER_TEST_H_
