// The CUDA math path of attention: one thread block per query row, the keys in tiles of
// kTile, fp32 math, any mask, layout, GQA ratio and dtype (FP8 included). It is the simple,
// always-correct fallback for what cuDNN rejects, not a fast kernel. The backward adds dk and
// dv with fp32 atomics into the workspace (not deterministic), then converts them. FP8
// intermediates are rounded as the CPU reference rounds them (attention_ref.cpp).
#include <cuda_runtime.h>

#include "attention/attention_kernel.cuh"
#include "attention/attention_math.h"
#include "common/cuda_utils.cuh"

namespace te {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = kThreads;  // keys per tile: one per thread

struct RowCtx {
  int64_t b, h, g, i, lo, hi;
  SeqLens L;
};

// The row of this block, or false when it is no query / has no allowed key.
__device__ bool row_of(const AttentionShape &s, const AttentionMask &m, const int32_t *cu_q, const int32_t *cu_kv,
                       RowCtx *r) {
  r->i = blockIdx.x;
  r->h = blockIdx.y;
  r->b = blockIdx.z;
  r->g = r->h / (s.heads_q / s.heads_kv);
  r->L = seq_lens(s, m.padding, cu_q, cu_kv, r->b);
  if (r->i >= r->L.q) return false;
  allowed_keys(m, r->i, r->L.q, r->L.kv, &r->lo, &r->hi);
  return r->lo <= r->hi;
}

// v through an FP8 format and back (attention_ref.cpp's round_fp8).
__device__ __forceinline__ float round_fp8(float v, te_dtype dt, float scale, float descale) {
  const float x = v * scale;
  if (dt == TE_DTYPE_FLOAT8_E4M3) return e4m3_to_float(float_to_e4m3(x)) * descale;
  return e5m2_to_float(float_to_e5m2(x)) * descale;
}

__global__ void fill_kernel(float *p, int64_t n, float v) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    p[e] = v;
  }
}

