// Device helpers of the CUDA math path of attention and of the scaled softmax: element access
// by runtime dtype (these paths favour covering every case over speed) and block reductions.
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_KERNEL_CUH_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_KERNEL_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "common/numerics.h"
#include "transformer_engine/tensor.h"

namespace te {

// Element i as fp32; FP8 values times descale.
__device__ __forceinline__ float attn_load(const void *p, int64_t i, te_dtype dt, float descale) {
  switch (dt) {
    case TE_DTYPE_FLOAT32: return static_cast<const float *>(p)[i];
    case TE_DTYPE_FLOAT16: return fp16_to_float(static_cast<const uint16_t *>(p)[i]);
    case TE_DTYPE_BFLOAT16: return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
    case TE_DTYPE_FLOAT8_E4M3: return e4m3_to_float(static_cast<const uint8_t *>(p)[i]) * descale;
    default: return e5m2_to_float(static_cast<const uint8_t *>(p)[i]) * descale;
  }
}

// Stores v (FP8: v * scale) and, for FP8 with an amax, records |v|.
__device__ __forceinline__ void attn_store(void *p, int64_t i, te_dtype dt, float v, const float *scale,
                                           float *amax) {
  switch (dt) {
    case TE_DTYPE_FLOAT32: static_cast<float *>(p)[i] = v; return;
    case TE_DTYPE_FLOAT16: static_cast<uint16_t *>(p)[i] = float_to_fp16(v); return;
    case TE_DTYPE_BFLOAT16: static_cast<uint16_t *>(p)[i] = float_to_bf16(v); return;
    default: break;
  }
  if (amax != nullptr) atomicMax(reinterpret_cast<unsigned int *>(amax), abs_bits(v));
  const float x = v * *scale;
  static_cast<uint8_t *>(p)[i] = dt == TE_DTYPE_FLOAT8_E4M3 ? float_to_e4m3(x) : float_to_e5m2(x);
}

// Block-wide max and sum of one float per thread (blockDim.x a multiple of 32, <= 1024);
// scratch holds 32 floats. Every thread gets the result.
__device__ __forceinline__ float block_reduce(float v, float *scratch, bool is_max) {
  for (int o = 16; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : (is_max ? -INFINITY : 0.0f);
  for (int o = 16; o > 0; o /= 2) {
    const float w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  return v;
}

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_KERNEL_CUH_
