// The CUDA LayerNorm / RMSNorm backward (grad_input and the partial column sums), instantiated
// once per input dtype by norm_backward_{fp32,fp16,bf16}.cu; norm.cu adds the partials up.
//
// Design. The backward reads x and dy and writes dx: 6 bytes per element for about 25
// instructions, far from the issue limit, so what bounds it is memory in flight. norm.h fixes
// the column sums: per group of 32 rows, rows in order, then over the groups in order; a group
// is therefore one row group's unit of work (it owns the partial sums of every column).
// norm_backward_rows_kernel (whole, aligned vectors, rows up to 8192 elements, 4096 for fp32):
//   - one row group (block) walks its 32-row groups in turn (a persistent grid of as few waves as
//     the residency allows, spread evenly over the blocks);
//   - a row's x and dy stay packed in registers for both passes, and the next row's (with its mu
//     and rsigma) are loaded while this one is computed, across group boundaries too;
//   - the two row sums share one barrier (group_lane_sums);
//   - each thread keeps the gains of its columns and their partial sums in shared memory that
//     only it touches (for want of registers: 64 columns of three arrays at 8192), laid out so
//     that its 128-bit accesses are conflict-free, and writes them out when its group is done;
//   - dx is converted by the hardware (bit-equal to the reference but for NaN, which the vectors
//     holding one take the reference's conversion for); so is its rounding before a residual
//     gradient is added (kAdd, grad_add in the input's dtype: loaded with the next row's x and
//     dy, so that its read is in flight with theirs; loaded in the second pass instead, it left
//     the kernel waiting on it and took the [8192, 4096] bf16 backward from about 96 to 192 us
//     a call on an H100).
// norm_backward_any_kernel takes every other row: one block per group, global reads per pass.
#ifndef TRANSFORMER_ENGINE_SRC_NORM_NORM_BACKWARD_CUH_
#define TRANSFORMER_ENGINE_SRC_NORM_NORM_BACKWARD_CUH_

#include <algorithm>

#include "norm/norm_cuda.cuh"

namespace te {
namespace norm_cuda {

// Longest row held in registers: x, dy and the next row's, 8 (fp32: 4) vectors per thread each.
template <te_dtype kIn>
constexpr int kBackwardVecs = sizeof(typename Hp<kIn>::Storage) == 2 ? 8 : 4;

// Bytes of the per-thread arrays: gains and partial dgamma (and dbeta), 8 floats per vector.
constexpr size_t backward_own_bytes(bool ln, int vecs) {
  return static_cast<size_t>(ln ? 3 : 2) * vecs * 2 * kThreads * sizeof(float4);
}

// dx rounded to dtype d by the hardware's conversion (norm_add_rounded's first rounding; equal
// to the reference's for every value but NaN, which stays a NaN and is canonicalized on store).
__device__ __forceinline__ float round_hw(float v, te_dtype d) {
  if (d == TE_DTYPE_BFLOAT16) return __bfloat162float(__float2bfloat16_rn(v));
  if (d == TE_DTYPE_FLOAT16) return __half2float(__float2half_rn(v));
  return v;
}

template <te_dtype kIn, int kVecs, bool kLn, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    norm_backward_rows_kernel(const NormBackwardArgs a, float *partials, int64_t groups) {
  constexpr int kSums = kLn ? 2 : 1;  // sum(dyg) (LayerNorm), sum(dyg * xhat)
  extern __shared__ float4 own[];     // [array: gain, dgamma, dbeta][vector][half][thread]
  __shared__ LaneScratch<kSums> scratch[2];
  const int t = threadIdx.x;
  const int64_t n = a.cols, rows = a.rows;
  const int vecs = own_vectors(n / kNormVec, kVecs);
  auto slot = [&](int array, int j, int half) -> float4 & { return own[((array * kVecs + j) * 2 + half) * kThreads + t]; };
  auto col = [&](int j) { return (t + static_cast<int64_t>(kThreads) * j) * kNormVec; };
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    if (j >= vecs) continue;
    float g[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = norm_gain(load_any(a.gamma, col(j) + e, a.weight_dtype), a.zero_centered);
    slot(0, j, 0) = make_float4(g[0], g[1], g[2], g[3]);
    slot(0, j, 1) = make_float4(g[4], g[5], g[6], g[7]);
  }

  // The next row's x and dy (and mu, rsigma, and its residual gradient), loaded while this row
  // is computed. Vectors past the row end are never loaded nor used: they keep these zeros.
  Packed8<kIn> next_x[kVecs], next_dy[kVecs], next_add[kAdd ? kVecs : 1];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    next_x[j].zero(), next_dy[j].zero();
    if constexpr (kAdd) next_add[j].zero();
  }
  float next_mu = 0.0f, next_rs = 0.0f;
  auto load = [&](int64_t row) {  // row == rows: none
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (row < rows && j < vecs) {
        next_x[j].load(a.input, row * n + col(j));
        next_dy[j].load(a.grad_output, row * n + col(j));
        if constexpr (kAdd) next_add[j].load(a.grad_add, row * n + col(j));
      }
    }
    if (row < rows) {
      next_mu = kLn ? a.mu[row] : 0.0f;
      next_rs = a.rsigma[row];
    }
  };
  // The row after `row` in this block's walk: the rest of its group, then the next group's.
  auto after = [&](int64_t row) -> int64_t {
    if (row + 1 < rows && (row + 1) % kNormGroupRows != 0) return row + 1;
    const int64_t next_group = row / kNormGroupRows + gridDim.x;
    return next_group < groups ? next_group * kNormGroupRows : rows;
  };

