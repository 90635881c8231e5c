// CUDA path of te_gemm: one cuBLASLt matmul per call.
//
// Row-major D[M, N] = op(A) op(B) is, seen column-major, D^T[N, M] = op(B)^T op(A)^T: cuBLASLt's
// "A" is our B and its "B" is our A, and our transposes carry over unchanged (our
// transpose_b = 1, B stored [N, K], is cuBLAS's transa = T; our transpose_a = 0 is its transb = N),
// so the FP8 layout of gemm.h is cuBLASLt's "TN".
//
// Per-tensor FP8 scale_inv pointers go to cuBLASLt as its A/B scale pointers (multiplied into
// the fp32 accumulator), the output scale as its D scale, d.amax as its AMAX_D. Block-scaled
// operands keep the core's scale layouts (tensor.h); cuBLASLt wants 1x128 scales M-major and
// 128x128 scales with the K-block count padded to 4, so a small kernel rewrites them into the
// front of the workspace first.
//
// Everything about a call but its pointers is a "plan": the matmul descriptor, the four layouts
// and the algorithm (cuBLASLt's heuristic costs tens of microseconds of host time, the
// descriptors a dozen allocations and attribute writes). Plans are made once per problem (keyed
// by everything that can change them) and kept per host thread for the life of the process, so
// a call only writes its pointers into the descriptor it owns and launches.
//
// For a per-tensor FP8 problem the heuristic gets what torch._scaled_mm gives it
// (aten/src/ATen/cuda/CUDABlas.cpp, scaled_gemm): the same layouts, C type, FAST_ACCUM,
// epilogue, one requested result, and the same workspace limit (kFp8TensorHeuristicWorkspace),
// so both get the same algorithm. The limit was the one input that differed (32 MiB here,
// 1 MiB in torch); with it, split accumulation ran up to 18% slower than torch's on H200
// (8192x3072x768), and slower under CUDA-graph replay than under launches (8192^3).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "common/cuda_utils.cuh"
#include "gemm/gemm_impl.h"
#include "scaling/scaling_impl.h"

namespace te {
namespace {

constexpr const char *kOp = "gemm";
constexpr size_t kCublasWorkspace = 32u << 20;  // what cuBLASLt's Hopper kernels can use
// The workspace limit the heuristic plans per-tensor FP8 GEMMs with: torch's cuBLASLt default
// (CUBLASLT_WORKSPACE_SIZE = 1024 KiB; getCUDABlasLtWorkspaceSize() is what scaled_gemm passes
// as MAX_WORKSPACE_BYTES). A larger limit lets the heuristic rank first algorithms that use
// workspace (split-K / stream-K reductions), and its ranking is a model, not a measurement
// (see above). Should nothing fit this limit, the plan falls back to the whole workspace.
// Block-scaled and 16/32-bit GEMMs keep the whole workspace: bf16 matches torch (whose cuBLAS
// path has 32 MiB), and block scaling has no torch counterpart measured yet.
constexpr size_t kFp8TensorHeuristicWorkspace = 1u << 20;
constexpr size_t kScaleWorkspace = 8u << 20;    // the rewritten block scales (any sane shape)
constexpr size_t kAlign = 256;

te_status cublas_status(cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS) return TE_SUCCESS;
  return fail(s == CUBLAS_STATUS_NOT_SUPPORTED ? TE_ERROR_UNSUPPORTED : TE_ERROR_RUNTIME, kOp,
              std::string("cuBLASLt ") + what + " failed with status " + std::to_string(static_cast<int>(s)));
}

#define TE_CUBLAS(call, what)                               \
  do {                                                      \
    const te_status st_ = cublas_status((call), (what));    \
    if (st_ != TE_SUCCESS) return st_;                      \
  } while (0)

cudaDataType_t cuda_type(te_dtype d) {
  switch (d) {
    case TE_DTYPE_FLOAT32: return CUDA_R_32F;
    case TE_DTYPE_FLOAT16: return CUDA_R_16F;
    case TE_DTYPE_BFLOAT16: return CUDA_R_16BF;
    case TE_DTYPE_FLOAT8_E4M3: return CUDA_R_8F_E4M3;
    default: return CUDA_R_8F_E5M2;
  }
}

// One cuBLASLt handle per device, made on first use and kept for the process.
te_status handle_for(int device, cublasLtHandle_t *out) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static cublasLtHandle_t handles[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) {
    return fail(TE_ERROR_UNSUPPORTED, kOp, "device index must be below 64, got " + std::to_string(device));
  }
  std::lock_guard<std::mutex> lock(mutex);
  if (handles[device] == nullptr) TE_CUBLAS(cublasLtCreate(&handles[device]), "cublasLtCreate");
  *out = handles[device];
  return TE_SUCCESS;
}

