// CUDA LayerNorm / RMSNorm: the backward kernels and the launchers of both directions (the
// forward kernels are in norm_forward.cuh).
//
// The FP8 transpose of the forward, when asked for, is the FP8 transpose kernel run on the
// row-wise FP8 output (a row-wise kernel cannot write a transposed tile coalesced).
//
// Backward: one block per group of 32 rows (norm.h's column-sum groups), rows in order; the
// gains and the group's partial column sums of grad_gamma / grad_beta live in shared memory,
// each column owned by one thread; a second kernel adds the groups' partials in group order.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.cuh"
#include "norm/norm_cuda.cuh"
#include "norm/norm_impl.h"
#include "transpose/transpose_impl.h"

namespace te {
namespace {

using namespace norm_cuda;

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
    te_status st = with_hp_dtype(a.input_dtype, [&](auto in) {
      return forward<decltype(in)::value>(a, vector_io, vector_weights, s);
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
