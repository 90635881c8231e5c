// C entry point te_gemm: validate every argument against the rules of gemm.h, then dispatch to
// the CPU path or cuBLASLt by the device of the buffers.
#include <string>

#include "common/internal.h"
#include "gemm/gemm_impl.h"
#include "transformer_engine/gemm.h"

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool is_fp32(te_dtype d) { return d == TE_DTYPE_FLOAT32; }
bool is_16bit(te_dtype d) { return d == TE_DTYPE_FLOAT16 || d == TE_DTYPE_BFLOAT16; }
bool is_gemm_operand(te_dtype d) { return is_high_precision(d) || is_fp8(d); }
bool is_block_output(te_dtype d) { return d == TE_DTYPE_FLOAT32 || d == TE_DTYPE_BFLOAT16; }
bool is_fp8_or_hp(te_dtype d) { return is_high_precision(d) || is_fp8(d); }

// The scale_inv of an FP8 operand stored as [rows, cols], by its scaling mode.
bool check_operand_scale(Checker &check, const te_tensor *t, const char *name, int64_t rows,
                         int64_t cols, GemmOperand *op) {
  const std::string what = std::string(name) + ".scale_inv";
  const te_buffer *s = slot(t, TE_SLOT_SCALE_INV);
  op->mode = t->scaling_mode;
  if (op->mode == TE_SCALING_TENSOR) {
    if (!check.fp32_scalar(s, what.c_str())) return false;
  } else {
    const bool tile = op->mode == TE_SCALING_BLOCK_128X128;
    const int64_t sr = tile ? ceil_div(rows, 128) : rows, sc = ceil_div(cols, 128);
    if (!check.present(s, what.c_str()) || !check.same_device(*s, what.c_str()) ||
        !check.dtype_in(*s, what.c_str(), is_fp32, "float32") ||
        !check.matrix_is(*s, what.c_str(), sr, sc)) {
      return false;
    }
  }
  op->scale_inv = static_cast<const float *>(s->data);
  return true;
}

