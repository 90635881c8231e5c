// GPU test of the Hopper grouped GEMM (src/gemm/hopper/grouped_gemm.cu), through its entry point
// te_hopper_grouped_gemm, against the CPU path (te_gemm on each group's CPU buffers) and the
// cuBLASLt loop (te_grouped_gemm on the same CUDA buffers): FP8 E4M3 with per-tensor scales
// (each group its own pair) to bf16 or fp32, and bf16 to bf16, with and without bias, on 8 and
// 64 groups whose M includes 0, 16, 48 and 1008 (not multiples of the 128-row tile), at the
// DeepSeek-V3 expert shape (K = 7168, N = 4096) and at K = 128, and groups of different N and K.
// Then one call captured in a CUDA graph and replayed after other calls (the staging of the
// arguments must outlive the capture), and the times of both on the 64-expert DeepSeek shape
// (65536 routed rows).
//
// Built in CUDA builds that found CUTLASS (cmake/cutlass.cmake) and run by ctest. The argument
// checks run anywhere; the GPU cases need an sm_90 device, and without one the test exits with
// 77, which ctest reports as skipped.
//
// Two kinds of data:
//  exact:  operand values are integers in [-4, 4], FP8 scales powers of two in [2^-2, 2], bias
//          values multiples of 2^-4 up to 8. The FP8 kernel sums each 128 of K in the tensor
//          cores (integer partial sums of at most 2^11 in magnitude: exact within their reduced
//          precision, about 14 significant bits, below) and adds those sums in fp32 (below 2^17
//          for K = 7168: exact); the bf16 kernel sums in fp32 (exact below 2^24). The scale product and the
//          bias are exact too, so every path computes the exact result and rounds it once to D's
//          type: the kernel's D must equal the CPU path's bit for bit. This is the check that
//          catches a wrong pointer, stride, scale or group. (cuBLASLt's fast FP8 accumulation sums
//          all of K in the tensor cores, whose partial sums exceed 14 bits here: its differences
//          from the CPU path are reported, not checked.)
//  random: normal values (FP8: quantized, scales not powers of two), compared within a bound
//          derived below.
//
// The bound for random data, per element (i, j) of a group, with u = 2^-24 and
//   T = sa sb sum_k |a_ik| |b_jk|   (the CPU path on |A|, |B|; its own error is far below this)
//  - The CPU path sums in fp32: each product passes through at most K + 2 roundings, so it errs
//    from the exact sum by at most (K + 4) u T (the recursive-summation bound, with room).
//  - A GPU path's fp32 additions may truncate rather than round (the tensor cores' own), so
//    2 (K + 4) u T; FP8 tensor cores add up to 2^-9 T for their reduced precision within a
//    128-deep partial sum (2^-10.5 T measured on an H200, tests/common/_tolerances.py), once per
//    path. cuBLASLt is compared with its split accumulator on (config.use_split_accumulator),
//    which promotes its partial sums as our kernel does.
//  - The epilogues scale and add the bias in other orders: 4 u (T + |ref| + |bias| + bound).
//  - A bf16 D rounds each side's fp32 value x, y to nearest: |X - Y| <= |x - y| + 2^-9 (|x| + |y|)
//    <= d (1 + 2^-9) + 2^-8 (1 + 2^-8) |Y| for d >= |x - y| and Y the reference as stored.
// The test prints the largest error / bound ratio, so that the margin can be seen.
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

