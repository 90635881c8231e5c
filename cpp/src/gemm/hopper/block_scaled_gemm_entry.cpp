// C entry point te_hopper_block_scaled_gemm (hopper_gemm.h): te_gemm's checks for
// block-scaled FP8 operands on CUDA (the same rules and messages), then the Hopper kernel, never
// cuBLASLt. For tests and benchmarks; te_gemm's own dispatch is untouched.
#include <string>

#include "common/internal.h"
#include "gemm/hopper/block_scaled_gemm.h"

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool is_fp8_dtype(te_dtype d) { return is_fp8(d); }
bool is_fp32(te_dtype d) { return d == TE_DTYPE_FLOAT32; }
bool is_block_output(te_dtype d) { return d == TE_DTYPE_FLOAT32 || d == TE_DTYPE_BFLOAT16; }

// An FP8 operand stored [rows, cols] with its block scale_inv in tensor.h's layout.
bool check_operand(Checker &check, const te_tensor *t, const char *name, const te_buffer &data,
                   GemmOperand *op) {
  const std::string what = std::string(name) + ".scale_inv";
  const te_buffer *s = slot(t, TE_SLOT_SCALE_INV);
  const bool tile = op->mode == TE_SCALING_BLOCK_128X128;
  const int64_t rows = rows_of(data), cols = cols_of(data);
  const int64_t sr = tile ? ceil_div(rows, 128) : rows, sc = ceil_div(cols, 128);
  if (!check.present(s, what.c_str()) || !check.same_device(*s, what.c_str()) ||
      !check.dtype_in(*s, what.c_str(), is_fp32, "float32") || !check.matrix_is(*s, what.c_str(), sr, sc)) {
    return false;
  }
  op->data = data.data;
  op->dtype = data.dtype;
  op->rows = rows;
  op->cols = cols;
  op->scale_inv = static_cast<const float *>(s->data);
  return true;
}

