// What shapes one cuDNN attention graph (a Problem: everything of a call but its pointers), and
// what cuDNN takes before any graph is built: the checks whose reasons *_support returns when
// they fail, ahead of the graph's own validation. Free of cudnn-frontend (which the graph code,
// attention_cudnn.cpp, includes).
#ifndef TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_PROBLEM_H_
#define TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_PROBLEM_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/attention_impl.h"
#include "common/internal.h"

namespace te {
namespace cudnn_attention {

constexpr size_t kAlign = 256;  // of each part of the workspace

inline size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Ragged offsets, one tensor per operand family: q (and dQ), k (dK), v (dV), o (dO).
enum Family { kFamilyQ = 0, kFamilyK, kFamilyV, kFamilyO, kFamilies };

// Everything about a call that shapes its graph.
struct Problem {
  bool backward = false;
  AttnLayout layout = AttnLayout::BSHD;
  AttentionShape shape{};
  AttentionMask mask{};
  float softmax_scale = 0.0f, dropout = 0.0f;
  // d_o has its own dtype: the HYBRID recipe's E5M2 d_o goes with an E4M3 o.
  te_dtype qkv = TE_DTYPE_BFLOAT16, o = TE_DTYPE_BFLOAT16, d_o = TE_DTYPE_BFLOAT16, grad = TE_DTYPE_BFLOAT16;
  bool deterministic = false;
  bool inference = false;  // forward: no softmax stats (te_attention_config.inference)
  int device = -1;

  bool fp8() const { return is_fp8(qkv); }
  bool thd() const { return layout == AttnLayout::THD; }
  bool padding() const { return mask.padding || thd(); }
  bool dropout_on() const { return dropout > 0.0f; }
  // Nothing to compute: no query row.
  bool no_queries() const { return shape.batch == 0 || shape.seqlen_q == 0 || shape.total_q == 0 || shape.heads_q == 0; }
  // No key at all: every row has o = 0, lse = -inf (and zero gradients).
  bool no_keys() const { return shape.seqlen_kv == 0 || shape.total_kv == 0; }
  // int64 ragged offsets once an offset can pass int32.
  bool wide_offsets() const {
    const int64_t d = std::max(shape.head_dim_qk, shape.head_dim_v);
    return thd() && std::max(shape.total_q * shape.heads_q, shape.total_kv * shape.heads_kv) * d > INT32_MAX;
  }
};

Problem problem_of(const AttentionForwardArgs &args);
Problem problem_of(const AttentionBackwardArgs &args);

// The graph cache's key: the problem, the device's compute capability and the offset width.
using Key = std::vector<int64_t>;
Key key_of(const Problem &p, int sm);

// Where the sequence lengths and ragged offsets sit, from the start of our part of the workspace.
struct AuxLayout {
  size_t seqlen_q = 0, seqlen_kv = 0;
  size_t offsets[kFamilies] = {};
  size_t stats = 0;
  size_t bytes = 0;
};
AuxLayout aux_layout(const Problem &p);

// "" when nothing about the problem rules cuDNN out before a graph is built, else why.
std::string problem_reason(const Problem &p, int sm);

// "" when the call's pointers suit cuDNN (alignment; the lengths, rng state and FP8 factors that
// the problem needs), else why.
std::string pointer_reason(const Problem &p, const AttentionForwardArgs &args);
std::string pointer_reason(const Problem &p, const AttentionBackwardArgs &args);

}  // namespace cudnn_attention
}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_ATTENTION_CUDNN_ATTENTION_CUDNN_PROBLEM_H_
