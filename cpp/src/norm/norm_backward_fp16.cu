// The CUDA norm backward for fp16 inputs (see norm_backward.cuh).
#include "norm/norm_backward.cuh"

namespace te {
namespace norm_cuda {

template te_status backward<TE_DTYPE_FLOAT16>(const NormBackwardArgs &, bool, float *, int64_t, cudaStream_t);

}  // namespace norm_cuda
}  // namespace te
