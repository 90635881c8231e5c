// A standalone GPU check of the cuDNN fused-attention backend (src/attention/cudnn) against a
// float64 CPU reference of attention_impl.h's semantics, on small awkward shapes: layouts, GQA,
// padding, THD, causal and windowed masks, padded rows. Not part of ctest (it needs a GPU and a
// core built with cuDNN); a CUDA build that found cuDNN's headers has it as a target:
//
//   cmake --build <build> --target attention_cudnn_check && <build>/attention_cudnn_check
//
// or, against an installed library, nvcc -std=c++17 -arch=sm_90a -Icpp/include -Icpp/src this
// file -L<lib dir> -ltransformer_engine -Xlinker -rpath,<lib dir>. Exit status 0 when every case
// passed or was declined by the backend (each decline is printed with its reason).
//
// Each case prints the backend's support answer when it declines, else the largest error of
// each output over the valid rows and, separately, over the rows that are no query or key
// (expected 0 in o/dq/dk/dv and -inf in softmax_lse).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention/cudnn/attention_cudnn.h"

namespace {

using te::AttnLayout;

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even (inputs are finite)
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#define CUDA_OK(call)                                                                 \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

struct Case {
  const char *name;
  AttnLayout layout;
  int64_t b, hq, hkv, sq, skv, dqk, dv;
  bool padding, bottom_right;
  int64_t wl, wr;
  std::vector<int32_t> lens_q, lens_kv;  // per sequence when padding/THD
};

struct Geometry {
  const Case &c;
  std::vector<int32_t> cu_q, cu_kv;
  int64_t total_q, total_kv;

  explicit Geometry(const Case &cs) : c(cs) {
    const bool var = c.padding || c.layout == AttnLayout::THD;
    cu_q.assign(c.b + 1, 0);
    cu_kv.assign(c.b + 1, 0);
    for (int64_t i = 0; i < c.b; ++i) {
      // THD packs the sequences; padding keeps seqlen slots per sequence in BSHD/SBHD.
      const int32_t lq = var ? c.lens_q[i] : static_cast<int32_t>(c.sq);
      const int32_t lk = var ? c.lens_kv[i] : static_cast<int32_t>(c.skv);
      cu_q[i + 1] = cu_q[i] + lq;
      cu_kv[i + 1] = cu_kv[i] + lk;
    }
    total_q = c.layout == AttnLayout::THD ? cu_q[c.b] : c.b * c.sq;
    total_kv = c.layout == AttnLayout::THD ? cu_kv[c.b] : c.b * c.skv;
  }
  int64_t len_q(int64_t b) const { return cu_q[b + 1] - cu_q[b]; }
  int64_t len_kv(int64_t b) const { return cu_kv[b + 1] - cu_kv[b]; }
  // Element index of (batch, token, head, dim) for an operand of `heads` x `dim`.
  int64_t at(bool kv, int64_t b, int64_t s, int64_t h, int64_t d, int64_t heads, int64_t dim) const {
    const int64_t seqlen = kv ? c.skv : c.sq;
    switch (c.layout) {
      case AttnLayout::SBHD: return ((s * c.b + b) * heads + h) * dim + d;
      case AttnLayout::THD: return (((kv ? cu_kv[b] : cu_q[b]) + s) * heads + h) * dim + d;
      default: return ((b * seqlen + s) * heads + h) * dim + d;
    }
  }
};

struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
};

bool allowed(const Case &c, int64_t i, int64_t j, int64_t lq, int64_t lk) {
  if (j >= lk) return false;
  const int64_t off = c.bottom_right ? lk - lq : 0;
  if (c.wl >= 0 && j < i + off - c.wl) return false;
  if (c.wr >= 0 && j > i + off + c.wr) return false;
  return true;
}

