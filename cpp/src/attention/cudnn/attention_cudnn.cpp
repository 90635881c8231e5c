// cuDNN's fused attention (attention_cudnn.h) through cudnn-frontend's graph API: one graph per
// problem, holding one sdpa / sdpa_backward node (sdpa_fp8 / sdpa_fp8_backward for FP8).
//
// Layouts. cuDNN sees each operand as [batch, heads, seqlen, dim] with strides, so BSHD and SBHD
// are two stride orders of the same dims. THD is BSHD with seqlen = the longest sequence and,
// in place of the batch stride, a ragged-offset tensor per operand: [batch + 1] element offsets
// of each sequence's first token, cu_seqlens * heads * dim (a kernel writes them into the
// workspace). softmax_lse is cuDNN's Stats [batch, heads_q, max_seqlen_q, 1], packed, for every
// layout (THD included: Stats carries no ragged offset).
//
// Masks. Padding and THD give cuDNN per-sequence lengths ([batch, 1, 1, 1] int32, from
// cu_seqlens, also in the workspace). The window is cuDNN's diagonal band: it keeps key j of
// query i when j <= i + off + right_bound and j > i + off - left_bound, so right_bound =
// window_right and left_bound = window_left + 1; bottom-right alignment is off = seqlen_kv -
// seqlen_q, per sequence under padding. A window wider than both sequences is no window.
//
// Rows without keys. attention_impl.h wants o = 0 and lse = -inf for a query row with no allowed
// key and for rows that are no query (at or past a sequence's length; THD rows past the last
// sequence), and zero gradients for positions that are no query or key. cuDNN need not write
// such rows, nor write those values, so: a kernel sets them in o and softmax_lse after the
// forward (THD's tail rows are zeroed before it); the gradients are zeroed before a backward
// with padding; and the backward gives cuDNN a copy of softmax_lse with -inf turned into +inf,
// whose probabilities exp(s - lse) are 0 where -inf would make them NaN.
//
// Workspace: [cuDNN's | sequence lengths | ragged offsets | backward's softmax_lse copy], each
// part 256-byte aligned.
//
// Built graphs are cached by everything that shapes them (the Problem below, the offset width
// and the device's compute capability), failures included, so *_support, *_workspace_size and
// the call itself build a graph once. The cache lock is held while building; executions take a
// per-device lock, since a cuDNN handle carries one stream at a time.
#ifndef NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#endif
#include <cudnn_frontend.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "attention/cudnn/attention_cudnn.h"
#include "attention/cudnn/attention_cudnn_aux.h"
#include "attention/cudnn/attention_cudnn_problem.h"
#include "attention/cudnn/cudnn_library.h"
#include "common/internal.h"

