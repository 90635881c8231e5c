// The CUDA norm forward for fp16 inputs (see norm_forward.cuh).
#include "norm/norm_forward.cuh"

namespace te {
namespace norm_cuda {

template te_status forward<TE_DTYPE_FLOAT16>(const NormForwardArgs &, bool, cudaStream_t);

}  // namespace norm_cuda
}  // namespace te
