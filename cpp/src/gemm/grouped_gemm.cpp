// C entry points of the grouped GEMMs (gemm.h): te_grouped_gemm (one handle per group) and
// te_grouped_gemm_ragged (groups stacked in one operand, sizes on the device). Each group is
// checked and run as te_gemm checks and runs one GEMM (gemm.cpp), so a group's result is
// that of te_gemm on it alone.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/internal.h"
#include "gemm/gemm_impl.h"
#include "transformer_engine/gemm.h"
#include "transpose/transpose_impl.h"

namespace te {
namespace {

// The buffers of one resolved group that the call writes (outputs) and reads (inputs); null
// for unset slots.
void group_buffers(const te_tensor *a, const te_tensor *b, te_tensor *d, const te_tensor *bias,
                   const GemmArgs &g, std::vector<const te_buffer *> *outputs,
                   std::vector<const te_buffer *> *inputs) {
  const te_buffer *none = nullptr;
  outputs->push_back(slot(d, TE_SLOT_DATA));
  outputs->push_back(g.d_amax != nullptr ? slot(d, TE_SLOT_AMAX) : none);
  outputs->push_back(g.d_scale_inv != nullptr ? slot(d, TE_SLOT_SCALE_INV) : none);
  inputs->push_back(slot(a, TE_SLOT_DATA));
  inputs->push_back(slot(b, TE_SLOT_DATA));
  inputs->push_back(g.fp8 ? slot(a, TE_SLOT_SCALE_INV) : none);
  inputs->push_back(g.fp8 ? slot(b, TE_SLOT_SCALE_INV) : none);
  inputs->push_back(is_fp8(g.d_dtype) ? slot(d, TE_SLOT_SCALE) : none);
  inputs->push_back(bias != nullptr ? slot(bias, TE_SLOT_DATA) : none);
}

// The same buffers with their names ("group 3 d.data"), for the message of a clash.
void name_group_buffers(const te_tensor *a, const te_tensor *b, te_tensor *d,
                        const te_tensor *bias, const GemmArgs &g, size_t group,
                        std::vector<Checker::Named> *outputs,
                        std::vector<Checker::Named> *inputs) {
  // in group_buffers' order
  static const char *const kOutputNames[] = {"d.data", "d.amax", "d.scale_inv"};
  static const char *const kInputNames[] = {"a.data", "b.data", "a.scale_inv", "b.scale_inv",
                                            "d.scale", "bias.data"};
  std::vector<const te_buffer *> outs, ins;
  group_buffers(a, b, d, bias, g, &outs, &ins);
  const std::string at = "group " + std::to_string(group) + " ";
  for (size_t i = 0; i < outs.size(); ++i) outputs->push_back({outs[i], at + kOutputNames[i]});
  for (size_t i = 0; i < ins.size(); ++i) inputs->push_back({ins[i], at + kInputNames[i]});
}

struct TensorDeleter {
  void operator()(te_tensor *t) const { te_tensor_destroy(t); }
};
using OwnedTensor = std::unique_ptr<te_tensor, TensorDeleter>;

// A plain tensor of `shape` over buffer b's elements from offset_elems on (a group's rows of a
// stacked operand, or its entry of a [G, ...] one).
OwnedTensor slice(const te_buffer &b, int64_t offset_elems, std::vector<int64_t> shape) {
  te_buffer s = b;
  s.data = static_cast<char *>(b.data) + offset_elems * static_cast<int64_t>(te_dtype_size(b.dtype));
  s.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) s.shape[i] = shape[i];
  te_tensor *t = nullptr;
  te_tensor_create(TE_SCALING_TENSOR, &t);
  OwnedTensor owned(t);
  te_tensor_set(t, TE_SLOT_DATA, &s);
  return owned;
}

// slice() of an FP8 operand: its data from offset_elems on, with one per-tensor scale_inv,
// entry si_index of the [1] or [G] buffer si.
OwnedTensor fp8_slice(const te_buffer &b, int64_t offset_elems, std::vector<int64_t> shape,
                      const te_buffer &si, int64_t si_index) {
  OwnedTensor t = slice(b, offset_elems, std::move(shape));
  te_buffer s = si;
  s.data = static_cast<float *>(si.data) + si_index;
  s.ndim = 1;
  s.shape[0] = 1;
  te_tensor_set(t.get(), TE_SLOT_SCALE_INV, &s);
  return t;
}

bool is_operand(te_dtype d) { return is_high_precision(d) || is_fp8(d); }
bool is_size_dtype(te_dtype d) { return d == TE_DTYPE_INT32 || d == TE_DTYPE_INT64; }

// Host or device memory for the FP8 weight-gradient form's transposed groups: host memory on
// the CPU, the core's stream-ordered scratch pool on CUDA (freed on the stream after the GEMMs).
class TransposeScratch {
 public:
  TransposeScratch(te_device_type device, te_stream stream) : device_(device), stream_(stream) {}
  ~TransposeScratch() {
    if (cuda_ != nullptr) scratch_free_cuda(cuda_, stream_);
  }
  te_status alloc(size_t bytes, char **out) {
    if (device_ == TE_DEVICE_CUDA) {
      void *p = nullptr;
      if (te_status st = scratch_alloc_cuda(bytes, stream_, &p); st != TE_SUCCESS) return st;
      cuda_ = p;
      *out = static_cast<char *>(p);
    } else {
      host_.assign(bytes, 0);
      *out = host_.data();
    }
    return TE_SUCCESS;
  }
  // dst [cols, rows] = src [rows, cols]^T, FP8 bytes.
  te_status transpose(const void *src, void *dst, int64_t rows, int64_t cols) {
    if (rows == 0 || cols == 0) return TE_SUCCESS;
    const TransposeArgs args{src, dst, rows, cols, 1};
    if (device_ == TE_DEVICE_CUDA) return transpose_cuda(args, stream_);
    transpose_ref(args);
    return TE_SUCCESS;
  }

