// The block-scaled FP8 GEMM's variant sweep: every configuration of sweep_variant.cu (tile,
// cluster, schedule, tile scheduler) under every raster order and swizzle, timed on the shapes
// the recipe runs, beside cuBLASLt's block-scaled and per-tensor FP8 GEMMs in the same process.
// Each variant's D is compared bit for bit with variant 0's (the configuration te_gemm runs),
// whose correctness test_hopper_block_scaled_gemm establishes: a data-parallel variant only
// re-tiles the same sums, so anything but equal bits is a fault. Stream-K shares a tile's
// k-blocks among CTAs and adds their partial sums in another order: its D may differ in the
// last bit of an element, so it passes within kSplitTolerance of max |D| instead.
//
//   sweep_block_scaled_gemm OUT.json [GIT_COMMIT]
//
// Writes the JSON (device, CUTLASS version, date, shapes, medians) and prints a table. Exits
// 77 without an sm_90 device, 1 when a variant disagrees with te_gemm's or a reference fails.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "common/numerics.h"
#include "cutlass/version.h"
#include "gemm/gemm_impl.h"
#include "gemm/hopper/block_scaled_wgmma.h"
#include "hopper/hopper_test.h"  // CUDA_OK, gpu_missing, kSkipped
#include "hopper/sweep_variant.h"
#include "transformer_engine/tensor.h"

namespace {

constexpr int kBatches = 5;        // timed batches per case; the median batch is reported
constexpr int kCallsPerBatch = 8;  // calls per batch (timed together by CUDA events)
// Stream-K's bound, relative to max |D|: reordered fp32 sums then a bf16 rounding move an
// element by at most about one bf16 unit in the last place (2^-8 of itself); twice that.
constexpr double kSplitTolerance = 1.0 / 128;

struct Shape {
  int64_t m, n, k;
  const char *what;
};

// 8192^3, and the forward and input-gradient GEMMs of the 5B layer of the layer benchmarks
// (15872 tokens, hidden 4096, FFN 16384; the weight gradients take 1x128 scales on both
// operands, which the kernel does not take), and te.Linear's seed shape.
const Shape kShapes[] = {
    {8192, 8192, 8192, "square"},
    {15872, 12288, 4096, "5B qkv fwd"},
    {15872, 4096, 4096, "5B proj fwd / dgrad"},
    {15872, 16384, 4096, "5B fc1 fwd / fc2 dgrad"},
    {15872, 4096, 16384, "5B fc2 fwd / fc1 dgrad"},
    {15872, 4096, 12288, "5B qkv dgrad"},
    {2048, 3072, 768, "seed linear"},
    // awkward edges: M not a multiple of 128, N a single or odd count of 128-column blocks or
    // not a multiple of 128, K one block or not a multiple of 128
    {1000, 3072, 768, "M 1000"},
    {520, 200, 128, "K one block, N 200"},
    {256, 16, 4096, "N 16"},
    {384, 384, 336, "K 336"},
};

// Our hand-written kernel (block_scaled_wgmma.cu) with a cluster of cluster_n CTAs along N; the
// sweep's swizzle s picks its tile-order groups of 2 * s row blocks.
// overlap: the next k-block's WGMMAs issued before this one's promotion (two sets of block sums);
// block_n: the tile's width (128 or 256); cluster_m: 2 for a pair along M sharing B.
template <int cluster_n, bool overlap, int block_n = 128, int cluster_m = 1>
te_status run_wgmma(const te::GemmArgs &g, cudaStream_t stream, int, int swizzle) {
  te::hopper::WgmmaOptions o{cluster_n, 2 * swizzle, overlap};
  o.block_n = block_n;
  o.cluster_m = cluster_m;
  return te::hopper::block_scaled_wgmma_gemm("block_scaled_sweep", g, stream, o);
}

// The same with the grid cudaOccupancyMaxActiveClusters gives (the first run's, under which the
// two-CTA clusters ran at half speed), against the default of one CTA per SM.
template <int cluster_n, bool overlap>
te_status run_wgmma_resident_grid(const te::GemmArgs &g, cudaStream_t stream, int, int swizzle) {
  te::hopper::WgmmaOptions o{cluster_n, 2 * swizzle, overlap};
  static int resident = 0;
  if (resident == 0) {
    if (te_status st = te::hopper::block_scaled_wgmma_resident_clusters("block_scaled_sweep", o, &resident)) {
      return st;
    }
    std::printf("  (cudaOccupancyMaxActiveClusters: %d clusters of %d)\n", resident, cluster_n);
  }
  o.clusters = resident;
  return te::hopper::block_scaled_wgmma_gemm("block_scaled_sweep", g, stream, o);
}

// Indices 0 .. 6: sweep_variant.cu's CUTLASS configurations; 7 .. 17: the hand-written kernel
// (16 and 17 its per-tensor form, beside cuBLASLt's per-tensor GEMM).
std::vector<sweep::Variant> variants() {
  return {sweep_variant_0(), sweep_variant_1(), sweep_variant_2(), sweep_variant_3(),
          sweep_variant_4(), sweep_variant_5(), sweep_variant_6(),
          {"wgmma 128x128x128 cluster 1x2 (ours)", false, &run_wgmma<2, false>, false},
          {"wgmma 128x128x128 cluster 1x1 (ours)", false, &run_wgmma<1, false>, false},
          {"wgmma 128x128x128 cluster 1x2 overlapped (ours)", false, &run_wgmma<2, true>, false},
          {"wgmma 128x128x128 cluster 1x1 overlapped (ours)", false, &run_wgmma<1, true>, false},
          {"wgmma 1x2 overlapped, occupancy-query grid", false, &run_wgmma_resident_grid<2, true>, false},
          {"wgmma 1x1 overlapped, occupancy-query grid", false, &run_wgmma_resident_grid<1, true>, false},
          {"wgmma 128x256x128 cluster 1x2 (ours)", false, &run_wgmma<2, false, 256>, false},
          {"wgmma 128x256x128 cluster 1x1 (ours)", false, &run_wgmma<1, false, 256>, false},
          {"wgmma 128x256x128 cluster 2x1 (ours)", false, &run_wgmma<1, false, 256, 2>, false},
          {"wgmma 128x256x128 per-tensor 1x1 (ours)", false, &run_wgmma<1, false, 256>, false, true},
          {"wgmma 128x256x128 per-tensor 2x1 (ours)", false, &run_wgmma<1, false, 256, 2>, false, true}};
}

// Device buffers of one problem: FP8 operands with both scale forms, D and a spare D.
struct Problem {
  Shape s;
  int64_t kb = 0, nb = 0;
  uint8_t *a = nullptr, *b = nullptr;
  float *sa = nullptr, *sb = nullptr;        // 1x128 and 128x128 scale_inv
  float *tensor_scales = nullptr;            // per-tensor scale_inv of A and B (16 bytes apart)
  uint16_t *d = nullptr, *reference = nullptr;
  uint16_t *tensor_reference = nullptr;      // cuBLASLt's per-tensor D (fast accumulation)
  void *workspace = nullptr;
  size_t workspace_size = size_t(96) << 20;

