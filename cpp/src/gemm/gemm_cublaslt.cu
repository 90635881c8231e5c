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
// The algorithm for a problem is looked up once (cuBLASLt's heuristic costs tens of
// microseconds of host time) and cached by everything that can change the answer.
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

// RAII owners of the cuBLASLt descriptors.
struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~MatmulDesc() {
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  template <typename T>
  cublasStatus_t set(cublasLtMatmulDescAttributes_t attr, const T &value) {
    return cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(T));
  }
};
struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  ~Layout() {
    if (layout) cublasLtMatrixLayoutDestroy(layout);
  }
};
struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  ~Preference() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
};

// Largest power of two (up to 256) dividing the address: the heuristic's answer depends on it.
int alignment_of(const void *p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && v % (2 * a) == 0) a *= 2;
  return a;
}

struct Problem {
  // Everything the heuristic looks at.
  std::tuple<int64_t, int64_t, int64_t, int, int, int, int, int, int, int> shape_types;
  std::tuple<int, int, int, int, int, int, int, int, int> options;
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
  void *cublas_ws = ws != nullptr ? ws + ws_offset : nullptr;
  const size_t cublas_ws_size = g.workspace_size > ws_offset ? g.workspace_size - ws_offset : 0;

  // cuBLAS's view (column-major): its A is our B, its B is our A.
  const cublasOperation_t op_x = g.b.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_y = g.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  // C is D when accumulating; with an FP8 D its type must be the 16-bit "C type" (bias type).
  const te_dtype c_dtype = fp8_out ? (g.bias != nullptr ? g.bias_dtype : TE_DTYPE_BFLOAT16) : g.d_dtype;

  MatmulDesc desc;
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  TE_CUBLAS(cublasLtMatmulDescCreate(&desc.desc, compute, CUDA_R_32F), "MatmulDescCreate");
  TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_x), "set TRANSA");
  TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_y), "set TRANSB");
  if (g.fp8) {
    const int8_t fast = g.split_accumulator || blocked ? 0 : 1;
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast), "set FAST_ACCUM");
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void *>(b_scale)), "set A_SCALE");
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void *>(a_scale)), "set B_SCALE");
    if (blocked) {
      const int32_t mode_x = scale_mode(g.b.mode), mode_y = scale_mode(g.a.mode);
      TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode_x), "set A_SCALE_MODE");
      TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode_y), "set B_SCALE_MODE");
    }
    if (fp8_out) {
      TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, static_cast<const void *>(g.d_scale)), "set D_SCALE");
    }
    // cuBLASLt's AMAX_D is for FP8 outputs; a high-precision D gets its amax from our kernel.
    if (g.d_amax != nullptr && fp8_out) {
      TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, static_cast<void *>(g.d_amax)), "set AMAX_D");
    }
  }
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (g.gelu) {
    epilogue = g.bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.pre_gelu), "set EPILOGUE_AUX_POINTER");
    const int64_t ld = g.n;
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld), "set EPILOGUE_AUX_LD");
  } else if (g.bias != nullptr) {
    epilogue = CUBLASLT_EPILOGUE_BIAS;
  }
  if (g.bias != nullptr) {
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias), "set BIAS_POINTER");
    const int32_t bias_type = cuda_type(g.bias_dtype);
    TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type), "set BIAS_DATA_TYPE");
  }
  TE_CUBLAS(desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue), "set EPILOGUE");

  // Layouts (column-major): X = our B, Y = our A, C/D = D^T [N, M] with ld N.
  Layout lx, ly, lc, ld;
  const uint64_t x_rows = op_x == CUBLAS_OP_T ? g.k : g.n, x_cols = op_x == CUBLAS_OP_T ? g.n : g.k;
  const uint64_t y_rows = op_y == CUBLAS_OP_T ? g.m : g.k, y_cols = op_y == CUBLAS_OP_T ? g.k : g.m;
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&lx.layout, cuda_type(g.b.dtype), x_rows, x_cols, x_rows), "layout of b");
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&ly.layout, cuda_type(g.a.dtype), y_rows, y_cols, y_rows), "layout of a");
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&lc.layout, cuda_type(c_dtype), g.n, g.m, g.n), "layout of c");
  TE_CUBLAS(cublasLtMatrixLayoutCreate(&ld.layout, cuda_type(g.d_dtype), g.n, g.m, g.n), "layout of d");

  // The algorithm, from the cache or the heuristic.
  const Problem key{{g.m, g.n, g.k, g.a.dtype, g.b.dtype, g.d_dtype, c_dtype, g.a.mode, g.b.mode,
                     g.bias != nullptr ? g.bias_dtype : -1},
                    {op_x, op_y, epilogue, g.accumulate, g.split_accumulator, g.d_amax != nullptr,
                     std::min({alignment_of(g.a.data), alignment_of(g.b.data), alignment_of(g.d),
                               g.pre_gelu ? alignment_of(g.pre_gelu) : 256,
                               g.bias ? alignment_of(g.bias) : 256}),
                     static_cast<int>(std::min<size_t>(cublas_ws_size, kCublasWorkspace) >> 10), g.device}};
  static std::mutex cache_mutex;
  static std::map<Problem, cublasLtMatmulAlgo_t> cache;
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(key);
    if (it != cache.end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    Preference pref;
    TE_CUBLAS(cublasLtMatmulPreferenceCreate(&pref.pref), "MatmulPreferenceCreate");
    const uint64_t limit = std::min<size_t>(cublas_ws_size, kCublasWorkspace);
    TE_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &limit, sizeof(limit)),
              "set MAX_WORKSPACE_BYTES");
    cublasLtMatmulHeuristicResult_t result;
    std::memset(&result, 0, sizeof(result));
    int found = 0;
    const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle, desc.desc, lx.layout, ly.layout, lc.layout,
                                                             ld.layout, pref.pref, 1, &result, &found);
    if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
      return fail(TE_ERROR_UNSUPPORTED, kOp,
                  "cuBLASLt has no algorithm for M=" + std::to_string(g.m) + " N=" + std::to_string(g.n) +
                      " K=" + std::to_string(g.k) + " with a " + te_dtype_name(g.a.dtype) + " (" +
                      scaling_mode_name(g.a.mode) + "), b " + te_dtype_name(g.b.dtype) + " (" +
                      scaling_mode_name(g.b.mode) + "), d " + te_dtype_name(g.d_dtype) +
                      " on this device (heuristic status " + std::to_string(static_cast<int>(hs)) + ")");
    }
    algo = result.algo;
    std::lock_guard<std::mutex> lock(cache_mutex);
    cache.emplace(key, algo);
  }
  const float alpha = 1.0f, beta = g.accumulate ? 1.0f : 0.0f;
  // C is D when accumulating (same layout: in place). With beta = 0 it is not read, and a C
  // that aliased D under another type (FP8 D, 16-bit C) would be rejected, so it is NULL then.
  const void *c = c_dtype == g.d_dtype ? g.d : nullptr;
  TE_CUBLAS(cublasLtMatmul(handle, desc.desc, &alpha, g.b.data, lx.layout, g.a.data, ly.layout, &beta, c,
                           lc.layout, g.d, ld.layout, &algo, cublas_ws,
                           std::min<size_t>(cublas_ws_size, kCublasWorkspace), stream),
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

te_status gemm_cuda(const GemmArgs &g, te_stream stream) {
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
    return fail(TE_ERROR_UNSUPPORTED, kOp,
                "K (the contraction dimension) must be positive on CUDA, got 0 (cuBLASLt takes no "
                "empty contraction; the CPU path does)");
  }
  return run(g, s);
}

}  // namespace te
