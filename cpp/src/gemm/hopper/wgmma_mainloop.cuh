// The consumer side of our hand-written Hopper GEMM (block_scaled_wgmma.cu): how a consumer
// warpgroup walks the ring of k-block stages that the producer fills, issues its WGMMAs on them,
// frees them, and accumulates, in the kernel's three mainloops (per-tensor scales; block scales
// with one set of block sums; block scales with two, overlapped). Device code only, over
// wgmma_primitives.cuh.
//
// A consumer owns 64 rows of the tile; per k-block (K = 128, the scale block) it reads its rows
// of the stage's A tile and kHalves 128-row B tiles (each 128 x 128 FP8, 16 KiB, 128-byte
// swizzle). Its accumulators are WGMMA fragments: 64 floats per 64 x 128 piece.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_WGMMA_MAINLOOP_CUH_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_WGMMA_MAINLOOP_CUH_

#include <cstdint>

#include "gemm/hopper/wgmma_primitives.cuh"

namespace te {
namespace hopper {

constexpr int kBlockK = 128;
constexpr uint32_t kTileBytes = 128 * kBlockK;  // a 128 x 128 k-block tile: 16 KiB of FP8

// A place in the ring of stages (the producer's or a consumer's).
template <int kStages>
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// A consumer thread's scale rows: A's for its two fragment rows, B's for one 128-column half of
// the tile.
struct Scales {
  const float *a0, *a1, *b;
  // The promotion factors of k-block kb for the two rows: sa * sb, as CUTLASS's blockwise
  // mainloop forms them.
  __device__ __forceinline__ float2 at(int kb) const {
    const float sb = __ldg(b + kb);
    return make_float2(__ldg(a0 + kb) * sb, __ldg(a1 + kb) * sb);
  }
};

__device__ __forceinline__ void fence_block(float (&part)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) ptx::register_fence(part[i]);
}

// The four WGMMAs of one k-block (K = 128 as four k32 steps) of a 64 x 128 piece: into d, which
// the first one overwrites when `fresh`, else added to d. Not committed.
__device__ __forceinline__ void issue_wgmmas(float (&d)[64], const uint8_t *a, const uint8_t *b,
                                             bool fresh) {
#pragma unroll
  for (int k = 0; k < kBlockK / 32; ++k) {
    ptx::wgmma_m64n128k32(d, ptx::wgmma_descriptor(a + k * 32), ptx::wgmma_descriptor(b + k * 32),
                          fresh ? k : 1);
  }
}

// One k-block's WGMMAs into the block sum part, committed as a group.
__device__ __forceinline__ void issue_block(float (&part)[64], const uint8_t *a, const uint8_t *b) {
  fence_block(part);
  ptx::wgmma_fence();
  issue_wgmmas(part, a, b, true);
  ptx::wgmma_commit();
  fence_block(part);
}

// acc += part * scale of its row (fragment elements with bit 1 set are the second row).
__device__ __forceinline__ void promote(float (&acc)[64], const float (&part)[64], float2 scale) {
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = fmaf(part[i], (i & 2) ? scale.y : scale.x, acc[i]);
}

// The stage is read: free it for this CTA's producer and, in a cluster, the other CTA's (which
// multicasts its half of A into it). One arrival per warp and CTA.
template <int kCluster>
__device__ __forceinline__ void release_stage(uint64_t *empty, int stage, int lane) {
  if constexpr (kCluster > 1) {
    if (lane < kCluster) ptx::mbarrier_arrive_cluster(&empty[stage], lane);
  } else {
    if (lane == 0) ptx::mbarrier_arrive(&empty[stage]);
  }
}

// The overlapped mainloop's steps (128-column tiles: one B tile per stage). Each keeps one
// block's WGMMAs in flight: `issue` issues block 0; `step` issues the next block into cur, then
// waits for the block before it (in prev), frees its stage and promotes it; `finish` waits for
// the last block (in prev) and promotes it. The loop around them has the same block sums in
// flight on every path, so that ptxas can see that a promotion never reads registers a WGMMA
// is still writing (else it serializes the WGMMAs).
template <int kCluster, int kStages>
struct Overlapped {
  Ring<kStages> ring;
  int pending_stage = 0;
  float2 pending_scale;
  const Scales &scales;
  uint64_t *full, *empty;
  const uint8_t *a, *b;
  int lane;

