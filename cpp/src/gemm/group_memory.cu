// The memory operations of the grouped GEMMs on CUDA: reading the group sizes on the host,
// zeroing the rows that no group covers, and scratch for transposed FP8 groups.
#include <cuda_runtime.h>

#include "common/cuda_utils.cuh"
#include "common/scratch.cuh"
#include "gemm/gemm_impl.h"

namespace te {

te_status copy_to_host_cuda(void *dst, const void *src, size_t bytes, int device,
                            te_stream stream) {
  (void)device;  // the caller made it current
  constexpr const char *op = "grouped_gemm_ragged";
  cudaStream_t s = cuda_stream(stream);
  if (te_status st = cuda_status(op, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
      st != TE_SUCCESS) {
    return st;
  }
  return cuda_status(op, cudaStreamSynchronize(s));
}

te_status zero_cuda(void *dst, size_t bytes, te_stream stream) {
  return cuda_status("grouped_gemm_ragged", cudaMemsetAsync(dst, 0, bytes, cuda_stream(stream)));
}

te_status scratch_alloc_cuda(size_t bytes, te_stream stream, void **out) {
  return scratch_alloc("grouped_gemm_ragged", bytes, cuda_stream(stream), out);
}

te_status scratch_free_cuda(void *p, te_stream stream) {
  return scratch_free("grouped_gemm_ragged", p, cuda_stream(stream));
}

}  // namespace te
