// Device helpers shared by the CUDA norm kernels (norm.cu: backward; norm_forward.cuh: forward):
// the block's row sum in norm.h's fixed order, dtype-generic element access, and a row's
// 8-element vectors read from registers or global memory.
#ifndef TRANSFORMER_ENGINE_SRC_NORM_NORM_CUDA_CUH_
#define TRANSFORMER_ENGINE_SRC_NORM_NORM_CUDA_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_utils.cuh"
#include "norm/norm_impl.h"

namespace te {
namespace norm_cuda {

constexpr int kThreads = kNormLanes;  // one lane per thread
constexpr int kMaxVecs = 8;  // the backward holds rows of x and dy up to 8 * 8 * 128 elements in registers

// Lane sums of the block added as norm_lane_tree does; every thread gets the total.
// scratch: kNormLanes floats; ends with a barrier, so scratch may be reused.
__device__ __forceinline__ float block_lane_sum(float v, float *scratch) {
  const int t = threadIdx.x;
  scratch[t] = v;
  __syncthreads();
  if (t < 64) scratch[t] += scratch[t + 64];
  __syncthreads();
  if (t < 32) {
    float s = scratch[t] + scratch[t + 32];
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) s += __shfl_down_sync(0xFFFFFFFFu, s, d);
    if (t == 0) scratch[0] = s;
  }
  __syncthreads();
  const float total = scratch[0];
  __syncthreads();
  return total;
}

__device__ __forceinline__ float load_any(const void *p, int64_t i, te_dtype d) {
  switch (d) {
    case TE_DTYPE_FLOAT32: return static_cast<const float *>(p)[i];
    case TE_DTYPE_FLOAT16: return fp16_to_float(static_cast<const uint16_t *>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
  }
}

__device__ __forceinline__ void store_any(void *p, int64_t i, te_dtype d, float v) {
  switch (d) {
    case TE_DTYPE_FLOAT32: static_cast<float *>(p)[i] = v; break;
    case TE_DTYPE_FLOAT16: static_cast<uint16_t *>(p)[i] = float_to_fp16(v); break;
    default: static_cast<uint16_t *>(p)[i] = float_to_bf16(v); break;
  }
}

// Elements [i, i + 8) of a weight vector, decoded; p + i must be 16-byte aligned.
__device__ __forceinline__ void load_any8(const void *p, int64_t i, te_dtype d, float (&v)[8]) {
  switch (d) {
    case TE_DTYPE_FLOAT32: load_hp8<TE_DTYPE_FLOAT32>(p, i, v); break;
    case TE_DTYPE_FLOAT16: load_hp8<TE_DTYPE_FLOAT16>(p, i, v); break;
    default: load_hp8<TE_DTYPE_BFLOAT16>(p, i, v); break;
  }
}

// 8 elements at p + i (16-byte aligned), encoded in dtype d.
__device__ __forceinline__ void store_any8(void *p, int64_t i, te_dtype d, const float (&v)[8]) {
  if (d == TE_DTYPE_FLOAT32) {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t lo = d == TE_DTYPE_FLOAT16 ? float_to_fp16(v[2 * k]) : float_to_bf16(v[2 * k]);
    const uint16_t hi = d == TE_DTYPE_FLOAT16 ? float_to_fp16(v[2 * k + 1]) : float_to_bf16(v[2 * k + 1]);
    w[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
}

// The 8 elements of vector `vec` of a row: from registers when the row is held there, else
// from global memory (elements past the row end read as 0 and are never used).
template <te_dtype kIn, int kVecs>
struct RowVectors {
  Packed8<kIn> held[kVecs > 0 ? kVecs : 1];
  const void *row;
  int64_t cols;

  __device__ __forceinline__ void load(const void *row_ptr, int64_t n) {
    row = row_ptr;
    cols = n;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t i = (threadIdx.x + static_cast<int64_t>(kThreads) * j) * kNormVec;
      if (i < cols) {
        held[j].load(row, i);
      } else {
        held[j].zero();
      }
    }
  }
  // Number of this thread's vectors (kVecs when held; enough to cover the row otherwise).
  __device__ __forceinline__ int count() const {
    if (kVecs > 0) return kVecs;
    const int64_t left = div_up(cols, kNormVec) - threadIdx.x;  // this thread's first vector on
    return left > 0 ? static_cast<int>(div_up(left, kThreads)) : 0;
  }
  // Calls f(j) for each of this thread's vectors; unrolled when they are held in registers
  // (indices must be compile-time constants there, or the array would go to local memory).
  template <typename F>
  __device__ __forceinline__ void each(F &&f) const {
    if constexpr (kVecs > 0) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) f(j);
    } else {
      const int c = count();
      for (int j = 0; j < c; ++j) f(j);
    }
  }
  __device__ __forceinline__ int64_t start(int j) const {
    return (threadIdx.x + static_cast<int64_t>(kThreads) * j) * kNormVec;
  }
  __device__ __forceinline__ void get(int j, float (&x)[8]) const {
    if constexpr (kVecs > 0) {
      held[j].decode(x);
    } else {
      const int64_t i0 = start(j);
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = i0 + e < cols ? load_hp1<kIn>(row, i0 + e) : 0.0f;
    }
  }
};

// The forward of rows of input dtype kIn (norm_forward_{fp32,fp16,bf16}.cu): every kernel but
// the FP8 transpose, which the caller runs after.
template <te_dtype kIn>
te_status forward(const NormForwardArgs &a, bool vector_io, bool vector_weights, cudaStream_t s);

}  // namespace norm_cuda
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_NORM_NORM_CUDA_CUH_