  __device__ __forceinline__ void issue(float (&cur)[64], int kb) {
    const float2 scale = scales.at(kb);
    ptx::mbarrier_wait(&full[ring.stage], ring.phase);
    issue_block(cur, a + ring.stage * kTileBytes, b + ring.stage * kTileBytes);
    pending_stage = ring.stage;
    pending_scale = scale;
    ring.advance();
  }
  __device__ __forceinline__ void retire(float (&acc)[64], float (&prev)[64], int stage,
                                         float2 scale) {
    fence_block(prev);
    release_stage<kCluster>(empty, stage, lane);
    promote(acc, prev, scale);
  }
  __device__ __forceinline__ void step(float (&acc)[64], float (&cur)[64], float (&prev)[64],
                                       int kb) {
    const int stage = pending_stage;
    const float2 scale = pending_scale;
    issue(cur, kb);
    ptx::wgmma_wait<1>();
    retire(acc, prev, stage, scale);
  }
  __device__ __forceinline__ void finish(float (&acc)[64], float (&prev)[64]) {
    ptx::wgmma_wait<0>();
    retire(acc, prev, pending_stage, pending_scale);
  }
};

// Where a consumer warpgroup finds its k-block tiles and how it frees them: its 64 rows of each
// A stage, the B stages (kHalves 128-row tiles each), the barriers, and its lane.
struct ConsumerStages {
  const uint8_t *a, *b;
  uint64_t *full, *empty;
  int lane;
};

// Per-tensor scales: the WGMMAs add every k-block into acc (the tensor cores' own accumulation,
// cuBLASLt's fast accumulation), one k-block's group in flight while the next is issued; the
// scales multiply D once, in the epilogue.
template <int kCluster, int kHalves, int kStages>
__device__ __forceinline__ void tensor_mainloop(float (&acc)[kHalves][64], Ring<kStages> &ring,
                                                const ConsumerStages &at, int kblocks) {
  int previous = -1;
  for (int kb = 0; kb < kblocks; ++kb) {
    ptx::mbarrier_wait(&at.full[ring.stage], ring.phase);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) fence_block(acc[h]);
    ptx::wgmma_fence();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      issue_wgmmas(acc[h], at.a + ring.stage * kTileBytes,
                   at.b + (ring.stage * kHalves + h) * kTileBytes, false);
    }
    ptx::wgmma_commit();
#pragma unroll
    for (int h = 0; h < kHalves; ++h) fence_block(acc[h]);
    ptx::wgmma_wait<1>();
    if (previous >= 0) release_stage<kCluster>(at.empty, previous, at.lane);
    previous = ring.stage;
    ring.advance();
  }
  ptx::wgmma_wait<0>();
#pragma unroll
  for (int h = 0; h < kHalves; ++h) fence_block(acc[h]);
  if (previous >= 0) release_stage<kCluster>(at.empty, previous, at.lane);
}

// Block scales, one set of block sums: per k-block and 128-column half, the WGMMAs into part,
// wait, promote into the half's accumulators (the other consumer's WGMMAs keep the tensor cores
// busy meanwhile).
template <int kCluster, int kHalves, int kStages>
__device__ __forceinline__ void serial_mainloop(float (&acc)[kHalves][64], float (&part)[64],
                                                const Scales (&scales)[kHalves],
                                                Ring<kStages> &ring, const ConsumerStages &at,
                                                int kblocks) {
  for (int kb = 0; kb < kblocks; ++kb) {
    float2 scale[kHalves];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) scale[h] = scales[h].at(kb);
    ptx::mbarrier_wait(&at.full[ring.stage], ring.phase);
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
      issue_block(part, at.a + ring.stage * kTileBytes,
                  at.b + (ring.stage * kHalves + h) * kTileBytes);
      ptx::wgmma_wait<0>();
      fence_block(part);
      if (h == kHalves - 1) release_stage<kCluster>(at.empty, ring.stage, at.lane);
      promote(acc[h], part, scale[h]);
    }
    ring.advance();
  }
}

// Block scales, two sets of block sums (128-column tiles): block kb's WGMMAs are issued before
// block kb - 1 is promoted, into the other set, so that this warpgroup's tensor-core work goes
// on during its promotion.
template <int kCluster, int kStages>
__device__ __forceinline__ void overlapped_mainloop(float (&acc)[64], float (&part)[64],
                                                    float (&part2)[64], const Scales &scales,
                                                    Ring<kStages> &ring, const ConsumerStages &at,
                                                    int kblocks) {
  Overlapped<kCluster, kStages> o{ring, 0, make_float2(0.0f, 0.0f), scales, at.full, at.empty, at.a, at.b, at.lane};
  o.issue(part, 0);
  int kb = 1;
  for (; kb + 1 < kblocks; kb += 2) {
    o.step(acc, part2, part, kb);
    o.step(acc, part, part2, kb + 1);
  }
  if (kb < kblocks) {
    o.step(acc, part2, part, kb);
    o.finish(acc, part2);
  } else {
    o.finish(acc, part);
  }
  ring = o.ring;
}

}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_WGMMA_MAINLOOP_CUH_