bool check_operands(Checker &check, const te_tensor *a, const te_tensor *b, const te_gemm_config &cfg,
                    GemmArgs *g) {
  if (!check.handle(a, "a") || !check.handle(b, "b")) return false;
  const te_buffer *ad = slot(a, TE_SLOT_DATA);
  const te_buffer *bd = slot(b, TE_SLOT_DATA);
  if (!check.present(ad, "a.data") || !check.same_device(*ad, "a.data") ||
      !check.dtype_in(*ad, "a.data", is_gemm_operand, "float32, float16, bfloat16 or float8") ||
      !check.present(bd, "b.data") || !check.same_device(*bd, "b.data") ||
      !check.dtype_in(*bd, "b.data", is_gemm_operand, "float32, float16, bfloat16 or float8")) {
    return false;
  }
  g->fp8 = is_fp8(ad->dtype) && is_fp8(bd->dtype);
  if (!g->fp8 && ad->dtype != bd->dtype) {
    return check.fail(TE_ERROR_TYPE, "b.data must have the dtype of a.data (" +
                                         std::string(te_dtype_name(ad->dtype)) +
                                         "; or both float8), got " + describe(*bd));
  }
  if (g->fp8 && ad->dtype == TE_DTYPE_FLOAT8_E5M2 && bd->dtype == TE_DTYPE_FLOAT8_E5M2) {
    return check.fail(TE_ERROR_TYPE, "a.data and b.data must not both be float8_e5m2 (no FP8 "
                                     "tensor-core kernel takes E5M2 x E5M2), got both");
  }
  if (g->fp8 && (cfg.transpose_a != 0 || cfg.transpose_b != 1)) {
    return check.fail(TE_ERROR_VALUE,
                      "config must have transpose_a = 0 and transpose_b = 1 for FP8 operands "
                      "(FP8 tensor cores take both operands K-major: pass the column-wise data "
                      "instead of a transpose), got transpose_a = " + num(cfg.transpose_a) +
                          ", transpose_b = " + num(cfg.transpose_b));
  }
  // A: [M, K] (any rank, viewed as a matrix) or [K, M]; B: [N, K] or [K, N].
  if (cfg.transpose_a && ad->ndim != 2) {
    return check.fail(TE_ERROR_VALUE, "a.data must be 2-D [K, M] with transpose_a, got " + describe(*ad));
  }
  if (ad->ndim < 1) return check.fail(TE_ERROR_VALUE, "a.data must have at least 1 dimension, got a scalar");
  if (bd->ndim != 2) {
    return check.fail(TE_ERROR_VALUE, std::string("b.data must be 2-D ") +
                                          (cfg.transpose_b ? "[N, K]" : "[K, N]") + ", got " + describe(*bd));
  }
  const int64_t a_rows = rows_of(*ad), a_cols = cols_of(*ad);
  g->m = cfg.transpose_a ? a_cols : a_rows;
  g->k = cfg.transpose_a ? a_rows : a_cols;
  const int64_t b_k = cfg.transpose_b ? bd->shape[1] : bd->shape[0];
  g->n = cfg.transpose_b ? bd->shape[0] : bd->shape[1];
  if (b_k != g->k) {
    return check.fail(TE_ERROR_VALUE, std::string("b.data must have K = ") + num(g->k) +
                                          " (the contraction dimension of a) along dimension " +
                                          (cfg.transpose_b ? "1" : "0") + ", got " + describe(*bd));
  }
  if (g->fp8) {
    const char *names[3] = {"M (rows of a)", "N (rows of b)", "K (columns of a and b)"};
    const int64_t dims[3] = {g->m, g->n, g->k};
    for (int i = 0; i < 3; ++i) {
      if (dims[i] % 16 != 0) {
        return check.fail(TE_ERROR_VALUE, std::string(names[i]) +
                                              " must be a multiple of 16 for FP8 operands "
                                              "(the tensor cores' granule), got " + num(dims[i]));
      }
    }
  }
  g->a = GemmOperand{ad->data, ad->dtype, a_rows, a_cols, cfg.transpose_a != 0, TE_SCALING_TENSOR, nullptr};
  g->b = GemmOperand{bd->data, bd->dtype, bd->shape[0], bd->shape[1], cfg.transpose_b != 0,
                     TE_SCALING_TENSOR, nullptr};
  if (!g->fp8) return true;
  if (!check_operand_scale(check, a, "a", a_rows, a_cols, &g->a) ||
      !check_operand_scale(check, b, "b", bd->shape[0], bd->shape[1], &g->b)) {
    return false;
  }
  const te_scaling_mode ma = g->a.mode, mb = g->b.mode;
  const bool tensor = ma == TE_SCALING_TENSOR && mb == TE_SCALING_TENSOR;
  const bool block = ma == TE_SCALING_BLOCK_1X128 &&
                     (mb == TE_SCALING_BLOCK_128X128 || mb == TE_SCALING_BLOCK_1X128);
  if (!tensor && !block) {
    return check.fail(TE_ERROR_VALUE, std::string("the scaling modes of a and b must be tensor x tensor, "
                                                  "block_1x128 x block_128x128 or block_1x128 x "
                                                  "block_1x128, got ") +
                                          scaling_mode_name(ma) + " x " + scaling_mode_name(mb));
  }
  return true;
}

