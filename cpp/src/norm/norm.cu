// CUDA LayerNorm / RMSNorm.
//
// Forward: a row is reduced by a block of 128 threads, thread t being lane t of norm.h's row-sum
// order: it takes the 8-element vectors t, t + 128, ... of its row, sums them in increasing
// order, and the block adds the 128 lane sums pairwise exactly as norm_lane_tree does. Mean,
// variance, rsigma and every output element then follow the shared formulas of norm_impl.h, so
// the bits equal the CPU reference's. Whole, aligned rows are staged through shared memory by
// a persistent grid that loads the next rows while it reduces this one; other rows (8 does not
// divide cols, misaligned, too long) take one block per row reading global memory on each pass.
// The FP8 transpose, when asked for, is the FP8 transpose kernel run on the row-wise FP8 output
// (a row-wise kernel cannot write a transposed tile coalesced).
//
// Backward: one block per group of 32 rows (norm.h's column-sum groups), rows in order; the
// gains and the group's partial column sums of grad_gamma / grad_beta live in shared memory,
// each column owned by one thread; a second kernel adds the groups' partials in group order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "common/cuda_utils.cuh"
#include "norm/norm_impl.h"
#include "transpose/transpose_impl.h"

namespace te {
namespace {

constexpr int kThreads = kNormLanes;  // one lane per thread
constexpr int kMaxVecs = 8;  // the backward holds rows of x and dy up to 8 * 8 * 128 elements in registers

// Lane sums of the block added as norm_lane_tree does; every thread gets the total.
// scratch: kNormLanes floats; ends with a barrier, so scratch may be reused.
__device__ __forceinline__ float block_lane_sum(float v, float *scratch) {
  const int t = threadIdx.x;
  scratch[t] = v;
  __syncthreads();
  if (t < 64) scratch[t] += scratch[t + 64];
  __syncthreads();
  if (t < 32) {
    float s = scratch[t] + scratch[t + 32];
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) s += __shfl_down_sync(0xFFFFFFFFu, s, d);
    if (t == 0) scratch[0] = s;
  }
  __syncthreads();
  const float total = scratch[0];
  __syncthreads();
  return total;
}

__device__ __forceinline__ float load_any(const void *p, int64_t i, te_dtype d) {
  switch (d) {
    case TE_DTYPE_FLOAT32: return static_cast<const float *>(p)[i];
    case TE_DTYPE_FLOAT16: return fp16_to_float(static_cast<const uint16_t *>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t *>(p)[i]);
  }
}

__device__ __forceinline__ void store_any(void *p, int64_t i, te_dtype d, float v) {
  switch (d) {
    case TE_DTYPE_FLOAT32: static_cast<float *>(p)[i] = v; break;
    case TE_DTYPE_FLOAT16: static_cast<uint16_t *>(p)[i] = float_to_fp16(v); break;
    default: static_cast<uint16_t *>(p)[i] = float_to_bf16(v); break;
  }
}

// Elements [i, i + 8) of a weight vector, decoded; p + i must be 16-byte aligned.
__device__ __forceinline__ void load_any8(const void *p, int64_t i, te_dtype d, float (&v)[8]) {
  switch (d) {
    case TE_DTYPE_FLOAT32: load_hp8<TE_DTYPE_FLOAT32>(p, i, v); break;
    case TE_DTYPE_FLOAT16: load_hp8<TE_DTYPE_FLOAT16>(p, i, v); break;
    default: load_hp8<TE_DTYPE_BFLOAT16>(p, i, v); break;
  }
}

// 8 elements at p + i (16-byte aligned), encoded in dtype d.
__device__ __forceinline__ void store_any8(void *p, int64_t i, te_dtype d, const float (&v)[8]) {
  if (d == TE_DTYPE_FLOAT32) {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p) + i);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
    return;
  }
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t lo = d == TE_DTYPE_FLOAT16 ? float_to_fp16(v[2 * k]) : float_to_bf16(v[2 * k]);
    const uint16_t hi = d == TE_DTYPE_FLOAT16 ? float_to_fp16(v[2 * k + 1]) : float_to_bf16(v[2 * k + 1]);
    w[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
}

