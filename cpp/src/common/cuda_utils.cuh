// Helpers shared by the CUDA kernels: stream and error plumbing, dtype dispatch, vector loads
// and stores, max reductions on amax bits, the fp32 -> FP8 conversion, the 8x8 byte transpose.
//
// Every value that a kernel writes must equal, bit for bit, what the CPU reference writes. The
// conversions themselves come from common/numerics.h; this file adds only what the GPU needs
// on top: the hardware FP8 conversion, with its NaN pattern pinned to the reference's.
#ifndef TRANSFORMER_ENGINE_SRC_COMMON_CUDA_UTILS_CUH_
#define TRANSFORMER_ENGINE_SRC_COMMON_CUDA_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/internal.h"
#include "common/numerics.h"
#include "transformer_engine/tensor.h"

namespace te {

// ---------------------------------------------------------------------------------------------
// Host side: streams, errors, device facts, dtype dispatch.

inline cudaStream_t cuda_stream(te_stream stream) { return reinterpret_cast<cudaStream_t>(stream); }

inline te_status cuda_status(const char *op, cudaError_t err) {
  if (err == cudaSuccess) return TE_SUCCESS;
  return fail(TE_ERROR_RUNTIME, op,
              std::string("CUDA error ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// Status of the launches just made (cudaGetLastError also clears a pending launch error).
inline te_status launch_status(const char *op) { return cuda_status(op, cudaGetLastError()); }

// Number of SMs of the current device, queried once per device (grid sizing only).
inline te_status sm_count(const char *op, int *count) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int device = 0;
  if (te_status s = cuda_status(op, cudaGetDevice(&device))) return s;
  if (device >= 0 && device < kMaxDevices) {
    const int cached = cache[device].load(std::memory_order_relaxed);
    if (cached > 0) {
      *count = cached;
      return TE_SUCCESS;
    }
  }
  int n = 0;
  if (te_status s = cuda_status(op, cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device))) {
    return s;
  }
  if (device >= 0 && device < kMaxDevices) cache[device].store(n, std::memory_order_relaxed);
  *count = n;
  return TE_SUCCESS;
}

// The dynamic shared memory a block of `kernel` may take on the current device: the device's
// opt-in maximum less the kernel's static shared memory. The kernel's limit is raised to it
// once per device (raising it per call to the size at hand would lower it for a later, larger
// call).
template <typename Kernel>
te_status dynamic_smem_limit(const char *op, Kernel kernel, size_t *limit) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void *>, size_t> cache;
  int device = 0;
  if (te_status st = cuda_status(op, cudaGetDevice(&device))) return st;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, reinterpret_cast<const void *>(kernel));
  auto it = cache.find(key);
  if (it == cache.end()) {
    int optin = 0;
    cudaFuncAttributes attr{};
    if (te_status st = cuda_status(op, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device))) {
      return st;
    }
    if (te_status st = cuda_status(op, cudaFuncGetAttributes(&attr, kernel))) return st;
    const size_t room = static_cast<size_t>(optin) > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
    if (te_status st = cuda_status(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            static_cast<int>(room)))) {
      return st;
    }
    it = cache.emplace(key, room).first;
  }
  *limit = it->second;
  return TE_SUCCESS;
}

// Blocks of `threads` with `smem` bytes of dynamic shared memory (within dynamic_smem_limit,
// which the caller has asked for first) that stay resident per SM; asked once per size.
template <typename Kernel>
te_status resident_blocks(const char *op, Kernel kernel, int threads, size_t smem, int *per_sm) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void *, size_t>, int> cache;
  int device = 0;
  if (te_status st = cuda_status(op, cudaGetDevice(&device))) return st;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, reinterpret_cast<const void *>(kernel), smem);
  auto it = cache.find(key);
  if (it == cache.end()) {
    int n = 0;
    if (te_status st = cuda_status(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem))) {
      return st;
    }
    it = cache.emplace(key, std::max(n, 1)).first;
  }
  *per_sm = it->second;
  return TE_SUCCESS;
}

// How many blocks of `kernel` (`threads` each, `smem` bytes of dynamic shared memory) the
// device holds at once, for kernels whose blocks stride over their work; *fits is false (and
// *capacity 0) when `smem` is more than the kernel may take.
template <typename Kernel>
te_status resident_capacity(const char *op, Kernel kernel, int threads, size_t smem, int64_t *capacity, bool *fits) {
  size_t limit = 0;
  *capacity = 0;
  if (te_status st = dynamic_smem_limit(op, kernel, &limit)) return st;
  *fits = smem <= limit;
  if (!*fits) return TE_SUCCESS;
  int sms = 0, per_sm = 0;
  if (te_status st = sm_count(op, &sms)) return st;
  if (te_status st = resident_blocks(op, kernel, threads, smem, &per_sm)) return st;
  *capacity = static_cast<int64_t>(sms) * per_sm;
  return TE_SUCCESS;
}

