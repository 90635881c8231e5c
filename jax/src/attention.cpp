// XLA FFI handlers of the core's attention (te_attention_forward, te_attention_backward).
//
// cu_seqlens_q / cu_seqlens_kv (int32 [batch + 1]) and rng_state (see rng_tensor) are zero-size
// buffers when the call has no padding mask or no dropout. The CUDA workspace is an extra
// result, sized by the Python side with te_attention_workspace_size (workspace_of, ffi_common.h).
//
// The packed handlers take self-attention's q, k and v as the three parts of one projection
// output qkv [b, s, 3, heads, head_dim] (sbhd: [s, b, 3, ...]), or k and v as the two parts of
// a KV projection's output beside a dense q (GQA, cross-attention), and read them in place
// through the config's strides (attention.h); the backward writes the gradients where the
// operands sit, into arrays of their shapes. XLA would otherwise copy the parts out of the
// projection's output and join their gradients back into one.
#include <utility>

#include "ffi_common.h"
#include "handlers.h"
#include "transformer_engine/attention.h"

namespace te_jax {
namespace {

struct Optional {
  Tensor t;
  bool present = false;
};

ffi::Error optional_tensor(const char *op, const char *what, const ffi::AnyBuffer &b, const Device &dev,
                           Optional *out) {
  if (b.element_count() == 0) return ffi::Error::Success();
  out->present = true;
  return plain_tensor(op, what, b, dev, &out->t);
}

// rng_state: JAX without x64 has no int64 arrays, so the (seed, offset) pair travels as the
// bytes of uint32 [4] and is viewed here as the core's int64 [2] (little-endian halves).
ffi::Error rng_tensor(const char *op, const ffi::AnyBuffer &b, const Device &dev, Optional *out) {
  if (b.element_count() == 0) return ffi::Error::Success();
  if (b.element_type() == ffi::DataType::S64) return optional_tensor(op, "rng_state", b, dev, out);
  if (b.element_type() != ffi::DataType::U32 || b.element_count() != 4) {
    return invalid(op, "rng_state must be int64 [2] or uint32 [4], got " + std::to_string(b.element_count()) +
                           " elements of XLA type " + std::to_string(static_cast<int>(b.element_type())));
  }
  te_buffer buffer{};
  buffer.data = b.untyped_data();
  buffer.dtype = TE_DTYPE_INT64;
  buffer.ndim = 1;
  buffer.shape[0] = 2;
  buffer.device = dev.type;
  buffer.device_id = dev.id;
  out->present = true;
  TE_JAX_RETURN_IF_ERROR(out->t.init(op, TE_SCALING_TENSOR));
  return out->t.set(TE_SLOT_DATA, buffer);
}

ffi::Error make_config(const char *op, int32_t layout, int32_t mask, int64_t window_left, int64_t window_right,
                       float softmax_scale, float dropout, int64_t max_seqlen_q, int64_t max_seqlen_kv,
                       bool deterministic, int32_t backend, te_attention_config *c) {
  if (layout < 0 || layout >= TE_ATTN_LAYOUT_COUNT || mask < 0 || mask >= TE_ATTN_MASK_COUNT) {
    return invalid(op, "layout and mask_type must be te_attn_layout / te_attn_mask_type codes, got " +
                           std::to_string(layout) + " and " + std::to_string(mask));
  }
  *c = te_attention_config{static_cast<te_attn_layout>(layout),
                           static_cast<te_attn_mask_type>(mask),
                           window_left,
                           window_right,
                           softmax_scale,
                           dropout,
                           max_seqlen_q,
                           max_seqlen_kv,
                           deterministic ? 1 : 0,
                           static_cast<te_attn_backend>(backend),
                           /*inference=*/0};
  return ffi::Error::Success();
}

// The attributes every attention binding takes after its buffers: layout, mask and softmax.
template <typename Binding>
auto with_softmax_attrs(Binding binding) {
  return std::move(binding)
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("mask_type")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softmax_scale")
      .template Attr<float>("dropout");
}

// A call's optional buffers as the core takes them (a pointer each, null where absent: cu_q and
// cu_kv themselves may be null, no padding) and its workspace.
struct Extras {
  Optional cu_q, cu_kv, rng;
  Workspace ws;
  const te_tensor *get(const Optional &o) const { return o.present ? o.t.get() : nullptr; }
};

ffi::Error extras_of(const char *op, const ffi::AnyBuffer *cu_q, const ffi::AnyBuffer *cu_kv,
                     const ffi::AnyBuffer &rng, const ffi::AnyBuffer &workspace, const Device &dev, Extras *e) {
  if (cu_q != nullptr) TE_JAX_RETURN_IF_ERROR(optional_tensor(op, "cu_seqlens_q", *cu_q, dev, &e->cu_q));
  if (cu_kv != nullptr) TE_JAX_RETURN_IF_ERROR(optional_tensor(op, "cu_seqlens_kv", *cu_kv, dev, &e->cu_kv));
  TE_JAX_RETURN_IF_ERROR(rng_tensor(op, rng, dev, &e->rng));
  e->ws = workspace_of(workspace, dev);
  return ffi::Error::Success();
}

// The forward's call once q, k and v are described: o, softmax_lse and the extras.
ffi::Error run_forward(const char *op, const te_attention_config &cfg, Tensor (&qkv)[3], const ffi::AnyBuffer *cu_q,
                       const ffi::AnyBuffer *cu_kv, const ffi::AnyBuffer &rng, const ffi::AnyBuffer &o,
                       const ffi::AnyBuffer &lse, const ffi::AnyBuffer &workspace, const Device &dev) {
  Tensor to, tl;
  Extras e;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "o", o, dev, &to));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "softmax_lse", lse, dev, &tl));
  TE_JAX_RETURN_IF_ERROR(extras_of(op, cu_q, cu_kv, rng, workspace, dev, &e));
  return from_status(te_attention_forward(&cfg, qkv[0].get(), qkv[1].get(), qkv[2].get(), to.get(), tl.get(),
                                          e.get(e.cu_q), e.get(e.cu_kv), e.get(e.rng), nullptr, e.ws.data,
                                          e.ws.bytes, dev.stream));
}

