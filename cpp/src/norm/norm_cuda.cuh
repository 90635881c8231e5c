// Device helpers shared by the CUDA norm kernels (norm_forward.cuh, norm_backward.cuh): the row
// sum of a row group in norm.h's fixed order, dtype-generic element access, and the launch
// plumbing (shared-memory limits, residency).
//
// A row group is kThreads = 128 threads, thread t being lane t of norm.h's row-sum order: it
// takes the 8-element vectors t, t + 128, ... of a row and adds them up in that order; the
// group then adds the 128 lane sums as norm_lane_tree does (group_lane_sums).
#ifndef TRANSFORMER_ENGINE_SRC_NORM_NORM_CUDA_CUH_
#define TRANSFORMER_ENGINE_SRC_NORM_NORM_CUDA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "norm/norm_impl.h"

namespace te {
namespace norm_cuda {

constexpr int kThreads = kNormLanes;  // a row group: one thread per lane
constexpr int kGroupWarps = kThreads / 32;

// The row group's own barrier (ids 1..15; 0 is __syncthreads'), so that the groups of a block
// wait only for their own warps.
__device__ __forceinline__ void group_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// Reduction scratch of one row group for kRows sums: lane l of warp w at [r * 32 + l].w.
template <int kRows>
struct LaneScratch {
  float4 lanes[kRows * 32];
};

// The lane sums v[r] (one per thread of the row group, thread t = lane t) of kRows independent
// row sums, added exactly as norm_lane_tree does; every thread gets the totals in v.
// The tree's first two levels cross warps: lane l (< 32) gets l + 64 (warp 2 onto warp 0, warp
// 3 onto warp 1), then l + 32; every warp does this for itself from the scratch, so one barrier
// suffices. The last five levels are a butterfly in the warp: lane l adds lane l ^ d, which
// gives every lane the same bits as lane 0 of norm_lane_tree (each addition has the same two
// operands, possibly swapped, and IEEE addition is commutative).
// The caller alternates between two scratch buffers: a buffer is rewritten only after the
// group's next barrier, which every thread passes only after reading it.
template <int kRows>
__device__ __forceinline__ void group_lane_sums(float (&v)[kRows], LaneScratch<kRows> &scratch, int barrier) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % kGroupWarps;
  float *s = reinterpret_cast<float *>(scratch.lanes);
#pragma unroll
  for (int r = 0; r < kRows; ++r) s[(r * 32 + lane) * 4 + warp] = v[r];
  group_sync(barrier);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float4 q = scratch.lanes[r * 32 + lane];
    float total = (q.x + q.z) + (q.y + q.w);
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) total += __shfl_xor_sync(0xFFFFFFFFu, total, d);
    v[r] = total;
  }
}

// The 8 elements of a loaded vector as fp32, decoded anew on every call: the register copy is
// opaque to the compiler, which would otherwise merge the decodes of the passes over a row into
// one and keep 8 floats per vector live instead of the packed words. fp16 takes the hardware
// conversion: exact for every value but NaN, and no output here passes an input NaN through
// unchanged (each is fp32 arithmetic, whose NaN the GPU writes as one pattern whatever the
// operands' payloads).
template <te_dtype kIn>
__device__ __forceinline__ void decode_pass(const Packed8<kIn> &p, float (&x)[8]) {
  if constexpr (kIn == TE_DTYPE_FLOAT32) {
    p.decode(x);
  } else {
    uint4 w = p.raw;
    asm volatile("" : "+r"(w.x), "+r"(w.y), "+r"(w.z), "+r"(w.w));
    const uint32_t v[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kIn == TE_DTYPE_FLOAT16) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&v[k]));
        x[2 * k] = f.x, x[2 * k + 1] = f.y;
      } else {
        x[2 * k] = __uint_as_float(v[k] << 16), x[2 * k + 1] = __uint_as_float(v[k] & 0xFFFF0000u);
      }
    }
  }
}

// max(a, b) with NaN winning (max.NaN): the running amax as a float. For values >= +0 the float
// order is the order of abs_bits, and a NaN made by GPU arithmetic is 0x7FFFFFFF, the largest
// abs_bits there is, so the bits equal those of the reference's max over abs_bits.
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// max |v[e]| of 8 values, NaN if any is NaN.
__device__ __forceinline__ float abs_max8(const float (&v)[8]) {
  float m = fabsf(v[0]);
#pragma unroll
  for (int e = 1; e < 8; ++e) m = fmax_nan(m, fabsf(v[e]));
  return m;
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
    case TE_DTYPE_FLOAT32: static_cast<float *>(p)[i] = canonical(v); break;
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

// 8 elements at p + i (16-byte aligned), encoded in dtype d by the reference's own conversions.
__device__ __forceinline__ void store_any8(void *p, int64_t i, te_dtype d, const float (&v)[8]) {
  if (d == TE_DTYPE_FLOAT32) {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p) + i);
    q[0] = make_float4(canonical(v[0]), canonical(v[1]), canonical(v[2]), canonical(v[3]));
    q[1] = make_float4(canonical(v[4]), canonical(v[5]), canonical(v[6]), canonical(v[7]));
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

// A row's 8-element vectors read from global memory on every pass (the general kernels:
// any length, any alignment); elements past the row end read as 0 and are never used.
template <te_dtype kIn>
struct RowVectors {
  const void *row;
  int64_t cols;
  bool whole;  // 8 | cols and the row starts 16-byte aligned: whole vectors load as one

  // This thread's vectors t, t + kThreads, ... that start inside the row.
  __device__ __forceinline__ int count() const {
    const int64_t left = div_up(cols, kNormVec) - threadIdx.x % kThreads;
    return left > 0 ? static_cast<int>(div_up(left, kThreads)) : 0;
  }
  __device__ __forceinline__ int64_t start(int j) const {
    return (threadIdx.x % kThreads + static_cast<int64_t>(kThreads) * j) * kNormVec;
  }
  __device__ __forceinline__ void get(int j, float (&x)[8]) const {
    const int64_t i0 = start(j);
    if (whole) {
      load_hp8<kIn>(row, i0, x);
      return;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = i0 + e < cols ? load_hp1<kIn>(row, i0 + e) : 0.0f;
  }
};

// How many of this thread's vectors t, t + 128, ... (at most max_vecs) lie inside a row of
// nvec whole vectors.
__device__ __forceinline__ int own_vectors(int64_t nvec, int max_vecs) {
  const int64_t left = div_up(nvec - threadIdx.x % kThreads, kThreads);
  return left <= 0 ? 0 : left < max_vecs ? static_cast<int>(left) : max_vecs;
}

// Vectors per thread (1, 2, 4, ..., max) that hold a row of n elements, or 0 if more are needed.
inline int vecs_for(int64_t n, int max_vecs) {
  const int64_t need = div_up(div_up(n, kNormVec), kThreads);
  for (int v = 1; v <= max_vecs; v *= 2) {
    if (need <= v) return v;
  }
  return 0;
}

// The forward of rows of input dtype kIn (norm_forward_{fp32,fp16,bf16}.cu); the caller runs
// the FP8 transpose kernel after it when the transpose is asked for.
template <te_dtype kIn>
te_status forward(const NormForwardArgs &a, bool vector_io, cudaStream_t s);

// The backward's row kernels for input dtype kIn (norm_backward_{fp32,fp16,bf16}.cu): grad_input
// and the partial column sums of each 32-row group into `partials`.
template <te_dtype kIn>
te_status backward(const NormBackwardArgs &a, bool vector_io, float *partials, int64_t groups, cudaStream_t s);

}  // namespace norm_cuda
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_NORM_NORM_CUDA_CUH_
