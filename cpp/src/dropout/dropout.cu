// The CUDA path of dropout (dropout.h): one grid-stride pass, each thread taking a run of kVec
// adjacent elements (one 16-byte load per operand where aligned), dropout_impl.h's formula per
// element, so the bits equal the CPU reference's.
#include <cuda_runtime.h>

#include "common/cuda_utils.cuh"
#include "common/numerics.h"
#include "dropout/dropout_impl.h"

namespace te {
namespace {

constexpr int kThreads = 256;

template <te_dtype D>
struct Io;
template <>
struct Io<TE_DTYPE_FLOAT32> {
  using T = float;
  static __device__ float load(T v) { return v; }
  static __device__ T store(float v) { return v; }
};
template <>
struct Io<TE_DTYPE_BFLOAT16> {
  using T = uint16_t;
  static __device__ float load(T v) { return bf16_to_float(v); }
  static __device__ T store(float v) { return float_to_bf16(v); }
};
template <>
struct Io<TE_DTYPE_FLOAT16> {
  using T = uint16_t;
  static __device__ float load(T v) { return fp16_to_float(v); }
  static __device__ T store(float v) { return float_to_fp16(v); }
};

// kVec elements of 16 bytes' worth per thread and step; `vector`: every pointer 16-byte
// aligned and n a multiple of kVec, so runs are loaded and stored whole.
template <te_dtype D, bool vector>
__global__ void __launch_bounds__(kThreads) dropout_kernel(DropoutArgs a) {
  using T = typename Io<D>::T;
  constexpr int kVec = 16 / sizeof(T);
  struct alignas(16) Run {
    T v[kVec];
  };
  const uint64_t key = mix64(static_cast<uint64_t>(a.rng[0])), offset = static_cast<uint64_t>(a.rng[1]);
  const float scale = 1.0f / (1.0f - a.p);
  const bool has_residual = a.residual != nullptr;
  const T *x = static_cast<const T *>(a.x), *r = static_cast<const T *>(a.residual);
  T *out = static_cast<T *>(a.out);
  const int64_t runs = (a.n + kVec - 1) / kVec;
  for (int64_t run = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; run < runs;
       run += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e0 = run * kVec;
    Run xv{}, rv{}, ov{};
    if (vector) {
      xv = reinterpret_cast<const Run *>(x)[run];
      if (has_residual) rv = reinterpret_cast<const Run *>(r)[run];
    } else {
      for (int i = 0; i < kVec; ++i) {
        if (e0 + i < a.n) {
          xv.v[i] = x[e0 + i];
          rv.v[i] = has_residual ? r[e0 + i] : T{};
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float factor = dropout_factor(key, offset, e0 + i, a.p, scale);
      const float res = has_residual ? Io<D>::load(rv.v[i]) : 0.0f;
      ov.v[i] = Io<D>::store(dropout_value(Io<D>::load(xv.v[i]), factor, has_residual, res));
    }
    if (vector) {
      reinterpret_cast<Run *>(out)[run] = ov;
    } else {
      for (int i = 0; i < kVec; ++i) {
        if (e0 + i < a.n) out[e0 + i] = ov.v[i];
      }
    }
  }
}

bool aligned16(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <te_dtype D>
te_status launch(const DropoutArgs &a, cudaStream_t stream) {
  constexpr int64_t kVec = 16 / sizeof(typename Io<D>::T);
  const int64_t runs = (a.n + kVec - 1) / kVec;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t blocks = (runs + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < int64_t(sms) * 8 ? blocks : int64_t(sms) * 8);
  const bool vector = a.n % kVec == 0 && aligned16(a.x) && aligned16(a.out) &&
                      (a.residual == nullptr || aligned16(a.residual));
  if (vector) {
    dropout_kernel<D, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    dropout_kernel<D, false><<<grid, kThreads, 0, stream>>>(a);
  }
  return launch_status("dropout");
}

}  // namespace

te_status dropout_cuda(const DropoutArgs &a, te_stream stream) {
  cudaStream_t st = cuda_stream(stream);
  switch (a.dtype) {
    case TE_DTYPE_FLOAT32: return launch<TE_DTYPE_FLOAT32>(a, st);
    case TE_DTYPE_FLOAT16: return launch<TE_DTYPE_FLOAT16>(a, st);
    default: return launch<TE_DTYPE_BFLOAT16>(a, st);
  }
}

}  // namespace te