// The 8 elements of vector `vec` of a row: from registers when the row is held there, else
// from global memory (elements past the row end read as 0 and are never used).
template <te_dtype kIn, int kVecs>
struct RowVectors {
  Packed8<kIn> held[kVecs > 0 ? kVecs : 1];
  const void *row;
  int64_t cols;

  __device__ __forceinline__ void load(const void *row_ptr, int64_t n) {
    row = row_ptr;
    cols = n;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t i = (threadIdx.x + static_cast<int64_t>(kThreads) * j) * kNormVec;
      if (i < cols) {
        held[j].load(row, i);
      } else {
        held[j].zero();
      }
    }
  }
  // Number of this thread's vectors (kVecs when held; enough to cover the row otherwise).
  __device__ __forceinline__ int count() const {
    if (kVecs > 0) return kVecs;
    const int64_t left = div_up(cols, kNormVec) - threadIdx.x;  // this thread's first vector on
    return left > 0 ? static_cast<int>(div_up(left, kThreads)) : 0;
  }
  // Calls f(j) for each of this thread's vectors; unrolled when they are held in registers
  // (indices must be compile-time constants there, or the array would go to local memory).
  template <typename F>
  __device__ __forceinline__ void each(F &&f) const {
    if constexpr (kVecs > 0) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) f(j);
    } else {
      const int c = count();
      for (int j = 0; j < c; ++j) f(j);
    }
  }
  __device__ __forceinline__ int64_t start(int j) const {
    return (threadIdx.x + static_cast<int64_t>(kThreads) * j) * kNormVec;
  }
  __device__ __forceinline__ void get(int j, float (&x)[8]) const {
    if constexpr (kVecs > 0) {
      held[j].decode(x);
    } else {
      const int64_t i0 = start(j);
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = i0 + e < cols ? load_hp1<kIn>(row, i0 + e) : 0.0f;
    }
  }
};

// The 8-element vectors of a row staged in shared memory by cp.async (rows with 8 | cols and
// 16-byte aligned starts only); the same interface as RowVectors.
template <te_dtype kIn>
struct StagedRow {
  const unsigned char *buf;
  int64_t cols;

  __device__ __forceinline__ int count() const {
    const int64_t left = cols / kNormVec - threadIdx.x;
    return left > 0 ? static_cast<int>(div_up(left, kThreads)) : 0;
  }
  template <typename F>
  __device__ __forceinline__ void each(F &&f) const {
    const int c = count();
    for (int j = 0; j < c; ++j) f(j);
  }
  __device__ __forceinline__ int64_t start(int j) const {
    return (threadIdx.x + static_cast<int64_t>(kThreads) * j) * kNormVec;
  }
  __device__ __forceinline__ void get(int j, float (&x)[8]) const {
    Packed8<kIn> p;
    p.load(buf, start(j));
    p.decode(x);
  }
};

// One row of the forward: statistics, then the outputs, from the vectors of `v` (RowVectors or
// StagedRow); kVector: every vector is whole and 16-byte aligned in memory (8 | cols).
// kLn: LayerNorm (else RMSNorm), kZc: zero-centered gamma; compile-time so that no element
// pays for a select between the variants (the kernel is bound by instruction issue).
// kW: the weights' dtype, or kAnyWeight to read it at run time (rows off the vector path).
constexpr te_dtype kAnyWeight = TE_DTYPE_COUNT;

