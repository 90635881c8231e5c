// CPU reference of amax, the current-scaling scale and the delayed-scaling update.
#include <algorithm>
#include <cmath>

#include "common/elementwise.h"
#include "common/numerics.h"
#include "scaling/scaling_impl.h"

namespace te {

void compute_amax_ref(const AmaxArgs &a) {
  uint32_t m = 0;
  for (int64_t i = 0; i < a.numel; ++i) m = std::max(m, abs_bits(load_hp(a.input, i, a.input_dtype)));
  *a.amax = bits_float(m);
}

void scale_from_amax_ref(const ScaleFromAmaxArgs &a) {
  const float s = scale_from_amax(*a.amax, a.fp8_max, a.epsilon, a.pow2);
  *a.scale = s;
  *a.scale_inv = canonical_div(1.0f, s);
}

void delayed_scaling_update_ref(const DelayedScalingArgs &a) {
  for (size_t g = 0; g < a.num_groups; ++g) {
    const DelayedScalingGroup &grp = a.groups[g];
    const int64_t h = grp.history_len, n = grp.columns;
    for (int64_t j = 0; j < n; ++j) {
      float *col = grp.history + j;  // element i of this column is col[i * n]
      if (grp.step_amax != nullptr) col[0] = recorded_amax(col[0], grp.step_amax[j]);
      uint32_t m = abs_bits(col[0]);
      if (a.algo == TE_AMAX_COMPUTE_MAX) {
        for (int64_t i = 1; i < h; ++i) m = std::max(m, abs_bits(col[i * n]));
      }
      const float s = delayed_scale(bits_float(m), grp.scale[j], grp.fp8_max, a.margin);
      grp.scale[j] = s;
      grp.scale_inv[j] = canonical_div(1.0f, s);
      const float first = col[0];
      for (int64_t i = 0; i + 1 < h; ++i) col[i * n] = col[(i + 1) * n];
      col[(h - 1) * n] = first;
      col[0] = 0.0f;
    }
  }
}

}  // namespace te
