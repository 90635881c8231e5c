// CUDA quantization with one per-tensor scale (TENSOR mode): the row-wise cast (+ amax) and the
// fused cast + transpose, the two kernels that every FP8 linear layer runs on its activations.
//
// Design. Both kernels are bandwidth-bound; what matters is keeping enough 128-bit loads in
// flight and writing full sectors.
//   quantize_kernel (row-wise only): the tensor as a flat array; each thread takes 4 groups of
//     8 elements per iteration (4 independent 128-bit loads for 16-bit inputs, kept packed until
//     used; 8 for fp32), all issued before the first use, writes 8 FP8 bytes per group with
//     one 64-bit store, and keeps a running amax; the grid is one wave (4 blocks of 256 per
//     SM, guaranteed resident
//     by the launch bounds) striding over the tensor, so each block does one atomicMax. A
//     scalar grid-stride path serves misaligned pointers, and block 0 does the < 8 tail.
//   quantize_transpose_kernel (column-wise, with or without row-wise): a 128x128 tile per
//     block; each of the 256 threads owns an 8x8 patch (16 patch columns per tile row, so a
//     half-warp reads 256 contiguous bytes of a row), loads it with 8 (fp32: 16) 128-bit loads
//     (16-bit inputs stay packed, so 4 blocks of 256 fit per SM), converts it, writes its 8 row-wise rows with 64-bit stores, transposes the 8x8 bytes in
//     registers (__byte_perm) and stages them in an XOR-swizzled 16 KiB shared tile (see
//     TransposeStage), from which the block writes the transposed tile with 128-bit stores,
//     8 threads per 128-byte output row. Needs rows % 16 == 0, cols % 8 == 0 and aligned
//     pointers; other shapes go to the tiled kernel of quantize_block.cu, which takes any shape.
//     One launch takes up to 4 such casts (te_quantize_many: a small layer's input and weight),
//     each with its own range of blocks; launches cost host time, which bounds small layers.
// Numerics: x * scale is one fp32 multiply as in the reference (--fmad=false keeps it so), the
// conversion is fp8x4 (see cuda_utils.cuh), amax is the max of abs_bits(x) over the decoded
// input, and scale_inv = 1 / scale is written once, by block 0.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "common/cuda_utils.cuh"
#include "quantize/quantize_impl.h"