// ceil_div for device code (internal.h's is host-only).
__host__ __device__ __forceinline__ int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline bool aligned(const void *p, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

template <te_dtype kDtype>
using DtypeTag = std::integral_constant<te_dtype, kDtype>;

// Calls body(DtypeTag<d>{}) for a high-precision dtype d (the entry points checked it).
template <typename Body>
te_status with_hp_dtype(te_dtype dtype, Body &&body) {
  switch (dtype) {
    case TE_DTYPE_FLOAT32: return body(DtypeTag<TE_DTYPE_FLOAT32>{});
    case TE_DTYPE_FLOAT16: return body(DtypeTag<TE_DTYPE_FLOAT16>{});
    default: return body(DtypeTag<TE_DTYPE_BFLOAT16>{});
  }
}

// Calls body(DtypeTag<d>{}) for an FP8 dtype d (E4M3 or E5M2).
template <typename Body>
te_status with_fp8_dtype(te_dtype dtype, Body &&body) {
  if (dtype == TE_DTYPE_FLOAT8_E4M3) return body(DtypeTag<TE_DTYPE_FLOAT8_E4M3>{});
  return body(DtypeTag<TE_DTYPE_FLOAT8_E5M2>{});
}

// ---------------------------------------------------------------------------------------------
// High-precision elements: storage type, decode (as load_hp does), encode (as store_hp does).

template <te_dtype kDtype>
struct Hp;

template <>
struct Hp<TE_DTYPE_FLOAT32> {
  using Storage = float;
  static __device__ __forceinline__ float decode(float v) { return v; }
  static __device__ __forceinline__ float encode(float v) { return v; }
};

template <>
struct Hp<TE_DTYPE_BFLOAT16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float decode(uint16_t v) { return bf16_to_float(v); }
  static __device__ __forceinline__ uint16_t encode(float v) { return float_to_bf16(v); }
};

template <>
struct Hp<TE_DTYPE_FLOAT16> {
  using Storage = uint16_t;
  static __device__ __forceinline__ float decode(uint16_t v) { return fp16_to_float(v); }
  static __device__ __forceinline__ uint16_t encode(float v) { return float_to_fp16(v); }
};

// Element i of a high-precision array, decoded.
template <te_dtype kIn>
__device__ __forceinline__ float load_hp1(const void *p, int64_t i) {
  using S = typename Hp<kIn>::Storage;
  return Hp<kIn>::decode(static_cast<const S *>(p)[i]);
}

// Elements [i, i + 4), decoded; p + i must be 4-element aligned (8 bytes for 16-bit types,
// 16 bytes for fp32), so the load is one 64-bit or 128-bit access.
template <te_dtype kIn>
__device__ __forceinline__ void load_hp4(const void *p, int64_t i, float (&x)[4]) {
  if constexpr (kIn == TE_DTYPE_FLOAT32) {
    const float4 v = *reinterpret_cast<const float4 *>(static_cast<const float *>(p) + i);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2 *>(static_cast<const uint16_t *>(p) + i);
    // Little endian: the element with the lower index is the lower half of each word.
    x[0] = Hp<kIn>::decode(static_cast<uint16_t>(v.x)), x[1] = Hp<kIn>::decode(static_cast<uint16_t>(v.x >> 16));
    x[2] = Hp<kIn>::decode(static_cast<uint16_t>(v.y)), x[3] = Hp<kIn>::decode(static_cast<uint16_t>(v.y >> 16));
  }
}

// The 8 elements of a 16-bit type packed in v, decoded (little endian: the element with the
// lower index is the lower half of each word).
template <te_dtype kIn>
__device__ __forceinline__ void decode_hp8(const uint4 &v, float (&x)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = Hp<kIn>::decode(static_cast<uint16_t>(w[k]));
    x[2 * k + 1] = Hp<kIn>::decode(static_cast<uint16_t>(w[k] >> 16));
  }
}

