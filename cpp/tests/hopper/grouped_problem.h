// The problem of the Hopper grouped GEMM's GPU test (test_grouped_gemm.cpp): a case's groups
// as host data, their CUDA buffers and core handles, the three runs (the CPU path, the cuBLASLt
// loop, our kernel) and the bounded comparisons of their results (the bounds are derived at the
// top of test_grouped_gemm.cpp).
#ifndef TRANSFORMER_ENGINE_TESTS_HOPPER_GROUPED_PROBLEM_H_
#define TRANSFORMER_ENGINE_TESTS_HOPPER_GROUPED_PROBLEM_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "gemm/hopper/grouped_gemm.h"
#include "hopper_test.h"
#include "test_util.h"

namespace grouped_test {

using te_test::TensorHandle;
using namespace hopper_test;  // NOLINT: the shared constants and helpers

constexpr size_t kAlign = 256;                // every device buffer of a group starts here

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// --- problems ----------------------------------------------------------------------------------

enum class Operands { kFp8, kBf16 };

struct Case {
  std::string name;
  Operands ops;
  te_dtype d_dtype;
  std::vector<int64_t> m, n, k;  // per group
  bool bias, split, exact;
};

inline Case uniform(std::string name, Operands ops, te_dtype d_dtype, std::vector<int64_t> m, int64_t n, int64_t k,
             bool bias, bool split, bool exact) {
  const size_t g = m.size();
  return Case{std::move(name), ops, d_dtype, std::move(m), std::vector<int64_t>(g, n), std::vector<int64_t>(g, k),
              bias, split, exact};
}

// The inputs of one group as stored: operand codes (E4M3 bytes or bf16 bits, little-endian),
// scale_inv values (FP8), bias bits (bf16).
struct Group {
  std::vector<uint8_t> a, b;  // [m, k], [n, k]
  float sa = 1.0f, sb = 1.0f;
  std::vector<uint16_t> bias;  // [n] or empty
};

struct Problem {
  Case c;
  std::vector<Group> g;
  size_t groups() const { return c.m.size(); }
  size_t elem() const { return c.ops == Operands::kFp8 ? 1 : 2; }
  te_dtype ab_dtype() const { return c.ops == Operands::kFp8 ? TE_DTYPE_FLOAT8_E4M3 : TE_DTYPE_BFLOAT16; }
  size_t d_bytes(size_t i) const { return static_cast<size_t>(c.m[i] * c.n[i]) * te_dtype_size(c.d_dtype); }
};

uint16_t bf16_bits(float x) { return te::float_to_bf16(x); }

// A pool of operand codes (elements of `elem` bytes) from which groups take slices at random
// offsets: data of any size in the time of a copy, different in every group. Its length is odd,
// so that rows of a slice do not repeat each other.
using Pool = std::vector<uint8_t>;

inline Pool make_pool(Operands ops, bool exact, bool weights, uint32_t seed) {
  const size_t count = (size_t{1} << 20) + 7;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Pool pool(count * (ops == Operands::kFp8 ? 1 : 2));
  std::vector<float> x(count);
  float amax = 0.0f;
  for (size_t i = 0; i < count; ++i) {
    x[i] = exact ? static_cast<float>(static_cast<int>(rng() % 9) - 4) : normal(rng) * (weights ? 0.05f : 1.0f);
    amax = std::max(amax, std::fabs(x[i]));
  }
  for (size_t i = 0; i < count; ++i) {
    if (ops == Operands::kFp8) {
      // Random FP8 codes: the pool quantized per tensor (scale 448 / amax); groups then get scales
      // of their own (make_problem).
      pool[i] = te::float_to_e4m3(exact ? x[i] : x[i] * (448.0f / amax));
    } else {
      const uint16_t h = bf16_bits(x[i]);
      std::memcpy(&pool[2 * i], &h, 2);
    }
  }
  return pool;
}

inline void take(const Pool &pool, size_t elem, size_t count, std::mt19937 &rng, std::vector<uint8_t> *out) {
  const size_t n = pool.size() / elem;
  out->resize(std::max<size_t>(count * elem, 16));
  size_t at = rng() % n, done = 0;
  while (done < count) {
    const size_t run = std::min(count - done, n - at);
    std::memcpy(out->data() + done * elem, pool.data() + at * elem, run * elem);
    done += run;
    at = 0;
  }
}

inline Problem make_problem(const Case &c, uint32_t seed) {
  Problem p{c, std::vector<Group>(c.m.size())};
  const Pool pa = make_pool(c.ops, c.exact, false, seed * 7 + 1), pb = make_pool(c.ops, c.exact, true, seed * 7 + 2);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < p.groups(); ++i) {
    Group &g = p.g[i];
    take(pa, p.elem(), static_cast<size_t>(c.m[i] * c.k[i]), rng, &g.a);
    take(pb, p.elem(), static_cast<size_t>(c.n[i] * c.k[i]), rng, &g.b);
    if (c.ops == Operands::kFp8) {
      if (c.exact) {
        g.sa = std::ldexp(1.0f, static_cast<int>(rng() % 4) - 2);
        g.sb = std::ldexp(1.0f, static_cast<int>(rng() % 4) - 2);
      } else {  // amax / 448 of the pool's data, times a factor in [1/4, 4)
        g.sa = (4.0f / 448.0f) * std::exp2(static_cast<float>(rng() % 4096) / 1024.0f - 2.0f);
        g.sb = (0.2f / 448.0f) * std::exp2(static_cast<float>(rng() % 4096) / 1024.0f - 2.0f);
      }
    }
    if (c.bias) {
      g.bias.resize(static_cast<size_t>(c.n[i]));
      for (auto &v : g.bias) {
        v = bf16_bits(c.exact ? static_cast<float>(static_cast<int>(rng() % 257) - 128) / 16.0f : normal(rng));
      }
    }
  }
  return p;
}

