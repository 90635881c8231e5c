// The checks of an attention request that need no buffer (config and problem), the backend
// choice with its reasons, and the workspace sizes: shared by te_attention_backend and the
// entry points, so that a query and a call can never disagree.
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_BACKEND_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_BACKEND_H_

#include <string>

#include "attention/attention_impl.h"
#include "common/internal.h"
#include "transformer_engine/attention.h"

namespace te {

const char *attn_layout_name(te_attn_layout layout);
const char *attn_mask_name(te_attn_mask_type mask);

bool check_attention_config(Checker &check, const te_attention_config *config);
// The problem's sizes and dtypes against the config (config already checked).
bool check_attention_problem(Checker &check, const te_attention_config &config,
                             const te_attention_problem &problem, bool backward);

// Args without buffers (null pointers), from a checked config and problem.
AttentionForwardArgs forward_args(const te_attention_config &config, const te_attention_problem &problem);
AttentionBackwardArgs backward_args(const te_attention_config &config, const te_attention_problem &problem);

// The backend to run, or TE_ATTN_BACKEND_AUTO with check failed (TE_ERROR_UNSUPPORTED) when no
// backend can; reasons[b] is "" for each backend that takes the call.
te_attn_backend choose_forward_backend(Checker &check, const te_attention_config &config,
                                       const AttentionForwardArgs &args, std::string reasons[]);
te_attn_backend choose_backward_backend(Checker &check, const te_attention_config &config,
                                        const AttentionBackwardArgs &args, std::string reasons[]);

size_t forward_workspace_size(te_attn_backend backend, const AttentionForwardArgs &args);
size_t backward_workspace_size(te_attn_backend backend, const AttentionBackwardArgs &args);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_ATTENTION_BACKEND_H_
