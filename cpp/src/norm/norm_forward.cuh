// The CUDA LayerNorm / RMSNorm forward, instantiated once per input dtype by
// norm_forward_{fp32,fp16,bf16}.cu (one translation unit each: the variants make many kernels,
// and separate files compile in parallel).
//
// Design. A row is reduced by a row group of 128 threads, thread t being lane t of norm.h's
// row-sum order (it adds its vectors t, t + 128, ... in order; group_lane_sums adds the lanes
// with one barrier). Mean, variance, rsigma and every output element follow the shared formulas
// of norm_impl.h, so the bits equal the CPU reference's.
//
// norm_forward_rows_kernel takes rows of whole, aligned vectors up to 8192 elements (4096 for
// fp32): the common case. It is bound by the instructions it issues per element and by the
// shared-memory traffic of its weights and staged rows, so:
//   - a block is 4 row groups sharing gamma and beta, decoded to fp32 once per block in shared
//     memory with the zero-centered gain applied: no weight loads from global memory, decodes
//     or adds per element, and no L1 given up to row buffers. They are laid out so that a
//     warp's 16-byte reads of them have no bank conflict (kWeightHalf4), and filled while the
//     first step's rows are already on their way, each thread's loads issued together;
//   - each thread takes 128 bytes of input per step: 8 vectors (fp32: 4) of one row, or of 2
//     rows at 4096 elements or fewer (their reductions then share a barrier and their weights a
//     shared-memory read). They are decoded once (decode_row: one instruction per element;
//     fp16 by the hardware) and stay in registers, decoded, for every pass: 64 of the 128
//     registers, without spills at 16 warps per SM (ptxas -v);
//   - the next step's 128 bytes are in flight meanwhile: each thread copies them with cp.async
//     into its own slots of a double buffer in shared memory and reads back only those, so its
//     own wait orders them (no barrier). The FP8 kernels use all 128 registers, which leaves no
//     room for a second step in registers; the step after that is prefetched into the L2;
//   - one barrier per row sum, none per element; the sums add the zeros of the vectors past
//     the row end where that changes no bit (row_sums), so that no element tests its index;
//   - LayerNorm or RMSNorm, the FP8 dtype or none and the row length are template arguments,
//     so that no element pays for a select between them;
//   - amax is a max.NaN over |y|, and a vector's FP8 bytes are canonicalized only when it holds
//     a NaN (or the scale is zero or not finite), on a branch that is almost never taken.
// Rows go in bands of 16 to the blocks in turn, and a band's rows to the groups in turn. The
// FP8 transpose is the transpose kernel's, run after this one (see launch_rows_fp8).
// norm_forward_any_kernel takes every other row (8 does not divide cols, misaligned, longer
// rows): one group per row, reading global memory on each pass.
#ifndef TRANSFORMER_ENGINE_SRC_NORM_NORM_FORWARD_CUH_
#define TRANSFORMER_ENGINE_SRC_NORM_NORM_FORWARD_CUH_

#include <algorithm>
#include <type_traits>

#include "norm/norm_cuda.cuh"

namespace te {
namespace norm_cuda {

constexpr te_dtype kNoFp8 = TE_DTYPE_COUNT;

// The 8 elements of a vector of a row held in registers, as decode_pass has them (fp16 by the
// hardware conversion, exact but for NaN payloads, which no output passes on), but visible to
// the compiler: the passes over a row share one decode per element, the row kept decoded in
// registers from the first pass to the last (the FP8 kernels have the registers for it at 16
// warps per SM: ptxas reports no spill).
template <te_dtype kIn>
__device__ __forceinline__ void decode_row(const Packed8<kIn> &p, float (&x)[8]) {
  if constexpr (kIn == TE_DTYPE_FLOAT16) {
    const uint32_t w[4] = {p.raw.x, p.raw.y, p.raw.z, p.raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[k]));
      x[2 * k] = f.x, x[2 * k + 1] = f.y;
    }
  } else {
    p.decode(x);  // bf16: a shift or a mask per element; fp32: none
  }
}

