// CUDA rotary position embedding, forward and backward (rope.h).
//
// Design. A bandwidth-bound elementwise op whose only real arithmetic is cos and sin, which
// depend on (position, feature) but not on the head: one warp per token computes the token's
// R cosines and sines once into shared memory (its own slice of the block's table), then
// streams all H * D elements of the token, so the double-precision sincos of rope_impl.h is
// amortized over the heads. Blocks of 4 warps stride over the tokens.
//   - Fast path (D % 8 == 0, R % 8 == 0, R/2 % 8 == 0 unless interleaved, 16-byte aligned
//     buffers): each lane moves chunks of 8 consecutive features, one 128-bit load and store for
//     16-bit types (two for fp32). A chunk never straddles R, so it is either rotated or copied
//     bit for bit. Interleaved pairs lie inside the chunk; "rotate half" partners are the chunk
//     R/2 away, a second aligned load (the same warp reads that chunk itself, so it comes from
//     L1). The table is read as float4, conflict free.
//   - Other shapes: the same loop one element at a time.
//   - The element formula, the position map and the sincos are rope_impl.h's, shared with the
//     CPU reference: identical bits. Positions outside [0, P) (unchecked here, see rope.h) get
//     NaN angles, and thus NaN outputs, without reading outside freqs.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "common/cuda_utils.cuh"
#include "rope/rope_impl.h"

namespace te {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kChunk = 8;
// Shared memory the table may take per block without an opt-in (cos and sin per warp).
constexpr size_t kTableBytes = 48 * 1024;

template <te_dtype kT>
struct Chunk8;

// 16-bit types: one uint4 holds the chunk.
template <te_dtype kT>
struct Chunk8 {
  uint4 raw;
  __device__ __forceinline__ void load(const void *p, int64_t i) {
    raw = __ldg(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(p) + i));
  }
  __device__ __forceinline__ void store(void *p, int64_t i) const {
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(p) + i) = raw;
  }
  __device__ __forceinline__ void decode(float (&x)[kChunk]) const { decode_hp8<kT>(raw, x); }
  __device__ __forceinline__ void encode(const float (&y)[kChunk]) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = static_cast<uint32_t>(Hp<kT>::encode(y[2 * k])) |
             (static_cast<uint32_t>(Hp<kT>::encode(y[2 * k + 1])) << 16);
    }
    raw = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct Chunk8<TE_DTYPE_FLOAT32> {
  float4 a, b;
  __device__ __forceinline__ void load(const void *p, int64_t i) {
    const float4 *q = reinterpret_cast<const float4 *>(static_cast<const float *>(p) + i);
    a = __ldg(q);
    b = __ldg(q + 1);
  }
  __device__ __forceinline__ void store(void *p, int64_t i) const {
    float4 *q = reinterpret_cast<float4 *>(static_cast<float *>(p) + i);
    q[0] = a;
    q[1] = b;
  }
  __device__ __forceinline__ void decode(float (&x)[kChunk]) const {
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  }
  __device__ __forceinline__ void encode(const float (&y)[kChunk]) {
    a = make_float4(y[0], y[1], y[2], y[3]);
    b = make_float4(y[4], y[5], y[6], y[7]);
  }
};

