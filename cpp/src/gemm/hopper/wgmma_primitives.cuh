// Hopper's asynchronous machinery as small device functions over inline PTX (sm_90a): mbarriers,
// TMA tile loads (plain and multicast to a cluster), WGMMA shared-memory descriptors and the
// FP8 m64n128k32 WGMMA, and the cluster and register-allocation instructions that a
// warp-specialized kernel needs. Used by block_scaled_wgmma.cu; each function is one or a few
// PTX instructions, named after what it does.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_WGMMA_PRIMITIVES_CUH_
#define TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_WGMMA_PRIMITIVES_CUH_

#include <cuda.h>  // CUtensorMap

#include <cstdint>

namespace te {
namespace hopper {
namespace ptx {

__device__ __forceinline__ uint32_t smem_address(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- mbarriers (64-bit barrier objects in shared memory) ---

__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals));
}

// Makes the initialized barriers visible to the cluster (and to the TMA unit).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also announces bytes the TMA unit will deliver in this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
               "r"(bytes)
               : "memory");
}

// One arrival on the barrier at bar's offset in the shared memory of cluster CTA `cta` (this
// CTA's own when cta is its rank). At the default CTA scope: the consumers free a stage whose
// reads (WGMMAs) have completed and they wrote nothing the other CTA reads, so there is nothing
// to release to the cluster; with .release.cluster, ptxas puts a GPU-wide memory barrier
// (MEMBAR.ALL.GPU) before every arrival.
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t *bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t *bar, uint32_t parity) {
  const uint32_t address = smem_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "selp.u32 %0, 1, 0, ready;\n"
        "}\n"
        : "=r"(done)
        : "r"(address), "r"(parity)
        : "memory");
  } while (!done);
}

// --- TMA ---

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap *map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at (inner, outer) of a 2-D tensor map into dst, completing bytes on bar.
__device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, uint64_t *bar,
                                            int32_t inner, int32_t outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// The same load delivered to dst's offset in every cluster CTA of cta_mask, completing bytes
// on each one's barrier at bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(void *dst, const CUtensorMap *map,
                                                      uint64_t *bar, int32_t inner, int32_t outer,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%4, %5}], [%2], %3;" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_address(bar)), "h"(cta_mask), "r"(inner),
      "r"(outer)
      : "memory");
}

// --- cluster and registers ---

__device__ __forceinline__ uint32_t cluster_cta_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every thread of every CTA of the cluster meets here (shared-memory writes released before).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

template <int kRegisters>
__device__ __forceinline__ void registers_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void registers_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

// --- WGMMA ---

// The descriptor of a K-major operand tile in shared memory written by TMA with 128-byte
// swizzling: rows of 128 bytes (128 FP8 values of K), in 1024-byte groups of 8 rows (the
// swizzle atom), the tile 1024-byte aligned. Fields: start address / 16 (bits 0-13), leading
// byte offset (bits 16-29; unused for a swizzled K-major operand whose K step stays inside the
// 128-byte row, set to 1), stride byte offset / 16 = 1024 / 16 between 8-row groups (bits
// 32-45), swizzle mode 1 = 128 bytes (bits 62-63). A K step of 32 FP8 values is an address
// 32 bytes further: the swizzle is applied to the absolute address, so the same descriptor
// fields hold.
__device__ __forceinline__ uint64_t wgmma_descriptor(const void *tile) {
  const uint64_t address = smem_address(tile);
  return ((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of an accumulator register across the
// asynchronous WGMMAs that own it.
__device__ __forceinline__ void register_fence(float &r) { asm volatile("" : "+f"(r)::"memory"); }

// One m64n128k32 E4M3 x E4M3 -> fp32 WGMMA of the calling warpgroup: d = A * B^T + (d when
// accumulate is non-zero), A and B read from shared memory through their descriptors.
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred keep;\n"
      "setp.ne.b32 keep, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, keep, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

}  // namespace ptx
}  // namespace hopper
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_HOPPER_WGMMA_PRIMITIVES_CUH_