__global__ void __launch_bounds__(kThreads) attention_forward_kernel(AttentionForwardArgs a) {
  extern __shared__ float smem[];
  const AttentionShape &s = a.shape;
  const AttentionFp8 &f = a.fp8;
  const int64_t dqk = s.head_dim_qk, dv = s.head_dim_v;
  float *qrow = smem, *ptile = smem + dqk, *scratch = ptile + kTile;
  RowCtx r;
  if (!row_of(s, a.mask, a.cu_seqlens_q, a.cu_seqlens_kv, &r)) return;
  const bool fp8 = a.qkv_dtype == TE_DTYPE_FLOAT8_E4M3;
  const float dq_ = fp8 ? *f.descale_q : 1.f, dk_ = fp8 ? *f.descale_k : 1.f, dv_ = fp8 ? *f.descale_v : 1.f;
  const int64_t qi = operand_offset(s, a.layout, kOperandQ, r.b, r.i, r.L.q_start, r.h);
  for (int64_t d = threadIdx.x; d < dqk; d += kThreads) qrow[d] = attn_load(a.q, qi + d, a.qkv_dtype, dq_);
  __syncthreads();
  auto logit = [&](int64_t j) {
    const int64_t kj = operand_offset(s, a.layout, kOperandK, r.b, j, r.L.kv_start, r.g);
    float acc = 0.f;
    for (int64_t d = 0; d < dqk; ++d) acc += qrow[d] * attn_load(a.k, kj + d, a.qkv_dtype, dk_);
    return a.softmax_scale * acc;
  };
  float m = -INFINITY, l = 0.f;
  for (int64_t j = r.lo + threadIdx.x; j <= r.hi; j += kThreads) {
    const float x = logit(j);
    const float nm = fmaxf(m, x);
    l = l * expf(m - nm) + expf(x - nm);
    m = nm;
  }
  const float row_max = block_reduce(m, scratch, true);
  const float row_sum = block_reduce(m == -INFINITY ? 0.f : l * expf(m - row_max), scratch, false);
  const float lse = row_max + logf(row_sum);
  constexpr int kMaxD = 8;  // head_dim_v <= kMaxD * kThreads (checked by the launcher)
  float acc[kMaxD] = {};
  const float keep_scale = a.dropout > 0.f ? 1.f / (1.f - a.dropout) : 1.f;
  const uint64_t seed = a.dropout > 0.f ? static_cast<uint64_t>(a.rng_state[0]) : 0;
  const uint64_t offset = a.dropout > 0.f ? static_cast<uint64_t>(a.rng_state[1]) : 0;
  for (int64_t t0 = r.lo; t0 <= r.hi; t0 += kTile) {
    const int64_t j = t0 + threadIdx.x;
    float p = 0.f;
    if (j <= r.hi) {
      p = expf(logit(j) - lse);
      if (fp8) {
        if (f.amax_s != nullptr) atomicMax(reinterpret_cast<unsigned int *>(f.amax_s), abs_bits(p));
        p = round_fp8(p, TE_DTYPE_FLOAT8_E4M3, *f.scale_s, *f.descale_s);
      }
      if (a.dropout > 0.f) p = dropout_keep(seed, offset, s, r.b, r.h, r.i, j, a.dropout) ? p * keep_scale : 0.f;
    }
    __syncthreads();
    ptile[threadIdx.x] = p;
    __syncthreads();
    const int64_t n = r.hi - t0 + 1 < kTile ? r.hi - t0 + 1 : kTile;
    for (int64_t t = 0; t < n; ++t) {
      const float pt = ptile[t];
      if (pt == 0.f) continue;
      const int64_t vj = operand_offset(s, a.layout, kOperandV, r.b, t0 + t, r.L.kv_start, r.g);
      for (int c = 0; c < kMaxD; ++c) {
        const int64_t d = threadIdx.x + c * kThreads;
        if (d < dv) acc[c] += pt * attn_load(a.v, vj + d, a.qkv_dtype, dv_);
      }
    }
  }
  const int64_t oi = dense_offset(s, a.layout, true, s.heads_q, dv, r.b, r.i, r.L.q_start, r.h);
  for (int c = 0; c < kMaxD; ++c) {
    const int64_t d = threadIdx.x + c * kThreads;
    if (d < dv) attn_store(a.o, oi + d, a.o_dtype, acc[c], f.scale_o, f.amax_o);
  }
  if (threadIdx.x == 0 && a.softmax_lse != nullptr) a.softmax_lse[(r.b * s.heads_q + r.h) * s.seqlen_q + r.i] = lse;
}