Reference reference(const Geometry &g, float scale, const std::vector<float> &q, const std::vector<float> &k,
                    const std::vector<float> &v, const std::vector<float> &d_o) {
  const Case &c = g.c;
  Reference r;
  r.o.assign(g.total_q * c.hq * c.dv, 0.0);
  r.lse.assign(c.b * c.hq * c.sq, -INFINITY);
  r.dq.assign(g.total_q * c.hq * c.dqk, 0.0);
  r.dk.assign(g.total_kv * c.hkv * c.dqk, 0.0);
  r.dv.assign(g.total_kv * c.hkv * c.dv, 0.0);
  const int64_t group = c.hq / c.hkv;
  for (int64_t b = 0; b < c.b; ++b) {
    const int64_t lq = g.len_q(b), lk = g.len_kv(b);
    for (int64_t h = 0; h < c.hq; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < lq; ++i) {
        std::vector<double> s(lk, -INFINITY);
        double m = -INFINITY;
        for (int64_t j = 0; j < lk; ++j) {
          if (!allowed(c, i, j, lq, lk)) continue;
          double dot = 0;
          for (int64_t d = 0; d < c.dqk; ++d) {
            dot += double(q[g.at(false, b, i, h, d, c.hq, c.dqk)]) * k[g.at(true, b, j, hk, d, c.hkv, c.dqk)];
          }
          s[j] = scale * dot;
          m = std::max(m, s[j]);
        }
        if (m == -INFINITY) continue;  // no allowed key: o = 0, lse = -inf, no gradient
        double sum = 0;
        for (int64_t j = 0; j < lk; ++j) sum += std::exp(s[j] - m);
        const double lse = m + std::log(sum);
        r.lse[(b * c.hq + h) * c.sq + i] = lse;
        std::vector<double> p(lk);
        for (int64_t j = 0; j < lk; ++j) p[j] = std::exp(s[j] - lse);
        double delta = 0;  // rowsum(dO * O)
        for (int64_t d = 0; d < c.dv; ++d) {
          double o = 0;
          for (int64_t j = 0; j < lk; ++j) o += p[j] * v[g.at(true, b, j, hk, d, c.hkv, c.dv)];
          r.o[g.at(false, b, i, h, d, c.hq, c.dv)] = o;
          delta += o * d_o[g.at(false, b, i, h, d, c.hq, c.dv)];
        }
        for (int64_t j = 0; j < lk; ++j) {
          if (p[j] == 0) continue;
          double dp = 0;
          for (int64_t d = 0; d < c.dv; ++d) {
            dp += double(d_o[g.at(false, b, i, h, d, c.hq, c.dv)]) * v[g.at(true, b, j, hk, d, c.hkv, c.dv)];
            r.dv[g.at(true, b, j, hk, d, c.hkv, c.dv)] += p[j] * d_o[g.at(false, b, i, h, d, c.hq, c.dv)];
          }
          const double ds = p[j] * (dp - delta) * scale;
          for (int64_t d = 0; d < c.dqk; ++d) {
            r.dq[g.at(false, b, i, h, d, c.hq, c.dqk)] += ds * k[g.at(true, b, j, hk, d, c.hkv, c.dqk)];
            r.dk[g.at(true, b, j, hk, d, c.hkv, c.dqk)] += ds * q[g.at(false, b, i, h, d, c.hq, c.dqk)];
          }
        }
      }
    }
  }
  return r;
}

// Random bf16 values (returned as the floats they round to) and their device copy.
struct Operand {
  std::vector<float> host;
  void *device = nullptr;
  Operand(int64_t n, std::mt19937 &rng) : host(n) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<uint16_t> bits(n);
    for (int64_t i = 0; i < n; ++i) {
      bits[i] = to_bf16(dist(rng));
      host[i] = from_bf16(bits[i]);
    }
    CUDA_OK(cudaMalloc(&device, (n > 0 ? n : 1) * 2));
    CUDA_OK(cudaMemcpy(device, bits.data(), n * 2, cudaMemcpyHostToDevice));
  }
  explicit Operand(int64_t n) : host(n) {
    CUDA_OK(cudaMalloc(&device, (n > 0 ? n : 1) * 2));
    CUDA_OK(cudaMemset(device, 0xFF, (n > 0 ? n : 1) * 2));  // NaN bits: unwritten outputs show
  }
  ~Operand() { cudaFree(device); }
  std::vector<float> read() const {
    std::vector<uint16_t> bits(host.size());
    CUDA_OK(cudaMemcpy(bits.data(), device, bits.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> out(bits.size());
    for (size_t i = 0; i < bits.size(); ++i) out[i] = from_bf16(bits[i]);
    return out;
  }
};

// Largest |got - want| over elements whose reference is finite, relative to the largest |want|
// (a NaN, e.g. an unwritten output, counts as infinite); and the number of elements where the
// reference is -inf (softmax_lse of a row without keys) and the result is not.
struct Error {
  double rel = 0;
  int64_t bad_fill = 0;
};

template <typename Got>
Error compare(const std::vector<Got> &got, const std::vector<double> &want) {
  double scale = 1e-6, worst = 0;
  Error e;
  for (double w : want) {
    if (std::isfinite(w)) scale = std::max(scale, std::fabs(w));
  }
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got[i], w = want[i];
    if (std::isinf(w)) {
      if (!(g == w || (std::isinf(w) && g < -1e30))) ++e.bad_fill;
      continue;
    }
    worst = std::max(worst, std::isfinite(g) ? std::fabs(g - w) : INFINITY);
  }
  e.rel = worst / scale;
  return e;
}