// Vectors per thread and step of the row kernel: 128 bytes of input.
template <te_dtype kIn>
constexpr int kStepVecs = sizeof(typename Hp<kIn>::Storage) == 2 ? 8 : 4;
// Rows per step: as many as fill the step, at most 2 (more rows cost registers for their
// statistics, and rows that short are cheap anyway).
template <te_dtype kIn, int kVecs>
constexpr int kStepRows = kStepVecs<kIn> / kVecs < 2 ? kStepVecs<kIn> / kVecs : 2;
constexpr int kGroups = 4;
constexpr int kBlockThreads = kGroups * kThreads;
constexpr int kBandRows = 16;
// Steps ahead that a group's rows are prefetched into the L2 (the next step is already being
// copied into shared memory): about 8 MB of L2 per step ahead at 8192 bf16 columns.
constexpr int kPrefetchSteps = 2;

// 16-byte units of one vector (fp32: two) and of one thread's step in the staging buffer.
template <te_dtype kIn>
constexpr int kVecUnits = sizeof(Packed8<kIn>) / 16;
template <te_dtype kIn, int kVecs>
constexpr int kStageUnits = kStepRows<kIn, kVecs> * kVecs * kVecUnits<kIn>;
// Bytes of the double buffer of a block: unit u of thread x in buffer b at
// [(b * kStageUnits + u) * kBlockThreads + x], so that a warp's accesses are contiguous.
template <te_dtype kIn, int kVecs>
constexpr size_t kStageBytes = size_t{2} * kStageUnits<kIn, kVecs> * kBlockThreads * 16;

// The vector at `slot` (unit 0; later units kBlockThreads apart) of the staging buffer.
template <te_dtype kIn>
__device__ __forceinline__ void unstage(Packed8<kIn> &p, const uint4 *slot) {
  if constexpr (kIn == TE_DTYPE_FLOAT32) {
    const uint4 lo = slot[0], hi = slot[kBlockThreads];
    p.a = make_float4(__uint_as_float(lo.x), __uint_as_float(lo.y), __uint_as_float(lo.z), __uint_as_float(lo.w));
    p.b = make_float4(__uint_as_float(hi.x), __uint_as_float(hi.y), __uint_as_float(hi.z), __uint_as_float(hi.w));
  } else {
    p.raw = slot[0];
  }
}

// a * b for indices >= 0 as unsigned 32 x 32 -> 64 bits: no sign words to keep in registers.
__device__ __forceinline__ uint64_t wide_mul(int a, int b) {
  return static_cast<uint64_t>(static_cast<uint32_t>(a)) * static_cast<uint32_t>(b);
}

// Asks the L2 for a row of `bytes` (at most 16 KiB, a row kernel's row) at p, the row group's
// threads taking its 128-byte lines in turn (at most 129 lines: two for a thread at most): the
// next step's rows arrive while this step is computed, without holding registers.
__device__ __forceinline__ void prefetch_row_l2(const void *p, int bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(p), first = start & ~uintptr_t{127};
  const int lines = (static_cast<int>(start & 127) + bytes + 127) / 128;
  const int l = threadIdx.x % kThreads;
  if (l < lines) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(first + l * 128));
  if (l + kThreads < lines) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(first + (l + kThreads) * 128));
}

// Floats of each weight array in shared memory: every vector that kVecs vectors per thread can
// reach, which covers the row (vecs_for picks kVecs so).
template <int kVecs>
constexpr int kWeightSpan = kVecs * kThreads * kNormVec;

// The layout of a weight array in shared memory: elements 0-3 of vector v as the float4 at v,
// elements 4-7 as the one at v + kWeightSpan / 8 (the second half). A thread reads each half of
// its vector with one 16-byte load, and the lanes of a warp read consecutive 16-byte words: 4
// wavefronts a load. (Eight consecutive floats per vector put lane l's loads 32 l bytes apart,
// two lanes on each bank of a quarter warp: 8 wavefronts a load, which doubled the shared-memory
// traffic of the weights, the largest in the loop, LayerNorm's twice RMSNorm's.)
template <int kVecs>
constexpr int kWeightHalf4 = kWeightSpan<kVecs> / 8;  // float4s of a half

