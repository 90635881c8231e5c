// CUDA delayed-scaling update: for every column of every amax history, the amax (max or most
// recent), the new scale and scale_inv, and the roll of the history, in one launch.
//
// Design. The group descriptors travel by value in the kernel's parameters (a __grid_constant__
// struct of fixed capacity: 16 groups, or 256 for larger calls, several launches beyond that),
// so there is no device allocation, no copy and nothing to synchronise: the launch is
// CUDA-graph capturable. Each block of 256 threads takes `cols_per_block` consecutive columns of
// one group (a power of two <= 32, chosen per group so that a block covers the whole history in
// one or a few passes: 1 column of a 1024-long history, 32 columns of a short one) and finds its
// group by binary search over the groups' first block. Threads are laid out as
// cols_per_block columns x (256 / cols_per_block) history rows, so consecutive threads read
// consecutive columns of a row.
//   1. Read pass: history[0], with the step's amax recorded into it where the caller gives one
//      (recorded_amax; kept in a register, the roll stores it), and the amax bits over the column
//      (max of abs_bits, NaN on top, as the reference); reduced across the block in shared memory; one thread per column writes
//      scale and scale_inv.
//   2. Roll in place, new[i] = old[i + 1], new[H - 1] = old[0], new[0] = 0, by chunks of
//      kValsPerThread rows per thread: read the chunk's sources, barrier, write. Chunk k reads
//      rows up to its end + 1, which the next chunk writes only after its own barrier, and writes
//      nothing a later chunk reads, so no history length limit is needed.
// Groups must not share history buffers (the reference would roll a shared one twice, in order;
// here the blocks would race).
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "scaling/scaling_impl.h"

namespace te {
namespace {

constexpr int kThreads = 256;
constexpr int kValsPerThread = 4;  // history rows per thread per roll pass

struct GroupDesc {
  float *history;
  float *scale;
  float *scale_inv;
  const float *step_amax;  // or null
  float fp8_max;
  int64_t history_len;
  int64_t columns;
  int64_t first_block;
  int32_t cols_per_block;
};

template <int kCapacity>
struct Batch {
  GroupDesc groups[kCapacity];
  int32_t count;
  int32_t margin;
  bool algo_max;
};

template <int kCapacity>
__global__ void __launch_bounds__(kThreads) delayed_scaling_update_kernel(const __grid_constant__ Batch<kCapacity> b) {
  __shared__ uint32_t partial[kThreads];
  // The last group whose first block is <= this block (groups with no column were dropped).
  int lo = 0, hi = b.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.groups[mid].first_block <= static_cast<int64_t>(blockIdx.x)) lo = mid; else hi = mid - 1;
  }
  const GroupDesc &g = b.groups[lo];
  const int cpb = g.cols_per_block, rows_per_pass = kThreads / cpb;
  const int tx = threadIdx.x % cpb, ty = threadIdx.x / cpb;
  const int64_t n = g.columns, h = g.history_len;
  const int64_t j = (static_cast<int64_t>(blockIdx.x) - g.first_block) * cpb + tx;
  const bool active = j < n;
  float *col = g.history + j;  // element i of this column is col[i * n]

  uint32_t m = 0;
  float first = 0.0f;  // slot 0 with the step's amax recorded: read here, never written back
  if (active) {
    first = g.step_amax != nullptr ? recorded_amax(col[0], g.step_amax[j]) : col[0];
    if (b.algo_max) {
      for (int64_t i = ty; i < h; i += rows_per_pass) m = max(m, abs_bits(i == 0 ? first : col[i * n]));
    } else {
      m = abs_bits(first);
    }
  }
  partial[threadIdx.x] = m;
  __syncthreads();  // also: every read of pass 1 is done before the roll writes
  if (active && ty == 0) {
    for (int k = 1; k < rows_per_pass; ++k) m = max(m, partial[k * cpb + tx]);
    const float s = delayed_scale(bits_float(m), g.scale[j], g.fp8_max, b.margin);
    g.scale[j] = s;
    g.scale_inv[j] = canonical_div(1.0f, s);
  }

