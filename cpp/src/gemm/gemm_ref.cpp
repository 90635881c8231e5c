// CPU path of te_gemm: the operands are decoded to fp32 in K-major layout, multiplied with
// fp32 accumulation, scaled per tensor or per 128-element K block like the tensor cores do, and
// finished by the epilogue (accumulate, bias, GELU, amax, FP8 cast).
//
// It is the test oracle of the cuBLASLt path and the CPU backend of both frameworks, so it is
// written to be fast enough for training small models: a register-tiled dot-product kernel
// (vectorised by the compiler; AVX2 when the CPU has it) over row blocks spread across threads.
// Every output element is summed by one thread in a fixed order, so results do not depend on
// the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "common/elementwise.h"
#include "common/internal.h"
#include "common/numerics.h"
#include "gemm/gemm_impl.h"

namespace te {
namespace {

// The vector helpers are internal and inlined: the ABI note for AVX vectors does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

constexpr int64_t kBlock = 128;  // K granule of the block-scaled modes
constexpr int kLanes = 8;
typedef float vec8 __attribute__((vector_size(32)));

inline float decode(const GemmOperand &x, int64_t i) {
  if (is_fp8(x.dtype)) return from_fp8(static_cast<const uint8_t *>(x.data)[i], x.dtype);
  return load_hp(x.data, i, x.dtype);
}

// op(X) as fp32 [outer, k], K contiguous, with k padded to a multiple of kLanes by zeros.
// row_major_outer: X is stored [outer, k] (else [k, outer]).
std::vector<float> pack_k_major(const GemmOperand &x, int64_t outer, int64_t k, int64_t k_pad,
                                bool row_major_outer) {
  std::vector<float> p(static_cast<size_t>(outer * k_pad), 0.0f);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t j = 0; j < k; ++j) {
      p[o * k_pad + j] = decode(x, row_major_outer ? o * k + j : j * outer + o);
    }
  }
  return p;
}

inline vec8 load8(const float *p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(vec8 v) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// dots[r][c] = sum over [k0, k1) of a[r][k] * b[c][k] for a 2x4 tile (rows past ra / rb are
// ignored). k0 and k1 are multiples of kLanes.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void tile_dots(const float *a, const float *b, int64_t ld, int ra, int rb, int64_t k0, int64_t k1,
               float dots[2][4]) {
  vec8 acc[2][4] = {};
  const float *ar[2] = {a, a + (ra > 1 ? ld : 0)};
  const float *br[4];
  for (int c = 0; c < 4; ++c) br[c] = b + (c < rb ? c : 0) * ld;
  for (int64_t k = k0; k < k1; k += kLanes) {
    const vec8 a0 = load8(ar[0] + k), a1 = load8(ar[1] + k);
    for (int c = 0; c < 4; ++c) {
      const vec8 bv = load8(br[c] + k);
      acc[0][c] += a0 * bv;
      acc[1][c] += a1 * bv;
    }
  }
  for (int r = 0; r < 2; ++r) {
    for (int c = 0; c < 4; ++c) dots[r][c] = hsum(acc[r][c]);
  }
}

float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + std::tanh(inner));
}

// Scale of row `row` of an FP8 operand stored [rows, k] in K block `kb`.
inline float block_scale(const GemmOperand &x, int64_t row, int64_t kb, int64_t k) {
  const int64_t nkb = ceil_div(k, kBlock);
  if (x.mode == TE_SCALING_BLOCK_128X128) return x.scale_inv[(row / kBlock) * nkb + kb];
  return x.scale_inv[row * nkb + kb];
}

struct Packed {
  std::vector<float> a, b;  // [m, k_pad], [n, k_pad]
  int64_t k_pad;
};