// Fills the weight arrays of the row kernel (gains with the zero-centered offset applied, and
// the betas of LayerNorm) in the layout above, zeros past the row end (nvec whole vectors):
// the FP8 loop reads the weights of every vector a thread could own, also those past the row
// end, without a branch. whole: gamma (and beta) are 16-byte aligned, when every load of a
// thread is issued before the first decode (which branches for fp16), so that the fill waits
// about one memory latency rather than one per element; otherwise elements load one by one.
template <te_dtype kW, int kVecs, bool kLn>
__device__ __forceinline__ void fill_weights(const NormForwardArgs &a, int nvec, bool whole, float4 *gain,
                                             float4 *bias) {
  constexpr int kSpanVecs = kWeightSpan<kVecs> / kNormVec;
  constexpr int kPer = (kSpanVecs + kBlockThreads - 1) / kBlockThreads;  // vectors per thread
  Packed8<kW> gp[kPer], bp[kPer];
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    const int v = static_cast<int>(threadIdx.x) + s * kBlockThreads;
    if (whole && v < nvec) {
      gp[s].load(a.gamma, int64_t{v} * kNormVec);
      if (kLn) bp[s].load(a.beta, int64_t{v} * kNormVec);
    }
  }
#pragma unroll
  for (int s = 0; s < kPer; ++s) {
    const int v = static_cast<int>(threadIdx.x) + s * kBlockThreads;
    if (kSpanVecs % kBlockThreads != 0 && v >= kSpanVecs) continue;
    float g[8] = {}, b[8] = {};
    if (v < nvec) {
      if (whole) {
        gp[s].decode(g);
        if (kLn) bp[s].decode(b);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          g[e] = load_hp1<kW>(a.gamma, int64_t{v} * kNormVec + e);
          if (kLn) b[e] = load_hp1<kW>(a.beta, int64_t{v} * kNormVec + e);
        }
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = norm_gain(g[e], a.zero_centered);
    }
    gain[v] = make_float4(g[0], g[1], g[2], g[3]);
    gain[v + kWeightHalf4<kVecs>] = make_float4(g[4], g[5], g[6], g[7]);
    if (kLn) {
      bias[v] = make_float4(b[0], b[1], b[2], b[3]);
      bias[v + kWeightHalf4<kVecs>] = make_float4(b[4], b[5], b[6], b[7]);
    }
  }
}