int run_case(const Case &c, cudaStream_t stream) {
  const Geometry g(c);
  std::mt19937 rng(1234);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dqk));
  Operand q(g.total_q * c.hq * c.dqk, rng), k(g.total_kv * c.hkv * c.dqk, rng), v(g.total_kv * c.hkv * c.dv, rng);
  Operand d_o(g.total_q * c.hq * c.dv, rng);
  Operand o(g.total_q * c.hq * c.dv), dq(g.total_q * c.hq * c.dqk), dk(g.total_kv * c.hkv * c.dqk),
      dv(g.total_kv * c.hkv * c.dv);
  float *lse = nullptr;
  int32_t *cu_q = nullptr, *cu_kv = nullptr;
  const int64_t lse_n = c.b * c.hq * c.sq;
  CUDA_OK(cudaMalloc(&lse, lse_n * 4));
  CUDA_OK(cudaMemset(lse, 0xFF, lse_n * 4));
  CUDA_OK(cudaMalloc(&cu_q, (c.b + 1) * 4));
  CUDA_OK(cudaMalloc(&cu_kv, (c.b + 1) * 4));
  CUDA_OK(cudaMemcpy(cu_q, g.cu_q.data(), (c.b + 1) * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(cu_kv, g.cu_kv.data(), (c.b + 1) * 4, cudaMemcpyHostToDevice));

  te::AttentionForwardArgs f{};
  f.layout = c.layout;
  f.shape = {c.b, c.hq, c.hkv, c.sq, c.skv, c.dqk, c.dv, g.total_q, g.total_kv};
  f.mask = {c.bottom_right, c.padding || c.layout == AttnLayout::THD, c.wl, c.wr};
  f.softmax_scale = scale;
  f.qkv_dtype = f.o_dtype = TE_DTYPE_BFLOAT16;
  f.q = q.device, f.k = k.device, f.v = v.device, f.o = o.device, f.softmax_lse = lse;
  if (f.mask.padding) f.cu_seqlens_q = cu_q, f.cu_seqlens_kv = cu_kv;
  f.device = 0;
  int failed = 0;
  const std::string why = te::cudnn_attention_forward_support(f);
  if (!why.empty()) {
    std::printf("%-28s skipped: %s\n", c.name, why.c_str());
  } else {
    void *ws = nullptr;
    f.workspace_size = te::cudnn_attention_forward_workspace_size(f);
    CUDA_OK(cudaMalloc(&ws, f.workspace_size > 0 ? f.workspace_size : 1));
    f.workspace = ws;
    if (te::cudnn_attention_forward(f, reinterpret_cast<te_stream>(stream)) != TE_SUCCESS) {
      std::printf("%-28s forward FAILED: %s\n", c.name, te_last_error());
      failed = 1;
    }
    te::AttentionBackwardArgs bw{};
    bw.layout = f.layout, bw.shape = f.shape, bw.mask = f.mask, bw.softmax_scale = scale;
    bw.qkv_dtype = bw.o_dtype = bw.do_dtype = bw.grad_dtype = TE_DTYPE_BFLOAT16;
    bw.q = q.device, bw.k = k.device, bw.v = v.device, bw.o = o.device, bw.d_o = d_o.device, bw.softmax_lse = lse;
    bw.dq = dq.device, bw.dk = dk.device, bw.dv = dv.device;
    bw.cu_seqlens_q = f.cu_seqlens_q, bw.cu_seqlens_kv = f.cu_seqlens_kv;
    bw.device = 0;
    const std::string why_b = te::cudnn_attention_backward_support(bw);
    void *ws_b = nullptr;
    if (why_b.empty()) {
      bw.workspace_size = te::cudnn_attention_backward_workspace_size(bw);
      CUDA_OK(cudaMalloc(&ws_b, bw.workspace_size > 0 ? bw.workspace_size : 1));
      bw.workspace = ws_b;
      if (te::cudnn_attention_backward(bw, reinterpret_cast<te_stream>(stream)) != TE_SUCCESS) {
        std::printf("%-28s backward FAILED: %s\n", c.name, te_last_error());
        failed = 1;
      }
    }
    CUDA_OK(cudaStreamSynchronize(stream));
    const Reference r = reference(g, scale, q.host, k.host, v.host, d_o.host);
    std::vector<float> lse_got(lse_n);
    CUDA_OK(cudaMemcpy(lse_got.data(), lse, lse_n * 4, cudaMemcpyDeviceToHost));
    const Error eo = compare(o.read(), r.o), el = compare(lse_got, r.lse);
    double lse_abs = 0;
    for (int64_t i = 0; i < lse_n; ++i) {
      if (std::isfinite(r.lse[i])) lse_abs = std::max(lse_abs, std::fabs(lse_got[i] - r.lse[i]));
    }
    // bf16 outputs: ~3 significant digits; the grads sum many bf16-rounded terms.
    bool ok = eo.rel < 2e-2 && lse_abs < 2e-2 && el.bad_fill == 0;
    std::printf("%-28s fwd  o %.2e  lse %.2e  (bad padded lse %lld)", c.name, eo.rel, lse_abs,
                static_cast<long long>(el.bad_fill));
    if (why_b.empty()) {
      const Error eq = compare(dq.read(), r.dq), ek = compare(dk.read(), r.dk), ev = compare(dv.read(), r.dv);
      ok = ok && eq.rel < 3e-2 && ek.rel < 3e-2 && ev.rel < 3e-2;
      std::printf("  bwd dq %.2e dk %.2e dv %.2e", eq.rel, ek.rel, ev.rel);
    } else {
      std::printf("  bwd skipped: %s", why_b.c_str());
    }
    std::printf("  %s\n", ok ? "ok" : "FAIL");
    failed |= !ok;
    cudaFree(ws);
    cudaFree(ws_b);
  }
  cudaFree(lse);
  cudaFree(cu_q);
  cudaFree(cu_kv);
  return failed;
}

}  // namespace

