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
//  - A bf16 D rounds each side's fp32 value x, y to nearest, and two values within d of each
//    other may land on neighbouring bf16 values: |X - Y| <= d (1 + 2^-9) + 2^-7 (1 + 2^-7) |Y|
//    for d >= |x - y| and Y the reference as stored.
// The test prints the largest error / bound ratio, so that the margin can be seen.
#include "grouped_problem.h"

namespace {

using namespace grouped_test;  // NOLINT: the problem and its runs
using te_test::TensorHandle;
using namespace hopper_test;  // NOLINT: the shared constants and helpers

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
  if (!ours_ran(ours.status, ours.message, ours.guards_intact)) return;
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