// kF8: the FP8 output's dtype or kNoFp8.
template <te_dtype kIn, int kVecs, bool kLn, te_dtype kF8>
__global__ void __launch_bounds__(kBlockThreads, 1) norm_forward_rows_kernel(const NormForwardArgs a) {
  if (a.gate != nullptr && *a.gate != 0.0f) return;  // a shut gate: the amax stays 0 (tensor.h)
  constexpr int kRows = kStepRows<kIn, kVecs>;
  constexpr int kSteps = kBandRows / (kGroups * kRows);  // steps of a group per band
  constexpr bool kFp8 = kF8 != kNoFp8;
  using S = typename Hp<kIn>::Storage;
  static_assert(kWeightSpan<kVecs> * sizeof(S) <= 16384, "a row is at most 16 KiB (prefetch_row_l2)");
  // gains [kWeightSpan], betas [kWeightSpan] (LayerNorm), the staging double buffer
  extern __shared__ float4 dynamic_smem[];
  __shared__ LaneScratch<kRows> scratch[2][kGroups];
  __shared__ uint32_t warp_amax[kBlockThreads / 32];

  // 32-bit indices (rows < 2^30 on this path, cols <= 8192): fewer registers live in the loop.
  const int n = static_cast<int>(a.cols), rows = static_cast<int>(a.rows), nvec = n / kNormVec;
  constexpr int kHalf = kWeightHalf4<kVecs>;
  float4 *gain = dynamic_smem;  // in the layout of kWeightHalf4: kWeightSpan floats
  float4 *bias = gain + 2 * kHalf;
  uint4 *staging = reinterpret_cast<uint4 *>(gain + (kLn ? 2 : 1) * 2 * kHalf);
  constexpr int kUnits = kStageUnits<kIn, kVecs>;
  const int group = threadIdx.x / kThreads, t = threadIdx.x % kThreads;
  const int vecs = own_vectors(nvec, kVecs);
  const int grid = gridDim.x;
  const float scale = kFp8 ? *a.scale : 1.0f;
  // NaN unless scale is finite and nonzero, when a scaled value is NaN only if y is: the
  // max.NaN of it and max |y| says whether the FP8 bytes may hold a NaN to canonicalize.
  const float scale_probe = scale != 0.0f && abs_bits(scale) < 0x7F800000u ? 0.0f : __int_as_float(0x7FFFFFFF);
  const float abs_scale = fabsf(scale);

  auto row_at = [&](int row) { return wide_mul(row, n); };  // element offset of a row's start
  auto first_row = [&](int k) {  // of this group's step k
    return (static_cast<int>(blockIdx.x) + k / kSteps * grid) * kBandRows + (k % kSteps * kGroups + group) * kRows;
  };
  // Asks the L2 for the rows of this group's step k.
  auto prefetch = [&](int k) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int row = first_row(k) + r;
      if (row < rows) prefetch_row_l2(static_cast<const S *>(a.input) + row_at(row), n * static_cast<int>(sizeof(S)));
    }
  };
  // Copies this thread's vectors of its step k into buffer k % 2 and closes a cp.async group
  // (an empty one past the last row, so that the wait below counts uniformly).
  auto stage = [&](int k) {
    const int row0 = first_row(k);
    uint4 *buf = staging + (k & 1) * kUnits * kBlockThreads + threadIdx.x;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (row0 + r < rows && j < vecs) {
          const char *src = reinterpret_cast<const char *>(static_cast<const S *>(a.input) + row_at(row0 + r) +
                                                           (t + kThreads * j) * kNormVec);
#pragma unroll
          for (int u = 0; u < kVecUnits<kIn>; ++u) {
            cp_async16(buf + ((r * kVecs + j) * kVecUnits<kIn> + u) * kBlockThreads, src + 16 * u);
          }
        }
      }
    }
    cp_async_commit();
  };
  // The first step's copies and the L2 prefetch of the second are in flight while the weights
  // are filled.
  stage(0);
  prefetch(1);
  {
    const uintptr_t addresses = reinterpret_cast<uintptr_t>(a.gamma) | (kLn ? reinterpret_cast<uintptr_t>(a.beta) : 0);
    const bool whole = (addresses & 15) == 0;
    switch (a.weight_dtype) {
      case TE_DTYPE_FLOAT32: fill_weights<TE_DTYPE_FLOAT32, kVecs, kLn>(a, nvec, whole, gain, bias); break;
      case TE_DTYPE_FLOAT16: fill_weights<TE_DTYPE_FLOAT16, kVecs, kLn>(a, nvec, whole, gain, bias); break;
      default: fill_weights<TE_DTYPE_BFLOAT16, kVecs, kLn>(a, nvec, whole, gain, bias); break;
    }
  }
  __syncthreads();  // the weights are in shared memory
  float amax = 0.0f;
  int parity = 0;  // the scratch buffer of the next reduction
  // Steps until this block's next band starts past the last row (uniform in the block).
  for (int k = 0; (static_cast<int>(blockIdx.x) + k / kSteps * grid) * kBandRows < rows; ++k) {
    const int row0 = first_row(k);
    stage(k + 1);
    cp_async_wait<1>();  // this step's copies have landed (the next step's may be in flight)
    const uint4 *buf = staging + (k & 1) * kUnits * kBlockThreads + threadIdx.x;
    Packed8<kIn> in[kRows][kVecs];  // the step's rows, packed, decoded on each pass
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (row0 + r < rows && j < vecs) {
          unstage(in[r][j], buf + (r * kVecs + j) * kVecUnits<kIn> * kBlockThreads);
        } else {
          in[r][j].zero();
        }
      }
    }
    prefetch(k + kPrefetchSteps);
    if (row0 < rows) {  // uniform in the group, as its barriers need
      float acc[kRows], mu[kRows] = {}, rs[kRows];
      // acc[r] = the group's sum of value(x, r) over row r, in the documented lane order.
      // kZeroKeeps: value(0, r) is +0, so that the vectors past the row end (zeros, see above)
      // may be added without a test: a lane sum starts at +0 and so is never -0 (in round to
      // nearest, x + y is -0 only when both are), and adding +0 to it changes no bit.
      auto row_sums = [&](auto value, auto zero_keeps) {
        constexpr bool kZeroKeeps = decltype(zero_keeps)::value;
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          acc[r] = 0.0f;
#pragma unroll
          for (int j = 0; j < kVecs; ++j) {
            float x[8];
            decode_row(in[r][j], x);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
              if (kZeroKeeps || j < vecs) acc[r] += value(x[e], r);
            }
          }
        }
        group_lane_sums(acc, scratch[parity][group], 1 + group);
        parity ^= 1;
      };
      if (kLn) {
        row_sums([](float x, int) { return x; }, std::true_type{});
#pragma unroll
        for (int r = 0; r < kRows; ++r) mu[r] = acc[r] / static_cast<float>(n);
      }
      // (LayerNorm's (0 - mu)^2 is not 0: its vectors past the row end are left out.)
      row_sums(
          [&](float x, int r) {
            const float d = kLn ? x - mu[r] : x;
            return d * d;
          },
          std::integral_constant<bool, !kLn>{});
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        rs[r] = norm_rsigma(acc[r], n, a.eps);
        if (t == 0 && row0 + r < rows) {
          if (kLn) a.mu[row0 + r] = canonical(mu[r]);
          a.rsigma[row0 + r] = canonical(rs[r]);
        }
      }
      // y of the vector v of row r; returns max |y|, NaN if one is.
      auto output = [&](const Packed8<kIn> &v, int r, const float (&g)[8], const float (&b)[8], float (&y)[8]) {
        float x[8];
        decode_row(v, x);
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = norm_output(norm_xhat(x[e], mu[r], rs[r], kLn), g[e], b[e], kLn);
        return abs_max8(y);
      };
      // The weights of this thread's vector j (vector t + kThreads * j of the row).
      const float4 *gain_t = gain + t, *bias_t = bias + t;
      auto weights = [&](int j, float (&g)[8], float (&b)[8]) {
        const float4 *gv = gain_t + j * kThreads, *bv = bias_t + j * kThreads;
        const float4 g0 = gv[0], g1 = gv[kHalf];
        g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w, g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
        if (kLn) {
          const float4 b0 = bv[0], b1 = bv[kHalf];
          b[0] = b0.x, b[1] = b0.y, b[2] = b0.z, b[3] = b0.w, b[4] = b1.x, b[5] = b1.y, b[6] = b1.z, b[7] = b1.w;
        }
      };
      // Vectors past the row end (j >= vecs) and rows past the last compute on zeros; only
      // their stores and amax are left out, so that the loop has no branch per vector.
      if constexpr (kFp8) {
        uint8_t *fp8_row[kRows];  // this thread's first vector of each row
#pragma unroll
        for (int r = 0; r < kRows; ++r) fp8_row[r] = a.fp8 + row_at(row0 + r) + t * kNormVec;
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          float g[8], b[8] = {}, y[8];
          weights(j, g, b);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const bool valid = j < vecs && (kRows == 1 || row0 + r < rows);
            const float m = output(in[r][j], r, g, b, y);
            if (valid) amax = fmax_nan(amax, m);
            float s[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] = y[e] * scale;
            uint2 q = fp8x8_nan_raw<kF8>(s, m, abs_scale);
            const float probe = fmax_nan(m, scale_probe);
            if (probe != probe) q = make_uint2(canonical_fp8_nan<kF8>(q.x), canonical_fp8_nan<kF8>(q.y));  // rare
            if (valid) *reinterpret_cast<uint2 *>(fp8_row[r] + j * kThreads * kNormVec) = q;
          }
        }
      }
      // The high-precision output in a loop of its own, so that the FP8 loop stays compact
      // (y is recomputed when both are asked for).
      if (a.output != nullptr) {
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          if (j >= vecs) continue;
          float g[8], b[8] = {}, y[8];
          weights(j, g, b);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (kRows > 1 && row0 + r >= rows) continue;
            const float m = output(in[r][j], r, g, b, y);
            store_hp8(a.output, row_at(row0 + r) + (t + kThreads * j) * kNormVec, a.output_dtype, y, m != m);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // the last, empty group
  if constexpr (kFp8) {
    const uint32_t block = block_max<kBlockThreads>(float_bits(amax), warp_amax);
    if (threadIdx.x == 0) {
      if (a.amax != nullptr) atomic_max_amax(a.amax, is_nan_bits(block) ? kCanonicalNaN : block);
      if (blockIdx.x == 0) *a.scale_inv = canonical_div(1.0f, scale);
    }
  }
}

