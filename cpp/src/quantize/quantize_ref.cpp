// CPU reference of quantize / dequantize: the numerics oracle of the CUDA kernels and the CPU
// backend. Plain loops, written for reading, not for speed.
#include <algorithm>
#include <cstdint>

#include "common/elementwise.h"
#include "common/internal.h"
#include "common/numerics.h"
#include "quantize/quantize_impl.h"

namespace te {
namespace {

// Max |x| over the rectangle [r0, r1) x [c0, c1) of the input, NaN-propagating.
float block_amax(const QuantizeArgs &a, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      m = std::max(m, abs_bits(load_hp(a.input, r * a.cols + c, a.input_dtype)));
    }
  }
  return bits_float(m);
}

// Quantizes the rectangle with one multiplier; writes row-wise data at [r, c] and, when
// transposed_out is set, the transposed copy at [c, r].
void quantize_block(const QuantizeArgs &a, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                    float multiplier, uint8_t *out, uint8_t *transposed_out) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t q = to_fp8(load_hp(a.input, r * a.cols + c, a.input_dtype) * multiplier,
                               a.fp8_dtype);
      if (out != nullptr) out[r * a.cols + c] = q;
      if (transposed_out != nullptr) transposed_out[c * a.rows + r] = q;
    }
  }
}

void quantize_tensor_ref(const QuantizeArgs &a) {
  const float scale = *a.scale;
  quantize_block(a, 0, a.rows, 0, a.cols, scale, a.rowwise, a.columnwise);
  *a.scale_inv = canonical_div(1.0f, scale);
}

// 1x128 blocks along the rows (row-wise) and along the columns (column-wise, written
// transposed, so that each output row holds 1x128 blocks too).
void quantize_block_1x128_ref(const QuantizeArgs &a) {
  const float fmax = fp8_max(a.fp8_dtype);
  const int64_t kb = 128;
  if (a.rowwise != nullptr) {
    float *sinv = static_cast<float *>(a.rowwise_scale_inv);
    const int64_t nb = ceil_div(a.cols, kb);
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t c0 = b * kb, c1 = std::min(a.cols, c0 + kb);
        const float s = scale_from_amax(block_amax(a, r, r + 1, c0, c1), fmax, a.epsilon, a.pow2);
        quantize_block(a, r, r + 1, c0, c1, s, a.rowwise, nullptr);
        sinv[r * nb + b] = canonical_div(1.0f, s);
      }
    }
  }
  if (a.columnwise != nullptr) {
    float *sinv = static_cast<float *>(a.columnwise_scale_inv);
    const int64_t nb = ceil_div(a.rows, kb);
    for (int64_t c = 0; c < a.cols; ++c) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t r0 = b * kb, r1 = std::min(a.rows, r0 + kb);
        const float s = scale_from_amax(block_amax(a, r0, r1, c, c + 1), fmax, a.epsilon, a.pow2);
        quantize_block(a, r0, r1, c, c + 1, s, nullptr, a.columnwise);
        sinv[c * nb + b] = canonical_div(1.0f, s);
      }
    }
  }
}

// 128x128 tiles: one scale per tile serves both the row-wise data and its transpose.
void quantize_block_128x128_ref(const QuantizeArgs &a) {
  const float fmax = fp8_max(a.fp8_dtype);
  const int64_t kb = 128;
  const int64_t nbr = ceil_div(a.rows, kb), nbc = ceil_div(a.cols, kb);
  for (int64_t br = 0; br < nbr; ++br) {
    for (int64_t bc = 0; bc < nbc; ++bc) {
      const int64_t r0 = br * kb, r1 = std::min(a.rows, r0 + kb);
      const int64_t c0 = bc * kb, c1 = std::min(a.cols, c0 + kb);
      const float s = scale_from_amax(block_amax(a, r0, r1, c0, c1), fmax, a.epsilon, a.pow2);
      quantize_block(a, r0, r1, c0, c1, s, a.rowwise, a.columnwise);
      if (a.rowwise != nullptr) static_cast<float *>(a.rowwise_scale_inv)[br * nbc + bc] = canonical_div(1.0f, s);
      if (a.columnwise != nullptr) static_cast<float *>(a.columnwise_scale_inv)[bc * nbr + br] = canonical_div(1.0f, s);
    }
  }
}