// --- the CPU path ------------------------------------------------------------------------------

// D of every group (as stored) by te_gemm on host buffers. abs_product: T instead (|A|, |B|,
// fp32 D, no bias).
inline std::vector<std::vector<uint8_t>> run_cpu(const Problem &p, bool abs_product) {
  const Case &c = p.c;
  const te_dtype d_dtype = abs_product ? TE_DTYPE_FLOAT32 : c.d_dtype;
  const te_gemm_config cfg{0, 1, 0, c.split ? 1 : 0, 0};
  std::vector<std::vector<uint8_t>> out(p.groups());
  for (size_t i = 0; i < p.groups(); ++i) {
    const Group &g = p.g[i];
    std::vector<uint8_t> a = g.a, b = g.b;
    if (abs_product) {
      for (auto *v : {&a, &b}) {
        for (size_t j = p.elem() - 1; j < v->size(); j += p.elem()) (*v)[j] &= 0x7F;  // the sign bit
      }
    }
    float sa = g.sa, sb = g.sb;
    std::vector<uint16_t> bias = g.bias;
    out[i].assign(std::max<size_t>(static_cast<size_t>(c.m[i] * c.n[i]) * te_dtype_size(d_dtype), 16), 0);
    TensorHandle ta, tb, td, tbias;
    bind(ta, TE_SLOT_DATA, TE_DEVICE_CPU, 0, a.data(), p.ab_dtype(), {c.m[i], c.k[i]});
    bind(tb, TE_SLOT_DATA, TE_DEVICE_CPU, 0, b.data(), p.ab_dtype(), {c.n[i], c.k[i]});
    if (c.ops == Operands::kFp8) {
      bind(ta, TE_SLOT_SCALE_INV, TE_DEVICE_CPU, 0, &sa, TE_DTYPE_FLOAT32, {1});
      bind(tb, TE_SLOT_SCALE_INV, TE_DEVICE_CPU, 0, &sb, TE_DTYPE_FLOAT32, {1});
    }
    bind(td, TE_SLOT_DATA, TE_DEVICE_CPU, 0, out[i].data(), d_dtype, {c.m[i], c.n[i]});
    const bool with_bias = c.bias && !abs_product;
    if (with_bias) bind(tbias, TE_SLOT_DATA, TE_DEVICE_CPU, 0, bias.data(), TE_DTYPE_BFLOAT16, {c.n[i]});
    const te_status st = te_gemm(ta, tb, td, with_bias ? tbias.t : nullptr, nullptr, &cfg, nullptr, 0, nullptr);
    if (st != TE_SUCCESS) std::printf("    cpu group %zu failed: %s\n", i, te_last_error());
    CHECK(st == TE_SUCCESS);
    out[i].resize(static_cast<size_t>(c.m[i] * c.n[i]) * te_dtype_size(d_dtype));
  }
  return out;
}