template <typename T>
cublasStatus_t set_attr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T &value) {
  return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(T));
}

// The descriptor, layouts and algorithm of one problem. Never destroyed: plans live as long as
// the process (destroying them at exit could run after cuBLASLt itself is torn down).
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t x = nullptr, y = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  size_t workspace_size = 0;  // the limit the algorithm was chosen under; what the matmul gets
};

// Largest power of two (up to 256) dividing the address. The heuristic's answer depends on it
// (its MIN_ALIGNMENT preferences, default 256, exclude algorithms that need more), so it is set
// in the preference and is part of the plan's key.
int alignment_of(const void *p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

struct Problem {
  // Everything the heuristic looks at.
  std::tuple<int64_t, int64_t, int64_t, int, int, int, int, int, int, int> shape_types;
  std::tuple<int, int, int, int, int, int, int, int, int, int, int, int> options;
  bool operator<(const Problem &o) const {
    return std::tie(shape_types, options) < std::tie(o.shape_types, o.options);
  }
};

// --- block-scale layouts ----------------------------------------------------------------------

// 1x128 scales of a [rows, kb]-blocked operand, row-major [rows, kb] -> M-major [kb, rows].
__global__ void scales_1x128_mn_major_kernel(const float *in, float *out, int64_t rows, int64_t kb) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * kb) return;
  const int64_t r = i / kb, b = i % kb;
  out[b * rows + r] = in[i];
}

// 128x128 scales [rb, kb] -> [rb, round_up(kb, 4)], the padding zero.
__global__ void scales_128x128_padded_kernel(const float *in, float *out, int64_t rb, int64_t kb,
                                             int64_t kb4) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rb * kb4) return;
  const int64_t r = i / kb4, b = i % kb4;
  out[i] = b < kb ? in[r * kb + b] : 0.0f;
}

__global__ void reciprocal_kernel(const float *scale, float *scale_inv) {
  *scale_inv = canonical_div(1.0f, *scale);
}

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Rewrites an operand's block scales into the workspace at *offset; returns the new pointer.
te_status stage_block_scales(const GemmOperand &x, char *workspace, size_t *offset, size_t limit,
                             cudaStream_t stream, const float **staged) {
  const int64_t kb = ceil_div(x.cols, 128);
  const bool tile = x.mode == TE_SCALING_BLOCK_128X128;
  const int64_t rows = tile ? ceil_div(x.rows, 128) : x.rows;
  const int64_t cols = tile ? round_up(kb, 4) : kb;
  const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(float);
  if (*offset + bytes > limit) {
    return fail(TE_ERROR_VALUE, kOp, "workspace must hold the block scales (" + std::to_string(*offset + bytes) +
                                         " bytes, see te_gemm_workspace_size), got " + std::to_string(limit));
  }
  float *out = reinterpret_cast<float *>(workspace + *offset);
  *offset = round_up(*offset + bytes, kAlign);
  const int threads = 256;
  const int64_t n = rows * cols;
  if (n > 0) {
    const unsigned blocks = static_cast<unsigned>(ceil_div(n, threads));
    if (tile) {
      scales_128x128_padded_kernel<<<blocks, threads, 0, stream>>>(x.scale_inv, out, rows, kb, cols);
    } else {
      scales_1x128_mn_major_kernel<<<blocks, threads, 0, stream>>>(x.scale_inv, out, rows, kb);
    }
  }
  *staged = out;
  return launch_status(kOp);
}

cublasLtMatmulMatrixScale_t scale_mode(te_scaling_mode m) {
  return m == TE_SCALING_BLOCK_128X128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                       : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
}