namespace te {
namespace {

constexpr const char *kOp = "quantize";

// --- Row-wise only ---------------------------------------------------------------------------

constexpr int kFlatThreads = 256;
// Groups of 8 elements in flight per thread. More would fit in registers, but fewer, longer
// grid-stride iterations balance worse across the one-wave grid (8 measured slower than 4).
constexpr int kFlatUnroll = 4;
constexpr int kFlatBlocksPerSm = 4;  // resident together (launch bounds), so the grid is one wave

template <te_dtype kIn, te_dtype kFp8>
__global__ void __launch_bounds__(kFlatThreads, kFlatBlocksPerSm)
    quantize_kernel(const void *__restrict__ input, uint8_t *__restrict__ output,
                    const float *__restrict__ scale_ptr, float *__restrict__ scale_inv,
                    float *__restrict__ amax, int64_t n, bool vectorized) {
  constexpr int kUnroll = kFlatUnroll;
  __shared__ uint32_t scratch[kFlatThreads / 32];
  const float scale = *scale_ptr;
  uint32_t m = 0;
  if (vectorized) {
    const int64_t groups = n / 8;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kFlatThreads * kUnroll;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * kFlatThreads * kUnroll + threadIdx.x;
         base < groups; base += stride) {
      Packed8<kIn> in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * kFlatThreads;
        if (g < groups) {
          in[u].load(input, g * 8);
        } else {
          in[u].zero();
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t g = base + u * kFlatThreads;
        float v[8];
        in[u].decode(v);
#pragma unroll
        for (int k = 0; k < 8; ++k) m = max(m, abs_bits(v[k]));
        if (g < groups) {
          store_u64(output + g * 8, fp8x4<kFp8>(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale),
                    fp8x4<kFp8>(v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale));
        }
      }
    }
    // The last n % 8 elements.
    const int64_t i = groups * 8 + threadIdx.x;
    if (blockIdx.x == 0 && i < n) {
      const float v = load_hp1<kIn>(input, i);
      m = max(m, abs_bits(v));
      output[i] = fp8x1<kFp8>(v * scale);
    }
  } else {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kFlatThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kFlatThreads + threadIdx.x; i < n; i += stride) {
      const float v = load_hp1<kIn>(input, i);
      m = max(m, abs_bits(v));
      output[i] = fp8x1<kFp8>(v * scale);
    }
  }
  if (amax != nullptr) {
    m = block_max<kFlatThreads>(m, scratch);
    if (threadIdx.x == 0) atomic_max_amax(amax, m);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = canonical_div(1.0f, scale);
}

// --- Row-wise + column-wise (transposed) -----------------------------------------------------

constexpr int kTile = 128;             // tile rows and columns
constexpr int kTileThreads = kStageThreads;  // one 8x8 patch each: 16 x 16 patches
constexpr int kPatchesPerRow = kTile / 8;

// 16-bit inputs keep the loaded patch packed (32 registers) and decode it a row at a time, so
// 4 blocks fit per SM (<= 64 registers): the more loads in flight, the closer to the copy
// bandwidth. fp32 holds twice the bytes per patch and takes 2.
template <te_dtype kIn>
constexpr int kTileBlocksPerSm = kIn == TE_DTYPE_FLOAT32 ? 2 : 4;

// One cast + transpose of a launch and its share of the grid: blocks [first_block, first_block
// + blocks) take its tiles, striding by `blocks`. A launch takes up to kMaxJobs of them
// (te_quantize_many), so that the casts of a small layer cost one launch, not one each.
struct TransposeJob {
  const void *input;
  uint8_t *rowwise, *columnwise;
  const float *scale;
  float *scale_inv, *amax;
  int64_t rows, cols, tiles_c, num_tiles;
  int64_t first_block, blocks;
};
constexpr int kMaxJobs = 4;
struct TransposeJobs {
  TransposeJob job[kMaxJobs];
  int count;
};

template <te_dtype kIn, te_dtype kFp8>
__global__ void __launch_bounds__(kTileThreads, kTileBlocksPerSm<kIn>)
    quantize_transpose_kernel(const __grid_constant__ TransposeJobs jobs) {
  __shared__ TransposeStage stage;
  __shared__ uint32_t warp_amax[kTileThreads / 32];
  // This block's job (constant indices only: a dynamic index would copy the jobs to local memory).
  TransposeJob job = jobs.job[0];
#pragma unroll
  for (int j = 1; j < kMaxJobs; ++j) {
    if (j < jobs.count && blockIdx.x >= jobs.job[j].first_block) job = jobs.job[j];
  }
  const int64_t rows = job.rows, cols = job.cols, block = blockIdx.x - job.first_block;
  const float scale = *job.scale;
  const int pr = threadIdx.x / kPatchesPerRow, pc = threadIdx.x % kPatchesPerRow;
  uint32_t m = 0;

  for (int64_t tile = block; tile < job.num_tiles; tile += job.blocks) {
    if (tile != block) __syncthreads();  // the previous tile's stage has been read
    const int64_t r0 = (tile / job.tiles_c) * kTile, c0 = (tile % job.tiles_c) * kTile;
    const int64_t prow = r0 + pr * 8, pcol = c0 + pc * 8;
    // rows % 8 == 0 and cols % 8 == 0, so a patch is wholly inside the matrix or wholly outside.
    const bool valid = prow < rows && pcol < cols;

    Packed8<kIn> patch[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (valid) {
        patch[i].load(job.input, (prow + i) * cols + pcol);
      } else {
        patch[i].zero();
      }
    }

    uint32_t lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float x[8];
      patch[i].decode(x);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, abs_bits(x[k]));
      lo[i] = fp8x4<kFp8>(x[0] * scale, x[1] * scale, x[2] * scale, x[3] * scale);
      hi[i] = fp8x4<kFp8>(x[4] * scale, x[5] * scale, x[6] * scale, x[7] * scale);
    }
    if (valid && job.rowwise != nullptr) {
#pragma unroll
      for (int i = 0; i < 8; ++i) store_u64(job.rowwise + (prow + i) * cols + pcol, lo[i], hi[i]);
    }

    stage_put_patch(stage, pr, pc, lo, hi);
    __syncthreads();
    stage_store_transposed(stage, job.columnwise, r0, c0, rows, cols);
  }

  if (job.amax != nullptr) {
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t b = warp_amax[0];
#pragma unroll
      for (int w = 1; w < kTileThreads / 32; ++w) b = max(b, warp_amax[w]);
      atomic_max_amax(job.amax, b);
    }
  }
  if (block == 0 && threadIdx.x == 0) *job.scale_inv = canonical_div(1.0f, scale);
}

template <te_dtype kIn, te_dtype kFp8>
te_status launch_rowwise(const QuantizeArgs &a, cudaStream_t stream, int sms) {
  const int64_t n = a.rows * a.cols;
  const bool vectorized = aligned(a.input, 16) && aligned(a.rowwise, 8);
  const int64_t per_block = static_cast<int64_t>(kFlatThreads) * (vectorized ? 8 * kFlatUnroll : 1);
  const int64_t blocks = std::min<int64_t>(ceil_div(n, per_block), static_cast<int64_t>(sms) * kFlatBlocksPerSm);
  quantize_kernel<kIn, kFp8><<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), kFlatThreads, 0, stream>>>(
      a.input, a.rowwise, a.scale, a.scale_inv, a.amax, n, vectorized);
  return launch_status(kOp);
}