__device__ __forceinline__ void load_table8(const float *tab, int64_t j, float (&v)[kChunk]) {
  const float4 *q = reinterpret_cast<const float4 *>(tab + j);
  const float4 a = q[0], b = q[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// One chunk of 8 rotated features starting at feature j0 (a multiple of 8, below R) of the
// head row at `row`.
template <te_dtype kT, bool kInterleaved, bool kBackward>
__device__ __forceinline__ void rotate_chunk(const RopeArgs &a, const float *cos_tab, const float *sin_tab,
                                             int64_t row, int64_t j0) {
  Chunk8<kT> own;
  own.load(a.input, row + j0);
  float x[kChunk], xp[kChunk], c[kChunk], y[kChunk];
  own.decode(x);
  if (kInterleaved) {
#pragma unroll
    for (int k = 0; k < kChunk; ++k) xp[k] = x[k ^ 1];
  } else {
    Chunk8<kT> other;
    other.load(a.input, row + rope_partner(j0, a.rot, false));
    other.decode(xp);
  }
  load_table8(cos_tab, j0, c);
  // Forward: the chunk's own sines; backward: the partners' (rope_partner_coef).
  float s[kChunk];
  if (kBackward && !kInterleaved) {
    load_table8(sin_tab, rope_partner(j0, a.rot, false), s);
  } else {
    load_table8(sin_tab, j0, s);
    if (kBackward) {
#pragma unroll
      for (int k = 0; k < kChunk; k += 2) {
        const float t = s[k];
        s[k] = s[k + 1];
        s[k + 1] = t;
      }
    }
  }
  const bool first_half = j0 < a.rot / 2;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const bool first = kInterleaved ? (k & 1) == 0 : first_half;
    // As rope_partner_coef: forward -sin for the first of a pair; backward -sin for the second.
    const float coef = first != kBackward ? -s[k] : s[k];
    y[k] = rope_rotate(x[k], xp[k], c[k], coef);
  }
  own.encode(y);
  own.store(a.output, row + j0);
}

template <te_dtype kT, bool kFast, bool kInterleaved, bool kBackward>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    rope_kernel(const RopeArgs a, int warps_per_block) {
  using S = typename Hp<kT>::Storage;
  extern __shared__ __align__(16) float table[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float *cos_tab = table + static_cast<int64_t>(warp) * 2 * a.rot;
  float *sin_tab = cos_tab + a.rot;
  const int width = static_cast<int>(a.heads * a.dim);  // < 2^31: the launcher checks
  const int dim = static_cast<int>(a.dim), rot = static_cast<int>(a.rot);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t token = static_cast<int64_t>(blockIdx.x) * warps_per_block + warp; token < a.tokens;
       token += stride) {
    const int64_t p = rope_position(a, token);
    __syncwarp();  // the previous token's table reads are done
    for (int j = lane; j < rot; j += 32) {
      const float angle = p >= 0 ? __ldg(a.freqs + p * a.rot + j) : bits_float(kCanonicalNaN);
      rope_sincos(angle, &cos_tab[j], &sin_tab[j]);
    }
    __syncwarp();
    const int64_t base = token * width;
    if (kFast) {
      const int chunks_per_head = dim / kChunk;
      for (int q = lane; q < width / kChunk; q += 32) {
        const int h = q / chunks_per_head, j0 = (q - h * chunks_per_head) * kChunk;
        const int64_t row = base + static_cast<int64_t>(h) * dim;
        if (j0 < rot) {
          rotate_chunk<kT, kInterleaved, kBackward>(a, cos_tab, sin_tab, row, j0);
        } else {
          Chunk8<kT> copy;
          copy.load(a.input, row + j0);
          copy.store(a.output, row + j0);
        }
      }
    } else {
      const S *in = static_cast<const S *>(a.input);
      S *out = static_cast<S *>(a.output);
      for (int e = lane; e < width; e += 32) {
        const int h = e / dim, j = e - h * dim;
        const int64_t row = base + static_cast<int64_t>(h) * dim;
        if (j < rot) {
          const float x = Hp<kT>::decode(in[row + j]);
          const float xp = Hp<kT>::decode(in[row + rope_partner(j, rot, kInterleaved)]);
          const float coef = rope_partner_coef(sin_tab, j, rot, kInterleaved, kBackward);
          out[row + j] = Hp<kT>::encode(rope_rotate(x, xp, cos_tab[j], coef));
        } else {
          out[row + j] = in[row + j];  // bits, not a decoded value
        }
      }
    }
  }
}

bool fast_path(const RopeArgs &a) {
  return a.dim % kChunk == 0 && a.rot % kChunk == 0 && (a.interleaved || (a.rot / 2) % kChunk == 0) &&
         aligned(a.input, 16) && aligned(a.output, 16);
}

template <te_dtype kT, bool kFast, bool kInterleaved, bool kBackward>
te_status launch(const RopeArgs &a, const char *op, unsigned blocks, int warps, size_t smem, cudaStream_t stream) {
  rope_kernel<kT, kFast, kInterleaved, kBackward><<<blocks, warps * 32, smem, stream>>>(a, warps);
  return launch_status(op);
}

}  // namespace

te_status rope_cuda(const RopeArgs &a, te_stream stream_handle) {
  const char *op = a.backward ? "rope_backward" : "rope_forward";
  const cudaStream_t stream = cuda_stream(stream_handle);
  if (a.heads * a.dim > INT_MAX) {
    return fail(TE_ERROR_UNSUPPORTED, op, "a token's H * D elements must be fewer than 2^31 on CUDA, got " +
                                              std::to_string(a.heads * a.dim));
  }
  const size_t per_warp = 2 * static_cast<size_t>(a.rot) * sizeof(float);
  const int warps = static_cast<int>(std::min<size_t>(kWarpsPerBlock, kTableBytes / per_warp));
  if (warps < 1) {
    return fail(TE_ERROR_UNSUPPORTED, op, "R (the rotated features) must be at most " +
                                              std::to_string(kTableBytes / (2 * sizeof(float))) + " on CUDA, got " +
                                              std::to_string(a.rot));
  }
  int sms = 0;
  if (te_status s = sm_count(op, &sms)) return s;
  // Enough resident warps to cover memory latency; beyond, the blocks stride over the tokens.
  const int64_t want = ceil_div(a.tokens, warps);
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(want, int64_t{sms} * 32)));
  const size_t smem = per_warp * warps;
  const bool fast = fast_path(a);
  return with_hp_dtype(a.dtype, [&](auto tag) {
    constexpr te_dtype kT = decltype(tag)::value;
    if (fast) {
      if (a.interleaved) {
        return a.backward ? launch<kT, true, true, true>(a, op, blocks, warps, smem, stream)
                          : launch<kT, true, true, false>(a, op, blocks, warps, smem, stream);
      }
      return a.backward ? launch<kT, true, false, true>(a, op, blocks, warps, smem, stream)
                        : launch<kT, true, false, false>(a, op, blocks, warps, smem, stream);
    }
    if (a.interleaved) {
      return a.backward ? launch<kT, false, true, true>(a, op, blocks, warps, smem, stream)
                        : launch<kT, false, true, false>(a, op, blocks, warps, smem, stream);
    }
    return a.backward ? launch<kT, false, false, true>(a, op, blocks, warps, smem, stream)
                      : launch<kT, false, false, false>(a, op, blocks, warps, smem, stream);
  });
}

}  // namespace te
