/* Transformer Engine core: matrix transpose of any element type. */
#ifndef TRANSFORMER_ENGINE_TRANSPOSE_H_
#define TRANSFORMER_ENGINE_TRANSPOSE_H_

#include "transformer_engine/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the transpose of [in] input's DATA, viewed as [M, K], into [out] output's DATA,
 * which must hold M*K elements of the same dtype with shape [K, M] (or [K, *leading dims]).
 * Works on raw elements, so FP8 data is transposed without touching its scales. */
te_status te_transpose(const te_tensor *input, te_tensor *output, te_stream stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_TRANSPOSE_H_ */