// The casts + transposes of `args` (at most kMaxJobs, one input dtype and FP8 format) in one
// launch, each with as many blocks as tiles (one launch of up to INT_MAX blocks in all).
template <te_dtype kIn, te_dtype kFp8>
te_status launch_transpose(const QuantizeArgs *const *args, int count, cudaStream_t stream) {
  TransposeJobs jobs{};
  jobs.count = count;
  int64_t blocks = 0;
  for (int j = 0; j < count; ++j) {
    const QuantizeArgs &a = *args[j];
    TransposeJob &job = jobs.job[j];
    job = TransposeJob{a.input, a.rowwise, a.columnwise, a.scale, a.scale_inv, a.amax, a.rows, a.cols,
                       ceil_div(a.cols, kTile)};
    job.num_tiles = ceil_div(a.rows, kTile) * job.tiles_c;
    job.first_block = blocks;
    job.blocks = std::min<int64_t>(job.num_tiles, INT_MAX / kMaxJobs);
    blocks += job.blocks;
  }
  quantize_transpose_kernel<kIn, kFp8><<<static_cast<unsigned>(blocks), kTileThreads, 0, stream>>>(jobs);
  return launch_status(kOp);
}

// The fast cast + transpose needs whole 8x8 patches, whole 16-byte units of the transposed rows,
// and aligned vectors.
bool transpose_fast_path(const QuantizeArgs &a) {
  return a.rows % 16 == 0 && a.cols % 8 == 0 && aligned(a.input, 16) &&
         (a.rowwise == nullptr || aligned(a.rowwise, 8)) && aligned(a.columnwise, 16);
}

// The blocks atomicMax into amax: zero it first on the stream, unless the caller asked to raise
// the value it holds.
te_status zero_amax(const QuantizeArgs &a, cudaStream_t stream) {
  if (a.amax == nullptr || a.accumulate_amax) return TE_SUCCESS;
  return cuda_status(kOp, cudaMemsetAsync(a.amax, 0, sizeof(float), stream));
}

template <typename Body>
te_status with_dtypes(const QuantizeArgs &a, Body &&body) {
  return with_hp_dtype(a.input_dtype, [&](auto in) {
    return with_fp8_dtype(a.fp8_dtype, [&](auto fp8) { return body(in, fp8); });
  });
}

// Whether the fast kernels take the call (the rest goes to the tiled kernels of quantize_block.cu).
bool fast_kernels_take(const QuantizeArgs &a) {
  return a.mode == TE_SCALING_TENSOR && a.rows * a.cols > 0 && (a.columnwise == nullptr || transpose_fast_path(a));
}

}  // namespace

te_status quantize_cuda(const QuantizeArgs &a, te_stream stream_handle) {
  if (!fast_kernels_take(a)) return quantize_tiled_cuda(a, stream_handle);
  const cudaStream_t stream = cuda_stream(stream_handle);
  if (te_status s = zero_amax(a, stream)) return s;
  if (a.columnwise != nullptr) {
    const QuantizeArgs *one = &a;
    return with_dtypes(a, [&](auto in, auto fp8) {
      return launch_transpose<decltype(in)::value, decltype(fp8)::value>(&one, 1, stream);
    });
  }
  int sms = 0;
  if (te_status s = sm_count(kOp, &sms)) return s;
  return with_dtypes(a, [&](auto in, auto fp8) {
    return launch_rowwise<decltype(in)::value, decltype(fp8)::value>(a, stream, sms);
  });
}

te_status quantize_many_cuda(const QuantizeArgs *args, size_t count, te_stream stream_handle) {
  const cudaStream_t stream = cuda_stream(stream_handle);
  std::vector<bool> done(count, false);
  for (size_t i = 0; i < count; ++i) {
    if (done[i]) continue;
    const QuantizeArgs &a = args[i];
    if (!fast_kernels_take(a) || a.columnwise == nullptr) {
      if (te_status s = quantize_cuda(a, stream_handle)) return s;
      continue;
    }
    // The casts + transposes with a's dtypes, up to kMaxJobs, in one launch.
    const QuantizeArgs *batch[kMaxJobs];
    int n = 0;
    for (size_t j = i; j < count && n < kMaxJobs; ++j) {
      const QuantizeArgs &b = args[j];
      if (done[j] || !fast_kernels_take(b) || b.columnwise == nullptr || b.input_dtype != a.input_dtype ||
          b.fp8_dtype != a.fp8_dtype) {
        continue;
      }
      if (te_status s = zero_amax(b, stream)) return s;
      batch[n++] = &b;
      done[j] = true;
    }
    te_status s = with_dtypes(a, [&](auto in, auto fp8) {
      return launch_transpose<decltype(in)::value, decltype(fp8)::value>(batch, n, stream);
    });
    if (s != TE_SUCCESS) return s;
  }
  return TE_SUCCESS;
}

}  // namespace te
