// The resolved arguments of te_dropout_add_forward / te_dropout_backward, and the element
// formula that the CPU reference and the CUDA kernel share (dropout.h), so that both write the
// same bits.
#ifndef TRANSFORMER_ENGINE_SRC_DROPOUT_DROPOUT_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_DROPOUT_DROPOUT_IMPL_H_

#include <cstdint>

#include "common/hash.h"
#include "transformer_engine/tensor.h"

namespace te {

struct DropoutArgs {
  float p;               // drop probability, [0, 1)
  const void *x;         // forward: x; backward: dy
  const void *residual;  // forward only, or null
  void *out;             // y or dx
  te_dtype dtype;        // of all of them
  int64_t n;             // elements
  const int64_t *rng;    // [2]: seed, offset (on the call's device)
};

// Element e's factor: 1 / (1 - p) where kept, 0 where dropped (key: mix64(seed); scale:
// 1 / (1 - p) in fp32).
TE_HOST_DEVICE float dropout_factor(uint64_t key, uint64_t offset, int64_t e, float p, float scale) {
  return uniform24_keyed(offset + static_cast<uint64_t>(e), key) >= p ? scale : 0.0f;
}

// (What an element of the output is, in fp32, before its one rounding.)
TE_HOST_DEVICE float dropout_value(float x, float factor, bool has_residual, float residual) {
  const float dropped = x * factor;
  return has_residual ? residual + dropped : dropped;
}

void dropout_ref(const DropoutArgs &args);
te_status dropout_cuda(const DropoutArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_DROPOUT_DROPOUT_IMPL_H_
