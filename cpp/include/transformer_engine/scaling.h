/* Transformer Engine core: delayed scaling, the scale update from amax histories. */
#ifndef TRANSFORMER_ENGINE_SCALING_H_
#define TRANSFORMER_ENGINE_SCALING_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TE_AMAX_COMPUTE_MAX = 0,         /* amax = max over the whole history */
  TE_AMAX_COMPUTE_MOST_RECENT = 1, /* amax = history[0], the slot the last step wrote */
} te_amax_compute_algo;

/* Delayed-scaling update of num_tensors groups in one call (one kernel launch on CUDA).
 * Group i: [in,out] amax_histories[i] DATA fp32 [H] or [H, n]; [in,out] scales[i] DATA fp32
 * [n] (n = 1 for a 1-D history); [out] scale_invs[i] DATA fp32 [n]. All groups share one
 * device. For each of the n columns:
 *   amax  = max(history) or history[0] by algo (NaN in the history gives NaN);
 *   if amax is finite and > 0: scale = (fp8_max(fp8_dtype) / amax) / 2^margin, and an
 *   infinite result becomes FLT_MAX; otherwise scale keeps its value;
 *   scale_inv = 1 / scale;
 *   the history rolls one step, history'[j] = history[(j + 1) % H], and history'[0] = 0, the
 *   slot that the next step's amax goes into.
 * fp8_dtype is E4M3 or E5M2. */
te_status te_delayed_scaling_update(te_tensor *const *amax_histories, te_tensor *const *scales,
                                    te_tensor *const *scale_invs, size_t num_tensors,
                                    te_dtype fp8_dtype, te_amax_compute_algo algo, int32_t margin,
                                    te_stream stream);

/* The same update for groups of several FP8 formats, each history first recording the amax of
 * the step that just ran: for a caller whose ops write a step's amax into a buffer of its own
 * (a functional framework) rather than into slot 0 of the history. Group i as above, and
 * [in] step_amaxes[i] DATA fp32 [n] (NULL: no recording for any group), before the update:
 *   history[0] = max(history[0], step_amax) per column (NaN in either gives NaN);
 * fp8_dtypes[i] (E4M3 or E5M2) is group i's format. One kernel launch on CUDA, whatever the mix
 * of formats: te_delayed_scaling_update is this call with one format and no step amaxes. */
te_status te_delayed_scaling_update_with_amaxes(te_tensor *const *amax_histories,
                                                te_tensor *const *step_amaxes,
                                                te_tensor *const *scales, te_tensor *const *scale_invs,
                                                const te_dtype *fp8_dtypes, size_t num_tensors,
                                                te_amax_compute_algo algo, int32_t margin,
                                                te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_SCALING_H_ */
