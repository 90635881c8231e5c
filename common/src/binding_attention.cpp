// Binding of attention.h: the attention entry points, the backend query and the scaled masked
// softmax. The config travels as an AttentionConfig object built once per layer.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "binding_util.h"

namespace te_binding {

using namespace nb::literals;

namespace {

te_attention_config make_config(te_attn_layout layout, te_attn_mask_type mask_type, int64_t window_left,
                                int64_t window_right, float softmax_scale, float dropout, int64_t max_seqlen_q,
                                int64_t max_seqlen_kv, bool deterministic, te_attn_backend backend, bool inference,
                                const std::vector<int64_t> &strides) {
  te_attention_config c{layout,       mask_type,     window_left,           window_right, softmax_scale,
                        dropout,      max_seqlen_q,  max_seqlen_kv,         deterministic ? 1 : 0,
                        backend,      inference ? 1 : 0};
  if (!strides.empty() && strides.size() != 6) {
    raise_status(TE_ERROR_VALUE, "AttentionConfig: strides must be 6 values (row and head stride of q, k and v) "
                                 "or empty (dense), got " + std::to_string(strides.size()) + " values");
  }
  for (size_t i = 0; i < strides.size(); i += 2) {
    c.row_stride[i / 2] = strides[i];
    c.head_stride[i / 2] = strides[i + 1];
  }
  return c;
}

// do_dtype: d_o's dtype, o_dtype when not given (it differs only for an FP8 backward).
te_attention_problem make_problem(const std::vector<int64_t> &sizes, te_dtype qkv_dtype, te_dtype o_dtype,
                                  te_dtype grad_dtype, std::optional<te_dtype> do_dtype, int device_id) {
  if (sizes.size() != 9) {
    raise_status(TE_ERROR_VALUE, "attention_backend: sizes must be (batch, heads_q, heads_kv, seqlen_q, "
                                 "seqlen_kv, head_dim_qk, head_dim_v, total_q, total_kv), got " +
                                     std::to_string(sizes.size()) + " values");
  }
  te_attention_problem p{};
  p.batch = sizes[0];
  p.heads_q = sizes[1];
  p.heads_kv = sizes[2];
  p.seqlen_q = sizes[3];
  p.seqlen_kv = sizes[4];
  p.head_dim_qk = sizes[5];
  p.head_dim_v = sizes[6];
  p.total_q = sizes[7];
  p.total_kv = sizes[8];
  p.qkv_dtype = qkv_dtype;
  p.o_dtype = o_dtype;
  p.do_dtype = do_dtype.value_or(o_dtype);
  p.grad_dtype = grad_dtype;
  p.device = device_id < 0 ? TE_DEVICE_CPU : TE_DEVICE_CUDA;
  p.device_id = device_id < 0 ? 0 : device_id;
  return p;
}

}  // namespace

void register_attention(nb::module_ &m) {
  nb::enum_<te_attn_layout>(m, "AttnLayout", "Layouts of q, k, v (attention.h).")
      .value("bshd", TE_ATTN_LAYOUT_BSHD)
      .value("sbhd", TE_ATTN_LAYOUT_SBHD)
      .value("thd", TE_ATTN_LAYOUT_THD);
  nb::enum_<te_attn_mask_type>(m, "AttnMask", "Attention masks (attention.h).")
      .value("no_mask", TE_ATTN_MASK_NO_MASK)
      .value("causal", TE_ATTN_MASK_CAUSAL)
      .value("causal_bottom_right", TE_ATTN_MASK_CAUSAL_BOTTOM_RIGHT)
      .value("padding", TE_ATTN_MASK_PADDING)
      .value("padding_causal", TE_ATTN_MASK_PADDING_CAUSAL)
      .value("padding_causal_bottom_right", TE_ATTN_MASK_PADDING_CAUSAL_BOTTOM_RIGHT);
  nb::enum_<te_attn_backend>(m, "AttnBackend", "Backends of te_attention_forward / backward.")
      .value("auto", TE_ATTN_BACKEND_AUTO)
      .value("cudnn", TE_ATTN_BACKEND_CUDNN)
      .value("cuda_math", TE_ATTN_BACKEND_CUDA_MATH)
      .value("cpu", TE_ATTN_BACKEND_CPU);
  nb::enum_<te_softmax_mask_type>(m, "SoftmaxMask", "Masks of scaled_softmax_forward.")
      .value("none", TE_SOFTMAX_MASK_NONE)
      .value("causal", TE_SOFTMAX_MASK_CAUSAL)
      .value("causal_bottom_right", TE_SOFTMAX_MASK_CAUSAL_BOTTOM_RIGHT)
      .value("arbitrary", TE_SOFTMAX_MASK_ARBITRARY);

  nb::class_<te_attention_config>(m, "AttentionConfig", "te_attention_config: what an attention call computes.")
      .def(nb::new_(&make_config), "layout"_a, "mask_type"_a, nb::kw_only(), "window_left"_a = -1,
           "window_right"_a = -1, "softmax_scale"_a, "dropout"_a = 0.0f, "max_seqlen_q"_a = 0,
           "max_seqlen_kv"_a = 0, "deterministic"_a = false, "backend"_a = TE_ATTN_BACKEND_AUTO,
           "inference"_a = false, "strides"_a = std::vector<int64_t>{},
           "strides: (row, head) element strides of q, k and v in turn (dq, dk, dv share them), "
           "or empty for dense operands (attention.h)")
      .def_ro("inference", &te_attention_config::inference)
      .def_ro("layout", &te_attention_config::layout)
      .def_ro("mask_type", &te_attention_config::mask_type)
      .def_ro("window_left", &te_attention_config::window_left)
      .def_ro("window_right", &te_attention_config::window_right)
      .def_ro("softmax_scale", &te_attention_config::softmax_scale)
      .def_ro("dropout", &te_attention_config::dropout)
      .def_ro("backend", &te_attention_config::backend);

  m.def(
      "attention_backend",
      [](const te_attention_config &config, const std::vector<int64_t> &sizes, te_dtype qkv_dtype,
         te_dtype o_dtype, te_dtype grad_dtype, std::optional<te_dtype> do_dtype, int device_id, bool backward) {
        const te_attention_problem p = make_problem(sizes, qkv_dtype, o_dtype, grad_dtype, do_dtype, device_id);
        te_attn_backend chosen = TE_ATTN_BACKEND_AUTO;
        char reasons[TE_ATTN_BACKEND_COUNT][TE_ATTN_REASON_SIZE] = {};
        const te_status s = te_attention_backend(&config, &p, backward ? 1 : 0, &chosen, reasons);
        // No backend is an answer here (with its reasons), not an error.
        if (s != TE_SUCCESS && s != TE_ERROR_UNSUPPORTED) raise_status(s, te_last_error());
        std::vector<std::string> why;
        for (int b = 0; b < TE_ATTN_BACKEND_COUNT; ++b) why.emplace_back(reasons[b]);
        return std::make_tuple(s == TE_SUCCESS ? nb::cast(chosen) : nb::none(), why,
                               std::string(s == TE_SUCCESS ? "" : te_last_error()));
      },
      "config"_a, "sizes"_a, "qkv_dtype"_a, "o_dtype"_a, "grad_dtype"_a, nb::kw_only(), "do_dtype"_a = nb::none(),
      "device_id"_a = -1, "backward"_a = false,
      "(backend or None, [reason per AttnBackend value 0..2, '' when it takes the call], message). sizes: "
      "(batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim_qk, head_dim_v, total_q, total_kv); "
      "device_id -1 for the CPU; do_dtype (d_o's, backward) defaults to o_dtype.");

  m.def(
      "attention_workspace_size",
      [](const te_attention_config &config, const std::vector<int64_t> &sizes, te_dtype qkv_dtype,
         te_dtype o_dtype, te_dtype grad_dtype, std::optional<te_dtype> do_dtype, int device_id, bool backward) {
        const te_attention_problem p = make_problem(sizes, qkv_dtype, o_dtype, grad_dtype, do_dtype, device_id);
        size_t bytes = 0;
        check_status(te_attention_workspace_size(&config, &p, backward ? 1 : 0, &bytes));
        return bytes;
      },
      "config"_a, "sizes"_a, "qkv_dtype"_a, "o_dtype"_a, "grad_dtype"_a, nb::kw_only(), "do_dtype"_a = nb::none(),
      "device_id"_a = -1, "backward"_a = false, "Bytes of CUDA workspace of the call (0 on the CPU).");

  m.def(
      "attention_forward",
      [](const te_attention_config &config, nb::handle q, nb::handle k, nb::handle v, nb::handle o,
         nb::handle softmax_lse, nb::handle cu_seqlens_q, nb::handle cu_seqlens_kv, nb::handle rng_state,
         nb::handle softmax_fp8, nb::handle workspace, uintptr_t stream) {
        const char *op = "attention_forward";
        Handle hq = make_handle(op, "q", q, 0), hk = make_handle(op, "k", k, 0), hv = make_handle(op, "v", v, 0);
        Handle ho = make_handle(op, "o", o, kAllSlots & ~(1u << TE_SLOT_SCALE));
        Handle hl = optional_handle(op, "softmax_lse", softmax_lse, kAllSlots);  // None in inference
        Handle cq = optional_handle(op, "cu_seqlens_q", cu_seqlens_q, 0);
        Handle ck = optional_handle(op, "cu_seqlens_kv", cu_seqlens_kv, 0);
        Handle rng = optional_handle(op, "rng_state", rng_state, 0);
        Handle sf = optional_handle(op, "softmax_fp8", softmax_fp8, 1u << TE_SLOT_AMAX);
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        nb::gil_scoped_release release;
        check_status(te_attention_forward(&config, hq.get(), hk.get(), hv.get(), ho.get(), hl.get(), cq.get(),
                                          ck.get(), rng.get(), sf.get(), ws, ws_size, as_stream(stream)));
      },
      "config"_a, "q"_a, "k"_a, "v"_a, "o"_a, "softmax_lse"_a.none(), nb::kw_only(), "cu_seqlens_q"_a = nb::none(),
      "cu_seqlens_kv"_a = nb::none(), "rng_state"_a = nb::none(), "softmax_fp8"_a = nb::none(),
      "workspace"_a = nb::none(), "stream"_a = 0,
      "Attention forward into o and softmax_lse [batch, heads_q, max_seqlen_q] fp32 (attention.h); "
      "softmax_lse is None exactly when config.inference is set.");

  m.def(
      "attention_backward",
      [](const te_attention_config &config, nb::handle q, nb::handle k, nb::handle v, nb::handle o,
         nb::handle d_o, nb::handle softmax_lse, nb::handle dq, nb::handle dk, nb::handle dv,
         nb::handle cu_seqlens_q, nb::handle cu_seqlens_kv, nb::handle rng_state, nb::handle softmax_fp8,
         nb::handle dp_fp8, nb::handle workspace, uintptr_t stream) {
        const char *op = "attention_backward";
        Handle hq = make_handle(op, "q", q, 0), hk = make_handle(op, "k", k, 0), hv = make_handle(op, "v", v, 0);
        Handle ho = make_handle(op, "o", o, 0), hdo = make_handle(op, "d_o", d_o, 0);
        Handle hl = make_handle(op, "softmax_lse", softmax_lse, 0);
        const unsigned out = kAllSlots & ~(1u << TE_SLOT_SCALE);
        Handle hdq = make_handle(op, "dq", dq, out), hdk = make_handle(op, "dk", dk, out);
        Handle hdv = make_handle(op, "dv", dv, out);
        Handle cq = optional_handle(op, "cu_seqlens_q", cu_seqlens_q, 0);
        Handle ck = optional_handle(op, "cu_seqlens_kv", cu_seqlens_kv, 0);
        Handle rng = optional_handle(op, "rng_state", rng_state, 0);
        Handle sf = optional_handle(op, "softmax_fp8", softmax_fp8, 0);
        Handle dp = optional_handle(op, "dp_fp8", dp_fp8, 1u << TE_SLOT_AMAX);
        size_t ws_size = 0;
        void *ws = workspace_of(op, workspace, &ws_size);
        nb::gil_scoped_release release;
        check_status(te_attention_backward(&config, hq.get(), hk.get(), hv.get(), ho.get(), hdo.get(), hl.get(),
                                           cq.get(), ck.get(), rng.get(), sf.get(), hdq.get(), hdk.get(),
                                           hdv.get(), dp.get(), ws, ws_size, as_stream(stream)));
      },
      "config"_a, "q"_a, "k"_a, "v"_a, "o"_a, "d_o"_a, "softmax_lse"_a, nb::kw_only(), "dq"_a, "dk"_a, "dv"_a,
      "cu_seqlens_q"_a = nb::none(), "cu_seqlens_kv"_a = nb::none(), "rng_state"_a = nb::none(),
      "softmax_fp8"_a = nb::none(), "dp_fp8"_a = nb::none(), "workspace"_a = nb::none(), "stream"_a = 0,
      "Attention backward into dq, dk, dv from the forward's inputs, o and softmax_lse (FP8: the "
      "forward's softmax_fp8, and dp_fp8 of the logits' gradient).");

  m.def(
      "scaled_softmax_forward",
      [](te_softmax_mask_type mask_type, float scale, nb::handle x, nb::handle mask, nb::handle y,
         uintptr_t stream) {
        const char *op = "scaled_softmax_forward";
        Handle hx = make_handle(op, "x", x, 0), hm = optional_handle(op, "mask", mask, 0);
        Handle hy = make_handle(op, "y", y, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_scaled_softmax_forward(mask_type, scale, hx.get(), hm.get(), hy.get(), as_stream(stream)));
      },
      "mask_type"_a, "scale"_a, "x"_a, "mask"_a.none(), "y"_a, nb::kw_only(), "stream"_a = 0,
      "y = softmax(scale * x) over the last dim of x [b, h, sq, sk], masked entries 0 (uint8 mask, "
      "nonzero = masked, for SoftmaxMask.arbitrary).");

  m.def(
      "scaled_softmax_backward",
      [](float scale, nb::handle dy, nb::handle y, nb::handle dx, uintptr_t stream) {
        const char *op = "scaled_softmax_backward";
        Handle hdy = make_handle(op, "dy", dy, 0), hy = make_handle(op, "y", y, 0);
        Handle hdx = make_handle(op, "dx", dx, kAllSlots);
        nb::gil_scoped_release release;
        check_status(te_scaled_softmax_backward(scale, hdy.get(), hy.get(), hdx.get(), as_stream(stream)));
      },
      "scale"_a, "dy"_a, "y"_a, "dx"_a, nb::kw_only(), "stream"_a = 0,
      "dx = scale * y * (dy - sum(dy * y)) row by row.");
}

}  // namespace te_binding