// Writes the call's pointers into a plan's descriptor: the scale_inv of each operand (cuBLAS's
// A is our B), the output scale and amax of an FP8 D, the bias and the GELU input.
cublasStatus_t set_pointers(const GemmArgs &g, cublasLtMatmulDesc_t desc, const float *a_scale, const float *b_scale) {
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  auto put = [&](cublasLtMatmulDescAttributes_t attr, const void *p) {
    if (st == CUBLAS_STATUS_SUCCESS) st = set_attr(desc, attr, p);
  };
  if (g.fp8) {
    put(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_scale);
    put(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_scale);
    if (is_fp8(g.d_dtype)) {
      put(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, g.d_scale);
      // cuBLASLt's AMAX_D is for FP8 outputs; a high-precision D gets its amax from our kernel.
      if (g.d_amax != nullptr) put(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, g.d_amax);
    }
  }
  if (g.gelu) put(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.pre_gelu);
  if (g.bias != nullptr) put(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  return st;
}

// The heuristic's best algorithm for a plan's descriptor and layouts within `ws_limit` bytes of
// workspace, for operands at the alignments of the call g (cuBLAS's A is our B, its B our A,
// C and D our D). found = 0 when none fits.
cublasStatus_t best_algorithm(const GemmArgs &g, cublasLtHandle_t handle, const Plan &plan, size_t ws_limit,
                              cublasLtMatmulHeuristicResult_t *result, int *found) {
  cublasLtMatmulPreference_t pref = nullptr;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  auto put = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto &value) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
  };
  put(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(ws_limit));
  put(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, static_cast<uint32_t>(alignment_of(g.b.data)));
  put(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, static_cast<uint32_t>(alignment_of(g.a.data)));
  put(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, static_cast<uint32_t>(alignment_of(g.d)));
  put(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, static_cast<uint32_t>(alignment_of(g.d)));
  std::memset(result, 0, sizeof(*result));
  *found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.x, plan.y, plan.c, plan.d, pref, 1, result, found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

// Makes the plan of `key` for the call g: descriptor attributes that the key fixes, layouts,
// the heuristic's algorithm, chosen within `ws_preferred` bytes of workspace, or within all
// `ws_available` if none fits the preferred limit. On failure nothing is kept (the caller frees
// what was made).
te_status make_plan(const GemmArgs &g, cublasLtHandle_t handle, cublasOperation_t op_x, cublasOperation_t op_y,
                    te_dtype c_dtype, cublasLtEpilogue_t epilogue, bool blocked, const float *a_scale,
                    const float *b_scale, size_t ws_preferred, size_t ws_available, Plan *plan) {
  TE_CUBLAS(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  cublasLtMatmulDesc_t desc = plan->desc;
  TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_TRANSA, op_x), "set TRANSA");
  TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_TRANSB, op_y), "set TRANSB");
  if (g.fp8) {
    const int8_t fast = g.split_accumulator || blocked ? 0 : 1;
    TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast), "set FAST_ACCUM");
    if (blocked) {
      const int32_t mode_x = scale_mode(g.b.mode), mode_y = scale_mode(g.a.mode);
      TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode_x), "set A_SCALE_MODE");
      TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode_y), "set B_SCALE_MODE");
    }
  }
  if (g.gelu) {
    const int64_t ld = g.n;
    TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld), "set EPILOGUE_AUX_LD");
  }
  if (g.bias != nullptr) {
    const int32_t bias_type = cuda_type(g.bias_dtype);
    TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type), "set BIAS_DATA_TYPE");
  }
  TE_CUBLAS(set_attr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue), "set EPILOGUE");
  // Layouts (column-major): X = our B, Y = our A, C/D = D^T [N, M] with ld N.
  const uint64_t x_rows = op_x == CUBLAS_OP_T ? g.k : g.n, x_cols = op_x == CUBLAS_OP_T ? g.n : g.k;
  const uint64_t y_rows = op_y == CUBLAS_OP_T ? g.m : g.k, y_cols = op_y == CUBLAS_OP_T ? g.k : g.m;
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->x, cuda_type(g.b.dtype), x_rows, x_cols, x_rows), "layout of b");
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->y, cuda_type(g.a.dtype), y_rows, y_cols, y_rows), "layout of a");
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->c, cuda_type(c_dtype), g.n, g.m, g.n), "layout of c");
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->d, cuda_type(g.d_dtype), g.n, g.m, g.n), "layout of d");
  // The heuristic sees the pointer attributes too; set them as this call has them.
  TE_CUBLAS(set_pointers(g, desc, a_scale, b_scale), "set the pointers of the call");

  cublasLtMatmulHeuristicResult_t result;
  int found = 0;
  size_t ws_limit = std::min(ws_preferred, ws_available);
  cublasStatus_t st = best_algorithm(g, handle, *plan, ws_limit, &result, &found);
  if (found == 0 && ws_available > ws_limit) {  // (none found may come as NOT_SUPPORTED)
    ws_limit = ws_available;
    st = best_algorithm(g, handle, *plan, ws_limit, &result, &found);
  }
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    return fail(TE_ERROR_UNSUPPORTED, kOp,
                "cuBLASLt has no algorithm for M=" + std::to_string(g.m) + " N=" + std::to_string(g.n) +
                    " K=" + std::to_string(g.k) + " with a " + te_dtype_name(g.a.dtype) + " (" +
                    scaling_mode_name(g.a.mode) + "), b " + te_dtype_name(g.b.dtype) + " (" +
                    scaling_mode_name(g.b.mode) + "), d " + te_dtype_name(g.d_dtype) +
                    " on this device (heuristic status " + std::to_string(static_cast<int>(st)) + ")");
  }
  plan->algo = result.algo;
  plan->workspace_size = ws_limit;
  return TE_SUCCESS;
}

