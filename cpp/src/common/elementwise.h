// Loads and stores of high-precision elements by runtime dtype (CPU reference path).
#ifndef TRANSFORMER_ENGINE_SRC_COMMON_ELEMENTWISE_H_
#define TRANSFORMER_ENGINE_SRC_COMMON_ELEMENTWISE_H_

#include <cstdint>

#include "common/numerics.h"
#include "transformer_engine/tensor.h"

namespace te {

inline float load_hp(const void *data, int64_t i, te_dtype dtype) {
  switch (dtype) {
    case TE_DTYPE_FLOAT32: return static_cast<const float *>(data)[i];
    case TE_DTYPE_FLOAT16: return fp16_to_float(static_cast<const uint16_t *>(data)[i]);
    default: return bf16_to_float(static_cast<const uint16_t *>(data)[i]);
  }
}

inline void store_hp(void *data, int64_t i, te_dtype dtype, float v) {
  switch (dtype) {
    case TE_DTYPE_FLOAT32: static_cast<float *>(data)[i] = v; break;
    case TE_DTYPE_FLOAT16: static_cast<uint16_t *>(data)[i] = float_to_fp16(v); break;
    default: static_cast<uint16_t *>(data)[i] = float_to_bf16(v); break;
  }
}

inline uint8_t to_fp8(float v, te_dtype fp8_dtype) {
  return fp8_dtype == TE_DTYPE_FLOAT8_E4M3 ? float_to_e4m3(v) : float_to_e5m2(v);
}

inline float from_fp8(uint8_t v, te_dtype fp8_dtype) {
  return fp8_dtype == TE_DTYPE_FLOAT8_E4M3 ? e4m3_to_float(v) : e5m2_to_float(v);
}

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_COMMON_ELEMENTWISE_H_