__global__ void __launch_bounds__(kThreads) attention_backward_kernel(AttentionBackwardArgs a, float *dk_acc,
                                                                      float *dv_acc) {
  extern __shared__ float smem[];
  const AttentionShape &s = a.shape;
  const AttentionFp8 &f = a.fp8;
  const int64_t dqk = s.head_dim_qk, dv = s.head_dim_v;
  float *qrow = smem, *dorow = qrow + dqk, *dstile = dorow + dv, *pdtile = dstile + kTile, *scratch = pdtile + kTile;
  RowCtx r;
  if (!row_of(s, a.mask, a.cu_seqlens_q, a.cu_seqlens_kv, &r)) return;
  const bool fp8 = a.qkv_dtype == TE_DTYPE_FLOAT8_E4M3;
  const float dq_ = fp8 ? *f.descale_q : 1.f, dk_ = fp8 ? *f.descale_k : 1.f, dv_ = fp8 ? *f.descale_v : 1.f;
  const bool o8 = a.o_dtype == TE_DTYPE_FLOAT8_E4M3 || a.o_dtype == TE_DTYPE_FLOAT8_E5M2;
  const bool do8 = a.do_dtype == TE_DTYPE_FLOAT8_E4M3 || a.do_dtype == TE_DTYPE_FLOAT8_E5M2;
  const float do_ = do8 ? *f.descale_do : 1.f, o_ = o8 ? *f.descale_o : 1.f;
  const bool fp8_ds = fp8 && do8;
  // q, k, v (and dq) where the call's strides put them; o, d_o and the dk/dv sums dense
  const int64_t qi = operand_offset(s, a.layout, kOperandQ, r.b, r.i, r.L.q_start, r.h);
  const int64_t oi = dense_offset(s, a.layout, true, s.heads_q, dv, r.b, r.i, r.L.q_start, r.h);
  float part = 0.f;  // dot(d_o_i, o_i) = sum_j p_j dp_j
  for (int64_t d = threadIdx.x; d < dqk; d += kThreads) qrow[d] = attn_load(a.q, qi + d, a.qkv_dtype, dq_);
  for (int64_t d = threadIdx.x; d < dv; d += kThreads) {
    dorow[d] = attn_load(a.d_o, oi + d, a.do_dtype, do_);
    part += dorow[d] * attn_load(a.o, oi + d, a.o_dtype, o_);
  }
  const float row_dot = block_reduce(part, scratch, false);  // also orders qrow/dorow writes
  const float lse = a.softmax_lse[(r.b * s.heads_q + r.h) * s.seqlen_q + r.i];
  const float keep_scale = a.dropout > 0.f ? 1.f / (1.f - a.dropout) : 1.f;
  const uint64_t seed = a.dropout > 0.f ? static_cast<uint64_t>(a.rng_state[0]) : 0;
  const uint64_t offset = a.dropout > 0.f ? static_cast<uint64_t>(a.rng_state[1]) : 0;
  constexpr int kMaxD = 8;
  float dq[kMaxD] = {};
  for (int64_t t0 = r.lo; t0 <= r.hi; t0 += kTile) {
    const int64_t j = t0 + threadIdx.x;
    float ds = 0.f, pd = 0.f;
    if (j <= r.hi) {
      const int64_t kj = operand_offset(s, a.layout, kOperandK, r.b, j, r.L.kv_start, r.g);
      const int64_t vj = operand_offset(s, a.layout, kOperandV, r.b, j, r.L.kv_start, r.g);
      float x = 0.f, dpd = 0.f;
      for (int64_t d = 0; d < dqk; ++d) x += qrow[d] * attn_load(a.k, kj + d, a.qkv_dtype, dk_);
      for (int64_t d = 0; d < dv; ++d) dpd += dorow[d] * attn_load(a.v, vj + d, a.qkv_dtype, dv_);
      const float p = expf(a.softmax_scale * x - lse);
      const bool keep = a.dropout <= 0.f || dropout_keep(seed, offset, s, r.b, r.h, r.i, j, a.dropout);
      const float dp = keep ? dpd * keep_scale : 0.f;
      ds = a.softmax_scale * p * (dp - row_dot);
      if (f.amax_dp != nullptr) atomicMax(reinterpret_cast<unsigned int *>(f.amax_dp), abs_bits(ds));
      if (fp8_ds) ds = round_fp8(ds, a.do_dtype, *f.scale_dp, *f.descale_dp);
      const float pr = fp8 ? round_fp8(p, TE_DTYPE_FLOAT8_E4M3, *f.scale_s, *f.descale_s) : p;
      pd = keep ? pr * keep_scale : 0.f;
    }
    __syncthreads();
    dstile[threadIdx.x] = ds;
    pdtile[threadIdx.x] = pd;
    __syncthreads();
    const int64_t n = r.hi - t0 + 1 < kTile ? r.hi - t0 + 1 : kTile;
    for (int64_t t = 0; t < n; ++t) {
      const float dst = dstile[t];
      if (dst == 0.f) continue;
      const int64_t kj = operand_offset(s, a.layout, kOperandK, r.b, t0 + t, r.L.kv_start, r.g);
      for (int c = 0; c < kMaxD; ++c) {
        const int64_t d = threadIdx.x + c * kThreads;
        if (d < dqk) dq[c] += dst * attn_load(a.k, kj + d, a.qkv_dtype, dk_);
      }
    }
    for (int64_t e = threadIdx.x; e < n * dqk; e += kThreads) {
      const int64_t t = e / dqk, d = e % dqk;
      const int64_t kj = dense_offset(s, a.layout, false, s.heads_kv, dqk, r.b, t0 + t, r.L.kv_start, r.g);
      if (dstile[t] != 0.f) atomicAdd(dk_acc + kj + d, dstile[t] * qrow[d]);
    }
    for (int64_t e = threadIdx.x; e < n * dv; e += kThreads) {
      const int64_t t = e / dv, d = e % dv;
      const int64_t vj = dense_offset(s, a.layout, false, s.heads_kv, dv, r.b, t0 + t, r.L.kv_start, r.g);
      if (pdtile[t] != 0.f) atomicAdd(dv_acc + vj + d, pdtile[t] * dorow[d]);
    }
  }
  for (int c = 0; c < kMaxD; ++c) {
    const int64_t d = threadIdx.x + c * kThreads;
    if (d < dqk) attn_store(a.dq, qi + d, a.grad_dtype, dq[c], f.scale_dq, f.amax_dq);
  }
}