// Any row: one row group (block) per row, reading global memory on every pass. whole: 8 | cols
// and every row and output starts 16-byte aligned (8-byte for FP8); weights8: gamma and beta
// load as vectors of 8 too.
template <te_dtype kIn>
__global__ void __launch_bounds__(kThreads) norm_forward_any_kernel(const NormForwardArgs a, bool whole,
                                                                    bool weights8) {
  if (a.gate != nullptr && *a.gate != 0.0f) return;  // a shut gate: the amax stays 0 (tensor.h)
  __shared__ LaneScratch<1> scratch[2];
  __shared__ uint32_t warp_amax[kGroupWarps];
  const bool ln = a.type == TE_NORM_LAYERNORM;
  const int64_t n = a.cols, r = blockIdx.x;
  const RowVectors<kIn> v{static_cast<const char *>(a.input) + r * n * sizeof(typename Hp<kIn>::Storage), n, whole};
  const int count = v.count();
  float acc[1] = {0.0f}, mu = 0.0f;
  if (ln) {
    for (int j = 0; j < count; ++j) {
      float x[8];
      v.get(j, x);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (v.start(j) + e < n) acc[0] += x[e];
      }
    }
    group_lane_sums(acc, scratch[0], 1);
    mu = acc[0] / static_cast<float>(n);
    acc[0] = 0.0f;
  }
  for (int j = 0; j < count; ++j) {
    float x[8];
    v.get(j, x);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float d = ln ? x[e] - mu : x[e];
      if (v.start(j) + e < n) acc[0] += d * d;
    }
  }
  group_lane_sums(acc, scratch[1], 1);
  const float rsigma = norm_rsigma(acc[0], n, a.eps);
  if (threadIdx.x == 0) {
    if (ln) a.mu[r] = canonical(mu);
    a.rsigma[r] = canonical(rsigma);
  }
  const float scale = a.has_fp8 ? *a.scale : 1.0f;
  const bool e4m3 = a.fp8_dtype == TE_DTYPE_FLOAT8_E4M3;
  float amax = 0.0f;
  for (int j = 0; j < count; ++j) {
    const int64_t i0 = v.start(j), base = r * n + i0;
    float x[8], g[8], b[8] = {}, y[8];
    v.get(j, x);
    if (whole && weights8) {
      load_any8(a.gamma, i0, a.weight_dtype, g);
      if (ln) load_any8(a.beta, i0, a.weight_dtype, b);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        g[e] = i0 + e < n ? load_any(a.gamma, i0 + e, a.weight_dtype) : 0.0f;
        if (ln) b[e] = i0 + e < n ? load_any(a.beta, i0 + e, a.weight_dtype) : 0.0f;
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      y[e] = i0 + e < n ? norm_output(norm_xhat(x[e], mu, rsigma, ln), norm_gain(g[e], a.zero_centered), b[e], ln)
                        : 0.0f;
    }
    amax = fmax_nan(amax, abs_max8(y));
    if (a.output != nullptr) {
      if (whole) {
        store_any8(a.output, base, a.output_dtype, y);
      } else {
        for (int e = 0; e < 8 && i0 + e < n; ++e) store_any(a.output, base + e, a.output_dtype, y[e]);
      }
    }
    if (a.has_fp8) {
      float s[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) s[e] = y[e] * scale;
      if (whole) {
        const uint32_t lo = e4m3 ? fp8x4<TE_DTYPE_FLOAT8_E4M3>(s[0], s[1], s[2], s[3])
                                 : fp8x4<TE_DTYPE_FLOAT8_E5M2>(s[0], s[1], s[2], s[3]);
        const uint32_t hi = e4m3 ? fp8x4<TE_DTYPE_FLOAT8_E4M3>(s[4], s[5], s[6], s[7])
                                 : fp8x4<TE_DTYPE_FLOAT8_E5M2>(s[4], s[5], s[6], s[7]);
        store_u64(a.fp8 + base, lo, hi);
      } else {
        for (int e = 0; e < 8 && i0 + e < n; ++e) {
          a.fp8[base + e] = e4m3 ? fp8x1<TE_DTYPE_FLOAT8_E4M3>(s[e]) : fp8x1<TE_DTYPE_FLOAT8_E5M2>(s[e]);
        }
      }
    }
  }
  if (a.has_fp8) {
    const uint32_t m = block_max<kThreads>(float_bits(amax), warp_amax);
    if (threadIdx.x == 0) {
      if (a.amax != nullptr) atomic_max_amax(a.amax, is_nan_bits(m) ? kCanonicalNaN : m);
      if (blockIdx.x == 0) *a.scale_inv = canonical_div(1.0f, scale);
    }
  }
}