// MXFP8: 1x32 blocks along rows (row-wise), 32x1 blocks down columns (column-wise, same
// [rows, cols] layout), E8M0 scales.
void quantize_mxfp8_ref(const QuantizeArgs &a) {
  const float fmax = fp8_max(a.fp8_dtype);
  const int64_t kb = 32;
  if (a.rowwise != nullptr) {
    uint8_t *sinv = static_cast<uint8_t *>(a.rowwise_scale_inv);
    const int64_t nb = ceil_div(a.cols, kb);
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t c0 = b * kb, c1 = std::min(a.cols, c0 + kb);
        const uint8_t e = e8m0_scale_inv_from_amax(block_amax(a, r, r + 1, c0, c1), fmax);
        quantize_block(a, r, r + 1, c0, c1, e8m0_inverse_to_float(e), a.rowwise, nullptr);
        sinv[r * nb + b] = e;
      }
    }
  }
  if (a.columnwise != nullptr) {
    uint8_t *sinv = static_cast<uint8_t *>(a.columnwise_scale_inv);
    const int64_t nb = ceil_div(a.rows, kb);
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t c = 0; c < a.cols; ++c) {
        const int64_t r0 = b * kb, r1 = std::min(a.rows, r0 + kb);
        const uint8_t e = e8m0_scale_inv_from_amax(block_amax(a, r0, r1, c, c + 1), fmax);
        quantize_block(a, r0, r1, c, c + 1, e8m0_inverse_to_float(e), a.columnwise, nullptr);
        sinv[b * a.cols + c] = e;
      }
    }
  }
}

}  // namespace

void quantize_ref(const QuantizeArgs &a) {
  switch (a.mode) {
    case TE_SCALING_TENSOR: quantize_tensor_ref(a); break;
    case TE_SCALING_BLOCK_1X128: quantize_block_1x128_ref(a); break;
    case TE_SCALING_BLOCK_128X128: quantize_block_128x128_ref(a); break;
    case TE_SCALING_MXFP8: quantize_mxfp8_ref(a); break;
  }
  if (a.amax != nullptr) {
    const float m = block_amax(a, 0, a.rows, 0, a.cols);
    // The max of the bit patterns, as the CUDA kernels' atomicMax takes it.
    *a.amax = a.accumulate_amax ? bits_float(std::max(float_bits(*a.amax), float_bits(m))) : m;
  }
}

void dequantize_ref(const DequantizeArgs &a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t c = 0; c < a.cols; ++c) {
      float scale_inv = 0.0f;
      switch (a.mode) {
        case TE_SCALING_TENSOR:
          scale_inv = *static_cast<const float *>(a.scale_inv);
          break;
        case TE_SCALING_BLOCK_1X128:
          scale_inv = static_cast<const float *>(a.scale_inv)[r * ceil_div(a.cols, 128) + c / 128];
          break;
        case TE_SCALING_BLOCK_128X128:
          scale_inv = static_cast<const float *>(a.scale_inv)[(r / 128) * ceil_div(a.cols, 128) + c / 128];
          break;
        case TE_SCALING_MXFP8:
          scale_inv = e8m0_to_float(static_cast<const uint8_t *>(a.scale_inv)[r * ceil_div(a.cols, 32) + c / 32]);
          break;
      }
      const int64_t i = r * a.cols + c;
      store_hp(a.output, i, a.output_dtype, canonical_mul(scale_inv, from_fp8(a.input[i], a.fp8_dtype)));
    }
  }
}

}  // namespace te
