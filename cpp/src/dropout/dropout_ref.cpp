// The CPU reference of dropout (dropout.h): element by element, dropout_impl.h's formula.
#include "common/elementwise.h"
#include "dropout/dropout_impl.h"

namespace te {

void dropout_ref(const DropoutArgs &a) {
  const uint64_t key = mix64(static_cast<uint64_t>(a.rng[0])), offset = static_cast<uint64_t>(a.rng[1]);
  const float scale = 1.0f / (1.0f - a.p);
  const bool has_residual = a.residual != nullptr;
  for (int64_t e = 0; e < a.n; ++e) {
    const float r = has_residual ? load_hp(a.residual, e, a.dtype) : 0.0f;
    const float v = dropout_value(load_hp(a.x, e, a.dtype), dropout_factor(key, offset, e, a.p, scale),
                                  has_residual, r);
    store_hp(a.out, e, a.dtype, v);
  }
}

}  // namespace te