// Elements [i, i + 8), decoded; p + i must be 16-byte aligned: one 128-bit load for 16-bit
// types, two for fp32.
template <te_dtype kIn>
__device__ __forceinline__ void load_hp8(const void *p, int64_t i, float (&x)[8]) {
  if constexpr (kIn == TE_DTYPE_FLOAT32) {
    const float4 *q = reinterpret_cast<const float4 *>(static_cast<const float *>(p) + i);
    const float4 a = q[0], b = q[1];
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
    decode_hp8<kIn>(*reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(p) + i), x);
  }
}

// Two 16-bit halves of w (bf16, else fp16) with every NaN set to the reference's one pattern
// (float_to_bf16: 0x7FC0, float_to_fp16: 0x7E00), whatever its sign and payload.
template <bool kBf16>
__device__ __forceinline__ uint32_t canonical_hp_nan2(uint32_t w) {
  constexpr uint32_t kInf = kBf16 ? 0x7F80u : 0x7C00u;
  constexpr uint32_t kNaN = kBf16 ? 0x7FC07FC0u : 0x7E007E00u;
  // Adding 0x8000 - (inf + 1) to a half's magnitude sets its bit 15 exactly when it is a NaN
  // (no carry leaves the half: 0x7FFF plus the addend stays below 0x10000).
  constexpr uint32_t kBias = (0x8000u - (kInf + 1)) * 0x00010001u;
  const uint32_t top = ((w & 0x7FFF7FFFu) + kBias) & 0x80008000u;
  const uint32_t mask = top | (top - (top >> 15));  // 0xFFFF in NaN halves
  return (w & ~mask) | (kNaN & mask);
}

// 8 values packed as bf16 (kBf16) or fp16 by the hardware's conversion, one instruction per
// two values: it rounds to nearest even, keeps subnormals and overflows to infinity exactly as
// float_to_bf16 and float_to_fp16 do, and differs from them only in NaN's pattern, which a
// vector that may hold a NaN (nan) gets replaced with the reference's. The software
// conversions cost 6 to 12 integer instructions a value, in kernels that are issue-bound.
template <bool kBf16>
__device__ __forceinline__ uint4 pack_hp8(const float (&v)[8], bool nan) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (kBf16) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
      w[k] = *reinterpret_cast<const uint32_t *>(&h);
    } else {
      const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
      w[k] = *reinterpret_cast<const uint32_t *>(&h);
    }
  }
  if (nan) {
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = canonical_hp_nan2<kBf16>(w[k]);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 values as the 16-bit dtype d (bf16, else fp16) packed by pack_hp8; the branch on d (uniform
// across a grid) comes before the conversion, so that only one is issued.
__device__ __forceinline__ uint4 pack_hp16x8(te_dtype d, const float (&v)[8], bool nan) {
  return d == TE_DTYPE_BFLOAT16 ? pack_hp8<true>(v, nan) : pack_hp8<false>(v, nan);
}

// 8 high-precision values at p + i (16-byte aligned) in dtype d, with the reference's bits:
// 16-bit ones by pack_hp16x8, fp32 ones as they are, each NaN as kCanonicalNaN where nan says
// one may be there (a NaN max |v|, say).
__device__ __forceinline__ void store_hp8(void *p, int64_t i, te_dtype d, const float (&v)[8], bool nan) {
  if (d != TE_DTYPE_FLOAT32) {
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p) + i) = pack_hp16x8(d, v, nan);
    return;
  }
  float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p) + i);
  if (nan) {
    q[0] = make_float4(canonical(v[0]), canonical(v[1]), canonical(v[2]), canonical(v[3]));
    q[1] = make_float4(canonical(v[4]), canonical(v[5]), canonical(v[6]), canonical(v[7]));
  } else {
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// 8 consecutive high-precision elements as loaded, decoded later: loads are issued before any
// arithmetic, and 16-bit types stay packed (4 registers) until then.
template <te_dtype kIn>
struct Packed8 {
  uint4 raw;
  __device__ __forceinline__ void load(const void *p, int64_t i) {
    raw = *reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(p) + i);
  }
  __device__ __forceinline__ void zero() { raw = make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ void decode(float (&x)[8]) const { decode_hp8<kIn>(raw, x); }
};

template <>
struct Packed8<TE_DTYPE_FLOAT32> {
  float4 a, b;
  __device__ __forceinline__ void load(const void *p, int64_t i) {
    const float4 *q = reinterpret_cast<const float4 *>(static_cast<const float *>(p) + i);
    a = q[0];
    b = q[1];
  }
  __device__ __forceinline__ void zero() { a = b = make_float4(0.f, 0.f, 0.f, 0.f); }
  __device__ __forceinline__ void decode(float (&x)[8]) const {
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  }
};

// Asynchronous 16-byte copies from global into shared memory (sm_80+), in commit groups: a
// thread that reads back only what it copied itself needs no barrier, only its own wait.
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// 8 bytes (through the L1: cp.async.cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async8(void *smem, const void *gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's newest groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void store_u64(uint8_t *p, uint32_t lo, uint32_t hi) {
  *reinterpret_cast<uint2 *>(p) = make_uint2(lo, hi);
}