namespace te {
namespace {

using namespace cudnn_attention;
namespace fe = cudnn_frontend;
namespace fg = cudnn_frontend::graph;
using TensorPtr = std::shared_ptr<fg::Tensor_attributes>;

constexpr const char *kForwardOp = "attention_forward";
constexpr const char *kBackwardOp = "attention_backward";
constexpr size_t kMaxGraphs = 256;
constexpr int kMaxDevices = 64;

// Graph tensor ids; the variant pack of a call maps them to pointers.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV,
  kSeqlenQ, kSeqlenKv, kOffsetQ, kOffsetK, kOffsetV, kOffsetO, kSeed, kRngOffset,
  kDescaleQ, kDescaleK, kDescaleV, kDescaleS, kScaleS, kScaleO, kAmaxS, kAmaxO,
  kDescaleO, kDescaleDO, kDescaleDP, kScaleDP, kScaleDQ, kScaleDK, kScaleDV,
  kAmaxDP, kAmaxDQ, kAmaxDK, kAmaxDV,
};

struct Plan {
  std::string error;  // why cuDNN does not take the problem; "" when graph is ready
  std::shared_ptr<fg::Graph> graph;
  int64_t cudnn_workspace = 0;
  AuxLayout aux;
  size_t aux_base() const { return round_up(static_cast<size_t>(cudnn_workspace), kAlign); }
  size_t workspace() const { return aux_base() + aux.bytes; }
};

// --- graphs --------------------------------------------------------------------------------

fe::DataType_t fe_type(te_dtype d) {
  switch (d) {
    case TE_DTYPE_FLOAT32: return fe::DataType_t::FLOAT;
    case TE_DTYPE_FLOAT16: return fe::DataType_t::HALF;
    case TE_DTYPE_BFLOAT16: return fe::DataType_t::BFLOAT16;
    case TE_DTYPE_FLOAT8_E4M3: return fe::DataType_t::FP8_E4M3;
    case TE_DTYPE_FLOAT8_E5M2: return fe::DataType_t::FP8_E5M2;
    default: return fe::DataType_t::NOT_SET;
  }
}

struct Dims {
  std::vector<int64_t> dim, stride;
};

// An operand with `heads` heads of `head_dim` over `seqlen` positions, as [b, h, s, d], its rows
// (tokens) `row` and heads `head` elements apart (dense: heads * head_dim and head_dim).
Dims bhsd(const Problem &p, int64_t heads, int64_t seqlen, int64_t head_dim, int64_t row, int64_t head) {
  const int64_t b = p.shape.batch;
  if (p.layout == AttnLayout::SBHD) return {{b, heads, seqlen, head_dim}, {row, head, b * row, 1}};
  // BSHD; THD too, whose batch stride the ragged offsets replace.
  return {{b, heads, seqlen, head_dim}, {seqlen * row, head, row, 1}};
}

// q, k or v (and its gradient) under the call's strides.
Dims operand_dims(const Problem &p, AttnOperand op) {
  const AttentionShape &s = p.shape;
  const bool q = op == kOperandQ;
  return bhsd(p, q ? s.heads_q : s.heads_kv, q ? s.seqlen_q : s.seqlen_kv,
              op == kOperandV ? s.head_dim_v : s.head_dim_qk, s.row_stride[op], s.head_stride[op]);
}

// o and d_o: dense.
Dims o_dims_of(const Problem &p) {
  const AttentionShape &s = p.shape;
  return bhsd(p, s.heads_q, s.seqlen_q, s.head_dim_v, s.heads_q * s.head_dim_v, s.head_dim_v);
}

Dims lse_dims(const Problem &p) {
  const int64_t h = p.shape.heads_q, s = p.shape.seqlen_q;
  return {{p.shape.batch, h, s, 1}, {h * s, s, 1, 1}};
}

const Dims kScalar{{1, 1, 1, 1}, {1, 1, 1, 1}};

TensorPtr input(fg::Graph &g, const char *name, int64_t uid, const Dims &d, fe::DataType_t type) {
  return g.tensor(fg::Tensor_attributes().set_name(name).set_uid(uid).set_dim(d.dim).set_stride(d.stride).set_data_type(type));
}

TensorPtr scale_input(fg::Graph &g, const char *name, int64_t uid) {
  return input(g, name, uid, kScalar, fe::DataType_t::FLOAT);
}

void output(const TensorPtr &t, int64_t uid, const Dims &d, fe::DataType_t type) {
  t->set_output(true).set_uid(uid).set_dim(d.dim).set_stride(d.stride).set_data_type(type);
}

// The inputs every graph of a problem has.
struct Operands {
  TensorPtr q, k, v, seqlen_q, seqlen_kv, seed, rng_offset;
  TensorPtr offsets[kFamilies];
};

Operands add_operands(fg::Graph &g, const Problem &p) {
  const AttentionShape &s = p.shape;
  const fe::DataType_t type = fe_type(p.qkv);
  Operands x;
  x.q = input(g, "q", kQ, operand_dims(p, kOperandQ), type);
  x.k = input(g, "k", kK, operand_dims(p, kOperandK), type);
  x.v = input(g, "v", kV, operand_dims(p, kOperandV), type);
  if (p.padding()) {
    const Dims lengths{{s.batch, 1, 1, 1}, {1, 1, 1, 1}};
    x.seqlen_q = input(g, "seqlen_q", kSeqlenQ, lengths, fe::DataType_t::INT32);
    x.seqlen_kv = input(g, "seqlen_kv", kSeqlenKv, lengths, fe::DataType_t::INT32);
  }
  if (p.thd()) {
    const Dims offsets{{s.batch + 1, 1, 1, 1}, {1, 1, 1, 1}};
    const fe::DataType_t width = p.wide_offsets() ? fe::DataType_t::INT64 : fe::DataType_t::INT32;
    static const char *const names[kFamilies] = {"offsets_q", "offsets_k", "offsets_v", "offsets_o"};
    for (int f = 0; f < kFamilies; ++f) x.offsets[f] = input(g, names[f], kOffsetQ + f, offsets, width);
    x.q->set_ragged_offset(x.offsets[kFamilyQ]);
    x.k->set_ragged_offset(x.offsets[kFamilyK]);
    x.v->set_ragged_offset(x.offsets[kFamilyV]);
  }
  if (p.dropout_on()) {
    x.seed = input(g, "rng_seed", kSeed, kScalar, fe::DataType_t::INT64);
    x.rng_offset = input(g, "rng_offset", kRngOffset, kScalar, fe::DataType_t::INT64);
  }
  return x;
}

// Scale, padding, window and dropout: the same setters on all four SDPA attribute classes.
template <typename Attributes>
void set_options(const Problem &p, const Operands &x, Attributes &a) {
  a.set_attn_scale(p.softmax_scale);
  if (p.padding()) a.set_padding_mask(true).set_seq_len_q(x.seqlen_q).set_seq_len_kv(x.seqlen_kv);
  if (p.mask.window_left >= 0 || p.mask.window_right >= 0) {
    a.set_diagonal_alignment(p.mask.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                 : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  if (p.mask.window_right >= 0) a.set_diagonal_band_right_bound(static_cast<int>(p.mask.window_right));
  if (p.mask.window_left >= 0) a.set_diagonal_band_left_bound(static_cast<int>(p.mask.window_left + 1));
  if (p.dropout_on()) a.set_dropout(p.dropout, x.seed, x.rng_offset);
}

std::shared_ptr<fg::Graph> new_graph(const Problem &p, int sm) {
  auto g = std::make_shared<fg::Graph>();
  g->set_io_data_type(fe_type(p.qkv))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  // Known already; spares the frontend a device query (nodes copy the context when added).
  g->set_sm_version(sm);
  return g;
}

std::shared_ptr<fg::Graph> forward_graph(const Problem &p, int sm) {
  const AttentionShape &s = p.shape;
  auto g = new_graph(p, sm);
  const Operands x = add_operands(*g, p);
  fg::SDPA_attributes a;
  a.set_name("attention_forward").set_generate_stats(!p.inference);
  set_options(p, x, a);
  TensorPtr o, stats;
  if (p.fp8()) {
    auto r = g->sdpa_fp8(x.q, x.k, x.v, scale_input(*g, "descale_q", kDescaleQ), scale_input(*g, "descale_k", kDescaleK),
                         scale_input(*g, "descale_v", kDescaleV), scale_input(*g, "descale_s", kDescaleS),
                         scale_input(*g, "scale_s", kScaleS), scale_input(*g, "scale_o", kScaleO), a);
    o = r[0];
    stats = r[1];
    output(r[2], kAmaxS, kScalar, fe::DataType_t::FLOAT);
    output(r[3], kAmaxO, kScalar, fe::DataType_t::FLOAT);
  } else {
    auto r = g->sdpa(x.q, x.k, x.v, a);
    o = r[0];
    stats = r[1];
  }
  output(o, kO, o_dims_of(p), fe_type(p.o));
  if (p.thd()) o->set_ragged_offset(x.offsets[kFamilyO]);
  if (!p.inference) output(stats, kStats, lse_dims(p), fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fg::Graph> backward_graph(const Problem &p, int sm) {
  const AttentionShape &s = p.shape;
  auto g = new_graph(p, sm);
  const Operands x = add_operands(*g, p);
  const Dims o_dims = o_dims_of(p);
  // d_o has its own dtype: under the HYBRID recipe o is E4M3 and d_o E5M2 (cuDNN then also
  // quantizes ds, its "dP", to E5M2).
  TensorPtr o = input(*g, "o", kO, o_dims, fe_type(p.o));
  TensorPtr d_o = input(*g, "d_o", kDO, o_dims, fe_type(p.d_o));
  if (p.thd()) {
    o->set_ragged_offset(x.offsets[kFamilyO]);
    d_o->set_ragged_offset(x.offsets[kFamilyO]);
  }
  TensorPtr stats = input(*g, "softmax_lse", kStats, lse_dims(p), fe::DataType_t::FLOAT);
  std::array<TensorPtr, 3> grads;
  if (p.fp8()) {
    fg::SDPA_fp8_backward_attributes a;
    a.set_name("attention_backward").set_deterministic_algorithm(p.deterministic);
    set_options(p, x, a);
    auto r = g->sdpa_fp8_backward(
        x.q, x.k, x.v, o, d_o, stats, scale_input(*g, "descale_q", kDescaleQ), scale_input(*g, "descale_k", kDescaleK),
        scale_input(*g, "descale_v", kDescaleV), scale_input(*g, "descale_o", kDescaleO),
        scale_input(*g, "descale_do", kDescaleDO), scale_input(*g, "descale_s", kDescaleS),
        scale_input(*g, "descale_dp", kDescaleDP), scale_input(*g, "scale_s", kScaleS),
        scale_input(*g, "scale_dq", kScaleDQ), scale_input(*g, "scale_dk", kScaleDK),
        scale_input(*g, "scale_dv", kScaleDV), scale_input(*g, "scale_dp", kScaleDP), a);
    grads = {r[0], r[1], r[2]};
    output(r[3], kAmaxDQ, kScalar, fe::DataType_t::FLOAT);
    output(r[4], kAmaxDK, kScalar, fe::DataType_t::FLOAT);
    output(r[5], kAmaxDV, kScalar, fe::DataType_t::FLOAT);
    output(r[6], kAmaxDP, kScalar, fe::DataType_t::FLOAT);
  } else {
    fg::SDPA_backward_attributes a;
    a.set_name("attention_backward").set_deterministic_algorithm(p.deterministic);
    set_options(p, x, a);
    grads = g->sdpa_backward(x.q, x.k, x.v, o, d_o, stats, a);
  }
  const fe::DataType_t grad = fe_type(p.grad);
  output(grads[0], kDQ, operand_dims(p, kOperandQ), grad);
  output(grads[1], kDK, operand_dims(p, kOperandK), grad);
  output(grads[2], kDV, operand_dims(p, kOperandV), grad);
  if (p.thd()) {
    grads[0]->set_ragged_offset(x.offsets[kFamilyQ]);
    grads[1]->set_ragged_offset(x.offsets[kFamilyK]);
    grads[2]->set_ragged_offset(x.offsets[kFamilyV]);
  }
  return g;
}

// cuDNN's messages can run to several lines; the first few hundred characters say enough.
std::string brief(std::string message) {
  for (char &c : message) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  constexpr size_t kMax = 400;
  if (message.size() > kMax) message = message.substr(0, kMax) + "...";
  return message.empty() ? "unknown cuDNN error" : message;
}

Plan build_plan(const Problem &p, int sm, cudnnHandle_t handle) {
  Plan plan;
  plan.aux = aux_layout(p);
  try {
    std::shared_ptr<fg::Graph> g = p.backward ? backward_graph(p, sm) : forward_graph(p, sm);
    fe::error_t e = g->validate();
    if (e.is_good()) e = g->build_operation_graph(handle);
    if (e.is_good()) e = g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
    if (e.is_good()) e = g->check_support();
    if (e.is_good()) e = g->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
    if (e.is_good()) e = g->get_workspace_size(plan.cudnn_workspace);
    if (e.is_bad()) {
      plan.error = brief(e.err_msg);
      return plan;
    }
    plan.graph = std::move(g);
  } catch (const std::exception &ex) {
    plan.error = brief(ex.what());
  }
  return plan;
}

// The cached plan of a problem, built on first use. The problem's own checks come first; the
// device must be current.
std::shared_ptr<const Plan> plan_for(const Problem &p) {
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<const Plan>> cache;
  static std::list<Key> order;  // oldest first

  const int sm = p.device >= 0 ? device_sm(p.device) : -1;
  if (std::string why = problem_reason(p, sm); !why.empty()) {
    auto plan = std::make_shared<Plan>();
    plan->error = std::move(why);
    return plan;
  }
  if (p.no_queries() || p.no_keys()) return std::make_shared<Plan>();  // no graph: see the callers
  const Key key = key_of(p, sm);
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  auto plan = std::make_shared<Plan>();
  cudnnHandle_t handle = nullptr;
  if (std::string why = cudnn_handle_for(p.device, &handle); !why.empty()) {
    plan->error = why;  // not cached: a later call may succeed
    return plan;
  }
  *plan = build_plan(p, sm, handle);
  if (!plan->error.empty() && p.backward && p.deterministic) {
    // "Deterministic where the backend has one": without it, the usual algorithm.
    Problem relaxed = p;
    relaxed.deterministic = false;
    *plan = build_plan(relaxed, sm, handle);
  }
  cache.emplace(key, plan);
  order.push_back(key);
  if (order.size() > kMaxGraphs) {
    cache.erase(order.front());  // callers still holding that plan keep it alive
    order.pop_front();
  }
  return plan;
}

// --- execution -----------------------------------------------------------------------------

// A cuDNN handle carries one stream at a time: set_stream and execute go together.
std::mutex &execution_mutex(int device) {
  static std::mutex mutexes[kMaxDevices];
  return mutexes[device];
}

using VariantPack = std::unordered_map<int64_t, void *>;

void *mut(const void *p) { return const_cast<void *>(p); }

// The lengths and offsets the graph reads, written into the workspace; and their pack entries.
te_status add_metadata(const char *op, const Problem &p, const Plan &plan, char *workspace, const int32_t *cu_q,
                       const int32_t *cu_kv, const int64_t *rng_state, cudaStream_t stream, VariantPack *pack) {
  if (p.dropout_on()) {
    (*pack)[kSeed] = mut(rng_state);
    (*pack)[kRngOffset] = mut(rng_state + 1);
  }
  if (!p.padding()) return TE_SUCCESS;
  char *aux = workspace + plan.aux_base();
  CudnnSequenceMetadata m{};
  m.cu_seqlens_q = cu_q;
  m.cu_seqlens_kv = cu_kv;
  m.batch = p.shape.batch;
  m.seqlen_q = reinterpret_cast<int32_t *>(aux + plan.aux.seqlen_q);
  m.seqlen_kv = reinterpret_cast<int32_t *>(aux + plan.aux.seqlen_kv);
  (*pack)[kSeqlenQ] = m.seqlen_q;
  (*pack)[kSeqlenKv] = m.seqlen_kv;
  m.wide = p.wide_offsets();
  if (p.thd()) {
    const AttentionShape &s = p.shape;
    const int64_t per_token[kFamilies] = {s.heads_q * s.head_dim_qk, s.heads_kv * s.head_dim_qk,
                                          s.heads_kv * s.head_dim_v, s.heads_q * s.head_dim_v};
    for (int f = 0; f < kFamilies; ++f) {
      m.offsets[f] = aux + plan.aux.offsets[f];
      m.elements_per_token[f] = per_token[f];
      m.from_kv[f] = f == kFamilyK || f == kFamilyV;
      (*pack)[kOffsetQ + f] = m.offsets[f];
    }
  }
  return cudnn_sequence_metadata(op, m, stream);
}

te_status zero(const char *op, void *p, int64_t elements, te_dtype dtype, cudaStream_t stream) {
  if (elements <= 0) return TE_SUCCESS;
  const cudaError_t err = cudaMemsetAsync(p, 0, static_cast<size_t>(elements) * te_dtype_size(dtype), stream);
  if (err == cudaSuccess) return TE_SUCCESS;
  return fail(TE_ERROR_RUNTIME, op, std::string("CUDA error ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

te_status zero_amaxes(const char *op, std::initializer_list<float *> amaxes, cudaStream_t stream) {
  // cuDNN reduces into them; a stale amax must not survive (0 is also right for any empty one).
  for (float *amax : amaxes) {
    if (te_status s = zero(op, amax, 1, TE_DTYPE_FLOAT32, stream)) return s;
  }
  return TE_SUCCESS;
}

te_status execute(const char *op, const Problem &p, const Plan &plan, VariantPack &pack, void *workspace,
                  cudaStream_t stream) {
  cudnnHandle_t handle = nullptr;
  if (std::string why = cudnn_handle_for(p.device, &handle); !why.empty()) return fail(TE_ERROR_RUNTIME, op, why);
  std::lock_guard<std::mutex> lock(execution_mutex(p.device));
  if (std::string why = cudnn_set_stream(handle, stream); !why.empty()) return fail(TE_ERROR_RUNTIME, op, why);
  fe::error_t e = plan.graph->execute(handle, pack, workspace);
  if (e.is_bad()) return fail(TE_ERROR_RUNTIME, op, "cuDNN fused attention failed: " + brief(e.err_msg));
  return TE_SUCCESS;
}

// The plan of a call, or the error to return: unsupported, or a workspace too small.
te_status plan_of_call(const char *op, const Problem &p, const std::string &pointers, size_t workspace_size,
                       const void *workspace, std::shared_ptr<const Plan> *plan) {
  *plan = plan_for(p);
  const std::string &why = (*plan)->error.empty() ? pointers : (*plan)->error;
  if (!why.empty()) return fail(TE_ERROR_UNSUPPORTED, op, "cuDNN fused attention does not take this call: " + why);
  const size_t needed = (*plan)->graph != nullptr ? (*plan)->workspace() : 0;
  if (workspace_size < needed || (needed > 0 && workspace == nullptr)) {
    return fail(TE_ERROR_VALUE, op, "workspace must be at least " + std::to_string(needed) +
                                        " bytes for cuDNN (see the workspace size query), got " +
                                        std::to_string(workspace == nullptr ? 0 : workspace_size));
  }
  return TE_SUCCESS;
}

int64_t lse_elements(const AttentionShape &s) { return s.batch * s.heads_q * s.seqlen_q; }

// What the call's tensors add to the problem's own checks. A query without tensors (the
// backend and workspace-size queries, which see shapes alone) describes a call that will pass
// what its mask, dropout and FP8 options need: were those missing pointers counted against
// cuDNN there, the query would name another backend, and a workspace too small for the cuDNN
// call that then runs.
template <typename Args>
std::string call_reason(const Problem &p, const Args &args) {
  return args.q == nullptr ? std::string() : pointer_reason(p, args);
}

}  // namespace

// This file is compiled with hidden visibility (for the frontend's inline code); the entry
// points stay visible like the rest of the core's internals, so a check program can call them.
#define TE_CUDNN_ENTRY __attribute__((visibility("default")))

TE_CUDNN_ENTRY std::string cudnn_attention_forward_support(const AttentionForwardArgs &args) {
  try {
    const Problem p = problem_of(args);
    CudaDeviceScope scope(args.device);
    const std::shared_ptr<const Plan> plan = plan_for(p);
    return plan->error.empty() ? call_reason(p, args) : plan->error;
  } catch (const std::exception &e) {
    return brief(e.what());
  }
}

TE_CUDNN_ENTRY std::string cudnn_attention_backward_support(const AttentionBackwardArgs &args) {
  try {
    const Problem p = problem_of(args);
    CudaDeviceScope scope(args.device);
    const std::shared_ptr<const Plan> plan = plan_for(p);
    return plan->error.empty() ? call_reason(p, args) : plan->error;
  } catch (const std::exception &e) {
    return brief(e.what());
  }
}

TE_CUDNN_ENTRY size_t cudnn_attention_forward_workspace_size(const AttentionForwardArgs &args) {
  try {
    CudaDeviceScope scope(args.device);
    const auto plan = plan_for(problem_of(args));
    return plan->graph != nullptr ? plan->workspace() : 0;
  } catch (const std::exception &) {
    return 0;
  }
}

TE_CUDNN_ENTRY size_t cudnn_attention_backward_workspace_size(const AttentionBackwardArgs &args) {
  try {
    CudaDeviceScope scope(args.device);
    const auto plan = plan_for(problem_of(args));
    return plan->graph != nullptr ? plan->workspace() : 0;
  } catch (const std::exception &) {
    return 0;
  }
}

TE_CUDNN_ENTRY te_status cudnn_attention_forward(const AttentionForwardArgs &a, te_stream stream_handle) {
  return guarded(kForwardOp, [&]() -> te_status {
    const Problem p = problem_of(a);
    CudaDeviceScope scope(a.device);
    std::shared_ptr<const Plan> plan;
    if (te_status s = plan_of_call(kForwardOp, p, pointer_reason(p, a), a.workspace_size, a.workspace, &plan)) return s;
    const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
    const AttentionShape &s = p.shape;
    if (p.no_queries()) return TE_SUCCESS;
    if (p.fp8()) {
      if (te_status st = zero_amaxes(kForwardOp, {a.fp8.amax_s, a.fp8.amax_o}, stream)) return st;
    }
    if (p.no_keys() || p.thd()) {
      if (te_status st = zero(kForwardOp, a.o, s.total_q * s.heads_q * s.head_dim_v, p.o, stream)) return st;
    }
    if (p.no_keys()) {
      if (p.inference) return TE_SUCCESS;
      const float neg_inf = -std::numeric_limits<float>::infinity();
      return cudnn_fill_fp32(kForwardOp, a.softmax_lse, lse_elements(s), neg_inf, stream);
    }
    char *ws = static_cast<char *>(a.workspace);
    VariantPack pack{{kQ, mut(a.q)}, {kK, mut(a.k)}, {kV, mut(a.v)}, {kO, a.o}};
    if (!p.inference) pack.insert({kStats, a.softmax_lse});
    if (p.fp8()) {
      const AttentionFp8 &f = a.fp8;
      pack.insert({{kDescaleQ, mut(f.descale_q)}, {kDescaleK, mut(f.descale_k)}, {kDescaleV, mut(f.descale_v)},
                   {kDescaleS, mut(f.descale_s)}, {kScaleS, mut(f.scale_s)}, {kScaleO, mut(f.scale_o)},
                   {kAmaxS, f.amax_s}, {kAmaxO, f.amax_o}});
    }
    if (te_status st = add_metadata(kForwardOp, p, *plan, ws, a.cu_seqlens_q, a.cu_seqlens_kv, a.rng_state, stream, &pack)) {
      return st;
    }
    if (te_status st = execute(kForwardOp, p, *plan, pack, ws, stream)) return st;
    if (!p.padding() && p.mask.window_left < 0 && p.mask.window_right < 0) return TE_SUCCESS;  // every row has keys
    CudnnEmptyRows r{};
    r.layout = p.layout;
    r.batch = s.batch, r.heads = s.heads_q, r.seqlen_q = s.seqlen_q, r.seqlen_kv = s.seqlen_kv;
    r.head_dim_v = s.head_dim_v;
    if (p.padding()) r.cu_seqlens_q = a.cu_seqlens_q, r.cu_seqlens_kv = a.cu_seqlens_kv;
    r.bottom_right = p.mask.bottom_right;
    r.window_left = p.mask.window_left, r.window_right = p.mask.window_right;
    r.o = a.o, r.o_element_size = te_dtype_size(p.o), r.softmax_lse = a.softmax_lse;
    return cudnn_empty_rows(kForwardOp, r, stream);
  });
}

TE_CUDNN_ENTRY te_status cudnn_attention_backward(const AttentionBackwardArgs &a, te_stream stream_handle) {
  return guarded(kBackwardOp, [&]() -> te_status {
    const Problem p = problem_of(a);
    CudaDeviceScope scope(a.device);
    std::shared_ptr<const Plan> plan;
    if (te_status s = plan_of_call(kBackwardOp, p, pointer_reason(p, a), a.workspace_size, a.workspace, &plan)) return s;
    const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
    const AttentionShape &s = p.shape;
    if (p.fp8()) {
      const AttentionFp8 &f = a.fp8;
      if (te_status st = zero_amaxes(kBackwardOp, {f.amax_dp, f.amax_dq, f.amax_dk, f.amax_dv}, stream)) return st;
    }
    if (p.padding() || p.no_queries() || p.no_keys()) {
      if (te_status st = zero(kBackwardOp, a.dq, s.total_q * s.heads_q * s.head_dim_qk, p.grad, stream)) return st;
      if (te_status st = zero(kBackwardOp, a.dk, s.total_kv * s.heads_kv * s.head_dim_qk, p.grad, stream)) return st;
      if (te_status st = zero(kBackwardOp, a.dv, s.total_kv * s.heads_kv * s.head_dim_v, p.grad, stream)) return st;
    }
    if (p.no_queries() || p.no_keys()) return TE_SUCCESS;
    char *ws = static_cast<char *>(a.workspace);
    float *stats = reinterpret_cast<float *>(ws + plan->aux_base() + plan->aux.stats);
    if (te_status st = cudnn_backward_stats(kBackwardOp, a.softmax_lse, stats, lse_elements(s), stream)) return st;
    VariantPack pack{{kQ, mut(a.q)}, {kK, mut(a.k)}, {kV, mut(a.v)}, {kO, mut(a.o)}, {kDO, mut(a.d_o)},
                     {kStats, stats}, {kDQ, a.dq}, {kDK, a.dk}, {kDV, a.dv}};
    if (p.fp8()) {
      const AttentionFp8 &f = a.fp8;
      pack.insert({{kDescaleQ, mut(f.descale_q)}, {kDescaleK, mut(f.descale_k)}, {kDescaleV, mut(f.descale_v)},
                   {kDescaleO, mut(f.descale_o)}, {kDescaleDO, mut(f.descale_do)}, {kDescaleS, mut(f.descale_s)},
                   {kDescaleDP, mut(f.descale_dp)}, {kScaleS, mut(f.scale_s)}, {kScaleDP, mut(f.scale_dp)},
                   {kScaleDQ, mut(f.scale_dq)}, {kScaleDK, mut(f.scale_dk)}, {kScaleDV, mut(f.scale_dv)},
                   {kAmaxDP, f.amax_dp}, {kAmaxDQ, f.amax_dq}, {kAmaxDK, f.amax_dk}, {kAmaxDV, f.amax_dv}});
    }
    if (te_status st = add_metadata(kBackwardOp, p, *plan, ws, a.cu_seqlens_q, a.cu_seqlens_kv, a.rng_state, stream, &pack)) {
      return st;
    }
    return execute(kBackwardOp, p, *plan, pack, ws, stream);
  });
}

}  // namespace te