// --- the CUDA paths ----------------------------------------------------------------------------

// A problem's buffers on the device: each kind in one allocation, every group's buffer at a
// 256-byte boundary, each D between guard bytes.
struct DeviceProblem {
  int dev = 0;
  uint8_t *a = nullptr, *b = nullptr, *bias = nullptr, *d = nullptr, *ws = nullptr;
  float *scales = nullptr;  // sa, sb of group i at 2i, 2i + 1
  std::vector<size_t> a_at, b_at, bias_at, d_at;
  size_t d_total = 0, ws_bytes = 0;

  explicit DeviceProblem(const Problem &p) {
    CUDA_OK(cudaGetDevice(&dev));
    const size_t g = p.groups();
    size_t a_total = 0, b_total = 0, bias_total = 0;
    d_total = kGuard;
    for (size_t i = 0; i < g; ++i) {
      a_at.push_back(a_total);
      a_total += round_up(std::max<size_t>(p.g[i].a.size(), 1), kAlign);
      b_at.push_back(b_total);
      b_total += round_up(std::max<size_t>(p.g[i].b.size(), 1), kAlign);
      bias_at.push_back(bias_total);
      bias_total += round_up(std::max<size_t>(p.g[i].bias.size() * 2, 1), kAlign);
      d_at.push_back(d_total);
      d_total += round_up(p.d_bytes(i), kAlign) + kGuard;
    }
    CUDA_OK(cudaMalloc(&a, a_total));
    CUDA_OK(cudaMalloc(&b, b_total));
    CUDA_OK(cudaMalloc(&bias, bias_total));
    CUDA_OK(cudaMalloc(&d, d_total));
    CUDA_OK(cudaMalloc(&scales, std::max<size_t>(2 * g, 1) * sizeof(float)));
    std::vector<float> s(2 * g);
    for (size_t i = 0; i < g; ++i) {
      CUDA_OK(cudaMemcpy(a + a_at[i], p.g[i].a.data(), p.g[i].a.size(), cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(b + b_at[i], p.g[i].b.data(), p.g[i].b.size(), cudaMemcpyHostToDevice));
      if (!p.g[i].bias.empty()) {
        CUDA_OK(cudaMemcpy(bias + bias_at[i], p.g[i].bias.data(), p.g[i].bias.size() * 2, cudaMemcpyHostToDevice));
      }
      s[2 * i] = p.g[i].sa;
      s[2 * i + 1] = p.g[i].sb;
    }
    if (g > 0) CUDA_OK(cudaMemcpy(scales, s.data(), s.size() * sizeof(float), cudaMemcpyHostToDevice));
    // One workspace for both paths: cuBLASLt's size covers the grouped kernel's.
    ws_bytes = te_gemm_workspace_size();
    CUDA_OK(cudaMalloc(&ws, ws_bytes));
  }
  ~DeviceProblem() {
    for (void *q : {static_cast<void *>(a), static_cast<void *>(b), static_cast<void *>(bias), static_cast<void *>(d),
                    static_cast<void *>(ws), static_cast<void *>(scales)}) {
      cudaFree(q);
    }
  }
  DeviceProblem(const DeviceProblem &) = delete;
  DeviceProblem &operator=(const DeviceProblem &) = delete;
};

// The te_tensor handles of a problem's device buffers, as te_grouped_gemm takes them.
struct Handles {
  std::vector<std::unique_ptr<TensorHandle>> own;
  std::vector<const te_tensor *> a, b, bias;
  std::vector<te_tensor *> d;