  explicit Problem(Shape shape) : s(shape) {
    kb = (s.k + 127) / 128;
    nb = (s.n + 127) / 128;
    std::mt19937 rng(static_cast<uint32_t>(s.m * 31 + s.n * 7 + s.k));
    // E4M3 values of magnitude 2^-3 .. 2^3 (exponent field 4 .. 10), random sign and mantissa.
    std::uniform_int_distribution<int> exp(4, 10), man(0, 7), sign(0, 1);
    auto fp8 = [&](size_t count) {
      std::vector<uint8_t> h(count);
      for (auto &v : h) v = static_cast<uint8_t>(sign(rng) << 7 | exp(rng) << 3 | man(rng));
      return h;
    };
    std::uniform_real_distribution<float> scale(0.5f, 2.0f);
    auto scales = [&](size_t count) {
      std::vector<float> h(count);
      for (auto &v : h) v = scale(rng);
      return h;
    };
    upload(&a, fp8(static_cast<size_t>(s.m * s.k)));
    upload(&b, fp8(static_cast<size_t>(s.n * s.k)));
    upload(&sa, scales(static_cast<size_t>(s.m * kb)));
    upload(&sb, scales(static_cast<size_t>(nb * kb)));
    upload(&tensor_scales, std::vector<float>{0.75f, 0, 0, 0, 1.25f, 0, 0, 0});
    CUDA_OK(cudaMalloc(&d, static_cast<size_t>(s.m * s.n) * 2));
    CUDA_OK(cudaMalloc(&reference, static_cast<size_t>(s.m * s.n) * 2));
    CUDA_OK(cudaMalloc(&tensor_reference, static_cast<size_t>(s.m * s.n) * 2));
    CUDA_OK(cudaMalloc(&workspace, workspace_size));
  }
  ~Problem() {
    for (void *p : {static_cast<void *>(a), static_cast<void *>(b), static_cast<void *>(sa),
                    static_cast<void *>(sb), static_cast<void *>(tensor_scales), static_cast<void *>(d),
                    static_cast<void *>(reference), static_cast<void *>(tensor_reference), workspace}) {
      cudaFree(p);
    }
  }
  template <typename T>
  static void upload(T **dst, const std::vector<T> &h) {
    CUDA_OK(cudaMalloc(dst, h.size() * sizeof(T)));
    CUDA_OK(cudaMemcpy(*dst, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }

  // te_gemm's resolved arguments: D [M, N] bf16 = A [M, K] B [N, K]^T, block-scaled or
  // per-tensor, into out.
  te::GemmArgs args(bool blocked, bool split_accumulator, uint16_t *out, int device) const {
    te::GemmArgs g{};
    g.m = s.m;
    g.n = s.n;
    g.k = s.k;
    g.a = {a, TE_DTYPE_FLOAT8_E4M3, s.m, s.k, false, blocked ? TE_SCALING_BLOCK_1X128 : TE_SCALING_TENSOR,
           blocked ? sa : tensor_scales};
    g.b = {b, TE_DTYPE_FLOAT8_E4M3, s.n, s.k, true, blocked ? TE_SCALING_BLOCK_128X128 : TE_SCALING_TENSOR,
           blocked ? sb : tensor_scales + 4};
    g.fp8 = true;
    g.d = out;
    g.d_dtype = TE_DTYPE_BFLOAT16;
    g.bias_dtype = TE_DTYPE_BFLOAT16;
    g.split_accumulator = split_accumulator;
    g.workspace = workspace;
    g.workspace_size = workspace_size;
    g.device = device;
    return g;
  }
  double tflops(double ms) const { return 2.0 * s.m * s.n * s.k / (ms * 1e-3) / 1e12; }
};

// Median over kBatches of the mean ms per call of kCallsPerBatch back-to-back calls; -1 when a
// call fails (its message in *error).
template <typename Call>
double median_ms(Call call, std::string *error) {
  for (int i = 0; i < 2; ++i) {
    if (call() != TE_SUCCESS) {
      *error = te_last_error();
      return -1;
    }
  }
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  std::vector<double> batches;
  for (int b = 0; b < kBatches; ++b) {
    CUDA_OK(cudaEventRecord(start));
    for (int i = 0; i < kCallsPerBatch; ++i) call();
    CUDA_OK(cudaEventRecord(stop));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    batches.push_back(ms / kCallsPerBatch);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(batches.begin(), batches.end());
  return batches[batches.size() / 2];
}

// Elements of two bf16 D that differ, and the largest difference relative to max |reference|.
struct Difference {
  int64_t differing = 0;
  double max_relative = 0;
};
Difference compare(const uint16_t *x, const uint16_t *reference, int64_t count) {
  std::vector<uint16_t> hx(count), hr(count);
  CUDA_OK(cudaMemcpy(hx.data(), x, count * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hr.data(), reference, count * 2, cudaMemcpyDeviceToHost));
  Difference out;
  double top = 0, worst = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double r = te::bf16_to_float(hr[i]), v = te::bf16_to_float(hx[i]);
    top = std::max(top, std::fabs(r));
    if (hx[i] != hr[i]) {
      ++out.differing;
      worst = std::max(worst, std::fabs(v - r));
    }
  }
  out.max_relative = top > 0 ? worst / top : worst;
  return out;
}

std::string json_string(const std::string &s) {
  std::string out = "\"";
  for (char c : s) out += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return out + "\"";
}

}  // namespace

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s OUT.json [GIT_COMMIT]\n", argv[0]);
    return 2;
  }
  if (const std::string missing = hopper_test::gpu_missing(); !missing.empty()) {
    std::printf("skipped: %s\n", missing.c_str());
    return hopper_test::kSkipped;
  }
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, device));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));

  const std::vector<sweep::Variant> all = variants();
  // Optional third argument: the indices to time, comma-separated (default: all; 0, the
  // reference for the bits, always runs).
  std::vector<bool> wanted(all.size(), argc <= 3);
  if (argc > 3) {
    for (const char *c = argv[3]; *c != '\0';) {
      char *end = nullptr;
      const long index = std::strtol(c, &end, 10);
      if (end == c || index < 0 || index >= static_cast<long>(all.size())) {
        std::fprintf(stderr, "bad variant list '%s'\n", argv[3]);
        return 2;
      }
      wanted[index] = true;
      c = *end == ',' ? end + 1 : end;
    }
  }
  std::string rows;
  auto row = [&](const std::string &fields) { rows += (rows.empty() ? "\n    {" : ",\n    {") + fields + "}"; };
  bool faults = false;

  for (const Shape &shape : kShapes) {
    Problem p(shape);
    const int64_t elements = shape.m * shape.n;
    const std::string where = "\"shape_mnk\": [" + std::to_string(shape.m) + ", " + std::to_string(shape.n) +
                              ", " + std::to_string(shape.k) + "], \"what\": " + json_string(shape.what);
    std::printf("== M %ld N %ld K %ld (%s)\n", static_cast<long>(shape.m), static_cast<long>(shape.n),
                static_cast<long>(shape.k), shape.what);

    // cuBLASLt: per-tensor FP8 (fast and split accumulation) and block-scaled, the references.
    struct Reference {
      const char *name;
      bool blocked, split;
    };
    for (const Reference ref : {Reference{"cublaslt per-tensor fast_accum", false, false},
                                Reference{"cublaslt per-tensor split_accum", false, true},
                                Reference{"cublaslt block-scaled", true, true}}) {
      const te::GemmArgs g = p.args(ref.blocked, ref.split, p.d, device);
      std::string error;
      const double ms = median_ms([&] { return te::gemm_cublaslt(g, nullptr); }, &error);
      if (ms < 0) {
        std::printf("  %-44s FAILED: %s\n", ref.name, error.c_str());
        faults = true;
        row(where + ", \"impl\": " + json_string(ref.name) + ", \"error\": " + json_string(error));
        continue;
      }
      std::printf("  %-44s %8.3f ms %7.1f TFLOP/s\n", ref.name, ms, p.tflops(ms));
      row(where + ", \"impl\": " + json_string(ref.name) + ", \"median_ms\": " + std::to_string(ms) +
          ", \"tflops\": " + std::to_string(p.tflops(ms)));
    }

    // The production variant's D at CUTLASS's default options: what every variant must equal.
    if (all[0].run(p.args(true, true, p.reference, device), nullptr, 0, 1) != TE_SUCCESS) {
      std::printf("  production variant FAILED: %s\n", te_last_error());
      faults = true;
      continue;
    }
    CUDA_OK(cudaDeviceSynchronize());
    const bool tensor_reference = te::gemm_cublaslt(p.args(false, false, p.tensor_reference, device), nullptr) ==
                                  TE_SUCCESS;
    CUDA_OK(cudaDeviceSynchronize());
    // cuBLASLt's block-scaled D against ours: not bitwise (its own summation), reported.
    CUDA_OK(cudaMemset(p.d, 0, elements * 2));
    if (te::gemm_cublaslt(p.args(true, true, p.d, device), nullptr) == TE_SUCCESS) {
      const Difference vs = compare(p.d, p.reference, elements);
      row(where + ", \"check\": \"cublaslt block-scaled vs production variant\", \"differing\": " +
          std::to_string(vs.differing) + ", \"max_relative\": " + std::to_string(vs.max_relative));
    }

    for (size_t v = 0; v < all.size(); ++v) {
      if (!wanted[v]) continue;
      double best = -1;
      int best_raster = 0, best_swizzle = 1;
      for (int raster : {0, 1, 2}) {
        if (raster != 0 && !all[v].has_raster) continue;
        for (int swizzle : {1, 2, 4, 8}) {
          const te::GemmArgs g = p.args(!all[v].per_tensor, !all[v].per_tensor, p.d, device);
          std::string error;
          const double ms = median_ms([&] { return all[v].run(g, nullptr, raster, swizzle); }, &error);
          std::string fields = where + ", \"impl\": " + json_string("hopper " + all[v].name) +
                               ", \"variant\": " + std::to_string(v) + ", \"raster\": " + std::to_string(raster) +
                               ", \"swizzle\": " + std::to_string(swizzle);
          if (ms < 0) {
            row(fields + ", \"error\": " + json_string(error));
            if (raster == 0 && swizzle == 1) std::printf("  %-44s FAILED: %s\n", all[v].name.c_str(), error.c_str());
            continue;
          }
          row(fields + ", \"median_ms\": " + std::to_string(ms) + ", \"tflops\": " + std::to_string(p.tflops(ms)));
          if (best < 0 || ms < best) {
            best = ms;
            best_raster = raster;
            best_swizzle = swizzle;
          }
        }
      }
      if (best < 0) continue;
      // The bits, at the best options.
      CUDA_OK(cudaMemset(p.d, 0, elements * 2));
      all[v].run(p.args(!all[v].per_tensor, !all[v].per_tensor, p.d, device), nullptr, best_raster, best_swizzle);
      CUDA_OK(cudaDeviceSynchronize());
      const Difference vs = compare(p.d, all[v].per_tensor ? p.tensor_reference : p.reference, elements);
      const bool bounded = all[v].splits_k || (all[v].per_tensor && tensor_reference);
      const bool agrees = vs.differing == 0 || (bounded && vs.max_relative <= kSplitTolerance);
      if (!agrees) faults = true;
      std::string verdict = vs.differing == 0 ? "bits equal" : "BITS DIFFER: " + std::to_string(vs.differing);
      if (vs.differing != 0 && bounded) {
        verdict = std::to_string(vs.differing) + " elements reordered, max " + std::to_string(vs.max_relative) +
                  " of max |D|" + (agrees ? " (within the bound)" : " OVER the bound");
      }
      if (all[v].per_tensor) verdict = "vs cuBLASLt per-tensor: " + verdict;
      std::printf("  %-44s %8.3f ms %7.1f TFLOP/s  (raster %d, swizzle %d)  %s\n", all[v].name.c_str(), best,
                  p.tflops(best), best_raster, best_swizzle, verdict.c_str());
      row(where + ", \"impl\": " + json_string("hopper " + all[v].name) + ", \"variant\": " + std::to_string(v) +
          ", \"best\": true, \"raster\": " + std::to_string(best_raster) + ", \"swizzle\": " +
          std::to_string(best_swizzle) + ", \"median_ms\": " + std::to_string(best) + ", \"tflops\": " +
          std::to_string(p.tflops(best)) + ", \"bits_equal_to_production\": " +
          (vs.differing == 0 && !all[v].per_tensor ? "true" : "false") + ", \"differing\": " + std::to_string(vs.differing) +
          ", \"max_relative\": " + std::to_string(vs.max_relative) + ", \"agrees\": " + (agrees ? "true" : "false"));
    }
  }

  FILE *f = std::fopen(argv[1], "w");
  if (f == nullptr) {
    std::perror(argv[1]);
    return 1;
  }
  std::fprintf(f,
               "{\n  \"benchmark\": \"hopper_block_scaled_sweep\",\n  \"environment\": {\"device\": %s, "
               "\"date\": \"%s\", \"cutlass\": \"%d.%d.%d\", \"cuda_runtime\": %d, \"git_commit\": %s},\n"
               "  \"description\": %s,\n  \"config\": {\"d_dtype\": \"bfloat16\", \"batches\": %d, "
               "\"calls_per_batch\": %d, \"timing\": \"cuda_events\"},\n  \"results\": [%s\n  ]\n}\n",
               json_string(prop.name).c_str(), date, CUTLASS_MAJOR, CUTLASS_MINOR, CUTLASS_PATCH, CUDART_VERSION,
               json_string(argc > 2 ? argv[2] : "").c_str(),
               json_string("block-scaled FP8 GEMM (A 1x128, B 128x128 scales, bf16 D) variants of our Hopper "
                           "kernel (tile, cluster, schedule, tile scheduler; every raster order and swizzle), "
                           "beside cuBLASLt's block-scaled and per-tensor FP8 GEMMs, same process; median_ms: "
                           "the median batch's mean per call; best rows: each variant's fastest options, with "
                           "its D compared bit for bit against the production variant's")
                   .c_str(),
               kBatches, kCallsPerBatch, rows.c_str());
  std::fclose(f);
  std::printf("wrote %s\n%s\n", argv[1], faults ? "FAULTS: see above" : "no faults");
  return faults ? 1 : 0;
}
