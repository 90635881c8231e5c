// The fused activation kernels for fp16 inputs, backward (see activation_kernel.cuh).
#include "activation/activation_kernel.cuh"

namespace te {
namespace activation_detail {

template te_status launch_act<TE_DTYPE_FLOAT16, true>(const ActParams &, te_activation, cudaStream_t, int);

}  // namespace activation_detail
}  // namespace te