template <bool kVector, te_dtype kW, bool kLn, bool kZc, typename Row>
__device__ __forceinline__ void norm_forward_row(const NormForwardArgs &a, int64_t r, const Row &v,
                                                 bool vector_weights, float scale, uint32_t &amax_bits,
                                                 float *scratch) {
  constexpr bool ln = kLn;
  const int64_t n = a.cols;
  // Whole vectors need no per-element bound check.
  auto valid = [&](int64_t i) { return kVector || i < n; };
  float mu = 0.0f;
  if (ln) {
    float acc = 0.0f;
    v.each([&](int j) {
      float x[8];
      v.get(j, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (valid(v.start(j) + e)) acc += x[e];
      }
    });
    mu = block_lane_sum(acc, scratch) / static_cast<float>(n);
  }
  float acc = 0.0f;
  v.each([&](int j) {
    float x[8];
    v.get(j, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float d = ln ? x[e] - mu : x[e];
      if (valid(v.start(j) + e)) acc += d * d;
    }
  });
  const float rsigma = norm_rsigma(block_lane_sum(acc, scratch), n, a.eps);
  if (threadIdx.x == 0) {
    if (ln) a.mu[r] = mu;
    a.rsigma[r] = rsigma;
  }
  v.each([&](int j) {
    float x[8], y[8], g[8], b[8];
    v.get(j, x);
    const int64_t i0 = v.start(j);
    if constexpr (kW != kAnyWeight) {
      load_hp8<kW>(a.gamma, i0, g);
      if (ln) load_hp8<kW>(a.beta, i0, b);
    } else if (vector_weights && i0 + 8 <= n) {
      load_any8(a.gamma, i0, a.weight_dtype, g);
      if (ln) load_any8(a.beta, i0, a.weight_dtype, b);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        g[e] = valid(i0 + e) ? load_any(a.gamma, i0 + e, a.weight_dtype) : 0.0f;
        b[e] = valid(i0 + e) && ln ? load_any(a.beta, i0 + e, a.weight_dtype) : 0.0f;
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      y[e] = norm_output(norm_xhat(x[e], mu, rsigma, ln), norm_gain(g[e], kZc), ln ? b[e] : 0.0f, ln);
      if (valid(i0 + e)) amax_bits = max(amax_bits, abs_bits(y[e]));
    }
    const int64_t base = r * n + i0;
    const bool whole = kVector;  // else the row path checks each element
    if (a.output != nullptr) {
      if (whole) {
        store_any8(a.output, base, a.output_dtype, y);
      } else {
        for (int e = 0; e < 8; ++e) {
          if (valid(i0 + e)) store_any(a.output, base + e, a.output_dtype, y[e]);
        }
      }
    }
    if (a.has_fp8) {
      float s[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = y[e] * scale;
      const bool e4m3 = a.fp8_dtype == TE_DTYPE_FLOAT8_E4M3;
      if (whole) {
        const uint32_t lo = e4m3 ? fp8x4<TE_DTYPE_FLOAT8_E4M3>(s[0], s[1], s[2], s[3])
                                 : fp8x4<TE_DTYPE_FLOAT8_E5M2>(s[0], s[1], s[2], s[3]);
        const uint32_t hi = e4m3 ? fp8x4<TE_DTYPE_FLOAT8_E4M3>(s[4], s[5], s[6], s[7])
                                 : fp8x4<TE_DTYPE_FLOAT8_E5M2>(s[4], s[5], s[6], s[7]);
        store_u64(a.fp8 + base, lo, hi);
      } else {
        for (int e = 0; e < 8; ++e) {
          if (valid(i0 + e)) {
            a.fp8[base + e] = e4m3 ? fp8x1<TE_DTYPE_FLOAT8_E4M3>(s[e]) : fp8x1<TE_DTYPE_FLOAT8_E5M2>(s[e]);
          }
        }
      }
    }
  });
}

// Calls norm_forward_row with the row's variant as template arguments (uniform branches). On
// the vector path the weights' dtype is fixed at compile time too: the input's or fp32.
template <bool kVector, te_dtype kIn, te_dtype kW, typename Row>
__device__ __forceinline__ void norm_forward_row_variant(const NormForwardArgs &a, int64_t r, const Row &v,
                                                         bool vector_weights, float scale, uint32_t &amax_bits,
                                                         float *scratch) {
  const bool ln = a.type == TE_NORM_LAYERNORM;
  if (ln && a.zero_centered) {
    norm_forward_row<kVector, kW, true, true>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (ln) {
    norm_forward_row<kVector, kW, true, false>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (a.zero_centered) {
    norm_forward_row<kVector, kW, false, true>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else {
    norm_forward_row<kVector, kW, false, false>(a, r, v, vector_weights, scale, amax_bits, scratch);
  }
}

template <bool kVector, te_dtype kIn, typename Row>
__device__ __forceinline__ void norm_forward_row_any(const NormForwardArgs &a, int64_t r, const Row &v,
                                                     bool vector_weights, float scale, uint32_t &amax_bits,
                                                     float *scratch) {
  if constexpr (!kVector) {
    norm_forward_row_variant<false, kIn, kAnyWeight>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (a.weight_dtype == TE_DTYPE_FLOAT32) {
    norm_forward_row_variant<true, kIn, TE_DTYPE_FLOAT32>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else {
    norm_forward_row_variant<true, kIn, kIn>(a, r, v, vector_weights, scale, amax_bits, scratch);
  }
}

// The block's amax into a.amax, and scale_inv (by one thread of the grid).
__device__ __forceinline__ void norm_forward_finish(const NormForwardArgs &a, float scale, uint32_t amax_bits,
                                                    uint32_t *amax_scratch) {
  if (!a.has_fp8) return;
  if (a.amax != nullptr) {
    const uint32_t m = block_max<kThreads>(amax_bits, amax_scratch);
    if (threadIdx.x == 0) atomic_max_amax(a.amax, m);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.scale_inv = canonical_div(1.0f, scale);
}

// Any row: one block per row, reading global memory on every pass.
template <te_dtype kIn>
__global__ void __launch_bounds__(kThreads) norm_forward_kernel(const NormForwardArgs a, bool vector_weights) {
  __shared__ float scratch[kNormLanes];
  __shared__ uint32_t amax_scratch[kThreads / 32];
  const int64_t r = blockIdx.x;
  RowVectors<kIn, 0> v;
  v.load(static_cast<const char *>(a.input) + r * a.cols * sizeof(typename Hp<kIn>::Storage), a.cols);
  const float scale = a.has_fp8 ? *a.scale : 1.0f;
  uint32_t amax_bits = 0;
  norm_forward_row_any<false, kIn>(a, r, v, vector_weights, scale, amax_bits, scratch);
  norm_forward_finish(a, scale, amax_bits, amax_scratch);
}

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Whole, aligned rows (8 | cols): a persistent grid, block b taking rows b, b + grid, ...; each
// row is copied into one of kStages shared-memory buffers kStages - 1 rows ahead of its use, so
// the loads of the next rows are in flight while this one is reduced (one row per block at a
// time leaves too little memory traffic in flight otherwise). Each thread copies exactly the
// vectors it reads later, so its own cp.async wait is all the ordering a buffer needs.
template <te_dtype kIn, int kStages>
__global__ void __launch_bounds__(kThreads)
    norm_forward_staged_kernel(const NormForwardArgs a, bool vector_weights) {
  extern __shared__ __align__(16) unsigned char stages[];
  __shared__ float scratch[kNormLanes];
  __shared__ uint32_t amax_scratch[kThreads / 32];
  const size_t row_bytes = static_cast<size_t>(a.cols) * sizeof(typename Hp<kIn>::Storage);
  const int64_t chunks = static_cast<int64_t>(row_bytes / 16);
  constexpr int kChunksPerVec = sizeof(typename Hp<kIn>::Storage) * kNormVec / 16;
  const int64_t step = gridDim.x;
  auto issue = [&](int64_t row, int stage) {
    if (row < a.rows) {
      const unsigned char *src = static_cast<const unsigned char *>(a.input) + row * row_bytes;
      unsigned char *dst = stages + stage * row_bytes;
      for (int64_t v = threadIdx.x; v * kChunksPerVec < chunks; v += kThreads) {
#pragma unroll
        for (int c = 0; c < kChunksPerVec; ++c) {
          const int64_t off = (v * kChunksPerVec + c) * 16;
          cp_async16(dst + off, src + off);
        }
      }
    }
    cp_async_commit();  // an empty group past the last row keeps the group count uniform
  };
  int64_t r = blockIdx.x;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(r + s * step, s);
  const float scale = a.has_fp8 ? *a.scale : 1.0f;
  uint32_t amax_bits = 0;
  for (int k = 0; r < a.rows; ++k, r += step) {
    issue(r + (kStages - 1) * step, (k + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();
    const StagedRow<kIn> v{stages + (k % kStages) * row_bytes, a.cols};
    norm_forward_row_any<true, kIn>(a, r, v, vector_weights, scale, amax_bits, scratch);
  }
  cp_async_wait<0>();
  norm_forward_finish(a, scale, amax_bits, amax_scratch);
}

template <te_dtype kIn, int kVecs>
__global__ void __launch_bounds__(kThreads)
    norm_backward_kernel(const NormBackwardArgs a, float *partials, int64_t groups) {
  extern __shared__ float smem[];  // gains [n], partial dgamma [n], partial dbeta [n]
  __shared__ float scratch[kNormLanes];
  const bool ln = a.type == TE_NORM_LAYERNORM;
  const int64_t n = a.cols, grp = blockIdx.x;
  float *gain = smem, *part_g = smem + n, *part_b = smem + 2 * n;
  // Each thread initializes (and later owns) the columns of its own vectors.
  for (int64_t i0 = static_cast<int64_t>(threadIdx.x) * kNormVec; i0 < n; i0 += kThreads * kNormVec) {
    for (int e = 0; e < kNormVec && i0 + e < n; ++e) {
      gain[i0 + e] = norm_gain(load_any(a.gamma, i0 + e, a.weight_dtype), a.zero_centered);
      part_g[i0 + e] = 0.0f;
      part_b[i0 + e] = 0.0f;
    }
  }
  const int64_t r1 = min(a.rows, (grp + 1) * kNormGroupRows);
  const size_t es = sizeof(typename Hp<kIn>::Storage);
  for (int64_t r = grp * kNormGroupRows; r < r1; ++r) {
    RowVectors<kIn, kVecs> x, dy;
    x.load(static_cast<const char *>(a.input) + r * n * es, n);
    dy.load(static_cast<const char *>(a.grad_output) + r * n * es, n);
    const float mu = ln ? a.mu[r] : 0.0f, rsigma = a.rsigma[r];
    float s1 = 0.0f, s2 = 0.0f;
    x.each([&](int j) {
      float xv[8], dv[8];
      x.get(j, xv);
      dy.get(j, dv);
      const int64_t i0 = x.start(j);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (i0 + e < n) {
          const float dyg = dv[e] * gain[i0 + e];
          s1 += dyg;
          s2 += dyg * norm_xhat(xv[e], mu, rsigma, ln);
        }
      }
    });
    const float m1 = ln ? block_lane_sum(s1, scratch) / static_cast<float>(n) : 0.0f;
    const float m2 = block_lane_sum(s2, scratch) / static_cast<float>(n);
    x.each([&](int j) {
      float xv[8], dv[8], dx[8];
      x.get(j, xv);
      dy.get(j, dv);
      const int64_t i0 = x.start(j);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        dx[e] = 0.0f;
        if (i0 + e < n) {
          const float xhat = norm_xhat(xv[e], mu, rsigma, ln);
          dx[e] = norm_grad_input(dv[e] * gain[i0 + e], xhat, m1, m2, rsigma, ln);
          part_g[i0 + e] += dv[e] * xhat;
          part_b[i0 + e] += dv[e];
        }
      }
      if (kVecs > 0 && i0 + 8 <= n) {
        store_any8(a.grad_input, r * n + i0, a.grad_input_dtype, dx);
      } else {
        for (int e = 0; e < 8; ++e) {
          if (i0 + e < n) store_any(a.grad_input, r * n + i0 + e, a.grad_input_dtype, dx[e]);
        }
      }
    });
  }
  for (int64_t i0 = static_cast<int64_t>(threadIdx.x) * kNormVec; i0 < n; i0 += kThreads * kNormVec) {
    for (int e = 0; e < kNormVec && i0 + e < n; ++e) {
      partials[grp * n + i0 + e] = part_g[i0 + e];
      partials[(groups + grp) * n + i0 + e] = part_b[i0 + e];
    }
  }
}

// grad_gamma[c] (and grad_beta[c]) = the groups' partials added in group order.
__global__ void norm_backward_finalize_kernel(const NormBackwardArgs a, const float *partials, int64_t groups) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= a.cols) return;
  float g = 0.0f, b = 0.0f;
  for (int64_t k = 0; k < groups; ++k) {
    g += partials[k * a.cols + c];
    b += partials[(groups + k) * a.cols + c];
  }
  store_any(a.grad_gamma, c, a.weight_dtype, g);
  if (a.grad_beta != nullptr) store_any(a.grad_beta, c, a.weight_dtype, b);
}

// Vectors per thread that hold a row of n elements in registers, or 0 for the global path.
int vecs_for(int64_t n, bool vector_io) {
  if (!vector_io) return 0;
  const int64_t need = div_up(div_up(n, kNormVec), kThreads);
  for (int v = 1; v <= kMaxVecs; v *= 2) {
    if (need <= v) return v;
  }
  return 0;
}

// Launch<kIn, vecs>::run(args...) for vecs in {1, 2, 4, ..., kMax} or 0.
template <template <te_dtype, int> class Launch, te_dtype kIn, int kMax, typename... A>
te_status dispatch_vecs(int vecs, A &&...args) {
  switch (vecs) {
    case 1: return Launch<kIn, 1>::run(args...);
    case 2: return Launch<kIn, 2>::run(args...);
    case 4: return Launch<kIn, 4>::run(args...);
    case 8: return Launch<kIn, 8>::run(args...);
    case 16:
      if constexpr (kMax >= 16) return Launch<kIn, 16>::run(args...);
      [[fallthrough]];
    default: return Launch<kIn, 0>::run(args...);
  }
}

template <te_dtype kIn, int kVecs>
struct BackwardLaunch {
  static te_status run(const NormBackwardArgs &a, float *partials, int64_t groups, size_t smem, cudaStream_t s) {
    auto kernel = norm_backward_kernel<kIn, kVecs>;
    if (smem > 40 * 1024) {  // with the static shared memory, past the default 48 KiB
      if (te_status st = cuda_status("norm_backward", cudaFuncSetAttribute(
                                         kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)))) {
        return st;
      }
    }
    kernel<<<static_cast<unsigned>(groups), kThreads, smem, s>>>(a, partials, groups);
    return launch_status("norm_backward");
  }
};

// Shared memory the staged forward may take for its two row buffers per block (6 or more blocks
// stay resident per SM at rows of 8192 16-bit elements, each with a row in flight).
constexpr size_t kStagedRowBytes = 96 * 1024;

// Launches a staged forward kernel on as many blocks as the device keeps resident (the blocks
// loop over the rows); the residency per (device, kernel, buffer size) is asked for once.
// Launches a staged forward kernel (taking up to max_smem bytes of buffers) on as many blocks
// as the device keeps resident with smem bytes each: the blocks loop over the rows. The kernel's
// shared-memory limit is raised to max_smem once per device (raising it per call to the size
// at hand would lower it for a later, larger call); residency is asked for once per size.
template <typename Kernel>
te_status launch_staged(Kernel kernel, size_t max_smem, size_t smem, const NormForwardArgs &a, bool vector_weights,
                        cudaStream_t s) {
  constexpr const char *kOp = "norm_forward";
  static std::mutex mutex;
  static std::map<std::tuple<int, const void *, size_t>, int> resident;  // 0: the limit is set
  int device = 0, sms = 0;
  if (te_status st = cuda_status(kOp, cudaGetDevice(&device))) return st;
  if (te_status st = sm_count(kOp, &sms)) return st;
  int per_sm = 0;
  {
    std::lock_guard<std::mutex> lock(mutex);
    const void *fn = reinterpret_cast<const void *>(kernel);
    if (resident.count(std::make_tuple(device, fn, size_t{0})) == 0) {
      const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem));
      if (err != cudaSuccess) return cuda_status("norm_forward (raising the shared-memory limit)", err);
      resident[std::make_tuple(device, fn, size_t{0})] = 0;
    }
    const auto key = std::make_tuple(device, fn, smem);
    auto it = resident.find(key);
    if (it == resident.end()) {
      const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
      if (err != cudaSuccess) return cuda_status("norm_forward (occupancy query)", err);
      it = resident.emplace(key, std::max(per_sm, 1)).first;
    }
    per_sm = it->second;
  }
  const int64_t grid = std::min<int64_t>(a.rows, static_cast<int64_t>(sms) * per_sm);
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, s>>>(a, vector_weights);
  return launch_status(kOp);
}

// Rows can be moved as whole 8-element vectors: 8 | cols and every row start 16-byte aligned
// (8-byte for the FP8 output).
bool rows_aligned(const void *p, int64_t cols, size_t es) {
  return cols % kNormVec == 0 && aligned(p, es == 1 ? 8 : 16);
}

__global__ void scale_inv_kernel(const float *scale, float *scale_inv) { *scale_inv = canonical_div(1.0f, *scale); }

}  // namespace

te_status norm_forward_cuda(const NormForwardArgs &a, te_stream stream) {
  constexpr const char *kOp = "norm_forward";
  cudaStream_t s = cuda_stream(stream);
  if (a.has_fp8 && a.amax != nullptr) {
    if (te_status st = cuda_status(kOp, cudaMemsetAsync(a.amax, 0, sizeof(float), s))) return st;
  }
  if (a.rows > 0) {
    if (a.rows > 0x7FFFFFFF) return fail(TE_ERROR_UNSUPPORTED, kOp, "rows must be below 2^31 on CUDA");
    const size_t es = te_dtype_size(a.input_dtype);
    const bool vector_io = rows_aligned(a.input, a.cols, es) &&
                           (a.output == nullptr || rows_aligned(a.output, a.cols, te_dtype_size(a.output_dtype))) &&
                           (!a.has_fp8 || rows_aligned(a.fp8, a.cols, 1));
    const bool vector_weights = a.cols % kNormVec == 0 && aligned(a.gamma, 16) &&
                                (a.beta == nullptr || aligned(a.beta, 16));
    const size_t row_bytes = static_cast<size_t>(a.cols) * es;
    te_status st = with_hp_dtype(a.input_dtype, [&](auto in) {
      constexpr te_dtype kIn = decltype(in)::value;
      if (vector_io && vector_weights && row_bytes <= kStagedRowBytes / 2) {
        return launch_staged(norm_forward_staged_kernel<kIn, 2>, kStagedRowBytes, 2 * row_bytes, a, vector_weights, s);
      }
      norm_forward_kernel<kIn><<<static_cast<unsigned>(a.rows), kThreads, 0, s>>>(a, vector_weights);
      return launch_status(kOp);
    });
    if (st != TE_SUCCESS) return st;
  }
  if (a.rows == 0 && a.has_fp8) {  // no block ran: scale_inv still gets 1 / scale
    scale_inv_kernel<<<1, 1, 0, s>>>(a.scale, a.scale_inv);
    if (te_status st = launch_status(kOp)) return st;
  }
  if (a.fp8_transpose != nullptr && a.rows > 0) {
    const TransposeArgs t{a.fp8, a.fp8_transpose, a.rows, a.cols, 1};
    return transpose_cuda(t, stream);
  }
  return TE_SUCCESS;
}

te_status norm_backward_cuda(const NormBackwardArgs &a, te_stream stream) {
  constexpr const char *kOp = "norm_backward";
  cudaStream_t s = cuda_stream(stream);
  const int64_t groups = div_up(a.rows, kNormGroupRows);
  const size_t smem = static_cast<size_t>(3 * a.cols) * sizeof(float);
  constexpr size_t kMaxSmem = 200 * 1024;
  if (smem > kMaxSmem) {
    return fail(TE_ERROR_UNSUPPORTED, kOp,
                "input.data must have at most " + std::to_string(kMaxSmem / 12) +
                    " columns on CUDA (the per-column sums live in shared memory), got " + std::to_string(a.cols));
  }
  float *partials = static_cast<float *>(a.workspace);
  if (a.rows > 0) {
    const size_t es = te_dtype_size(a.input_dtype);
    const bool vector_io = rows_aligned(a.input, a.cols, es) && rows_aligned(a.grad_output, a.cols, es) &&
                           rows_aligned(a.grad_input, a.cols, te_dtype_size(a.grad_input_dtype));
    int vecs = vecs_for(a.cols, vector_io);
    if (vecs > 8) vecs = 0;  // two rows (x and dy) must fit in registers
    te_status st = with_hp_dtype(a.input_dtype, [&](auto in) {
      return dispatch_vecs<BackwardLaunch, decltype(in)::value, 8>(vecs, a, partials, groups, smem, s);
    });
    if (st != TE_SUCCESS) return st;
  }
  const int threads = 256;
  const unsigned blocks = static_cast<unsigned>(div_up(std::max<int64_t>(a.cols, 1), threads));
  norm_backward_finalize_kernel<<<blocks, threads, 0, s>>>(a, partials, groups);
  return launch_status(kOp);
}

}  // namespace te