int main() {
  const std::vector<Case> cases = {
      {"bshd", AttnLayout::BSHD, 2, 4, 4, 128, 128, 64, 64, false, false, -1, -1, {}, {}},
      {"bshd causal odd", AttnLayout::BSHD, 2, 4, 4, 77, 77, 64, 64, false, false, -1, 0, {}, {}},
      {"sbhd gqa causal", AttnLayout::SBHD, 2, 8, 2, 96, 96, 128, 128, false, false, -1, 0, {}, {}},
      {"bshd mqa d_v != d_qk", AttnLayout::BSHD, 1, 4, 1, 64, 80, 128, 64, false, false, -1, -1, {}, {}},
      {"bshd bottom-right causal", AttnLayout::BSHD, 2, 2, 2, 48, 112, 64, 64, false, true, -1, 0, {}, {}},
      {"bshd window (32, 0)", AttnLayout::BSHD, 1, 2, 2, 200, 200, 64, 64, false, false, 32, 0, {}, {}},
      {"bshd window (16, 8)", AttnLayout::BSHD, 1, 2, 2, 100, 100, 64, 64, false, false, 16, 8, {}, {}},
      {"bshd padding", AttnLayout::BSHD, 3, 4, 2, 64, 64, 64, 64, true, false, -1, -1, {64, 17, 40}, {64, 50, 9}},
      {"bshd padding causal", AttnLayout::BSHD, 2, 4, 4, 64, 64, 64, 64, true, false, -1, 0, {33, 64}, {33, 64}},
      {"thd causal", AttnLayout::THD, 3, 4, 4, 70, 70, 64, 64, true, false, -1, 0, {70, 5, 31}, {70, 5, 31}},
      {"thd gqa bottom-right", AttnLayout::THD, 3, 8, 2, 40, 90, 128, 128, true, true, -1, 0, {40, 1, 23}, {90, 30, 23}},
      {"thd window", AttnLayout::THD, 2, 2, 2, 128, 128, 64, 64, true, false, 20, 0, {128, 77}, {128, 77}},
      {"bshd head_dim 256", AttnLayout::BSHD, 1, 2, 2, 64, 64, 256, 256, false, false, -1, 0, {}, {}},
  };
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  int failed = 0;
  for (const Case &c : cases) failed += run_case(c, stream);
  std::printf("%d of %zu cases failed\n", failed, cases.size());
  return failed == 0 ? 0 : 1;
}