  load(blockIdx.x < groups ? blockIdx.x * kNormGroupRows : rows);
  int parity = 0;
  for (int64_t grp = blockIdx.x; grp < groups; grp += gridDim.x) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
#pragma unroll
      for (int array = 1; array < (kLn ? 3 : 2); ++array) {
        slot(array, j, 0) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        slot(array, j, 1) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    const int64_t r1 = min(rows, (grp + 1) * kNormGroupRows);
    for (int64_t r = grp * kNormGroupRows; r < r1; ++r) {
      Packed8<kIn> x[kVecs], dy[kVecs], add[kAdd ? kVecs : 1];
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        x[j] = next_x[j], dy[j] = next_dy[j];
        if constexpr (kAdd) add[j] = next_add[j];
      }
      const float mu = next_mu, rsigma = next_rs;
      load(after(r));
      float sums[kSums] = {};
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j >= vecs) continue;
        float xv[8], dv[8];
        decode_pass(x[j], xv);
        decode_pass(dy[j], dv);
        const float4 g0 = slot(0, j, 0), g1 = slot(0, j, 1);
        const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float dyg = dv[e] * g[e];
          if (kLn) sums[0] += dyg;
          sums[kSums - 1] += dyg * norm_xhat(xv[e], mu, rsigma, kLn);
        }
      }
      group_lane_sums(sums, scratch[parity], 1);
      parity ^= 1;
      const float m1 = kLn ? sums[0] / static_cast<float>(n) : 0.0f;
      const float m2 = sums[kSums - 1] / static_cast<float>(n);
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        if (j >= vecs) continue;
        float xv[8], dv[8], dx[8];
        decode_pass(x[j], xv);
        decode_pass(dy[j], dv);
        const float4 g0 = slot(0, j, 0), g1 = slot(0, j, 1);
        const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        float4 pg[2] = {slot(1, j, 0), slot(1, j, 1)}, pb[2] = {};
        if (kLn) pb[0] = slot(2, j, 0), pb[1] = slot(2, j, 1);
        float *part_g = reinterpret_cast<float *>(pg), *part_b = reinterpret_cast<float *>(pb);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float xhat = norm_xhat(xv[e], mu, rsigma, kLn);
          dx[e] = norm_grad_input(dv[e] * g[e], xhat, m1, m2, rsigma, kLn);
          part_g[e] += dv[e] * xhat;
          if (kLn) part_b[e] += dv[e];
        }
        slot(1, j, 0) = pg[0], slot(1, j, 1) = pg[1];
        if (kLn) slot(2, j, 0) = pb[0], slot(2, j, 1) = pb[1];
        if constexpr (kAdd) {
          float av[8];
          decode_pass(add[j], av);
#pragma unroll
          for (int e = 0; e < 8; ++e) dx[e] = canonical(round_hw(dx[e], a.grad_input_dtype) + av[e]);
        }
        const float m = abs_max8(dx);
        store_hp8(a.grad_input, r * n + col(j), a.grad_input_dtype, dx, m != m);
      }
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j >= vecs) continue;
#pragma unroll
      for (int array = 1; array < (kLn ? 3 : 2); ++array) {
        float4 *dst = reinterpret_cast<float4 *>(partials + ((array - 1) * groups + grp) * n + col(j));
        dst[0] = slot(array, j, 0);
        dst[1] = slot(array, j, 1);
      }
    }
  }
}

