/* Transformer Engine core: the whole C API. */
#ifndef TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_
#define TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_

#include "transformer_engine/tensor.h"
#include "transformer_engine/activation.h"
#include "transformer_engine/attention.h"
#include "transformer_engine/dropout.h"
#include "transformer_engine/gemm.h"
#include "transformer_engine/hopper_gemm.h"
#include "transformer_engine/norm.h"
#include "transformer_engine/quantize.h"
#include "transformer_engine/rope.h"
#include "transformer_engine/scaling.h"
#include "transformer_engine/transpose.h"

#endif /* TRANSFORMER_ENGINE_TRANSFORMER_ENGINE_H_ */