// ---------------------------------------------------------------------------------------------
// Max reductions on amax bits (see abs_bits: the uint32 order of |x| is the float order, NaN on
// top, so these propagate NaN with exactly the bits the CPU's std::max picks).

__device__ __forceinline__ uint32_t warp_max(uint32_t v) { return __reduce_max_sync(0xFFFFFFFFu, v); }

// Max over lanes that differ only in the low bits of the lane id (groups of kWidth lanes).
template <int kWidth>
__device__ __forceinline__ uint32_t group_max(uint32_t v) {
#pragma unroll
  for (int d = 1; d < kWidth; d *= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, d));
  return v;
}

// Max over the block; every thread must call it, and all get the result. scratch: one word per
// warp. Ends with a barrier, so scratch may be reused right after.
template <int kThreads>
__device__ __forceinline__ uint32_t block_max(uint32_t v, uint32_t *scratch) {
  constexpr int kWarps = kThreads / 32;
  v = warp_max(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  uint32_t m = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = max(m, scratch[w]);
  __syncthreads();
  return m;
}

// Folds amax bits into an fp32 amax that the launcher zeroed on the stream first.
__device__ __forceinline__ void atomic_max_amax(float *amax, uint32_t bits) {
  if (bits != 0) atomicMax(reinterpret_cast<unsigned int *>(amax), bits);
}

// ---------------------------------------------------------------------------------------------
// fp32 -> FP8, four values packed into a word (the first in the lowest byte).
//
// sm_89+ has the conversion in hardware (F2FP, cvt.rn.satfinite): round to nearest even,
// saturation of finite values to the finite max, like float_to_fp8_bits. Two things differ
// from the reference and are fixed up here with integer SIMD-within-a-word, four bytes at a
// time, no branch:
// - satfinite saturates infinities too (to sign | 0x7E for E4M3, sign | 0x7B for E5M2), where
//   the reference keeps them non-finite: +-Inf in E5M2, kFp8NaN in E4M3 (fp8_inf_fixup);
// - its NaN pattern is not the reference's single kFp8NaN (0x7F): it may keep the sign (0xFF)
//   and, for E5M2, part of the payload (0x7E, 0xFE, ...). Since satfinite never turns a non-NaN
//   into a NaN or an infinity, a byte whose magnitude is above the largest finite code (0x7E
//   for E4M3, 0x7B for E5M2) came from a NaN and is set to 0x7F (canonical_fp8_nan); after
//   fp8_inf_fixup, E5M2's 0x7C/0xFC are infinities and are left alone.

template <te_dtype kFp8>
__device__ __forceinline__ uint32_t canonical_fp8_nan(uint32_t w) {
  // Adding this to a byte's magnitude sets its bit 7 exactly when the byte is a NaN code.
  constexpr uint32_t kNanBias = kFp8 == TE_DTYPE_FLOAT8_E4M3 ? 0x01010101u : 0x03030303u;
  const uint32_t nan_top = ((w & 0x7F7F7F7Fu) + kNanBias) & 0x80808080u;
  // In NaN bytes: clear the sign, set the low 7 bits (0x80 - 0x01 = 0x7F per byte, no borrow).
  return (w & ~nan_top) | (nan_top - (nan_top >> 7));
}

// w: the satfinite bytes of a, b, c, d (a in the lowest byte). Bytes whose value was +-Inf
// (which satfinite wrote as +-max) become what float_to_fp8_bits writes: E5M2 +-max + 1, its
// +-Inf; E4M3 kFp8NaN (low 7 bits set, sign cleared). Other bytes are left as they are.
template <te_dtype kFp8>
__device__ __forceinline__ uint32_t fp8_inf_fixup(uint32_t w, float a, float b, float c, float d) {
  auto inf = [](float x) -> uint32_t { return abs_bits(x) == 0x7F800000u ? 1u : 0u; };
  const uint32_t ones = inf(a) | (inf(b) << 8) | (inf(c) << 16) | (inf(d) << 24);  // 1 per Inf byte
  if (kFp8 == TE_DTYPE_FLOAT8_E5M2) return w + ones;  // 0x7B + 1 = 0x7C, no carry out of the byte
  return (w | (ones * 0x7Fu)) & ~(ones << 7);
}

// The satfinite conversion alone, NaN bytes not yet canonical: fp8x4_nan_raw's bytes whenever
// none of a..d is an infinity, for callers that know (a bound on the magnitudes) and so skip
// the fix-up (4 to 5 integer instructions a value). sm_80: the reference's own conversion.
template <te_dtype kFp8>
__device__ __forceinline__ uint32_t fp8x4_nan_raw_no_inf(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr __nv_fp8_interpretation_t kKind = kFp8 == TE_DTYPE_FLOAT8_E4M3 ? __NV_E4M3 : __NV_E5M2;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kKind);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kKind);
  return lo | (hi << 16);
