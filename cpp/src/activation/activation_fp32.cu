// The fused activation kernels for fp32 inputs (see activation_kernel.cuh).
#include "activation/activation_kernel.cuh"

namespace te {
namespace activation_detail {

template te_status launch_act<TE_DTYPE_FLOAT32>(const ActParams &, te_activation, bool, cudaStream_t, int);

}  // namespace activation_detail
}  // namespace te
