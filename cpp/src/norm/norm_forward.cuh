// The CUDA LayerNorm / RMSNorm forward, instantiated once per input dtype by
// norm_forward_{fp32,fp16,bf16}.cu (one translation unit each: the variants below make many
// kernels, and separate files compile in parallel).
//
// A row is reduced by a block of 128 threads, thread t being lane t of norm.h's row-sum order:
// it takes the 8-element vectors t, t + 128, ... of its row, sums them in increasing order, and
// the block adds the 128 lane sums pairwise exactly as norm_lane_tree does. Mean, variance,
// rsigma and every output element then follow the shared formulas of norm_impl.h, so the bits
// equal the CPU reference's. Whole, aligned rows are staged through shared memory by a
// persistent grid that loads the next row while it reduces this one; other rows (8 does not
// divide cols, misaligned, too long) take one block per row reading global memory on each pass.
// The kernel is bound by instruction issue, so everything uniform over a call (LayerNorm or
// RMSNorm, zero-centered gamma, the weights' and the FP8 output's dtypes) is a template
// argument on the staged path rather than a select per element.
#ifndef TRANSFORMER_ENGINE_SRC_NORM_NORM_FORWARD_CUH_
#define TRANSFORMER_ENGINE_SRC_NORM_NORM_FORWARD_CUH_

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "norm/norm_cuda.cuh"

namespace te {
namespace norm_cuda {

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

// kF8: the FP8 output's dtype, kNoFp8 for none, or kAnyFp8 to read it at run time.
constexpr te_dtype kNoFp8 = TE_DTYPE_COUNT;
constexpr te_dtype kAnyFp8 = TE_DTYPE_INT8;

// 4 values to FP8 without the NaN canonicalization of fp8x4 (applied by the caller when needed).
template <te_dtype kFp8>
__device__ __forceinline__ uint32_t fp8x4_raw(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr __nv_fp8_interpretation_t kKind = kFp8 == TE_DTYPE_FLOAT8_E4M3 ? __NV_E4M3 : __NV_E5M2;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kKind);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kKind);
  return lo | (hi << 16);
#else
  return fp8x4<kFp8>(a, b, c, d);  // already canonical; canonicalizing again changes nothing
#endif
}

template <bool kVector, te_dtype kW, te_dtype kF8, bool kLn, bool kZc, typename Row>
__device__ __forceinline__ void norm_forward_row(const NormForwardArgs &a, int64_t r, const Row &v,
                                                 bool vector_weights, float scale, uint32_t &amax_bits,
                                                 float *scratch) {
  constexpr bool ln = kLn;
  const int64_t n = a.cols;
  const bool finite_scale = scale != 0.0f && abs_bits(scale) < 0x7F800000u;
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
    uint32_t vector_bits = 0;  // max |y| of this vector, as amax bits
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      y[e] = norm_output(norm_xhat(x[e], mu, rsigma, ln), norm_gain(g[e], kZc), ln ? b[e] : 0.0f, ln);
      if (valid(i0 + e)) vector_bits = max(vector_bits, abs_bits(y[e]));
    }
    amax_bits = max(amax_bits, vector_bits);
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
    if constexpr (kF8 == kAnyFp8) {
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
    } else if constexpr (kF8 != kNoFp8) {
      static_assert(kVector, "a fixed FP8 dtype is for whole vectors");
      float s[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = y[e] * scale;
      uint32_t lo = fp8x4_raw<kF8>(s[0], s[1], s[2], s[3]);
      uint32_t hi = fp8x4_raw<kF8>(s[4], s[5], s[6], s[7]);
      // A scaled value is NaN only if y is (finite_scale: scale is finite and nonzero), and
      // NaN bytes are rare: canonicalize only the vectors that may hold one.
      if (!finite_scale || vector_bits > 0x7F800000u) {
        lo = canonical_fp8_nan<kF8>(lo);
        hi = canonical_fp8_nan<kF8>(hi);
      }
      store_u64(a.fp8 + base, lo, hi);
    }
  });
}

// Calls norm_forward_row with the row's variant as template arguments (uniform branches). On
// the vector path the weights' dtype is fixed at compile time too: the input's or fp32.
template <bool kVector, te_dtype kW, te_dtype kF8, typename Row>
__device__ __forceinline__ void norm_forward_row_variant(const NormForwardArgs &a, int64_t r, const Row &v,
                                                         bool vector_weights, float scale, uint32_t &amax_bits,
                                                         float *scratch) {
  const bool ln = a.type == TE_NORM_LAYERNORM;
  if (ln && a.zero_centered) {
    norm_forward_row<kVector, kW, kF8, true, true>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (ln) {
    norm_forward_row<kVector, kW, kF8, true, false>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (a.zero_centered) {
    norm_forward_row<kVector, kW, kF8, false, true>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else {
    norm_forward_row<kVector, kW, kF8, false, false>(a, r, v, vector_weights, scale, amax_bits, scratch);
  }
}

template <bool kVector, te_dtype kW, typename Row>
__device__ __forceinline__ void norm_forward_row_fp8(const NormForwardArgs &a, int64_t r, const Row &v,
                                                     bool vector_weights, float scale, uint32_t &amax_bits,
                                                     float *scratch) {
  if (!a.has_fp8) {
    norm_forward_row_variant<kVector, kW, kNoFp8>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (a.fp8_dtype == TE_DTYPE_FLOAT8_E4M3) {
    norm_forward_row_variant<kVector, kW, TE_DTYPE_FLOAT8_E4M3>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else {
    norm_forward_row_variant<kVector, kW, TE_DTYPE_FLOAT8_E5M2>(a, r, v, vector_weights, scale, amax_bits, scratch);
  }
}

template <bool kVector, te_dtype kIn, typename Row>
__device__ __forceinline__ void norm_forward_row_any(const NormForwardArgs &a, int64_t r, const Row &v,
                                                     bool vector_weights, float scale, uint32_t &amax_bits,
                                                     float *scratch) {
  if constexpr (!kVector) {
    norm_forward_row_variant<false, kAnyWeight, kAnyFp8>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else if (a.weight_dtype == TE_DTYPE_FLOAT32) {
    norm_forward_row_fp8<true, TE_DTYPE_FLOAT32>(a, r, v, vector_weights, scale, amax_bits, scratch);
  } else {
    norm_forward_row_fp8<true, kIn>(a, r, v, vector_weights, scale, amax_bits, scratch);
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

template <te_dtype kIn>
te_status forward(const NormForwardArgs &a, bool vector_io, bool vector_weights, cudaStream_t s) {
  const size_t row_bytes = static_cast<size_t>(a.cols) * sizeof(typename Hp<kIn>::Storage);
  if (vector_io && vector_weights && row_bytes <= kStagedRowBytes / 2) {
    return launch_staged(norm_forward_staged_kernel<kIn, 2>, kStagedRowBytes, 2 * row_bytes, a, vector_weights, s);
  }
  norm_forward_kernel<kIn><<<static_cast<unsigned>(a.rows), kThreads, 0, s>>>(a, vector_weights);
  return launch_status("norm_forward");
}

}  // namespace norm_cuda
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_NORM_NORM_FORWARD_CUH_