// out (a gradient of `heads` heads of `dim`, under the strides) from its dense fp32 sums acc, or
// zeros where acc is null.
__global__ void convert_kernel(const float *acc, void *out, int64_t n, int64_t heads, int64_t dim, int64_t row_stride,
                               int64_t head_stride, te_dtype dt, const float *scale, float *amax) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    attn_store(out, strided_element(e, heads, dim, row_stride, head_stride), dt, acc != nullptr ? acc[e] : 0.f,
               scale, amax);
  }
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

te_status check_grid(const char *op, const AttentionShape &s) {
  if (s.head_dim_qk > 8 * kThreads || s.head_dim_v > 8 * kThreads || s.heads_q > 65535 || s.batch > 65535) {
    return fail(TE_ERROR_UNSUPPORTED, op,
                "the CUDA math path takes head dims <= 1024 and batch, heads <= 65535, got head dims " +
                    std::to_string(s.head_dim_qk) + "/" + std::to_string(s.head_dim_v));
  }
  return TE_SUCCESS;
}

bool is_fp8_dtype(te_dtype d) { return d == TE_DTYPE_FLOAT8_E4M3 || d == TE_DTYPE_FLOAT8_E5M2; }

}  // namespace

te_status attention_forward_cuda(const AttentionForwardArgs &a, te_stream stream) {
  const char *op = "attention_forward";
  const AttentionShape &s = a.shape;
  if (te_status st = check_grid(op, s)) return st;
  cudaStream_t st = cuda_stream(stream);
  const int64_t o_bytes = s.total_q * s.heads_q * s.head_dim_v * static_cast<int64_t>(te_dtype_size(a.o_dtype));
  // Zero bits are 0 in every dtype (FP8 included): rows that are no query stay 0.
  if (te_status e = cuda_status(op, cudaMemsetAsync(a.o, 0, static_cast<size_t>(o_bytes), st))) return e;
  const int64_t lse_n = s.batch * s.heads_q * s.seqlen_q;
  if (a.softmax_lse != nullptr) fill_kernel<<<grid_for(lse_n), 256, 0, st>>>(a.softmax_lse, lse_n, -INFINITY);
  for (float *amax : {a.fp8.amax_s, a.fp8.amax_o}) {
    if (amax != nullptr) {
      if (te_status e = cuda_status(op, cudaMemsetAsync(amax, 0, sizeof(float), st))) return e;
    }
  }
  if (s.seqlen_q > 0 && s.batch > 0) {
    const dim3 grid(static_cast<unsigned>(s.seqlen_q), static_cast<unsigned>(s.heads_q),
                    static_cast<unsigned>(s.batch));
    const size_t smem = static_cast<size_t>(s.head_dim_qk + kTile + 32) * sizeof(float);
    attention_forward_kernel<<<grid, kThreads, smem, st>>>(a);
  }
  return launch_status(op);
}