namespace {

using te_test::TensorHandle;
using namespace hopper_test;  // NOLINT: the shared constants and helpers

constexpr size_t kAlign = 256;                // every device buffer of a group starts here

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// --- problems ----------------------------------------------------------------------------------

enum class Operands { kFp8, kBf16 };

struct Case {
  std::string name;
  Operands ops;
  te_dtype d_dtype;
  std::vector<int64_t> m, n, k;  // per group
  bool bias, split, exact;
};

Case uniform(std::string name, Operands ops, te_dtype d_dtype, std::vector<int64_t> m, int64_t n, int64_t k,
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

Pool make_pool(Operands ops, bool exact, bool weights, uint32_t seed) {
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

void take(const Pool &pool, size_t elem, size_t count, std::mt19937 &rng, std::vector<uint8_t> *out) {
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

Problem make_problem(const Case &c, uint32_t seed) {
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
std::vector<std::vector<uint8_t>> run_cpu(const Problem &p, bool abs_product) {
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

te_status call(Path path, const Problem &p, const DeviceProblem &dp, const Handles &h, bool split, cudaStream_t s) {
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
void read_back(const Problem &p, const DeviceProblem &dp, Result *r) {
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
Result run_gpu(Path path, const Problem &p, const DeviceProblem &dp, const Handles &h, bool split,
               int timed_iters = 0) {
  Result r;
  CUDA_OK(cudaMemset(dp.d, kGuardByte, dp.d_total));
  r.status = call(path, p, dp, h, split, nullptr);
  r.message = r.status == TE_SUCCESS ? "" : te_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  if (r.status != TE_SUCCESS) return r;
  read_back(p, dp, &r);
  if (timed_iters > 0) {
    cudaEvent_t start, stop;
    CUDA_OK(cudaEventCreate(&start));
    CUDA_OK(cudaEventCreate(&stop));
    for (int i = 0; i < 3; ++i) call(path, p, dp, h, split, nullptr);  // warm-up
    CUDA_OK(cudaEventRecord(start));
    for (int i = 0; i < timed_iters; ++i) call(path, p, dp, h, split, nullptr);
    CUDA_OK(cudaEventRecord(stop));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    r.ms = ms / timed_iters;
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  return r;
}

// --- comparisons -------------------------------------------------------------------------------

// Elements whose bytes differ; *zero_signs counts those that differ only as +0 and -0.
int64_t bit_differences(const Problem &p, const std::vector<std::vector<uint8_t>> &x,
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
double compare_bounded(const Problem &p, const std::vector<std::vector<uint8_t>> &t,
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

int64_t total_rows(const Case &c) {
  int64_t r = 0;
  for (int64_t m : c.m) r += m;
  return r;
}

double flops(const Case &c) {
  double f = 0.0;
  for (size_t i = 0; i < c.m.size(); ++i) f += 2.0 * c.m[i] * c.n[i] * c.k[i];
  return f;
}

void print_case(const Case &c) {
  std::printf("  %-40s %zu groups, %lld rows, %s%s%s%s\n", c.name.c_str(), c.m.size(),
              static_cast<long long>(total_rows(c)), c.ops == Operands::kFp8 ? "e4m3" : "bf16",
              (std::string(" -> ") + te_dtype_name(c.d_dtype)).c_str(), c.bias ? " +bias" : "",
              c.ops == Operands::kFp8 ? (c.split ? " split" : " fast") : "");
}

void run_case(const Case &c, uint32_t seed) {
  print_case(c);
  const Problem p = make_problem(c, seed);
  const DeviceProblem dp(p);
  const Handles h(p, dp);
  const Result ours = run_gpu(Path::kOurs, p, dp, h, c.split);
  // cuBLASLt with the split accumulator for random FP8 data (see the top), as asked otherwise.
  const bool loop_split = c.split || (!c.exact && c.ops == Operands::kFp8);
  const Result loop = run_gpu(Path::kLoop, p, dp, h, loop_split);
  if (ours.status != TE_SUCCESS) {
    std::printf("    hopper failed: %s\n", ours.message.c_str());
    CHECK(ours.status == TE_SUCCESS);
    return;
  }
  CHECK(ours.guards_intact);
  const bool have_loop = loop.status == TE_SUCCESS;
  if (!have_loop) std::printf("    cublaslt loop: not compared (%s)\n", loop.message.c_str());
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

// --- argument checks (no device needed) --------------------------------------------------------

// One group's host buffers, labelled CUDA (never touched: every call below is refused before the
// device is looked at) or CPU.
struct ArgGroup {
  alignas(16) uint8_t a[32 * 128 * 2];  // room for 2-byte operands
  alignas(16) uint8_t b[32 * 128 * 2];
  alignas(16) uint8_t d[32 * 32 * 4 + 16];
  alignas(16) float sa[1], sb[1], amax[1], scale[1];
  alignas(16) uint16_t bias[32];
  TensorHandle ta, tb, td, tbias;
  void set(te_device_type dev, te_dtype a_dtype, te_dtype b_dtype, te_dtype d_dtype, int64_t m = 32, int64_t n = 32,
           int64_t k = 128, size_t d_offset = 0) {
    bind(ta, TE_SLOT_DATA, dev, 0, a, a_dtype, {m, k});
    bind(tb, TE_SLOT_DATA, dev, 0, b, b_dtype, {n, k});
    if (te_dtype_size(a_dtype) == 1) {
      bind(ta, TE_SLOT_SCALE_INV, dev, 0, sa, TE_DTYPE_FLOAT32, {1});
      bind(tb, TE_SLOT_SCALE_INV, dev, 0, sb, TE_DTYPE_FLOAT32, {1});
    }
    bind(td, TE_SLOT_DATA, dev, 0, d + d_offset, d_dtype, {m, n});
    bind(tbias, TE_SLOT_DATA, dev, 0, bias, TE_DTYPE_BFLOAT16, {n});
  }
  // A fresh d handle: without the scale or amax slot a previous check set.
  void fresh_d() {
    te_tensor_destroy(td.t);
    te_tensor_create(TE_SCALING_TENSOR, &td.t);
  }
};

struct ArgCall {
  ArgGroup g[2];
  te_status run(size_t groups, const te_gemm_config *cfg, bool bias0, bool bias1) {
    const te_tensor *a[2] = {g[0].ta, g[1].ta}, *b[2] = {g[0].tb, g[1].tb};
    te_tensor *d[2] = {g[0].td, g[1].td};
    const te_tensor *bias[2] = {bias0 ? g[0].tbias.t : nullptr, bias1 ? g[1].tbias.t : nullptr};
    return te_hopper_grouped_gemm(a, b, d, bias0 || bias1 ? bias : nullptr, groups, cfg, nullptr, 0, nullptr);
  }
};

TEST_CASE(entry_point_rejects_what_the_kernel_does_not_take) {
  static ArgCall call;  // static: the buffers are large for a stack
  constexpr te_device_type kCuda = TE_DEVICE_CUDA;
  const te_dtype e4m3 = TE_DTYPE_FLOAT8_E4M3, bf16 = TE_DTYPE_BFLOAT16;
  const te_gemm_config split{0, 1, 0, 1, 0};

  call.g[0].set(TE_DEVICE_CPU, e4m3, e4m3, bf16);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_VALUE, "hopper_grouped_gemm: the groups must be on a CUDA device");
  // te_gemm's rules come first (resolve_gemm), naming the group.
  call.g[0].set(kCuda, e4m3, e4m3, bf16, 24);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_VALUE,
              "hopper_grouped_gemm: group 0: M (rows of a) must be a multiple of 16", "got 24");
  const te_gemm_config gelu{0, 1, 0, 0, 1};
  call.g[0].set(kCuda, e4m3, e4m3, bf16);
  CHECK_ERROR(call.run(1, &gelu, false, false), TE_ERROR_VALUE, "config.gelu must be 0");
  // Then the kernel's own.
  call.g[0].set(kCuda, e4m3, TE_DTYPE_FLOAT8_E5M2, bf16);
  CHECK_ERROR(call.run(1, &split, false, false), TE_ERROR_UNSUPPORTED, "group 0: FP8 operands must both be float8_e4m3",
              "float8_e4m3 x float8_e5m2");
  call.g[0].set(kCuda, TE_DTYPE_FLOAT16, TE_DTYPE_FLOAT16, TE_DTYPE_FLOAT16);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "float8_e4m3 (per-tensor scales) or bfloat16",
              "float16 x float16");
  call.g[0].set(kCuda, bf16, bf16, TE_DTYPE_FLOAT32);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "D must be bfloat16 with bfloat16 operands");
  call.g[0].set(kCuda, e4m3, e4m3, TE_DTYPE_FLOAT16);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "D must be bfloat16 or float32 with FP8");
  call.g[0].set(kCuda, e4m3, e4m3, e4m3);
  bind(call.g[0].td, TE_SLOT_SCALE, kCuda, 0, call.g[0].scale, TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "an FP8 D is not produced");
  call.g[0].fresh_d();
  call.g[0].set(kCuda, e4m3, e4m3, bf16);
  bind(call.g[0].td, TE_SLOT_AMAX, kCuda, 0, call.g[0].amax, TE_DTYPE_FLOAT32, {1});
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "amax is not produced");
  call.g[0].fresh_d();
  call.g[0].set(kCuda, e4m3, e4m3, bf16);
  const te_gemm_config accumulate{0, 1, 1, 0, 0};
  CHECK_ERROR(call.run(1, &accumulate, false, false), TE_ERROR_UNSUPPORTED, "accumulation into D");
  const te_gemm_config nn{0, 0, 0, 0, 0};
  call.g[0].set(kCuda, bf16, bf16, bf16, 32, 32, 32);  // B [K, N] = [32, 32]
  CHECK_ERROR(call.run(1, &nn, false, false), TE_ERROR_UNSUPPORTED, "the layout must be A [M, K] and B [N, K]");
  call.g[0].set(kCuda, bf16, bf16, bf16, 32, 24);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "N must be a multiple of 16, got 24");
  call.g[0].set(kCuda, bf16, bf16, bf16, 32, 32, 0);
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "K must be positive, got 0");
  call.g[0].set(kCuda, e4m3, e4m3, bf16, 32, 32, 128, 8);  // D 8 bytes off: no TMA
  CHECK_ERROR(call.run(1, nullptr, false, false), TE_ERROR_UNSUPPORTED, "16-byte aligned");
  // Across groups: one kind per launch, bias everywhere or nowhere; empty groups are not looked at.
  call.g[0].set(kCuda, e4m3, e4m3, bf16);
  call.g[1].set(kCuda, bf16, bf16, bf16);
  CHECK_ERROR(call.run(2, nullptr, false, false), TE_ERROR_UNSUPPORTED, "group 1: every group must be of one kind",
              "float8_e4m3 -> bfloat16", "bfloat16 -> bfloat16");
  call.g[1].set(kCuda, e4m3, e4m3, bf16);
  CHECK_ERROR(call.run(2, nullptr, true, false), TE_ERROR_UNSUPPORTED, "group 1: a bias must be given for every group");
  call.g[0].set(kCuda, TE_DTYPE_FLOAT16, TE_DTYPE_FLOAT16, TE_DTYPE_FLOAT16, 0);  // no rows: not looked at
  call.g[1].set(kCuda, e4m3, TE_DTYPE_FLOAT8_E5M2, bf16);
  CHECK_ERROR(call.run(2, nullptr, false, false), TE_ERROR_UNSUPPORTED, "group 1: FP8 operands must both be float8_e4m3");
  // Overlap across groups (te_grouped_gemm's rule): group 1 writes group 0's A.
  call.g[0].set(kCuda, e4m3, e4m3, bf16);
  call.g[1].set(kCuda, e4m3, e4m3, bf16);
  bind(call.g[1].td, TE_SLOT_DATA, kCuda, 0, call.g[0].a, bf16, {32, 32});
  CHECK_ERROR(call.run(2, nullptr, false, false), TE_ERROR_VALUE, "group 1 d.data must not overlap the input group 0 a.data");
}

TEST_CASE(workspace_size) {
  const size_t w0 = te_hopper_grouped_gemm_workspace_size(0), w8 = te_hopper_grouped_gemm_workspace_size(8);
  const size_t w64 = te_hopper_grouped_gemm_workspace_size(64);
  std::printf("  workspace: %zu bytes for 0 groups, %zu for 8, %zu for 64\n", w0, w8, w64);
  CHECK(w0 > 0 && w0 < w8 && w8 < w64);
  CHECK(w0 % 256 == 0 && w64 % 256 == 0);
  CHECK(w64 - w0 <= 64 * 128);                                     // a few pointers per group
  CHECK(te_hopper_grouped_gemm_workspace_size(1024) <= te_gemm_workspace_size());  // cuBLASLt's covers it
}

// --- GPU cases ---------------------------------------------------------------------------------

// Why the GPU cases cannot run here, or "" when they can.

std::vector<int64_t> cycle(std::vector<int64_t> pattern, size_t groups) {
  std::vector<int64_t> m(groups);
  for (size_t i = 0; i < groups; ++i) m[i] = pattern[i % pattern.size()];
  return m;
}

// Calls that pass te_gemm's checks and the kernel's, then: an empty call, groups without rows,
// a short workspace.
void edge_cases() {
  std::printf("  edge cases\n");
  const Case c = uniform("edges", Operands::kFp8, TE_DTYPE_BFLOAT16, {0, 0, 32}, 256, 128, false, false, true);
  const Problem p = make_problem(c, 99);
  const DeviceProblem dp(p);
  const Handles h(p, dp);
  const te_gemm_config cfg{0, 1, 0, 0, 0};
  CHECK(te_hopper_grouped_gemm(nullptr, nullptr, nullptr, nullptr, 0, &cfg, nullptr, 0, nullptr) == TE_SUCCESS);
  CUDA_OK(cudaMemset(dp.d, kGuardByte, dp.d_total));
  // Only the empty groups: nothing launched, nothing written, no workspace needed.
  CHECK(te_hopper_grouped_gemm(h.a.data(), h.b.data(), h.d.data(), nullptr, 2, &cfg, nullptr, 0, nullptr) == TE_SUCCESS);
  Result r;
  CUDA_OK(cudaDeviceSynchronize());
  read_back(p, dp, &r);
  CHECK(r.guards_intact);
  const size_t need = te_hopper_grouped_gemm_workspace_size(3);
  CHECK_ERROR(te_hopper_grouped_gemm(h.a.data(), h.b.data(), h.d.data(), nullptr, 3, &cfg, dp.ws, need - 1, nullptr),
              TE_ERROR_VALUE, "workspace must hold");
  CHECK_ERROR(te_hopper_grouped_gemm(h.a.data(), h.b.data(), h.d.data(), nullptr, 3, &cfg, dp.ws + 16, need, nullptr),
              TE_ERROR_VALUE, "256-byte aligned");
}

// The call captured in a CUDA graph, replayed after other calls have reused the staging
// buffers: its result must not change.
void graph_case() {
  const Case c = uniform("exact, captured in a CUDA graph", Operands::kFp8, TE_DTYPE_BFLOAT16,
                         {48, 0, 1008, 16, 128, 272}, 512, 256, true, false, true);
  print_case(c);
  const Problem p = make_problem(c, 41), other = make_problem(c, 42);
  const DeviceProblem dp(p), dother(other);
  const Handles h(p, dp), hother(other, dother);
  const Result direct = run_gpu(Path::kOurs, p, dp, h, false);
  CHECK(direct.status == TE_SUCCESS);
  if (direct.status != TE_SUCCESS) return;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaMemset(dp.d, kGuardByte, dp.d_total));
  CUDA_OK(cudaDeviceSynchronize());  // s does not wait for the legacy stream
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const te_status st = call(Path::kOurs, p, dp, h, false, s);
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  if (st != TE_SUCCESS) std::printf("    captured call failed: %s\n", te_last_error());
  CHECK(st == TE_SUCCESS);
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 4; ++i) CHECK(call(Path::kOurs, other, dother, hother, false, s) == TE_SUCCESS);
  CUDA_OK(cudaGraphLaunch(exec, s));
  CUDA_OK(cudaStreamSynchronize(s));
  Result replayed;
  read_back(p, dp, &replayed);
  int64_t zeros = 0;
  const int64_t diff = bit_differences(p, replayed.d, direct.d, &zeros);
  std::printf("    graph replay vs direct call: %lld differing elements\n", static_cast<long long>(diff));
  CHECK(diff == 0 && replayed.guards_intact);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// Rows per expert of the DeepSeek-V3 MoE layer: 8192 tokens routed top-8 over `experts`, drawn
// uniformly (seed 0), each count rounded up to 16 (as the FP8 padding does).
std::vector<int64_t> routed_rows(size_t experts) {
  std::mt19937 rng(0);
  std::vector<int64_t> m(experts, 0);
  for (int i = 0; i < 8192 * 8; ++i) ++m[rng() % experts];
  for (auto &v : m) v = (v + 15) / 16 * 16;
  return m;
}

// Times of both on the 64-expert FC1 shape (K = 7168, N = 4096), and their agreement (relative
// to the largest output: a coarse check, the bounded ones are above).
void timing_case(Operands ops) {
  const Case c = uniform("timing, DeepSeek-V3 FC1, 64 experts", ops, TE_DTYPE_BFLOAT16, routed_rows(64), 4096, 7168,
                         false, false, false);
  print_case(c);
  const Problem p = make_problem(c, 7);
  const DeviceProblem dp(p);
  const Handles h(p, dp);
  const int iters = 20;
  const Result ours = run_gpu(Path::kOurs, p, dp, h, false, iters);
  if (ours.status != TE_SUCCESS) {
    std::printf("    hopper failed: %s\n", ours.message.c_str());
    CHECK(ours.status == TE_SUCCESS);
    return;
  }
  CHECK(ours.guards_intact);
  const double tf = flops(c) / 1e12;
  std::printf("    hopper grouped:        %8.1f us  %6.0f TFLOPS\n", ours.ms * 1e3, tf / (ours.ms * 1e-3));
  const bool fp8 = ops == Operands::kFp8;
  for (bool split : fp8 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
    const Result loop = run_gpu(Path::kLoop, p, dp, h, split, iters);
    if (loop.status != TE_SUCCESS) {
      std::printf("    cublaslt loop failed: %s\n", loop.message.c_str());
      continue;
    }
    std::printf("    cublaslt loop%-8s:  %8.1f us  %6.0f TFLOPS   hopper speedup %.2fx\n",
                fp8 ? (split ? " split" : " fast") : "", loop.ms * 1e3, tf / (loop.ms * 1e-3), loop.ms / ours.ms);
    double max_ref = 0.0, max_diff = 0.0;
    for (size_t g = 0; g < p.groups(); ++g) {
      for (size_t e = 0; e < loop.d[g].size() / 2; ++e) {
        const double x = d_value(ours.d[g], TE_DTYPE_BFLOAT16, e), y = d_value(loop.d[g], TE_DTYPE_BFLOAT16, e);
        max_ref = std::max(max_ref, std::fabs(y));
        max_diff = std::max(max_diff, std::isnan(x - y) ? INFINITY : std::fabs(x - y));
      }
    }
    const double rel = max_diff / std::max(max_ref, 1e-30);
    std::printf("      max |hopper - loop| / max |loop| = %.3g\n", rel);
    CHECK(rel < 1.0 / 64);
  }
}

void gpu_cases() {
  const Operands fp8 = Operands::kFp8, bf16 = Operands::kBf16;
  const te_dtype to_bf16 = TE_DTYPE_BFLOAT16, to_fp32 = TE_DTYPE_FLOAT32;
  const std::vector<int64_t> m8 = {0, 16, 48, 1008, 128, 0, 272, 512};
  const std::vector<int64_t> m64 = cycle({0, 16, 48, 1008, 32, 0, 112, 64}, 64);
  const std::vector<int64_t> m8r = {16, 1008, 0, 48, 256, 128, 0, 528};
  std::vector<Case> cases = {
      // name                                 ops   D        M     N     K     bias   split  exact
      uniform("exact, 8 groups, K 7168 N 4096", fp8, to_bf16, m8, 4096, 7168, true, false, true),
      uniform("exact, 64 groups, K 7168 N 4096", fp8, to_bf16, m64, 4096, 7168, false, true, true),
      uniform("exact, 8 groups, K 128, fp32 D", fp8, to_fp32, m8, 256, 128, true, false, true),
      uniform("exact, 64 groups, K 128, N 208", fp8, to_fp32, m64, 208, 128, false, false, true),
      uniform("random, 8 groups, K 7168 N 4096", fp8, to_bf16, m8r, 4096, 7168, true, true, false),
      uniform("random, 64 groups, K 128, fp32 D", fp8, to_fp32, m64, 208, 128, true, false, false),
      uniform("exact, 8 groups, K 7168 N 4096", bf16, to_bf16, m8, 4096, 7168, true, false, true),
      uniform("exact, 64 groups, K 128", bf16, to_bf16, m64, 256, 128, false, false, true),
      uniform("random, 8 groups, K 7168 N 4096", bf16, to_bf16, m8r, 4096, 7168, false, false, false),
      uniform("random, 64 groups, K 128, N 208", bf16, to_bf16, m64, 208, 128, true, false, false),
  };
  // Groups of different N and K (the kernel takes each group's own; the MoE case varies M only).
  Case mixed = uniform("exact, N and K per group", fp8, to_bf16, {48, 16, 0, 1008, 128, 64, 32}, 0, 0, true, false,
                       true);
  mixed.n = {256, 16, 512, 4096, 208, 1024, 128};
  mixed.k = {128, 384, 64, 7168, 1024, 16, 64};
  cases.push_back(mixed);
  Case mixed_bf16 = mixed;
  mixed_bf16.ops = bf16;
  mixed_bf16.exact = false;
  mixed_bf16.name = "random, N and K per group";
  cases.push_back(mixed_bf16);
  uint32_t seed = 1;
  for (const Case &c : cases) run_case(c, seed++);
  edge_cases();
  graph_case();
  timing_case(fp8);
  timing_case(bf16);
}

}  // namespace

int main() { return hopper_test::run(gpu_cases); }
