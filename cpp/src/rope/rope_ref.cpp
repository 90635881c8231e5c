// CPU reference of te_rope_forward / te_rope_backward (the CPU backend): token by token, the
// token's cos and sin table (one entry per rotated feature), then every head's features,
// through the element formula of rope_impl.h that the CUDA kernel uses too.
#include <cstring>
#include <vector>

#include "common/elementwise.h"
#include "rope/rope_impl.h"

namespace te {

void rope_ref(const RopeArgs &a) {
  const int64_t width = a.heads * a.dim;
  const size_t esize = te_dtype_size(a.dtype);
  std::vector<float> cos_tab(static_cast<size_t>(a.rot)), sin_tab(static_cast<size_t>(a.rot));
  for (int64_t token = 0; token < a.tokens; ++token) {
    const int64_t p = rope_position(a, token);
    for (int64_t j = 0; j < a.rot; ++j) {
      // No position: NaN angles make the rotated features NaN (rope.h); the entry point has
      // already refused such positions on the CPU, so this only mirrors the CUDA kernel.
      const float angle = p >= 0 ? a.freqs[p * a.rot + j] : bits_float(kCanonicalNaN);
      rope_sincos(angle, &cos_tab[j], &sin_tab[j]);
    }
    const int64_t base = token * width;
    for (int64_t h = 0; h < a.heads; ++h) {
      const int64_t row = base + h * a.dim;
      for (int64_t j = 0; j < a.rot; ++j) {
        const float x = load_hp(a.input, row + j, a.dtype);
        const float partner = load_hp(a.input, row + rope_partner(j, a.rot, a.interleaved), a.dtype);
        const float coef = rope_partner_coef(sin_tab.data(), j, a.rot, a.interleaved, a.backward);
        store_hp(a.output, row + j, a.dtype, rope_rotate(x, partner, cos_tab[j], coef));
      }
      // The features beyond R are copied bit for bit.
      if (a.dim > a.rot) {
        std::memcpy(static_cast<char *>(a.output) + (row + a.rot) * esize,
                    static_cast<const char *>(a.input) + (row + a.rot) * esize,
                    static_cast<size_t>(a.dim - a.rot) * esize);
      }
    }
  }
}

}  // namespace te