// Any row: one block per group of 32 rows, reading global memory on every pass; the gains and
// partial sums in shared memory, each column owned by one thread. whole: as in the forward.
template <te_dtype kIn>
__global__ void __launch_bounds__(kThreads)
    norm_backward_any_kernel(const NormBackwardArgs a, float *partials, int64_t groups, bool whole) {
  extern __shared__ float smem[];  // gains [n], partial dgamma [n], partial dbeta [n]
  __shared__ LaneScratch<2> scratch[2];
  const bool ln = a.type == TE_NORM_LAYERNORM;
  const int64_t n = a.cols, grp = blockIdx.x;
  float *gain = smem, *part_g = smem + n, *part_b = smem + 2 * n;
  for (int64_t i0 = static_cast<int64_t>(threadIdx.x) * kNormVec; i0 < n; i0 += kThreads * kNormVec) {
    for (int e = 0; e < kNormVec && i0 + e < n; ++e) {
      gain[i0 + e] = norm_gain(load_any(a.gamma, i0 + e, a.weight_dtype), a.zero_centered);
      part_g[i0 + e] = 0.0f;
      part_b[i0 + e] = 0.0f;
    }
  }
  const int64_t r1 = min(a.rows, (grp + 1) * kNormGroupRows);
  const size_t es = sizeof(typename Hp<kIn>::Storage);
  int parity = 0;
  for (int64_t r = grp * kNormGroupRows; r < r1; ++r) {
    const RowVectors<kIn> x{static_cast<const char *>(a.input) + r * n * es, n, whole};
    const RowVectors<kIn> dy{static_cast<const char *>(a.grad_output) + r * n * es, n, whole};
    const int count = x.count();
    const float mu = ln ? a.mu[r] : 0.0f, rsigma = a.rsigma[r];
    float sums[2] = {0.0f, 0.0f};
    for (int j = 0; j < count; ++j) {
      float xv[8], dv[8];
      x.get(j, xv);
      dy.get(j, dv);
      const int64_t i0 = x.start(j);
      for (int e = 0; e < 8 && i0 + e < n; ++e) {
        const float dyg = dv[e] * gain[i0 + e];
        sums[0] += dyg;
        sums[1] += dyg * norm_xhat(xv[e], mu, rsigma, ln);
      }
    }
    group_lane_sums(sums, scratch[parity], 1);
    parity ^= 1;
    const float m1 = ln ? sums[0] / static_cast<float>(n) : 0.0f;
    const float m2 = sums[1] / static_cast<float>(n);
    for (int j = 0; j < count; ++j) {
      float xv[8], dv[8], dx[8];
      x.get(j, xv);
      dy.get(j, dv);
      const int64_t i0 = x.start(j);
      for (int e = 0; e < 8 && i0 + e < n; ++e) {
        const float xhat = norm_xhat(xv[e], mu, rsigma, ln);
        dx[e] = norm_grad_input(dv[e] * gain[i0 + e], xhat, m1, m2, rsigma, ln);
        part_g[i0 + e] += dv[e] * xhat;
        part_b[i0 + e] += dv[e];
        if (a.grad_add != nullptr) {
          dx[e] = norm_add_rounded(dx[e], load_any(a.grad_add, r * n + i0 + e, a.grad_input_dtype),
                                   a.grad_input_dtype);
        }
      }
      if (whole) {
        store_any8(a.grad_input, r * n + i0, a.grad_input_dtype, dx);
      } else {
        for (int e = 0; e < 8 && i0 + e < n; ++e) store_any(a.grad_input, r * n + i0 + e, a.grad_input_dtype, dx[e]);
      }
    }
  }
  for (int64_t i0 = static_cast<int64_t>(threadIdx.x) * kNormVec; i0 < n; i0 += kThreads * kNormVec) {
    for (int e = 0; e < kNormVec && i0 + e < n; ++e) {
      partials[grp * n + i0 + e] = part_g[i0 + e];
      partials[(groups + grp) * n + i0 + e] = part_b[i0 + e];
    }
  }
}