constexpr const char *kForwardOp = "norm_forward";

// Launches the row kernel on as many blocks as stay resident (each walks its bands), if its
// `smem` bytes of shared memory fit the device; *launched says whether it did.
template <typename Kernel>
te_status launch_rows(Kernel kernel, const NormForwardArgs &a, size_t smem, cudaStream_t s, bool *launched) {
  int64_t capacity = 0;
  if (te_status st = resident_capacity(kForwardOp, kernel, kBlockThreads, smem, &capacity, launched)) return st;
  if (!*launched) return TE_SUCCESS;
  const int64_t grid = std::min<int64_t>(div_up(a.rows, kBandRows), capacity);
  kernel<<<static_cast<unsigned>(grid), kBlockThreads, smem, s>>>(a);
  return launch_status(kForwardOp);
}

// The row kernel of the call's variant. The FP8 transpose, when asked for, is left to the
// caller's transpose kernel (0.18 ms for both at 16384 x 8192 bf16 on the H200, the norm alone
// 0.11). Two ways of writing it from this kernel were slower (gpu_checks.md, 2026-12-03):
// 16-row bands of FP8 staged in shared memory, 0.47 ms (the block's loads stop while it stores
// the band); 32-row bands read back from the L2 right after they are written, 0.28 ms (each band
// leaves 32-byte pieces of 8192 transposed rows, which reach the DRAM as scattered sectors).
// Beating the pair needs longer transposed runs per block than shared memory or the L2 hold.
template <te_dtype kIn, int kVecs, bool kLn, te_dtype kF8>
te_status launch_rows_fp8(const NormForwardArgs &a, cudaStream_t s, bool *launched) {
  const size_t smem = static_cast<size_t>(kLn ? 2 : 1) * kWeightSpan<kVecs> * sizeof(float) + kStageBytes<kIn, kVecs>;
  return launch_rows(norm_forward_rows_kernel<kIn, kVecs, kLn, kF8>, a, smem, s, launched);
}