 private:
  te_device_type device_;
  te_stream stream_;
  void *cuda_ = nullptr;
  std::vector<char> host_;
};

}  // namespace

te_status resolve_groups(const char *op, const te_tensor *const *a, const te_tensor *const *b,
                         te_tensor *const *d, const te_tensor *const *bias, size_t groups,
                         const te_gemm_config *config, void *workspace, size_t workspace_size,
                         std::vector<GemmArgs> *args, te_device_type *device) {
  Checker check(op);
  if (groups > 0 && (a == nullptr || b == nullptr || d == nullptr)) {
    return check.reject(TE_ERROR_VALUE, "a, b and d must be arrays of groups handles, got a "
                                        "NULL array");
  }
  te_gemm_config cfg{0, 1, 0, 0, 0};
  if (config != nullptr) cfg = *config;
  if (cfg.gelu) {
    return check.reject(TE_ERROR_VALUE, "config.gelu must be 0 (no GELU epilogue in a grouped "
                                        "GEMM), got " + std::to_string(cfg.gelu));
  }
  args->assign(groups, GemmArgs{});
  std::vector<const te_buffer *> outputs, inputs;
  *device = TE_DEVICE_CPU;
  int device_id = 0;
  for (size_t i = 0; i < groups; ++i) {
    const std::string name = std::string(op) + ": group " + std::to_string(i);
    Checker group(name.c_str());
    const te_tensor *bias_i = bias != nullptr ? bias[i] : nullptr;
    GemmArgs &g = (*args)[i];
    if (!resolve_gemm(group, a[i], b[i], d[i], bias_i, nullptr, cfg, &g)) return group.status();
    if (i > 0 && (group.device() != *device || group.device_id() != device_id)) {
      return check.reject(TE_ERROR_VALUE, "every group must be on the device of group 0, got "
                                          "group " + std::to_string(i) + " on another");
    }
    *device = group.device();
    device_id = group.device_id();
    g.workspace = workspace;
    g.workspace_size = workspace != nullptr ? workspace_size : 0;
    g.device = device_id;
    group_buffers(a[i], b[i], d[i], bias_i, g, &outputs, &inputs);
  }
  // The groups run one after another (or all at once): a group reading another's output
  // would see it written or not by the order, so no output may meet any group's buffers.
  // Checked in O(n log n); the buffers are named only to report a clash.
  if (!any_output_overlap(outputs, inputs)) return TE_SUCCESS;
  std::vector<Checker::Named> named_outputs, named_inputs;
  for (size_t i = 0; i < groups; ++i) {
    name_group_buffers(a[i], b[i], d[i], bias != nullptr ? bias[i] : nullptr, (*args)[i], i,
                       &named_outputs, &named_inputs);
  }
  check.disjoint(named_outputs, named_inputs);
  return check.status();
}

}  // namespace te