bool check_output(Checker &check, te_tensor *d, const te_tensor *bias, te_tensor *pre_gelu,
                  const te_gemm_config &cfg, GemmArgs *g) {
  if (!check.handle(d, "d")) return false;
  const te_buffer *dd = slot(d, TE_SLOT_DATA);
  if (!check.present(dd, "d.data") || !check.same_device(*dd, "d.data")) return false;
  const bool block = g->fp8 && g->a.mode != TE_SCALING_TENSOR;
  if (block) {
    if (!check.dtype_in(*dd, "d.data", is_block_output, "float32 or bfloat16 (block-scaled FP8 GEMM)")) {
      return false;
    }
  } else if (g->fp8) {
    if (!check.dtype_in(*dd, "d.data", is_fp8_or_hp, "float32, float16, bfloat16 or float8")) return false;
  } else if (dd->dtype != g->a.dtype && dd->dtype != TE_DTYPE_FLOAT32) {
    return check.fail(TE_ERROR_TYPE, std::string("d.data must be ") + te_dtype_name(g->a.dtype) +
                                         " or float32 (the operands are " + te_dtype_name(g->a.dtype) +
                                         "), got " + describe(*dd));
  }
  if (!check.matrix_is(*dd, "d.data", g->m, g->n)) return false;
  g->d = dd->data;
  g->d_dtype = dd->dtype;
  const bool fp8_out = is_fp8(dd->dtype);
  if (dd->dtype == TE_DTYPE_FLOAT8_E5M2 && g->a.dtype != TE_DTYPE_FLOAT8_E5M2 &&
      g->b.dtype != TE_DTYPE_FLOAT8_E5M2) {
    return check.fail(TE_ERROR_TYPE, std::string("d.data may be float8_e5m2 only when a or b is "
                                                 "float8_e5m2 (cuBLASLt's FP8 rule), got a ") +
                                         te_dtype_name(g->a.dtype) + " and b " + te_dtype_name(g->b.dtype));
  }
  if (fp8_out) {
    const te_buffer *s = slot(d, TE_SLOT_SCALE);
    if (!check.fp32_scalar(s, "d.scale")) return false;
    g->d_scale = static_cast<const float *>(s->data);
    const te_buffer *si = slot(d, TE_SLOT_SCALE_INV);
    if (si != nullptr) {
      if (!check.fp32_scalar(si, "d.scale_inv")) return false;
      g->d_scale_inv = static_cast<float *>(si->data);
    }
  }
  const te_buffer *amax = slot(d, TE_SLOT_AMAX);
  if (amax != nullptr) {
    if (!g->fp8 || block) {
      return check.fail(TE_ERROR_VALUE, "d.amax must be unset unless a and b are FP8 with per-tensor "
                                        "scaling (cuBLASLt computes it only then), got it set");
    }
    if (!check.fp32_scalar(amax, "d.amax")) return false;
    g->d_amax = static_cast<float *>(amax->data);
  }
  if (cfg.accumulate && fp8_out) {
    return check.fail(TE_ERROR_VALUE, "d.data must be high precision with config.accumulate, got " +
                                          describe(*dd));
  }
  if (bias != nullptr) {
    const te_buffer *bb = slot(bias, TE_SLOT_DATA);
    if (!check.present(bb, "bias.data") || !check.same_device(*bb, "bias.data")) return false;
    te_dtype want = dd->dtype;
    if (g->fp8 && !is_16bit(dd->dtype)) want = TE_DTYPE_BFLOAT16;
    if (!g->fp8) want = dd->dtype == TE_DTYPE_FLOAT32 && g->a.dtype != TE_DTYPE_FLOAT32 ? g->a.dtype : dd->dtype;
    if (!check.dtype_is(*bb, "bias.data", want)) return false;
    if (bb->ndim != 1 || bb->shape[0] != g->n) {
      return check.fail(TE_ERROR_VALUE, "bias.data must have shape [" + num(g->n) + "], got " + describe(*bb));
    }
    g->bias = bb->data;
    g->bias_dtype = bb->dtype;
  }
  const te_buffer *pg = pre_gelu != nullptr ? slot(pre_gelu, TE_SLOT_DATA) : nullptr;
  if (cfg.gelu) {
    if (fp8_out || block) {
      return check.fail(TE_ERROR_VALUE, "config.gelu must be 0 with an FP8 output or block-scaled "
                                        "operands, got 1");
    }
    if (!check.handle(pre_gelu, "pre_gelu_out") || !check.present(pg, "pre_gelu_out.data") ||
        !check.same_device(*pg, "pre_gelu_out.data") ||
        !check.dtype_is(*pg, "pre_gelu_out.data", dd->dtype) ||
        !check.matrix_is(*pg, "pre_gelu_out.data", g->m, g->n)) {
      return false;
    }
    g->pre_gelu = pg->data;
  } else if (pre_gelu != nullptr) {
    return check.fail(TE_ERROR_VALUE, "pre_gelu_out must be NULL unless config.gelu is set, got a tensor");
  }
  return true;
}

}  // namespace