#else
  auto q = [](float x) -> uint32_t {
    return kFp8 == TE_DTYPE_FLOAT8_E4M3 ? float_to_e4m3(x) : float_to_e5m2(x);
  };
  return q(a) | (q(b) << 8) | (q(c) << 16) | (q(d) << 24);
#endif
}

// The satfinite conversion with infinities fixed up, NaN bytes not yet canonical: for callers
// that canonicalize only when a NaN can be present (the reference's bits on sm_80, canonical).
template <te_dtype kFp8>
__device__ __forceinline__ uint32_t fp8x4_nan_raw(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return fp8_inf_fixup<kFp8>(fp8x4_nan_raw_no_inf<kFp8>(a, b, c, d), a, b, c, d);
#else
  return fp8x4_nan_raw_no_inf<kFp8>(a, b, c, d);  // the reference's conversion: infinities too
#endif
}

// 8 scaled values s (row-wise bytes: s[0..3] in .x, s[4..7] in .y) as fp8x4_nan_raw writes
// them, given m = max |v| of the unscaled values and |scale|. No scaled value is infinite
// where m * |scale| is finite (rounding is monotone), and then the infinity fix-up is skipped:
// 4 to 5 integer instructions a value in kernels that are issue-bound. (A NaN m or scale takes
// the fix-up path; NaN bytes are left to the caller's canonicalization.)
template <te_dtype kFp8>
__device__ __forceinline__ uint2 fp8x8_nan_raw(const float (&s)[8], float m, float abs_scale) {
  if (m * abs_scale <= kFloatMax) {
    return make_uint2(fp8x4_nan_raw_no_inf<kFp8>(s[0], s[1], s[2], s[3]),
                      fp8x4_nan_raw_no_inf<kFp8>(s[4], s[5], s[6], s[7]));
  }
  return make_uint2(fp8x4_nan_raw<kFp8>(s[0], s[1], s[2], s[3]), fp8x4_nan_raw<kFp8>(s[4], s[5], s[6], s[7]));
}

template <te_dtype kFp8>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return canonical_fp8_nan<kFp8>(fp8x4_nan_raw<kFp8>(a, b, c, d));
#else
  return fp8x4_nan_raw<kFp8>(a, b, c, d);  // already the reference's bits
#endif
}

// One value; the same instruction as fp8x4, so scalar and vector paths agree.
template <te_dtype kFp8>
__device__ __forceinline__ uint8_t fp8x1(float a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint8_t>(fp8x4<kFp8>(a, 0.0f, 0.0f, 0.0f));
#else
  return kFp8 == TE_DTYPE_FLOAT8_E4M3 ? float_to_e4m3(a) : float_to_e5m2(a);
#endif
}

template <te_dtype kFp8>
__device__ __forceinline__ float fp8_decode(uint8_t v) {
  return kFp8 == TE_DTYPE_FLOAT8_E4M3 ? e4m3_to_float(v) : e5m2_to_float(v);
}

// ---------------------------------------------------------------------------------------------
// 8x8 byte transpose in registers: row i of the patch is (lo[i], hi[i]) (bytes 0-3, 4-7);
// column c comes out as t[c] = (bytes of rows 0-3, bytes of rows 4-7). 32 byte permutes.