constexpr const char *kBackwardOp = "norm_backward";

// Launches the row kernel if its shared memory fits the device (*launched).
template <te_dtype kIn, int kVecs, bool kLn, bool kAdd>
te_status launch_backward_rows(const NormBackwardArgs &a, float *partials, int64_t groups, cudaStream_t s,
                               bool *launched) {
  auto kernel = norm_backward_rows_kernel<kIn, kVecs, kLn, kAdd>;
  const size_t smem = backward_own_bytes(kLn, kVecs);
  int64_t capacity = 0;
  if (te_status st = resident_capacity(kBackwardOp, kernel, kThreads, smem, &capacity, launched)) return st;
  if (!*launched) return TE_SUCCESS;
  // As few waves of groups as the residency allows, spread evenly: no block walks more groups
  // than another but one.
  const int64_t waves = div_up(groups, capacity);
  const int64_t grid = div_up(groups, waves);
  kernel<<<static_cast<unsigned>(grid), kThreads, smem, s>>>(a, partials, groups);
  return launch_status(kBackwardOp);
}

template <te_dtype kIn, int kVecs>
te_status launch_backward_rows_any(const NormBackwardArgs &a, float *partials, int64_t groups, cudaStream_t s,
                                   bool *launched) {
  const bool ln = a.type == TE_NORM_LAYERNORM;
  if (a.grad_add != nullptr) {
    if (ln) return launch_backward_rows<kIn, kVecs, true, true>(a, partials, groups, s, launched);
    return launch_backward_rows<kIn, kVecs, false, true>(a, partials, groups, s, launched);
  }
  if (ln) return launch_backward_rows<kIn, kVecs, true, false>(a, partials, groups, s, launched);
  return launch_backward_rows<kIn, kVecs, false, false>(a, partials, groups, s, launched);
}

template <te_dtype kIn>
te_status backward(const NormBackwardArgs &a, bool vector_io, float *partials, int64_t groups, cudaStream_t s) {
  // (the rows kernel holds a residual gradient in the input's dtype; any other takes the general one)
  const bool rows_ok = vector_io && a.cols >= kNormVec && aligned(partials, 16) &&
                       (a.grad_add == nullptr || a.grad_input_dtype == kIn);
  const int vecs = rows_ok ? vecs_for(a.cols, kBackwardVecs<kIn>) : 0;
  bool launched = false;
  te_status st = TE_SUCCESS;
  switch (vecs) {
    case 1: st = launch_backward_rows_any<kIn, 1>(a, partials, groups, s, &launched); break;
    case 2: st = launch_backward_rows_any<kIn, 2>(a, partials, groups, s, &launched); break;
    case 4: st = launch_backward_rows_any<kIn, 4>(a, partials, groups, s, &launched); break;
    case 8:
      if constexpr (kBackwardVecs<kIn> >= 8) st = launch_backward_rows_any<kIn, 8>(a, partials, groups, s, &launched);
      break;
    default: break;
  }
  if (st != TE_SUCCESS || launched) return st;
  auto kernel = norm_backward_any_kernel<kIn>;
  const size_t smem = static_cast<size_t>(3 * a.cols) * sizeof(float);
  size_t limit = 0;
  if (te_status st2 = dynamic_smem_limit(kBackwardOp, kernel, &limit)) return st2;
  if (smem > limit) {
    return fail(TE_ERROR_UNSUPPORTED, kBackwardOp,
                "input.data must have at most " + std::to_string(limit / 12) +
                    " columns on CUDA (the per-column sums live in shared memory), got " + std::to_string(a.cols));
  }
  kernel<<<static_cast<unsigned>(groups), kThreads, smem, s>>>(a, partials, groups, vector_io);
  return launch_status(kBackwardOp);
}

}  // namespace norm_cuda
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_NORM_NORM_BACKWARD_CUH_