void free_plan(Plan *plan) {
  if (plan->desc) cublasLtMatmulDescDestroy(plan->desc);
  for (cublasLtMatrixLayout_t l : {plan->x, plan->y, plan->c, plan->d}) {
    if (l) cublasLtMatrixLayoutDestroy(l);
  }
}

te_status run(const GemmArgs &g, cudaStream_t stream) {
  cublasLtHandle_t handle;
  if (te_status st = handle_for(g.device, &handle); st != TE_SUCCESS) return st;
  const bool fp8_out = is_fp8(g.d_dtype);
  const bool blocked = g.fp8 && g.a.mode != TE_SCALING_TENSOR;
  char *ws = static_cast<char *>(g.workspace);
  size_t ws_offset = 0;
  const float *a_scale = g.a.scale_inv, *b_scale = g.b.scale_inv;
  if (blocked) {
    if (ws == nullptr) {
      return fail(TE_ERROR_VALUE, kOp, "workspace must be given for block-scaled operands, got none");
    }
    if (te_status st = stage_block_scales(g.a, ws, &ws_offset, g.workspace_size, stream, &a_scale); st) return st;
    if (te_status st = stage_block_scales(g.b, ws, &ws_offset, g.workspace_size, stream, &b_scale); st) return st;
  }
  // cuBLASLt refuses (NOT_SUPPORTED, at the matmul) per-tensor scale pointers that are not
  // 16-byte aligned, as one group's entry of a stacked [G] scale_inv is: such a scale is copied
  // into the workspace first.
  if (g.fp8 && !blocked) {
    for (const float **p : {&a_scale, &b_scale}) {
      if (reinterpret_cast<uintptr_t>(*p) % 16 == 0) continue;
      if (ws == nullptr || ws_offset + kAlign > g.workspace_size) {
        return fail(TE_ERROR_VALUE, kOp, "a per-tensor scale_inv that is not 16-byte aligned "
                                         "needs the workspace (cuBLASLt reads only aligned "
                                         "scales), got none");
      }
      float *slot = reinterpret_cast<float *>(ws + ws_offset);
      ws_offset += kAlign;
      if (te_status st = cuda_status(kOp, cudaMemcpyAsync(slot, *p, sizeof(float),
                                                          cudaMemcpyDeviceToDevice, stream));
          st != TE_SUCCESS) {
        return st;
      }
      *p = slot;
    }
  }
  void *cublas_ws = ws != nullptr ? ws + ws_offset : nullptr;
  const size_t cublas_ws_size =
      std::min<size_t>(g.workspace_size > ws_offset ? g.workspace_size - ws_offset : 0, kCublasWorkspace);

  // cuBLAS's view (column-major): its A is our B, its B is our A.
  const cublasOperation_t op_x = g.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_y = g.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  // C is D when accumulating; with an FP8 D its type must be the 16-bit "C type" (bias type).
  const te_dtype c_dtype = fp8_out ? (g.bias != nullptr ? g.bias_dtype : TE_DTYPE_BFLOAT16) : g.d_dtype;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (g.gelu) {
    epilogue = g.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  } else if (g.bias != nullptr) {
    epilogue = CUBLASLT_EPILOGUE_BIAS;
  }

  // Per-tensor FP8 plans with torch._scaled_mm's workspace limit (see kFp8TensorHeuristicWorkspace).
  const size_t ws_preferred = g.fp8 && !blocked ? kFp8TensorHeuristicWorkspace : cublas_ws_size;

  // The key holds every input of make_plan: shape, types, the descriptor's attributes
  // (FAST_ACCUM from split_accumulator, epilogue, amax), the alignments the preference
  // states, and the workspace available (ws_preferred follows from the rest).
  const Problem key{{g.m, g.n, g.k, g.a.dtype, g.b.dtype, g.d_dtype, c_dtype, g.a.mode, g.b.mode,
                     g.bias != nullptr ? g.bias_dtype : -1},
                    {op_x, op_y, epilogue, g.accumulate, g.split_accumulator, g.d_amax != nullptr,
                     alignment_of(g.a.data), alignment_of(g.b.data), alignment_of(g.d),
                     std::min(g.pre_gelu ? alignment_of(g.pre_gelu) : 256, g.bias ? alignment_of(g.bias) : 256),
                     static_cast<int>(cublas_ws_size >> 10), g.device}};
  // Per host thread: a plan's descriptor is written (its pointers) on every call, so threads
  // must not share one. Leaked with the plans it holds (see Plan).
  thread_local std::map<Problem, Plan> *plans = new std::map<Problem, Plan>();
  auto it = plans->find(key);
  if (it == plans->end()) {
    Plan plan;
    if (te_status st = make_plan(g, handle, op_x, op_y, c_dtype, epilogue, blocked, a_scale, b_scale,
                                 ws_preferred, cublas_ws_size, &plan)) {
      free_plan(&plan);
      return st;
    }
    it = plans->emplace(key, plan).first;
  }
  const Plan &plan = it->second;
  TE_CUBLAS(set_pointers(g, plan.desc, a_scale, b_scale), "set the pointers of the call");
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // C is D when accumulating (same layout: in place). With beta = 0 it is not read, and a C
  // that aliased D under another type (FP8 D, 16-bit C) would be rejected, so it is NULL then.
  const void *c = c_dtype == g.d_dtype ? g.d : nullptr;
  TE_CUBLAS(cublasLtMatmul(handle, plan.desc, &alpha, g.b.data, plan.x, g.a.data, plan.y, &beta, c, plan.c, g.d,
                           plan.d, &plan.algo, cublas_ws, plan.workspace_size, stream),
            "cublasLtMatmul");
  if (g.d_amax != nullptr && !fp8_out) {
    return compute_amax_cuda(AmaxArgs{g.d, g.d_dtype, g.m * g.n, g.d_amax}, stream);
  }
  if (g.d_scale_inv != nullptr) {
    reciprocal_kernel<<<1, 1, 0, stream>>>(g.d_scale, g.d_scale_inv);
    return launch_status(kOp);
  }
  return TE_SUCCESS;
}

}  // namespace