// Raw results (before the epilogue) of rows [r0, r1) into out [m, n] fp32.
void compute_rows(const GemmArgs &g, const Packed &p, int64_t r0, int64_t r1, float *out) {
  const bool blocked = g.fp8 && g.a.mode != TE_SCALING_TENSOR;
  const int64_t span = blocked ? kBlock : p.k_pad;  // K range summed before scaling
  const int64_t nkb = blocked ? ceil_div(g.k, kBlock) : 1;
  const float tensor_scale = g.fp8 && !blocked ? g.a.scale_inv[0] * g.b.scale_inv[0] : 1.0f;
  for (int64_t i = r0; i < r1; i += 2) {
    const int ra = static_cast<int>(std::min<int64_t>(2, r1 - i));
    for (int64_t j = 0; j < g.n; j += 4) {
      const int rb = static_cast<int>(std::min<int64_t>(4, g.n - j));
      float acc[2][4] = {};
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * span, k1 = std::min(p.k_pad, k0 + span);
        float dots[2][4];
        tile_dots(&p.a[i * p.k_pad], &p.b[j * p.k_pad], p.k_pad, ra, rb, k0, k1, dots);
        for (int r = 0; r < ra; ++r) {
          for (int c = 0; c < rb; ++c) {
            const float s = blocked ? block_scale(g.a, i + r, kb, g.k) * block_scale(g.b, j + c, kb, g.k)
                                    : tensor_scale;
            acc[r][c] += dots[r][c] * s;
          }
        }
      }
      for (int r = 0; r < ra; ++r) {
        for (int c = 0; c < rb; ++c) out[(i + r) * g.n + j + c] = acc[r][c];
      }
    }
  }
}

void epilogue(const GemmArgs &g, const std::vector<float> &raw) {
  uint32_t amax_bits = 0;
  const bool fp8_out = is_fp8(g.d_dtype);
  const float d_scale = fp8_out ? *g.d_scale : 1.0f;
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      const int64_t idx = i * g.n + j;
      float v = raw[idx];
      if (g.accumulate) v += load_hp(g.d, idx, g.d_dtype);
      if (g.bias != nullptr) v += load_hp(g.bias, j, g.bias_dtype);
      if (g.gelu) {
        store_hp(g.pre_gelu, idx, g.d_dtype, v);
        v = gelu_tanh(v);
      }
      if (fp8_out) {
        amax_bits = std::max(amax_bits, abs_bits(v));
        static_cast<uint8_t *>(g.d)[idx] = to_fp8(v * d_scale, g.d_dtype);
      } else {
        store_hp(g.d, idx, g.d_dtype, v);
        amax_bits = std::max(amax_bits, abs_bits(load_hp(g.d, idx, g.d_dtype)));
      }
    }
  }
  if (g.d_amax != nullptr) *g.d_amax = bits_float(amax_bits);
  if (g.d_scale_inv != nullptr) *g.d_scale_inv = canonical_div(1.0f, d_scale);
}

}  // namespace

void gemm_ref(const GemmArgs &g) {
  Packed p;
  p.k_pad = ceil_div(g.k, kLanes) * kLanes;
  if (g.fp8 && g.a.mode != TE_SCALING_TENSOR) p.k_pad = ceil_div(g.k, kBlock) * kBlock;
  p.a = pack_k_major(g.a, g.m, g.k, p.k_pad, !g.a.transposed);
  p.b = pack_k_major(g.b, g.n, g.k, p.k_pad, g.b.transposed);
  std::vector<float> raw(static_cast<size_t>(g.m * g.n), 0.0f);
  // Rows are split into even-sized chunks (pairs stay together), one thread per chunk; small
  // products stay on the calling thread.
  const double flops = 2.0 * static_cast<double>(g.m) * g.n * g.k;
  // Asked once: the query reads a file on Linux, which would cost more than a small GEMM.
  static const int64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = std::min<int64_t>({hw, ceil_div(g.m, 2), flops > 2e7 ? hw : 1});
  if (threads <= 1) {
    compute_rows(g, p, 0, g.m, raw.data());
  } else {
    const int64_t chunk = ceil_div(ceil_div(g.m, threads), 2) * 2;
    std::vector<std::thread> pool;
    for (int64_t r0 = chunk; r0 < g.m; r0 += chunk) {
      const int64_t r1 = std::min(g.m, r0 + chunk);
      try {
        pool.emplace_back(compute_rows, std::cref(g), std::cref(p), r0, r1, raw.data());
      } catch (const std::exception &) {  // no thread to be had: do that chunk here
        compute_rows(g, p, r0, r1, raw.data());
      }
    }
    compute_rows(g, p, 0, std::min(g.m, chunk), raw.data());
    for (std::thread &t : pool) t.join();
  }
  epilogue(g, raw);
}

}  // namespace te