  Handles(const Problem &p, const DeviceProblem &dp) {
    const Case &c = p.c;
    auto make = [&]() {
      own.push_back(std::make_unique<TensorHandle>());
      return own.back()->t;
    };
    for (size_t i = 0; i < p.groups(); ++i) {
      te_tensor *ta = make(), *tb = make(), *td = make();
      bind(ta, TE_SLOT_DATA, TE_DEVICE_CUDA, dp.dev, dp.a + dp.a_at[i], p.ab_dtype(), {c.m[i], c.k[i]});
      bind(tb, TE_SLOT_DATA, TE_DEVICE_CUDA, dp.dev, dp.b + dp.b_at[i], p.ab_dtype(), {c.n[i], c.k[i]});
      if (c.ops == Operands::kFp8) {
        bind(ta, TE_SLOT_SCALE_INV, TE_DEVICE_CUDA, dp.dev, dp.scales + 2 * i, TE_DTYPE_FLOAT32, {1});
        bind(tb, TE_SLOT_SCALE_INV, TE_DEVICE_CUDA, dp.dev, dp.scales + 2 * i + 1, TE_DTYPE_FLOAT32, {1});
      }
      bind(td, TE_SLOT_DATA, TE_DEVICE_CUDA, dp.dev, dp.d + dp.d_at[i], c.d_dtype, {c.m[i], c.n[i]});
      a.push_back(ta);
      b.push_back(tb);
      d.push_back(td);
      te_tensor *tbias = nullptr;
      if (c.bias) {
        tbias = make();
        bind(tbias, TE_SLOT_DATA, TE_DEVICE_CUDA, dp.dev, dp.bias + dp.bias_at[i], TE_DTYPE_BFLOAT16, {c.n[i]});
      }
      bias.push_back(tbias);
    }
  }
};

enum class Path { kLoop, kOurs };  // te_grouped_gemm (cuBLASLt per group), te_hopper_grouped_gemm

inline te_status call(Path path, const Problem &p, const DeviceProblem &dp, const Handles &h, bool split, cudaStream_t s) {
  const te_gemm_config cfg{0, 1, 0, split ? 1 : 0, 0};
  const te_tensor *const *bias = p.c.bias ? h.bias.data() : nullptr;
  const te_stream stream = reinterpret_cast<te_stream>(s);
  if (path == Path::kOurs) {
    return te_hopper_grouped_gemm(h.a.data(), h.b.data(), h.d.data(), bias, p.groups(), &cfg, dp.ws, dp.ws_bytes,
                                  stream);
  }
  return te_grouped_gemm(h.a.data(), h.b.data(), h.d.data(), bias, p.groups(), &cfg, dp.ws, dp.ws_bytes, stream);
}

struct Result {
  te_status status = TE_SUCCESS;
  std::string message;
  std::vector<std::vector<uint8_t>> d;  // per group, as stored
  bool guards_intact = true;
  double ms = 0.0;                      // per call, when timed
};

// D of every group as the device holds it now; guards checked.
inline void read_back(const Problem &p, const DeviceProblem &dp, Result *r) {
  std::vector<uint8_t> all(dp.d_total);
  CUDA_OK(cudaMemcpy(all.data(), dp.d, all.size(), cudaMemcpyDeviceToHost));
  r->d.assign(p.groups(), {});
  size_t at = 0;
  for (size_t i = 0; i < p.groups(); ++i) {
    // Everything between the previous group's D and this one's, and past this one's rows up to
    // the next 256-byte boundary, is guard.
    for (; at < dp.d_at[i]; ++at) r->guards_intact = r->guards_intact && all[at] == kGuardByte;
    r->d[i].assign(all.begin() + dp.d_at[i], all.begin() + dp.d_at[i] + p.d_bytes(i));
    at = dp.d_at[i] + p.d_bytes(i);
  }
  for (; at < dp.d_total; ++at) r->guards_intact = r->guards_intact && all[at] == kGuardByte;
}

// One call on freshly guarded D; timed_iters > 0: then that many calls timed on the stream.
inline Result run_gpu(Path path, const Problem &p, const DeviceProblem &dp, const Handles &h, bool split,
               int timed_iters = 0) {
  Result r;
  CUDA_OK(cudaMemset(dp.d, kGuardByte, dp.d_total));
  r.status = call(path, p, dp, h, split, nullptr);
  r.message = r.status == TE_SUCCESS ? "" : te_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  if (r.status != TE_SUCCESS) return r;
  read_back(p, dp, &r);
  if (timed_iters > 0) {
    r.ms = ms_per_call([&] { call(path, p, dp, h, split, nullptr); }, timed_iters);
  }
  return r;
}

// --- comparisons -------------------------------------------------------------------------------

// Elements whose bytes differ; *zero_signs counts those that differ only as +0 and -0.
inline int64_t bit_differences(const Problem &p, const std::vector<std::vector<uint8_t>> &x,
                        const std::vector<std::vector<uint8_t>> &y, int64_t *zero_signs) {
  int64_t n = 0;
  *zero_signs = 0;
  const size_t w = te_dtype_size(p.c.d_dtype);
  for (size_t g = 0; g < p.groups(); ++g) {
    if (x[g].size() != y[g].size()) return -1;
    for (size_t e = 0; e < x[g].size() / w; ++e) {
      if (std::memcmp(&x[g][e * w], &y[g][e * w], w) == 0) continue;
      ++n;
      if (d_value(x[g], p.c.d_dtype, e) == 0.0f && d_value(y[g], p.c.d_dtype, e) == 0.0f) ++*zero_signs;
      if (n == 1) {
        std::printf("      first difference: group %zu element %zu: %.9g vs %.9g\n", g, e,
                    d_value(x[g], p.c.d_dtype, e), d_value(y[g], p.c.d_dtype, e));
      }
    }
  }
  return n;
}

// Largest error / bound ratio of got against ref (the bound of the top); gpu_sides: how many of
// the two are GPU paths (1: against the CPU path, 2: against cuBLASLt). Counts elements over it.
inline double compare_bounded(const Problem &p, const std::vector<std::vector<uint8_t>> &t,
                       const std::vector<std::vector<uint8_t>> &got, const std::vector<std::vector<uint8_t>> &ref,
                       int gpu_sides, int64_t *over) {
  const Case &c = p.c;
  const bool fp8 = c.ops == Operands::kFp8;
  double worst = 0.0;
  *over = 0;
  for (size_t g = 0; g < p.groups(); ++g) {
    const double k4 = static_cast<double>(c.k[g] + 4);
    const double rel = gpu_sides * (2.0 * k4 * kU + (fp8 ? kTensorCore : 0.0)) + (2 - gpu_sides) * k4 * kU;
    for (int64_t i = 0; i < c.m[g]; ++i) {
      for (int64_t j = 0; j < c.n[g]; ++j) {
        const size_t e = static_cast<size_t>(i * c.n[g] + j);
        const double x = d_value(got[g], c.d_dtype, e), y = d_value(ref[g], c.d_dtype, e);
        const double tij = d_value(t[g], TE_DTYPE_FLOAT32, e);
        const double bias = c.bias ? std::fabs(te::bf16_to_float(p.g[g].bias[static_cast<size_t>(j)])) : 0.0;
        double bound = rel * tij;
        bound += 4.0 * kU * (tij + std::fabs(y) + bias + bound);
        if (c.d_dtype == TE_DTYPE_BFLOAT16) {
          // each side rounded once to bf16, from fp32 values within `bound`: they may land on
          // neighbouring bf16 values, one ulp (up to 2^-7 |y|) apart
          bound = bound * (1.0 + 1.0 / 512) + (1.0 / 128) * (1.0 + 1.0 / 128) * std::fabs(y);
        }
        bound += 1e-30;
        const double err = std::fabs(x - y);
        if (!(err <= bound)) ++*over;  // NaN counts as over
        worst = std::max(worst, std::isnan(err) ? INFINITY : err / bound);
      }
    }
  }
  return worst;
}

inline int64_t total_rows(const Case &c) {
  int64_t r = 0;
  for (int64_t m : c.m) r += m;
  return r;
}

inline double flops(const Case &c) {
  double f = 0.0;
  for (size_t i = 0; i < c.m.size(); ++i) f += 2.0 * c.m[i] * c.n[i] * c.k[i];
  return f;
}

inline void print_case(const Case &c) {
  std::printf("  %-40s %zu groups, %lld rows, %s%s%s%s\n", c.name.c_str(), c.m.size(),
              static_cast<long long>(total_rows(c)), c.ops == Operands::kFp8 ? "e4m3" : "bf16",
              (std::string(" -> ") + te_dtype_name(c.d_dtype)).c_str(), c.bias ? " +bias" : "",
              c.ops == Operands::kFp8 ? (c.split ? " split" : " fast") : "");
}

inline void run_case(const Case &c, uint32_t seed) {
  print_case(c);
  const Problem p = make_problem(c, seed);
  const DeviceProblem dp(p);
  const Handles h(p, dp);
  const Result ours = run_gpu(Path::kOurs, p, dp, h, c.split);
  // cuBLASLt with the split accumulator for random FP8 data (see the top), as asked otherwise.
  const bool loop_split = c.split || (!c.exact && c.ops == Operands::kFp8);
  const Result loop = run_gpu(Path::kLoop, p, dp, h, loop_split);
  if (!ours_ran(ours.status, ours.message, ours.guards_intact)) return;
  const bool have_loop = other_ran("cublaslt loop", loop.status, loop.message);
  const auto cpu = run_cpu(p, false);
  int64_t zeros = 0;
  if (c.exact) {
    const int64_t diff = bit_differences(p, ours.d, cpu, &zeros);
    std::printf("    exact data: hopper vs cpu %lld differing elements (%lld only in the sign of 0)\n",
                static_cast<long long>(diff), static_cast<long long>(zeros));
    CHECK(diff == 0);
    if (have_loop) {
      const int64_t ldiff = bit_differences(p, loop.d, cpu, &zeros);
      // cuBLASLt is the other implementation under comparison, not the one under test: reported.
      std::printf("    exact data: cublaslt loop vs cpu %lld differing elements%s\n", static_cast<long long>(ldiff),
                  ldiff == 0 ? "" : " (note: cuBLASLt is not exact here)");
    }
    return;
  }
  const auto t = run_cpu(p, true);
  int64_t over = 0;
  const double vs_cpu = compare_bounded(p, t, ours.d, cpu, 1, &over);
  std::printf("    hopper vs cpu: max error / bound %.3g, %lld over\n", vs_cpu, static_cast<long long>(over));
  CHECK(over == 0);
  if (have_loop) {
    const double vs_loop = compare_bounded(p, t, ours.d, loop.d, 2, &over);
    std::printf("    hopper vs cublaslt loop%s: max error / bound %.3g, %lld over\n", loop_split ? " (split)" : "",
                vs_loop, static_cast<long long>(over));
    CHECK(over == 0);
  }
}

}  // namespace grouped_test

#endif  // TRANSFORMER_ENGINE_TESTS_HOPPER_GROUPED_PROBLEM_H_
