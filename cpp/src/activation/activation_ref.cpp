// CPU reference of the fused activations: the numerics oracle of the CUDA kernels and the CPU
// backend. It works a chunk of 128 rows at a time (the chunk of the dbias order): the fp32
// values of the chunk first, then every output from them.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "activation/activation_impl.h"
#include "activation/activation_math.h"
#include "common/elementwise.h"
#include "common/internal.h"
#include "common/numerics.h"

namespace te {
namespace {

// The fp32 values of output / grad_input rows [r0, r1) into v ([r1 - r0, out_cols]), NaN as
// kCanonicalNaN.
template <te_activation kAct>
void chunk_values(const ActivationArgs &a, int64_t r0, int64_t r1, float *v) {
  const int64_t n = a.n, in_cols = a.in_cols(), oc = a.out_cols();
  const te_dtype dt = a.in_dtype;
  for (int64_t r = r0; r < r1; ++r) {
    float *row = v + (r - r0) * oc;
    for (int64_t c = 0; c < n; ++c) {
      if (!a.backward) {
        const float x = load_hp(a.input, r * in_cols + c, dt);
        const float b = a.gated ? load_hp(a.input, r * in_cols + n + c, dt) : 0.0f;
        row[c] = canonical(act::forward_value<kAct>(x, b, a.params));
      } else if (a.gated) {
        const float g = load_hp(a.grad_output, r * n + c, dt);
        const float x = load_hp(a.input, r * in_cols + c, dt);
        const float b = load_hp(a.input, r * in_cols + n + c, dt);
        act::gated_backward_values<kAct>(g, x, b, a.params, &row[c], &row[n + c]);
        row[c] = canonical(row[c]);
        row[n + c] = canonical(row[n + c]);
      } else {
        const float g = load_hp(a.grad_output, r * n + c, dt);
        const float x = a.input != nullptr ? load_hp(a.input, r * in_cols + c, dt) : 0.0f;
        row[c] = canonical(act::backward_value<kAct>(g, x, a.params));
      }
    }
  }
}

template <te_activation kAct>
void activation_ref_impl(const ActivationArgs &a) {
  const int64_t oc = a.out_cols();
  const bool fp8 = a.fp8_out();
  const float scale = fp8 ? *a.scale : 1.0f;
  std::vector<float> v(static_cast<size_t>(std::min(a.rows, kDbiasChunkRows) * oc));
  std::vector<float> dbias(a.dbias != nullptr ? static_cast<size_t>(oc) : 0, 0.0f);
  uint32_t amax = 0;
  for (int64_t r0 = 0; r0 < a.rows; r0 += kDbiasChunkRows) {
    const int64_t r1 = std::min(a.rows, r0 + kDbiasChunkRows);
    chunk_values<kAct>(a, r0, r1, v.data());
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < oc; ++c) {
        const float y = v[(r - r0) * oc + c];
        amax = std::max(amax, abs_bits(y));
        if (!fp8) {
          if (a.out != nullptr) store_hp(a.out, r * oc + c, a.out_dtype, y);
          continue;
        }
        const uint8_t q = to_fp8(y * scale, a.out_dtype);
        if (a.out != nullptr) static_cast<uint8_t *>(a.out)[r * oc + c] = q;
        if (a.out_t != nullptr) a.out_t[c * a.rows + r] = q;
      }
    }
    if (a.dbias != nullptr) {
      // The documented order: runs of 8 rows, then the 16 runs of the chunk, then the chunks.
      for (int64_t c = 0; c < oc; ++c) {
        float chunk = 0.0f;
        for (int64_t run = r0; run < r1; run += kDbiasRunRows) {
          float s = 0.0f;
          for (int64_t r = run; r < std::min(r1, run + kDbiasRunRows); ++r) s += v[(r - r0) * oc + c];
          chunk += s;
        }
        dbias[c] += chunk;
      }
    }
  }
  for (int64_t c = 0; c < static_cast<int64_t>(dbias.size()); ++c) {
    store_hp(a.dbias, c, a.dbias_dtype, canonical(dbias[c]));
  }
  if (a.amax != nullptr) *a.amax = bits_float(a.accumulate_amax ? std::max(float_bits(*a.amax), amax) : amax);
  if (fp8) *a.scale_inv = canonical_div(1.0f, scale);
}

}  // namespace

void activation_ref(const ActivationArgs &a) {
  switch (a.act) {
    case TE_ACTIVATION_IDENTITY: return activation_ref_impl<TE_ACTIVATION_IDENTITY>(a);
    case TE_ACTIVATION_GELU: return activation_ref_impl<TE_ACTIVATION_GELU>(a);
    case TE_ACTIVATION_RELU: return activation_ref_impl<TE_ACTIVATION_RELU>(a);
    case TE_ACTIVATION_SILU: return activation_ref_impl<TE_ACTIVATION_SILU>(a);
    case TE_ACTIVATION_QGELU: return activation_ref_impl<TE_ACTIVATION_QGELU>(a);
    case TE_ACTIVATION_SRELU: return activation_ref_impl<TE_ACTIVATION_SRELU>(a);
    case TE_ACTIVATION_GEGLU: return activation_ref_impl<TE_ACTIVATION_GEGLU>(a);
    case TE_ACTIVATION_SWIGLU: return activation_ref_impl<TE_ACTIVATION_SWIGLU>(a);
    case TE_ACTIVATION_REGLU: return activation_ref_impl<TE_ACTIVATION_REGLU>(a);
    case TE_ACTIVATION_QGEGLU: return activation_ref_impl<TE_ACTIVATION_QGEGLU>(a);
    case TE_ACTIVATION_SREGLU: return activation_ref_impl<TE_ACTIVATION_SREGLU>(a);
    case TE_ACTIVATION_GLU: return activation_ref_impl<TE_ACTIVATION_GLU>(a);
    case TE_ACTIVATION_CLAMPED_SWIGLU: return activation_ref_impl<TE_ACTIVATION_CLAMPED_SWIGLU>(a);
    default: return;
  }
}

}  // namespace te