ffi::Error AttentionForwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer cu_q,
                                ffi::AnyBuffer cu_kv, ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> o,
                                ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> workspace,
                                int32_t layout, int32_t mask, int64_t window_left, int64_t window_right,
                                float softmax_scale, float dropout, int64_t max_seqlen_q, int64_t max_seqlen_kv,
                                int32_t backend, Device dev) {
  constexpr const char *op = "attention_forward";
  te_attention_config cfg;
  TE_JAX_RETURN_IF_ERROR(make_config(op, layout, mask, window_left, window_right, softmax_scale, dropout,
                                     max_seqlen_q, max_seqlen_kv, false, backend, &cfg));
  Tensor qkv[3];
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "q", q, dev, &qkv[0]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "k", k, dev, &qkv[1]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "v", v, dev, &qkv[2]));
  return run_forward(op, cfg, qkv, &cu_q, &cu_kv, rng, *o, *lse, *workspace, dev);
}

auto TeAttentionForwardBinding() {
  return with_softmax_attrs(ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // q
      .Arg<ffi::AnyBuffer>()  // k
      .Arg<ffi::AnyBuffer>()  // v
      .Arg<ffi::AnyBuffer>()  // cu_seqlens_q int32 [batch + 1] or zero-size
      .Arg<ffi::AnyBuffer>()  // cu_seqlens_kv
      .Arg<ffi::AnyBuffer>()  // rng_state int64 [2] or zero-size
      .Ret<ffi::AnyBuffer>()  // o
      .Ret<ffi::AnyBuffer>()  // softmax_lse fp32 [batch, heads_q, max_seqlen_q]
      .Ret<ffi::AnyBuffer>())  // workspace uint8
      .Attr<int64_t>("max_seqlen_q")
      .Attr<int64_t>("max_seqlen_kv")
      .Attr<int32_t>("backend");
}

// The backward's call once q, k, v and their gradients are described.
ffi::Error run_backward(const char *op, const te_attention_config &cfg, Tensor (&qkv)[3], Tensor (&grads)[3],
                        const ffi::AnyBuffer &o, const ffi::AnyBuffer &d_o, const ffi::AnyBuffer &lse,
                        const ffi::AnyBuffer *cu_q, const ffi::AnyBuffer *cu_kv, const ffi::AnyBuffer &rng,
                        const ffi::AnyBuffer &workspace, const Device &dev) {
  Tensor to, tdo, tl;
  Extras e;
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "o", o, dev, &to));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "d_o", d_o, dev, &tdo));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "softmax_lse", lse, dev, &tl));
  TE_JAX_RETURN_IF_ERROR(extras_of(op, cu_q, cu_kv, rng, workspace, dev, &e));
  return from_status(te_attention_backward(&cfg, qkv[0].get(), qkv[1].get(), qkv[2].get(), to.get(), tdo.get(),
                                           tl.get(), e.get(e.cu_q), e.get(e.cu_kv), e.get(e.rng), nullptr,
                                           grads[0].get(), grads[1].get(), grads[2].get(), nullptr, e.ws.data,
                                           e.ws.bytes, dev.stream));
}

