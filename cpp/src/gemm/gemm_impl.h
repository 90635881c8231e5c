// The resolved arguments of te_gemm, shared by the C entry point, the CPU path and the
// cuBLASLt path. The entry point has checked every pointer, dtype and shape.
#ifndef TRANSFORMER_ENGINE_SRC_GEMM_GEMM_IMPL_H_
#define TRANSFORMER_ENGINE_SRC_GEMM_GEMM_IMPL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "transformer_engine/gemm.h"

namespace te {

// One operand as stored: a row-major matrix [rows, cols] (cols is the contiguous dimension).
struct GemmOperand {
  const void *data;
  te_dtype dtype;
  int64_t rows, cols;
  bool transposed;        // op(X) uses X^T (see gemm.h)
  te_scaling_mode mode;   // TENSOR, BLOCK_1X128 or BLOCK_128X128 (FP8 only)
  const float *scale_inv; // FP8 only: [1], or the block layout of tensor.h for [rows, cols]
};

struct GemmArgs {
  int64_t m, n, k;
  GemmOperand a, b;
  bool fp8;                  // both operands are FP8
  void *d;                   // [m, n]
  te_dtype d_dtype;
  const float *d_scale;      // FP8 output: [1]
  float *d_scale_inv;        // FP8 output, optional: receives 1/scale
  float *d_amax;             // optional: max|result| before the FP8 cast
  const void *bias;          // [n] or null
  te_dtype bias_dtype;
  void *pre_gelu;            // [m, n] in d_dtype, with gelu
  bool gelu;
  bool accumulate;
  bool split_accumulator;
  void *workspace;
  size_t workspace_size;
  int device;                // CUDA device of the buffers
};

class Checker;

// te_gemm's checks of one GEMM's arguments (gemm.h), resolved into *g (all but the workspace
// and device); false with the error in check otherwise.
bool resolve_gemm(Checker &check, const te_tensor *a, const te_tensor *b, te_tensor *d,
                  const te_tensor *bias, te_tensor *pre_gelu_out, const te_gemm_config &cfg,
                  GemmArgs *g);

// te_grouped_gemm's checks (gemm.h), in op's name: each group by resolve_gemm, every group on
// one device, and no output meeting any group's buffers. Fills args (workspace and device
// set too) and *device; the error's status otherwise.
te_status resolve_groups(const char *op, const te_tensor *const *a, const te_tensor *const *b,
                         te_tensor *const *d, const te_tensor *const *bias, size_t groups,
                         const te_gemm_config *config, void *workspace, size_t workspace_size,
                         std::vector<GemmArgs> *args, te_device_type *device);

// Runs one resolved GEMM on the device of its buffers.
te_status run_gemm(const GemmArgs &g, te_device_type device, te_stream stream);

// Copies bytes from device memory to the host and waits for them (a grouped GEMM's sizes).
te_status copy_to_host_cuda(void *dst, const void *src, size_t bytes, int device,
                            te_stream stream);

// Sets bytes of device memory to 0 on the stream (rows past a grouped GEMM's groups).
te_status zero_cuda(void *dst, size_t bytes, te_stream stream);

// Scratch device memory on the current device, ordered on the stream (the FP8 weight-gradient
// form's transposed groups), from the core's pool; freed on the stream.
te_status scratch_alloc_cuda(size_t bytes, te_stream stream, void **out);
te_status scratch_free_cuda(void *p, te_stream stream);

void gemm_ref(const GemmArgs &args);

// The CUDA path (gemm_cuda.cu): our Hopper kernel or cuBLASLt, by the dispatch rule there; in
// a CPU-only build it reports that the build has no CUDA path.
te_status gemm_cuda(const GemmArgs &args, te_stream stream);

// One cuBLASLt matmul (gemm_cublaslt.cu); empty problems (M, N or K = 0) handled without it.
te_status gemm_cublaslt(const GemmArgs &args, te_stream stream);

// Workspace bytes for cuBLASLt's algorithms, and for the block-scale layouts it wants.
size_t gemm_workspace_size();

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_GEMM_GEMM_IMPL_H_
