// cuDNN's fused attention (graph API through cudnn-frontend) behind the attention entry points.
// Compiled only when the build finds cudnn-frontend and cuDNN (TE_WITH_CUDNN); the dispatcher
// asks *_support first and calls the rest only when it answered "".
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_H_

#include <cstddef>
#include <string>

#include "attention/attention_impl.h"

namespace te {

// "" when cuDNN's fused kernels take this call on its device, else the reason in a few words
// ("head_dim_qk 320 is over cuDNN's limit of 256", "FP8 attention needs sm_90 or newer").
std::string cudnn_attention_forward_support(const AttentionForwardArgs &args);
std::string cudnn_attention_backward_support(const AttentionBackwardArgs &args);

// Bytes of CUDA workspace the call needs (the workspace members of args are ignored).
size_t cudnn_attention_forward_workspace_size(const AttentionForwardArgs &args);
size_t cudnn_attention_backward_workspace_size(const AttentionBackwardArgs &args);

te_status cudnn_attention_forward(const AttentionForwardArgs &args, te_stream stream);
te_status cudnn_attention_backward(const AttentionBackwardArgs &args, te_stream stream);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_H_