extern "C" {

te_status te_grouped_gemm(const te_tensor *const *a, const te_tensor *const *b,
                          te_tensor *const *d, const te_tensor *const *bias, size_t groups,
                          const te_gemm_config *config, void *workspace, size_t workspace_size,
                          te_stream stream) {
  return te::guarded("grouped_gemm", [&]() -> te_status {
    std::vector<te::GemmArgs> args;
    te_device_type device = TE_DEVICE_CPU;
    if (te_status st = te::resolve_groups("grouped_gemm", a, b, d, bias, groups, config,
                                          workspace, workspace_size, &args, &device);
        st != TE_SUCCESS) {
      return st;
    }
    for (const te::GemmArgs &g : args) {
      if (te_status st = te::run_gemm(g, device, stream); st != TE_SUCCESS) return st;
    }
    return TE_SUCCESS;
  });
}

te_status te_grouped_gemm_ragged(const te_tensor *a, const te_tensor *b, te_tensor *d,
                                 const te_tensor *bias, const te_tensor *group_sizes,
                                 const te_gemm_config *config, void *workspace,
                                 size_t workspace_size, te_stream stream) {
  return te::guarded("grouped_gemm_ragged", [&]() -> te_status {
    const char *op = "grouped_gemm_ragged";
    te::Checker check(op);
    te_gemm_config cfg{0, 1, 0, 0, 0};
    if (config != nullptr) cfg = *config;
    if (!check.handle(a, "a") || !check.handle(b, "b") || !check.handle(d, "d") ||
        !check.handle(group_sizes, "group_sizes")) {
      return check.status();
    }
    const te_buffer *ad = te::slot(a, TE_SLOT_DATA), *bd = te::slot(b, TE_SLOT_DATA);
    const te_buffer *dd = te::slot(d, TE_SLOT_DATA), *sd = te::slot(group_sizes, TE_SLOT_DATA);
    if (!check.present(ad, "a.data") || !check.same_device(*ad, "a.data") ||
        !check.dtype_in(*ad, "a.data", te::is_operand, "float32, float16, bfloat16 or float8") ||
        !check.present(bd, "b.data") || !check.same_device(*bd, "b.data") ||
        !check.present(dd, "d.data") || !check.same_device(*dd, "d.data") ||
        !check.present(sd, "group_sizes.data") || !check.same_device(*sd, "group_sizes.data") ||
        !check.dtype_in(*sd, "group_sizes.data", te::is_size_dtype, "int32 or int64")) {
      return check.status();
    }
    if (cfg.gelu) return check.reject(TE_ERROR_VALUE, "config.gelu must be 0, got 1");
    if (ad->ndim != 2) {
      return check.reject(TE_ERROR_VALUE, "a.data must be 2-D [M, K] (the groups' rows stacked), "
                                          "got " + te::describe(*ad));
    }
    if (sd->ndim != 1) {
      return check.reject(TE_ERROR_VALUE, "group_sizes.data must be 1-D [G], got " +
                                              te::describe(*sd));
    }
    const int64_t groups = sd->shape[0], m = ad->shape[0], k = ad->shape[1];
    const bool wgrad = cfg.transpose_a != 0;
    const te_buffer *stacked = wgrad ? dd : bd;  // the operand with one entry per group
    if (stacked->ndim != 3 || stacked->shape[0] != groups) {
      return check.reject(TE_ERROR_VALUE,
                          std::string(wgrad ? "d.data must be [G, K, N]" : "b.data must be [G, N, K] "
                                      "or [G, K, N]") + " with G = " + std::to_string(groups) +
                              " (group_sizes' length), got " + te::describe(*stacked));
    }
    if (wgrad && (cfg.transpose_b || bias != nullptr)) {
      return check.reject(TE_ERROR_VALUE, "the weight-gradient form (transpose_a) takes b [M, N] "
                                          "with transpose_b = 0 and no bias");
    }
    const te_buffer *biasd = bias != nullptr ? te::slot(bias, TE_SLOT_DATA) : nullptr;
    // FP8: per-tensor scales, a's one [1], b's one [1] or, in the forward form, one per group.
    const bool fp8 = te::is_fp8(ad->dtype);
    const te_buffer *asi = nullptr, *bsi = nullptr;
    if (fp8) {
      if (!te::is_fp8(bd->dtype)) {
        return check.reject(TE_ERROR_TYPE, "b.data must be float8 when a.data is, got " +
                                               te::describe(*bd));
      }
      if (a->scaling_mode != TE_SCALING_TENSOR || b->scaling_mode != TE_SCALING_TENSOR) {
        return check.reject(TE_ERROR_VALUE,
                            std::string("FP8 groups stacked in one operand take per-tensor "
                                        "scaling for a and b, got ") +
                                te::scaling_mode_name(a->scaling_mode) + " and " +
                                te::scaling_mode_name(b->scaling_mode) +
                                " (use te_grouped_gemm for block scaling)");
      }
      asi = te::slot(a, TE_SLOT_SCALE_INV);
      bsi = te::slot(b, TE_SLOT_SCALE_INV);
      if (!check.fp32_scalar(asi, "a.scale_inv") || !check.present(bsi, "b.scale_inv") ||
          !check.same_device(*bsi, "b.scale_inv")) {
        return check.status();
      }
      const int64_t count = te::numel(*bsi);
      if (bsi->dtype != TE_DTYPE_FLOAT32 || bsi->ndim != 1 ||
          !(count == 1 || (!wgrad && count == groups))) {
        return check.reject(TE_ERROR_VALUE,
                            std::string("b.scale_inv must be float32 [1]") +
                                (wgrad ? "" : " or [G] = [" + std::to_string(groups) +
                                                  "] (one per group)") +
                                ", got " + te::describe(*bsi));
      }
    }
    // The sizes (the one read before any write): on the host, after checking every buffer.
    std::vector<int64_t> sizes(static_cast<size_t>(groups));
    if (groups > 0) {
      const size_t elem = te_dtype_size(sd->dtype);
      std::vector<char> raw(static_cast<size_t>(groups) * elem);
      if (check.device() == TE_DEVICE_CUDA) {
        te::CudaDeviceScope on_device(check.device_id());
        if (te_status st = te::copy_to_host_cuda(raw.data(), sd->data, raw.size(),
                                                 check.device_id(), stream);
            st != TE_SUCCESS) {
          return st;
        }
      } else {
        std::memcpy(raw.data(), sd->data, raw.size());
      }
      for (int64_t g = 0; g < groups; ++g) {
        int64_t v = 0;
        if (sd->dtype == TE_DTYPE_INT32) {
          int32_t x;
          std::memcpy(&x, raw.data() + g * 4, 4);
          v = x;
        } else {
          std::memcpy(&v, raw.data() + g * 8, 8);
        }
        sizes[static_cast<size_t>(g)] = v;
      }
    }
    int64_t total = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t v = sizes[static_cast<size_t>(g)];
      if (v < 0 || total + v > m) {
        return check.reject(TE_ERROR_VALUE, "group_sizes must be >= 0 and sum to at most M = " +
                                                std::to_string(m) + " (a's rows), got " +
                                                std::to_string(v) + " for group " +
                                                std::to_string(g) + " after " +
                                                std::to_string(total) + " rows");
      }
      total += v;
    }
    if (wgrad && (bd->ndim != 2 || bd->shape[0] != m)) {
      return check.reject(TE_ERROR_VALUE, "b.data must be [M, N] with M = " + std::to_string(m) +
                                              " in the weight-gradient form, got " +
                                              te::describe(*bd));
    }
    // FP8 GEMMs take both operands K-major: in the weight-gradient form the groups' rows of a
    // and b are transposed into scratch first (group g's [K, M_g] and [N, M_g], one after
    // the other), and each group runs as aT_g @ bT_g^T.
    const bool fp8_wgrad = fp8 && wgrad;
    te::TransposeScratch scratch(check.device(), stream);
    char *transposed = nullptr;
    if (fp8_wgrad && m > 0) {
      te::CudaDeviceScope on_device(check.device_id());
      if (te_status st = scratch.alloc(static_cast<size_t>(m * (k + bd->shape[1])), &transposed);
          st != TE_SUCCESS) {
        return st;
      }
    }
    te_gemm_config group_cfg = cfg;
    if (fp8_wgrad) group_cfg.transpose_a = 0, group_cfg.transpose_b = 1;
    // One te_gemm-checked GEMM per group over slices of the stacked buffers.
    std::vector<te::GemmArgs> args(static_cast<size_t>(groups));
    std::vector<te::OwnedTensor> keep;
    int64_t row = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = sizes[static_cast<size_t>(g)];
      const std::string name = std::string(op) + ": group " + std::to_string(g);
      te::Checker group(name.c_str());
      te::OwnedTensor ta, tb, td, tbias;
      if (fp8_wgrad) {
        const int64_t n = bd->shape[1];
        te_buffer at = *ad, bt = *bd;
        at.data = transposed + row * k;
        bt.data = transposed + m * k + row * n;
        te::CudaDeviceScope on_device(check.device_id());
        if (te_status st = scratch.transpose(static_cast<const char *>(ad->data) + row * k,
                                             at.data, rows, k);
            st != TE_SUCCESS) {
          return st;
        }
        if (te_status st = scratch.transpose(static_cast<const char *>(bd->data) + row * n,
                                             bt.data, rows, n);
            st != TE_SUCCESS) {
          return st;
        }
        ta = te::fp8_slice(at, 0, {k, rows}, *asi, 0);
        tb = te::fp8_slice(bt, 0, {n, rows}, *bsi, 0);
        td = te::slice(*dd, g * dd->shape[1] * dd->shape[2], {dd->shape[1], dd->shape[2]});
      } else if (wgrad) {
        const int64_t n = bd->shape[1];
        ta = te::slice(*ad, row * k, {rows, k});
        tb = te::slice(*bd, row * n, {rows, n});
        td = te::slice(*dd, g * dd->shape[1] * dd->shape[2], {dd->shape[1], dd->shape[2]});
      } else {
        const int64_t per = bd->shape[1] * bd->shape[2];
        const int64_t n = cfg.transpose_b ? bd->shape[1] : bd->shape[2];
        if (fp8) {
          ta = te::fp8_slice(*ad, row * k, {rows, k}, *asi, 0);
          tb = te::fp8_slice(*bd, g * per, {bd->shape[1], bd->shape[2]}, *bsi,
                             te::numel(*bsi) == 1 ? 0 : g);
        } else {
          ta = te::slice(*ad, row * k, {rows, k});
          tb = te::slice(*bd, g * per, {bd->shape[1], bd->shape[2]});
        }
        if (dd->ndim != 2 || dd->shape[0] != m) {
          return check.reject(TE_ERROR_VALUE, "d.data must be [M, N] with M = " +
                                                  std::to_string(m) + ", got " + te::describe(*dd));
        }
        td = te::slice(*dd, row * dd->shape[1], {rows, dd->shape[1]});
        if (biasd != nullptr) {
          if (biasd->ndim != 2 || biasd->shape[0] != groups || biasd->shape[1] != n) {
            return check.reject(TE_ERROR_VALUE, "bias.data must be [G, N] = [" +
                                                    std::to_string(groups) + ", " +
                                                    std::to_string(n) + "], got " +
                                                    te::describe(*biasd));
          }
          tbias = te::slice(*biasd, g * n, {n});
        }
      }
      if (!te::resolve_gemm(group, ta.get(), tb.get(), td.get(), tbias.get(), nullptr, group_cfg,
                            &args[static_cast<size_t>(g)])) {
        return group.status();
      }
      args[static_cast<size_t>(g)].workspace = workspace;
      args[static_cast<size_t>(g)].workspace_size = workspace != nullptr ? workspace_size : 0;
      args[static_cast<size_t>(g)].device = check.device_id();
      keep.push_back(std::move(ta));
      keep.push_back(std::move(tb));
      keep.push_back(std::move(td));
      keep.push_back(std::move(tbias));
      row += rows;
    }
    // The whole a and d, against each other (the groups' slices tile them).
    if (!check.disjoint({{dd, "d.data"}}, {{ad, "a.data"}, {bd, "b.data"}, {sd, "group_sizes.data"},
                                           {biasd, "bias.data"}})) {
      return check.status();
    }
    for (const te::GemmArgs &g : args) {
      if (te_status st = te::run_gemm(g, check.device(), stream); st != TE_SUCCESS) return st;
    }
    if (!wgrad && total < m) {  // rows past the groups: zeros
      const int64_t n = dd->shape[1];
      te::OwnedTensor rest = te::slice(*dd, total * n, {m - total, n});
      const size_t bytes = static_cast<size_t>((m - total) * n) * te_dtype_size(dd->dtype);
      void *p = te::slot(rest.get(), TE_SLOT_DATA)->data;
      if (check.device() == TE_DEVICE_CUDA) {
        te::CudaDeviceScope on_device(check.device_id());
        return te::zero_cuda(p, bytes, stream);
      }
      std::memset(p, 0, bytes);
    }
    return TE_SUCCESS;
  });
}

}  // extern "C"