ffi::Error AttentionBackwardImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                                 ffi::AnyBuffer d_o, ffi::AnyBuffer lse, ffi::AnyBuffer cu_q, ffi::AnyBuffer cu_kv,
                                 ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                 ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> workspace,
                                 int32_t layout, int32_t mask, int64_t window_left, int64_t window_right,
                                 float softmax_scale, float dropout, int64_t max_seqlen_q, int64_t max_seqlen_kv,
                                 bool deterministic, int32_t backend, Device dev) {
  constexpr const char *op = "attention_backward";
  te_attention_config cfg;
  TE_JAX_RETURN_IF_ERROR(make_config(op, layout, mask, window_left, window_right, softmax_scale, dropout,
                                     max_seqlen_q, max_seqlen_kv, deterministic, backend, &cfg));
  Tensor qkv[3], grads[3];
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "q", q, dev, &qkv[0]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "k", k, dev, &qkv[1]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "v", v, dev, &qkv[2]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dq", *dq, dev, &grads[0]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dk", *dk, dev, &grads[1]));
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, "dv", *dv, dev, &grads[2]));
  return run_backward(op, cfg, qkv, grads, o, d_o, lse, &cu_q, &cu_kv, rng, *workspace, dev);
}

auto TeAttentionBackwardBinding() {
  return with_softmax_attrs(ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // q
      .Arg<ffi::AnyBuffer>()  // k
      .Arg<ffi::AnyBuffer>()  // v
      .Arg<ffi::AnyBuffer>()  // o
      .Arg<ffi::AnyBuffer>()  // d_o
      .Arg<ffi::AnyBuffer>()  // softmax_lse
      .Arg<ffi::AnyBuffer>()  // cu_seqlens_q or zero-size
      .Arg<ffi::AnyBuffer>()  // cu_seqlens_kv
      .Arg<ffi::AnyBuffer>()  // rng_state or zero-size
      .Ret<ffi::AnyBuffer>()  // dq
      .Ret<ffi::AnyBuffer>()  // dk
      .Ret<ffi::AnyBuffer>()  // dv
      .Ret<ffi::AnyBuffer>())  // workspace uint8
      .Attr<int64_t>("max_seqlen_q")
      .Attr<int64_t>("max_seqlen_kv")
      .Attr<bool>("deterministic")
      .Attr<int32_t>("backend");
}

// Parts first..first + count - 1 of a packed buffer [s0, s1, parts, heads, head_dim] (q, k, v
// of a QKV projection's output, or k, v of a KV one) as [s0, s1, heads, head_dim] tensors over
// their elements in place, operands first..first + count - 1 of cfg, whose strides they get.
ffi::Error packed_parts(const char *op, const char *what, const ffi::AnyBuffer &packed, int64_t parts,
                        const Device &dev, int first, te_attention_config *cfg, Tensor *out) {
  te_buffer whole;
  TE_JAX_RETURN_IF_ERROR(to_buffer(op, what, packed, dev, &whole));
  if (whole.ndim != 5 || whole.shape[2] != parts) {
    std::string shape;
    for (int32_t i = 0; i < whole.ndim; ++i) shape += (i ? ", " : "") + std::to_string(whole.shape[i]);
    return invalid(op, std::string(what) + " must be [s0, s1, " + std::to_string(parts) +
                           ", heads, head_dim], got [" + shape + "]");
  }
  const int64_t heads = whole.shape[3], dim = whole.shape[4];
  const size_t element = whole.dtype == TE_DTYPE_FLOAT32 ? 4 : 2;  // (the attention dtypes)
  for (int p = 0; p < parts; ++p) {
    te_buffer part = whole;
    part.ndim = 4;
    part.shape[2] = heads;
    part.shape[3] = dim;
    part.data = static_cast<char *>(whole.data) + static_cast<size_t>(p * heads * dim) * element;
    TE_JAX_RETURN_IF_ERROR(out[p].init(op, TE_SCALING_TENSOR));
    TE_JAX_RETURN_IF_ERROR(out[p].set(TE_SLOT_DATA, part));
    cfg->row_stride[first + p] = parts * heads * dim;
    cfg->head_stride[first + p] = dim;
  }
  return ffi::Error::Success();
}

// q, k, v of a packed call: with kv zero-size, the three parts of q (a QKV projection's output
// [s0, s1, 3, heads, head_dim]); else q dense [s0, s1, heads, head_dim] and the two parts of kv
// [s0, s1', 2, kv heads, head_dim].
ffi::Error packed_operands(const char *op, const char *q_name, const char *kv_name, const ffi::AnyBuffer &q,
                           const ffi::AnyBuffer &kv, const Device &dev, te_attention_config *cfg, Tensor (&qkv)[3]) {
  if (kv.element_count() == 0) return packed_parts(op, q_name, q, 3, dev, 0, cfg, qkv);
  TE_JAX_RETURN_IF_ERROR(plain_tensor(op, q_name, q, dev, &qkv[0]));
  return packed_parts(op, kv_name, kv, 2, dev, 1, cfg, qkv + 1);
}