size_t attention_backward_cuda_workspace_size(const AttentionShape &s) {
  return static_cast<size_t>(s.total_kv * s.heads_kv * (s.head_dim_qk + s.head_dim_v)) * sizeof(float);
}

te_status attention_backward_cuda(const AttentionBackwardArgs &a, te_stream stream) {
  const char *op = "attention_backward";
  const AttentionShape &s = a.shape;
  if (te_status st = check_grid(op, s)) return st;
  cudaStream_t st = cuda_stream(stream);
  const int64_t nk = s.total_kv * s.heads_kv * s.head_dim_qk, nv = s.total_kv * s.heads_kv * s.head_dim_v;
  const int64_t nq = s.total_q * s.heads_q * s.head_dim_qk;
  float *dk_acc = static_cast<float *>(a.workspace), *dv_acc = dk_acc + nk;
  const size_t g = te_dtype_size(a.grad_dtype);
  if (te_status e = cuda_status(op, cudaMemsetAsync(a.workspace, 0, attention_backward_cuda_workspace_size(s), st))) {
    return e;
  }
  const bool fp8 = is_fp8_dtype(a.grad_dtype);
  if (s.dense()) {
    if (te_status e = cuda_status(op, cudaMemsetAsync(a.dq, 0, static_cast<size_t>(nq) * g, st))) return e;
  } else {  // a strided dq shares its buffer: only its own elements are zeroed
    convert_kernel<<<grid_for(nq), 256, 0, st>>>(nullptr, a.dq, nq, s.heads_q, s.head_dim_qk, s.row_stride[kOperandQ],
                                                 s.head_stride[kOperandQ], a.grad_dtype,
                                                 fp8 ? a.fp8.scale_dq : nullptr, nullptr);
  }
  if (is_fp8_dtype(a.grad_dtype)) {
    for (float *amax : {a.fp8.amax_dq, a.fp8.amax_dk, a.fp8.amax_dv}) {
      if (amax != nullptr) {
        if (te_status e = cuda_status(op, cudaMemsetAsync(amax, 0, sizeof(float), st))) return e;
      }
    }
  }
  if (a.fp8.amax_dp != nullptr) {
    if (te_status e = cuda_status(op, cudaMemsetAsync(a.fp8.amax_dp, 0, sizeof(float), st))) return e;
  }
  if (s.seqlen_q > 0 && s.batch > 0) {
    const dim3 grid(static_cast<unsigned>(s.seqlen_q), static_cast<unsigned>(s.heads_q),
                    static_cast<unsigned>(s.batch));
    const size_t smem = static_cast<size_t>(s.head_dim_qk + s.head_dim_v + 2 * kTile + 32) * sizeof(float);
    attention_backward_kernel<<<grid, kThreads, smem, st>>>(a, dk_acc, dv_acc);
  }
  convert_kernel<<<grid_for(nk), 256, 0, st>>>(dk_acc, a.dk, nk, s.heads_kv, s.head_dim_qk, s.row_stride[kOperandK],
                                               s.head_stride[kOperandK], a.grad_dtype,
                                               fp8 ? a.fp8.scale_dk : nullptr, fp8 ? a.fp8.amax_dk : nullptr);
  convert_kernel<<<grid_for(nv), 256, 0, st>>>(dv_acc, a.dv, nv, s.heads_kv, s.head_dim_v, s.row_stride[kOperandV],
                                               s.head_stride[kOperandV], a.grad_dtype,
                                               fp8 ? a.fp8.scale_dv : nullptr, fp8 ? a.fp8.amax_dv : nullptr);
  return launch_status(op);
}

}  // namespace te