// 4x4 transpose of bytes: a[i] byte k -> b[k] byte i.
__device__ __forceinline__ void transpose4x4(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t &b0, uint32_t &b1, uint32_t &b2, uint32_t &b3) {
  // Interleave pairs of rows: (a0.k, a1.k) for k = 0, 1 and k = 2, 3; same for a2, a3.
  const uint32_t t0 = __byte_perm(a0, a1, 0x5140), t1 = __byte_perm(a0, a1, 0x7362);
  const uint32_t t2 = __byte_perm(a2, a3, 0x5140), t3 = __byte_perm(a2, a3, 0x7362);
  b0 = __byte_perm(t0, t2, 0x5410);
  b1 = __byte_perm(t0, t2, 0x7632);
  b2 = __byte_perm(t1, t3, 0x5410);
  b3 = __byte_perm(t1, t3, 0x7632);
}

__device__ __forceinline__ void transpose8x8(const uint32_t (&lo)[8], const uint32_t (&hi)[8], uint2 (&t)[8]) {
  transpose4x4(lo[0], lo[1], lo[2], lo[3], t[0].x, t[1].x, t[2].x, t[3].x);
  transpose4x4(lo[4], lo[5], lo[6], lo[7], t[0].y, t[1].y, t[2].y, t[3].y);
  transpose4x4(hi[0], hi[1], hi[2], hi[3], t[4].x, t[5].x, t[6].x, t[7].x);
  transpose4x4(hi[4], hi[5], hi[6], hi[7], t[4].y, t[5].y, t[6].y, t[7].y);
}

// ---------------------------------------------------------------------------------------------
// The staging of a transposed 128x128 byte tile in shared memory, shared by the fast
// quantize+transpose and the FP8 transpose: 128 rows (input columns) of 128 bytes, written as
// 8-byte chunks (one 8x8 patch column each) and read back as 16-byte units.
//
// A row is exactly the 32 banks, so without care the 16 chunks that a half-warp writes (16
// patches of one patch-row, i.e. 16 different tile rows, same chunk index) would all hit the
// same two banks. XOR-ing the chunk index with the patch column (row / 8) spreads them over all
// 32 banks, with no padding, so rows stay 16-byte aligned for the read-back.

struct __align__(16) TransposeStage {
  uint2 chunk[128][16];
};

// Chunk k (input rows 8k..8k+7) of tile row r.
__device__ __forceinline__ void stage_put(TransposeStage &s, int r, int k, uint2 v) {
  s.chunk[r][k ^ ((r >> 3) & 15)] = v;
}

// 16-byte unit q (input rows 16q..16q+15) of tile row r: logical chunks 2q and 2q+1 sit in
// physical unit q ^ (x >> 1), swapped when x (the XOR key) is odd.
__device__ __forceinline__ uint4 stage_get(const TransposeStage &s, int r, int q) {
  const int x = (r >> 3) & 15;
  const uint4 u = reinterpret_cast<const uint4 *>(s.chunk[r])[q ^ (x >> 1)];
  return (x & 1) ? make_uint4(u.z, u.w, u.x, u.y) : u;
}

// A thread's 8x8 byte patch (patch row pr, patch column pc of the tile; its rows as lo/hi
// words) goes into the stage transposed. Sync the block before stage_store_transposed.
__device__ __forceinline__ void stage_put_patch(TransposeStage &s, int pr, int pc,
                                                const uint32_t (&lo)[8], const uint32_t (&hi)[8]) {
  uint2 t[8];
  transpose8x8(lo, hi, t);
#pragma unroll
  for (int c = 0; c < 8; ++c) stage_put(s, pc * 8 + c, pr, t[c]);
}

// The block (256 threads) writes the staged tile of input rows r0.. and columns c0.. into the
// transposed [cols, rows] output: tile row R is output row c0 + R, 16-byte unit q covers input
// rows r0 + 16q .. r0 + 16q + 15 (rows % 16 == 0: wholly inside or outside), 8 threads per
// 128-byte output row.
constexpr int kStageThreads = 256;

__device__ __forceinline__ void stage_store_transposed(const TransposeStage &s, uint8_t *out,
                                                       int64_t r0, int64_t c0, int64_t rows,
                                                       int64_t cols) {
#pragma unroll
  for (int k = 0; k < 128 * 128 / 16 / kStageThreads; ++k) {
    const int R = k * (kStageThreads / 8) + threadIdx.x / 8, q = threadIdx.x % 8;
    const int64_t orow = c0 + R, ocol = r0 + q * 16;
    if (orow < cols && ocol < rows) {
      *reinterpret_cast<uint4 *>(out + orow * rows + ocol) = stage_get(s, R, q);
    }
  }
}

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_COMMON_CUDA_UTILS_CUH_