size_t gemm_workspace_size() { return kScaleWorkspace + kCublasWorkspace; }

te_status gemm_cublaslt(const GemmArgs &g, te_stream stream) {
  cudaStream_t s = cuda_stream(stream);
  if (g.m == 0 || g.n == 0) {  // nothing to multiply; the amax of nothing is 0
    if (g.d_amax != nullptr) {
      if (te_status st = cuda_status(kOp, cudaMemsetAsync(g.d_amax, 0, sizeof(float), s)); st) return st;
    }
    if (g.d_scale_inv != nullptr) {
      reciprocal_kernel<<<1, 1, 0, s>>>(g.d_scale, g.d_scale_inv);
      return launch_status(kOp);
    }
    return TE_SUCCESS;
  }
  if (g.k == 0) {
    // An empty sum (the weight gradient of an expert that got no token): D = 0, or D as it is
    // when accumulating. cuBLASLt takes no empty contraction, so it is written here.
    if (g.bias != nullptr || g.d_amax != nullptr || is_fp8(g.d_dtype) || g.gelu) {
      return fail(TE_ERROR_UNSUPPORTED, kOp,
                  "K (the contraction dimension) = 0 takes no bias, amax, FP8 output or GELU on "
                  "CUDA (D would be 0 or the bias alone); the CPU path does");
    }
    if (g.accumulate) return TE_SUCCESS;
    const size_t bytes = static_cast<size_t>(g.m * g.n) * te_dtype_size(g.d_dtype);
    return cuda_status(kOp, cudaMemsetAsync(g.d, 0, bytes, s));
  }
  return run(g, s);
}

}  // namespace te