te_status resolve_and_run(const te_tensor *a, const te_tensor *b, te_tensor *d, const te_tensor *bias,
                          const te_gemm_config *config, void *workspace, size_t workspace_size,
                          te_stream stream) {
  Checker check("hopper_block_scaled_gemm");
  te_gemm_config cfg{0, 1, 0, 0, 0};
  if (config != nullptr) cfg = *config;
  if (cfg.transpose_a != 0 || cfg.transpose_b != 1) {
    return check.reject(TE_ERROR_VALUE, "config must have transpose_a = 0 and transpose_b = 1 for FP8 "
                                        "operands (K-major), got transpose_a = " +
                                            num(cfg.transpose_a) + ", transpose_b = " + num(cfg.transpose_b));
  }
  if (cfg.gelu != 0) {
    return check.reject(TE_ERROR_VALUE, "config.gelu must be 0 with block-scaled operands, got " + num(cfg.gelu));
  }
  if (!check.handle(a, "a") || !check.handle(b, "b") || !check.handle(d, "d")) return check.status();
  const te_buffer *ad = slot(a, TE_SLOT_DATA);
  const te_buffer *bd = slot(b, TE_SLOT_DATA);
  const te_buffer *dd = slot(d, TE_SLOT_DATA);
  if (!check.present(ad, "a.data") || !check.same_device(*ad, "a.data") ||
      !check.dtype_in(*ad, "a.data", is_fp8_dtype, "float8") || !check.present(bd, "b.data") ||
      !check.same_device(*bd, "b.data") || !check.dtype_in(*bd, "b.data", is_fp8_dtype, "float8")) {
    return check.status();
  }
  if (ad->ndim < 1) return check.reject(TE_ERROR_VALUE, "a.data must have at least 1 dimension, got a scalar");
  if (bd->ndim != 2) return check.reject(TE_ERROR_VALUE, "b.data must be 2-D [N, K], got " + describe(*bd));
  GemmArgs g{};
  g.fp8 = true;
  g.m = rows_of(*ad);
  g.k = cols_of(*ad);
  g.n = bd->shape[0];
  if (bd->shape[1] != g.k) {
    return check.reject(TE_ERROR_VALUE, "b.data must have K = " + num(g.k) +
                                            " (the contraction dimension of a) along dimension 1, got " +
                                            describe(*bd));
  }
  const char *names[3] = {"M (rows of a)", "N (rows of b)", "K (columns of a and b)"};
  const int64_t dims[3] = {g.m, g.n, g.k};
  for (int i = 0; i < 3; ++i) {
    if (dims[i] % 16 != 0) {
      return check.reject(TE_ERROR_VALUE, std::string(names[i]) +
                                              " must be a multiple of 16 for FP8 operands (the tensor "
                                              "cores' granule), got " + num(dims[i]));
    }
  }
  g.a.mode = te_tensor_scaling_mode(a);
  g.b.mode = te_tensor_scaling_mode(b);
  if (g.a.mode != TE_SCALING_BLOCK_1X128 ||
      (g.b.mode != TE_SCALING_BLOCK_128X128 && g.b.mode != TE_SCALING_BLOCK_1X128)) {
    return check.reject(TE_ERROR_VALUE, std::string("the scaling modes of a and b must be block_1x128 x "
                                                    "block_128x128 or block_1x128 x block_1x128, got ") +
                                            scaling_mode_name(g.a.mode) + " x " + scaling_mode_name(g.b.mode));
  }
  g.a.transposed = false;
  g.b.transposed = true;
  if (!check_operand(check, a, "a", *ad, &g.a) || !check_operand(check, b, "b", *bd, &g.b)) return check.status();

  if (!check.present(dd, "d.data") || !check.same_device(*dd, "d.data") ||
      !check.dtype_in(*dd, "d.data", is_block_output, "float32 or bfloat16 (block-scaled FP8 GEMM)") ||
      !check.matrix_is(*dd, "d.data", g.m, g.n)) {
    return check.status();
  }
  if (slot(d, TE_SLOT_AMAX) != nullptr) {
    return check.reject(TE_ERROR_VALUE, "d.amax must be unset with block-scaled operands, got it set");
  }
  g.d = dd->data;
  g.d_dtype = dd->dtype;
  const te_buffer *bb = nullptr;
  if (bias != nullptr) {
    bb = slot(bias, TE_SLOT_DATA);
    if (!check.present(bb, "bias.data") || !check.same_device(*bb, "bias.data") ||
        !check.dtype_is(*bb, "bias.data", TE_DTYPE_BFLOAT16)) {
      return check.status();
    }
    if (bb->ndim != 1 || bb->shape[0] != g.n) {
      return check.reject(TE_ERROR_VALUE, "bias.data must have shape [" + num(g.n) + "], got " + describe(*bb));
    }
    g.bias = bb->data;
    g.bias_dtype = bb->dtype;
  }
  if (check.device() != TE_DEVICE_CUDA) {
    return check.reject(TE_ERROR_VALUE, "a.data must be on a CUDA device (the kernel has no CPU path), got " +
                                            describe(*ad));
  }
  if (!check.disjoint({{dd, "d.data"}}, {{ad, "a.data"},
                                         {bd, "b.data"},
                                         {slot(a, TE_SLOT_SCALE_INV), "a.scale_inv"},
                                         {slot(b, TE_SLOT_SCALE_INV), "b.scale_inv"},
                                         {bb, "bias.data"}})) {
    return check.status();
  }
  g.accumulate = cfg.accumulate != 0;
  g.split_accumulator = cfg.use_split_accumulator != 0;
  g.workspace = workspace;
  g.workspace_size = workspace != nullptr ? workspace_size : 0;
  g.device = check.device_id();
  CudaDeviceScope on_device(g.device);
  return hopper_block_scaled_gemm(g, stream);
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_hopper_block_scaled_gemm(const te_tensor *a, const te_tensor *b, te_tensor *d,
                                      const te_tensor *bias, const te_gemm_config *config,
                                      void *workspace, size_t workspace_size, te_stream stream) {
  return te::guarded("hopper_block_scaled_gemm", [&]() -> te_status {
    return te::resolve_and_run(a, b, d, bias, config, workspace, workspace_size, stream);
  });
}

}  // extern "C"