ffi::Error AttentionForwardPackedImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer rng,
                                      ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                                      ffi::Result<ffi::AnyBuffer> workspace, int32_t layout, int32_t mask,
                                      int64_t window_left, int64_t window_right, float softmax_scale, float dropout,
                                      int32_t backend, Device dev) {
  constexpr const char *op = "attention_forward_packed";
  te_attention_config cfg;
  TE_JAX_RETURN_IF_ERROR(make_config(op, layout, mask, window_left, window_right, softmax_scale, dropout, 0, 0,
                                     false, backend, &cfg));
  Tensor parts[3];
  TE_JAX_RETURN_IF_ERROR(packed_operands(op, "q", "kv", q, kv, dev, &cfg, parts));
  return run_forward(op, cfg, parts, nullptr, nullptr, rng, *o, *lse, *workspace, dev);
}

auto TeAttentionForwardPackedBinding() {
  return with_softmax_attrs(ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // q: qkv [s0, s1, 3, heads, head_dim], or q [s0, s1, heads, head_dim]
      .Arg<ffi::AnyBuffer>()  // kv [s0, s1', 2, kv heads, head_dim], or zero-size with a qkv
      .Arg<ffi::AnyBuffer>()  // rng_state int64 [2] or zero-size
      .Ret<ffi::AnyBuffer>()  // o [s0, s1, heads, head_dim]
      .Ret<ffi::AnyBuffer>()  // softmax_lse fp32 [batch, heads, seqlen_q]
      .Ret<ffi::AnyBuffer>())  // workspace uint8
      .Attr<int32_t>("backend");
}

ffi::Error AttentionBackwardPackedImpl(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer o, ffi::AnyBuffer d_o,
                                       ffi::AnyBuffer lse, ffi::AnyBuffer rng, ffi::Result<ffi::AnyBuffer> dq,
                                       ffi::Result<ffi::AnyBuffer> dkv, ffi::Result<ffi::AnyBuffer> workspace,
                                       int32_t layout, int32_t mask, int64_t window_left, int64_t window_right,
                                       float softmax_scale, float dropout, bool deterministic, int32_t backend,
                                       Device dev) {
  constexpr const char *op = "attention_backward_packed";
  te_attention_config cfg;
  TE_JAX_RETURN_IF_ERROR(make_config(op, layout, mask, window_left, window_right, softmax_scale, dropout, 0, 0,
                                     deterministic, backend, &cfg));
  Tensor parts[3], grads[3];
  TE_JAX_RETURN_IF_ERROR(packed_operands(op, "q", "kv", q, kv, dev, &cfg, parts));
  // (the gradients in their operands' layouts: the same strides)
  TE_JAX_RETURN_IF_ERROR(packed_operands(op, "dq", "dkv", *dq, *dkv, dev, &cfg, grads));
  return run_backward(op, cfg, parts, grads, o, d_o, lse, nullptr, nullptr, rng, *workspace, dev);
}

auto TeAttentionBackwardPackedBinding() {
  return with_softmax_attrs(ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // q (qkv or q, as the forward's)
      .Arg<ffi::AnyBuffer>()  // kv or zero-size
      .Arg<ffi::AnyBuffer>()  // o
      .Arg<ffi::AnyBuffer>()  // d_o
      .Arg<ffi::AnyBuffer>()  // softmax_lse
      .Arg<ffi::AnyBuffer>()  // rng_state or zero-size
      .Ret<ffi::AnyBuffer>()  // dq, q's shape (dqkv with a qkv)
      .Ret<ffi::AnyBuffer>()  // dkv, kv's shape (zero-size with a qkv)
      .Ret<ffi::AnyBuffer>())  // workspace uint8
      .Attr<bool>("deterministic")
      .Attr<int32_t>("backend");
}

}  // namespace

TE_JAX_DEFINE_HANDLERS(TeAttentionForward, AttentionForwardImpl);
TE_JAX_DEFINE_HANDLERS(TeAttentionBackward, AttentionBackwardImpl);
TE_JAX_DEFINE_HANDLERS(TeAttentionForwardPacked, AttentionForwardPackedImpl);
TE_JAX_DEFINE_HANDLERS(TeAttentionBackwardPacked, AttentionBackwardPackedImpl);

}  // namespace te_jax
