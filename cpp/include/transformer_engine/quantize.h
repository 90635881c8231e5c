/* Transformer Engine core: quantization to FP8 and back.
 *
 * Conversion to FP8 rounds to nearest even and saturates finite values to the format's finite
 * maximum. Non-finite values stay non-finite, so that an overflow is never hidden: NaN becomes
 * the one NaN byte 0x7F (whatever its sign); +-Inf becomes +-Inf in E5M2 (0x7C / 0xFC) and
 * the NaN byte 0x7F in E4M3, which has no infinity. The test is on the scaled fp32 value
 * x * scale: under delayed scaling, a finite x whose product overflows fp32 is non-finite too.
 * Every kernel that writes FP8 (quantize, block quantize, the fused norm and activation
 * casts) converts this way; the CPU and CUDA paths give identical bits.
 * Tensors are viewed as matrices [M, K]: K is the last dimension, M the product of the rest.
 */
#ifndef TRANSFORMER_ENGINE_QUANTIZE_H_
#define TRANSFORMER_ENGINE_QUANTIZE_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Options of quantization. The first two shape scale computation (current scaling and block
 * scaling); accumulate_amax concerns the AMAX output of te_quantize. A zero-initialised
 * config is the default of every field. */
typedef struct {
  int32_t force_pow2_scales; /* nonzero: round each scale down to a power of two */
  float amax_epsilon;        /* amax is raised to at least this before the scale is taken */
  /* te_quantize only. Nonzero: AMAX is not overwritten but raised, AMAX = max(AMAX, max|input|),
   * compared as the bit patterns of the floats (so NaN wins over any number). AMAX must then
   * hold a non-negative value or a NaN: delayed scaling points it at slot 0 of an amax history,
   * which the scale update zeroes, so that several quantizations of one step keep their max
   * with no separate reduction or copy. */
  int32_t accumulate_amax;
} te_quantize_config;

/* Quantizes [in] input (fp32/fp16/bf16, slot DATA) into [out] output, whose dtype (the
 * FP8 format: E4M3 or E5M2) is that of its DATA or COLUMNWISE_DATA slot; at least one of
 * the two must be set, and both are written in one pass when both are.
 *   TENSOR mode:  reads output SCALE; writes SCALE_INV = 1/scale and, when set, AMAX = max|input|
 *                 (NaN if any input is NaN; raised, not overwritten, with config->accumulate_amax).
 *                 COLUMNWISE_DATA is the transpose [K, M].
 *   block modes:  writes the scale_inv slots of the data slots that are set (see tensor.h for
 *                 shapes); the scale of a block is computed as te_compute_scale_from_amax does
 *                 for that block's amax; AMAX, when set, receives the amax of the whole input
 *                 (as in TENSOR mode, accumulate_amax included).
 * [in] config may be NULL (defaults: no power-of-two rounding, epsilon 0, AMAX overwritten); its
 * scale options apply to the block modes (MXFP8 scales are powers of two by construction). */
te_status te_quantize(const te_tensor *input, te_tensor *output, const te_quantize_config *config,
                      te_stream stream);

/* count quantizations with one config: the results of te_quantize(inputs[i], outputs[i],
 * config, stream) for each i, checked all before any runs (on failure nothing is written). They
 * run as one batch, so no output may overlap another's output or any input, and all tensors
 * must be on one device. On CUDA, TENSOR-mode casts with a transposed copy that share an input
 * dtype and an FP8 format run in one kernel launch: a small layer's forward (its input's and
 * its weight's casts) is bound by the host time of its launches. */
te_status te_quantize_many(const te_tensor *const *inputs, te_tensor *const *outputs, size_t count,
                           const te_quantize_config *config, te_stream stream);

/* Dequantizes [in] input (FP8 in slot DATA, with its scale_inv by mode) into [out] output
 * (fp32/fp16/bf16 in slot DATA, the same shape): output = fp8_value * scale_inv, rounded to
 * nearest even. */
te_status te_dequantize(const te_tensor *input, te_tensor *output, te_stream stream);

/* Writes max|x| over [in] input's DATA (fp32/fp16/bf16) into [out] output's AMAX slot
 * ([1] fp32). NaN anywhere gives NaN; an empty input gives 0. */
te_status te_compute_amax(const te_tensor *input, te_tensor *output, te_stream stream);

/* Current scaling: from [in,out] tensor's AMAX computes SCALE and SCALE_INV for its FP8 dtype
 * (that of its DATA or COLUMNWISE_DATA slot):
 *   a = max(amax, amax_epsilon); scale = fp8_max / a; an infinite scale becomes FLT_MAX;
 *   a = 0, NaN or Inf gives scale 1; with force_pow2_scales the scale is rounded down to a
 *   power of two; scale_inv = 1 / scale.
 * [in] config may be NULL. */
te_status te_compute_scale_from_amax(te_tensor *tensor, const te_quantize_config *config,
                                     te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_QUANTIZE_H_ */