template <te_dtype kIn, int kVecs, bool kLn>
te_status launch_rows_ln(const NormForwardArgs &a, cudaStream_t s, bool *launched) {
  if (!a.has_fp8) return launch_rows_fp8<kIn, kVecs, kLn, kNoFp8>(a, s, launched);
  if (a.fp8_dtype == TE_DTYPE_FLOAT8_E4M3) return launch_rows_fp8<kIn, kVecs, kLn, TE_DTYPE_FLOAT8_E4M3>(a, s, launched);
  return launch_rows_fp8<kIn, kVecs, kLn, TE_DTYPE_FLOAT8_E5M2>(a, s, launched);
}

template <te_dtype kIn, int kVecs>
te_status launch_rows_any(const NormForwardArgs &a, cudaStream_t s, bool *launched) {
  if (a.type == TE_NORM_LAYERNORM) return launch_rows_ln<kIn, kVecs, true>(a, s, launched);
  return launch_rows_ln<kIn, kVecs, false>(a, s, launched);
}

template <te_dtype kIn>
te_status forward(const NormForwardArgs &a, bool vector_io, cudaStream_t s) {
  // (rows below 2^30: the row kernel's indices are 32-bit, with room for a step past the end)
  const int vecs = vector_io && a.cols >= kNormVec && a.rows < (int64_t{1} << 30) ? vecs_for(a.cols, kStepVecs<kIn>) : 0;
  bool launched = false;
  te_status st = TE_SUCCESS;
  switch (vecs) {
    case 1: st = launch_rows_any<kIn, 1>(a, s, &launched); break;
    case 2: st = launch_rows_any<kIn, 2>(a, s, &launched); break;
    case 4: st = launch_rows_any<kIn, 4>(a, s, &launched); break;
    case 8:
      if constexpr (kStepVecs<kIn> >= 8) st = launch_rows_any<kIn, 8>(a, s, &launched);
      break;
    default: break;
  }
  if (st != TE_SUCCESS || launched) return st;
  const bool weights8 = a.cols % kNormVec == 0 && aligned(a.gamma, 16) && (a.beta == nullptr || aligned(a.beta, 16));
  norm_forward_any_kernel<kIn><<<static_cast<unsigned>(a.rows), kThreads, 0, s>>>(a, vector_io, weights8);
  return launch_status(kForwardOp);
}

}  // namespace norm_cuda
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_NORM_NORM_FORWARD_CUH_