// Checks one GEMM's arguments (gemm.h) and resolves them into g: operands, output, and that
// no output overlaps another output or an input.
bool resolve_gemm(Checker &check, const te_tensor *a, const te_tensor *b, te_tensor *d,
             const te_tensor *bias, te_tensor *pre_gelu_out, const te_gemm_config &cfg,
             GemmArgs *g) {
  if (!check_operands(check, a, b, cfg, g) ||
      !check_output(check, d, bias, pre_gelu_out, cfg, g)) {
    return false;
  }
  // Every output is written while every input is read (and, on CUDA, concurrently).
  const te_buffer *none = nullptr;
  const bool fp8_out = is_fp8(g->d_dtype);
  if (!check.disjoint({{slot(d, TE_SLOT_DATA), "d.data"},
                       {g->d_amax != nullptr ? slot(d, TE_SLOT_AMAX) : none, "d.amax"},
                       {g->d_scale_inv != nullptr ? slot(d, TE_SLOT_SCALE_INV) : none, "d.scale_inv"},
                       {g->pre_gelu != nullptr ? slot(pre_gelu_out, TE_SLOT_DATA) : none,
                        "pre_gelu_out.data"}},
                      {{slot(a, TE_SLOT_DATA), "a.data"},
                       {slot(b, TE_SLOT_DATA), "b.data"},
                       {g->fp8 ? slot(a, TE_SLOT_SCALE_INV) : none, "a.scale_inv"},
                       {g->fp8 ? slot(b, TE_SLOT_SCALE_INV) : none, "b.scale_inv"},
                       {fp8_out ? slot(d, TE_SLOT_SCALE) : none, "d.scale"},
                       {bias != nullptr ? slot(bias, TE_SLOT_DATA) : none, "bias.data"}})) {
    return false;
  }
  g->gelu = cfg.gelu != 0;
  g->accumulate = cfg.accumulate != 0;
  g->split_accumulator = cfg.use_split_accumulator != 0;
  return true;
}

te_status run_gemm(const GemmArgs &g, te_device_type device, te_stream stream) {
  if (device == TE_DEVICE_CUDA) {
    CudaDeviceScope on_device(g.device);
    return gemm_cuda(g, stream);
  }
  gemm_ref(g);
  return TE_SUCCESS;
}

}  // namespace te

extern "C" {

size_t te_gemm_workspace_size(void) { return te::gemm_workspace_size(); }

te_status te_gemm(const te_tensor *a, const te_tensor *b, te_tensor *d, const te_tensor *bias,
                  te_tensor *pre_gelu_out, const te_gemm_config *config, void *workspace,
                  size_t workspace_size, te_stream stream) {
  return te::guarded("gemm", [&]() -> te_status {
    te::Checker check("gemm");
    te_gemm_config cfg{0, 1, 0, 0, 0};
    if (config != nullptr) cfg = *config;
    te::GemmArgs g{};
    if (!te::resolve_gemm(check, a, b, d, bias, pre_gelu_out, cfg, &g)) return check.status();
    g.workspace = workspace;
    g.workspace_size = workspace != nullptr ? workspace_size : 0;
    g.device = check.device_id();
    return te::run_gemm(g, check.device(), stream);
  });
}

}  // extern "C"