  const int64_t chunk = static_cast<int64_t>(rows_per_pass) * kValsPerThread;
  for (int64_t base = 0; base < h; base += chunk) {
    float v[kValsPerThread];
#pragma unroll
    for (int k = 0; k < kValsPerThread; ++k) {
      const int64_t i = base + ty + static_cast<int64_t>(k) * rows_per_pass;
      v[k] = 0.0f;  // new[0], and filler for rows past the end
      if (active && i > 0 && i < h) v[k] = i == h - 1 ? first : col[(i + 1) * n];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kValsPerThread; ++k) {
      const int64_t i = base + ty + static_cast<int64_t>(k) * rows_per_pass;
      if (active && i < h) col[i * n] = v[k];
    }
  }
}

// Columns per block for a group: a power of two <= 32 and <= the column count (rounded up),
// halved while one roll pass would not cover the history, down to 1.
int32_t cols_per_block(int64_t history_len, int64_t columns) {
  int32_t c = 1;
  while (c < 32 && c < columns) c *= 2;
  while (c > 1 && static_cast<int64_t>(kThreads / c) * kValsPerThread < history_len) c /= 2;
  return c;
}

template <int kCapacity>
te_status launch_batch(const DelayedScalingArgs &a, const GroupDesc *groups, int count, int64_t blocks,
                       cudaStream_t stream) {
  Batch<kCapacity> b{};
  std::copy(groups, groups + count, b.groups);
  b.count = count;
  b.margin = a.margin;
  b.algo_max = a.algo == TE_AMAX_COMPUTE_MAX;
  delayed_scaling_update_kernel<kCapacity><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(b);
  return launch_status("delayed_scaling_update");
}

}  // namespace

te_status delayed_scaling_update_cuda(const DelayedScalingArgs &a, te_stream stream_handle) {
  constexpr int kSmall = 16, kLarge = 256;
  constexpr int64_t kMaxBlocks = 0x7FFFFFFF;
  const char *op = "delayed_scaling_update";
  const cudaStream_t stream = cuda_stream(stream_handle);
  GroupDesc batch[kLarge];
  int count = 0;
  int64_t blocks = 0;
  auto flush = [&]() -> te_status {
    if (count == 0) return TE_SUCCESS;
    const te_status s = count <= kSmall ? launch_batch<kSmall>(a, batch, count, blocks, stream)
                                        : launch_batch<kLarge>(a, batch, count, blocks, stream);
    count = 0;
    blocks = 0;
    return s;
  };
  // Validate everything before the first launch: nothing is written on failure.
  for (size_t i = 0; i < a.num_groups; ++i) {
    const DelayedScalingGroup &g = a.groups[i];
    if (ceil_div(g.columns, cols_per_block(g.history_len, g.columns)) > kMaxBlocks) {
      return fail(TE_ERROR_UNSUPPORTED, op, "amax_histories[" + std::to_string(i) +
                                                "] must have at most 2^31 - 1 blocks of columns, got " +
                                                std::to_string(g.columns) + " columns");
    }
  }
  for (size_t i = 0; i < a.num_groups; ++i) {
    const DelayedScalingGroup &g = a.groups[i];
    if (g.columns == 0) continue;
    const int32_t cpb = cols_per_block(g.history_len, g.columns);
    const int64_t need = ceil_div(g.columns, cpb);
    if (count == kLarge || blocks + need > kMaxBlocks) {
      if (te_status s = flush()) return s;
    }
    batch[count++] = GroupDesc{g.history, g.scale, g.scale_inv, g.step_amax, g.fp8_max,
                               g.history_len, g.columns, blocks, cpb};
    blocks += need;
  }
  return flush();
}

}  // namespace te
