// The counter-based randomness of the core's dropout (attention's probabilities, dropout.h):
// a 64-bit mix of a counter and a seed, the same bits on the CPU and CUDA.
#ifndef TRANSFORMER_ENGINE_SRC_COMMON_HASH_H_
#define TRANSFORMER_ENGINE_SRC_COMMON_HASH_H_

#include <cstdint>

#include "common/numerics.h"

namespace te {

// splitmix64's finalizer: consecutive counters give independent-looking bits.
TE_HOST_DEVICE uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A uniform fraction in [0, 1) with 24 bits from counter and key = mix64(seed) (computed once
// for many counters).
TE_HOST_DEVICE float uniform24_keyed(uint64_t counter, uint64_t key) {
  return static_cast<float>(mix64(counter ^ key) >> 40) * (1.0f / 16777216.0f);
}

// The same from the seed itself.
TE_HOST_DEVICE float uniform24(uint64_t counter, uint64_t seed) { return uniform24_keyed(counter, mix64(seed)); }

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_COMMON_HASH_H_
