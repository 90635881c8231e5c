// C entry points te_quantize and te_dequantize: validate every argument, then dispatch to the
// CPU reference or the CUDA kernels by the device of the buffers.
#include <cmath>
#include <string>
#include <vector>

#include "common/internal.h"
#include "quantize/quantize_impl.h"
#include "transformer_engine/quantize.h"

namespace te {
namespace {

bool is_e8m0(te_dtype d) { return d == TE_DTYPE_FLOAT8_E8M0; }
bool is_fp32(te_dtype d) { return d == TE_DTYPE_FLOAT32; }

// Shape [rows, cols] of the row-wise scale_inv of a [m, k] matrix in a block mode.
void block_scale_shape(te_scaling_mode mode, int64_t m, int64_t k, int64_t *rows, int64_t *cols) {
  switch (mode) {
    case TE_SCALING_BLOCK_1X128: *rows = m; *cols = ceil_div(k, 128); break;
    case TE_SCALING_BLOCK_128X128: *rows = ceil_div(m, 128); *cols = ceil_div(k, 128); break;
    default: *rows = m; *cols = ceil_div(k, 32); break;  // MXFP8
  }
}

// Checks a block-mode scale_inv slot against the data it scales.
bool check_block_scale_inv(Checker &check, const te_buffer *b, const char *what,
                           te_scaling_mode mode, int64_t rows, int64_t cols) {
  if (!check.present(b, what) || !check.same_device(*b, what)) return false;
  const bool mx = mode == TE_SCALING_MXFP8;
  if (!check.dtype_in(*b, what, mx ? is_e8m0 : is_fp32, mx ? "float8_e8m0" : "float32")) return false;
  return check.matrix_is(*b, what, rows, cols);
}

// The buffers quantize writes and reads for (input, output); unset slots are null.
struct QuantizeBuffers {
  struct Entry {
    const te_buffer *buffer;
    const char *name;
  };
  Entry written[5], read[2];
};

QuantizeBuffers buffers_of(const te_tensor *input, const te_tensor *output) {
  const te_buffer *row = slot(output, TE_SLOT_DATA), *col = slot(output, TE_SLOT_COLUMNWISE_DATA);
  const bool tensor_mode = output->scaling_mode == TE_SCALING_TENSOR;
  const te_buffer *scale_inv = tensor_mode || row != nullptr ? slot(output, TE_SLOT_SCALE_INV) : nullptr;
  const te_buffer *col_scale_inv = !tensor_mode && col != nullptr ? slot(output, TE_SLOT_COLUMNWISE_SCALE_INV) : nullptr;
  return {{{row, "output.data"},
           {col, "output.columnwise_data"},
           {scale_inv, "output.scale_inv"},
           {col_scale_inv, "output.columnwise_scale_inv"},
           {slot(output, TE_SLOT_AMAX), "output.amax"}},
          {{slot(input, TE_SLOT_DATA), "input.data"}, {tensor_mode ? slot(output, TE_SLOT_SCALE) : nullptr, "output.scale"}}};
}

// A batch runs its quantizations concurrently: what one writes must not overlap what another
// writes or reads (each one's own buffers are checked by check_quantize). A batch is a grouped
// layer's casts, one per group (tens of groups): the pairwise search below, which names the
// clash, runs only where one sweep over all the buffers in address order finds an overlap.
bool check_batch_disjoint(Checker &check, const std::vector<QuantizeBuffers> &items) {
  std::vector<const te_buffer *> written, read;
  for (const QuantizeBuffers &item : items) {
    for (const auto &w : item.written) written.push_back(w.buffer);
    for (const auto &r : item.read) read.push_back(r.buffer);
  }
  if (!any_output_overlap(written, read)) return true;
  for (size_t i = 0; i < items.size(); ++i) {
    for (const auto &w : items[i].written) {
      if (w.buffer == nullptr) continue;
      for (size_t j = 0; j < items.size(); ++j) {
        if (j == i) continue;
        auto clash = [&](const QuantizeBuffers::Entry &e, const char *how) {
          if (e.buffer == nullptr || !overlap(*w.buffer, *e.buffer)) return false;
          return !check.fail(TE_ERROR_VALUE, "tensor " + std::to_string(i) + " " + w.name + " must not overlap tensor " +
                                                 std::to_string(j) + " " + e.name + " (" + how +
                                                 "), got overlapping memory");
        };
        for (const auto &e : items[j].written) {
          if (clash(e, "both are written")) return false;
        }
        for (const auto &e : items[j].read) {
          if (clash(e, "an input")) return false;
        }
      }
    }
  }
  return true;
}

bool check_quantize(Checker &check, const te_tensor *input, te_tensor *output,
                    const te_quantize_config *config, QuantizeArgs *args) {
  if (!check.handle(input, "input") || !check.handle(output, "output")) return false;
  const te_buffer *in = slot(input, TE_SLOT_DATA);
  if (!check.present(in, "input.data") || !check.same_device(*in, "input.data") ||
      !check.dtype_in(*in, "input.data", is_high_precision, "float32, float16 or bfloat16")) {
    return false;
  }
  const int64_t m = rows_of(*in), k = cols_of(*in);
  const te_scaling_mode mode = output->scaling_mode;
  const te_buffer *row = slot(output, TE_SLOT_DATA);
  const te_buffer *col = slot(output, TE_SLOT_COLUMNWISE_DATA);
  if (row == nullptr && col == nullptr) {
    return check.fail(TE_ERROR_VALUE, "output.data or output.columnwise_data must be set, got neither");
  }
  if (row != nullptr) {
    if (!check.same_device(*row, "output.data") ||
        !check.dtype_in(*row, "output.data", is_fp8, "float8_e4m3 or float8_e5m2") ||
        !check.matrix_is(*row, "output.data", m, k)) {
      return false;
    }
  }
  if (col != nullptr) {
    if (!check.same_device(*col, "output.columnwise_data") ||
        !check.dtype_in(*col, "output.columnwise_data", is_fp8, "float8_e4m3 or float8_e5m2")) {
      return false;
    }
    if (row != nullptr && col->dtype != row->dtype) {
      return check.fail(TE_ERROR_TYPE, std::string("output.columnwise_data must have the dtype of output.data (") +
                                           te_dtype_name(row->dtype) + "), got " + describe(*col));
    }
    if (mode == TE_SCALING_MXFP8) {
      if (!check.matrix_is(*col, "output.columnwise_data", m, k)) return false;
    } else if (col->ndim < 1 || col->shape[0] != k || numel(*col) != m * k) {
      return check.fail(TE_ERROR_VALUE, "output.columnwise_data must be the transpose, shape [" +
                                            std::to_string(k) + ", " + std::to_string(m) +
                                            "], got " + describe(*col));
    }
  }
  *args = QuantizeArgs{};
  args->mode = mode;
  args->input = in->data;
  args->input_dtype = in->dtype;
  args->rows = m;
  args->cols = k;
  args->fp8_dtype = row != nullptr ? row->dtype : col->dtype;
  args->rowwise = row != nullptr ? static_cast<uint8_t *>(row->data) : nullptr;
  args->columnwise = col != nullptr ? static_cast<uint8_t *>(col->data) : nullptr;
  if (mode == TE_SCALING_TENSOR) {
    const te_buffer *scale = slot(output, TE_SLOT_SCALE);
    const te_buffer *scale_inv = slot(output, TE_SLOT_SCALE_INV);
    if (!check.fp32_scalar(scale, "output.scale") ||
        !check.fp32_scalar(scale_inv, "output.scale_inv")) {
      return false;
    }
    args->scale = static_cast<const float *>(scale->data);
    args->scale_inv = static_cast<float *>(scale_inv->data);
  } else {
    int64_t sr = 0, sc = 0;
    if (row != nullptr) {
      block_scale_shape(mode, m, k, &sr, &sc);
      const te_buffer *b = slot(output, TE_SLOT_SCALE_INV);
      if (!check_block_scale_inv(check, b, "output.scale_inv", mode, sr, sc)) return false;
      args->rowwise_scale_inv = b->data;
    }
    if (col != nullptr) {
      if (mode == TE_SCALING_MXFP8) {
        sr = ceil_div(m, 32);
        sc = k;
      } else {
        block_scale_shape(mode, k, m, &sr, &sc);  // the transpose, blocked like a row-wise tensor
      }
      const te_buffer *b = slot(output, TE_SLOT_COLUMNWISE_SCALE_INV);
      if (!check_block_scale_inv(check, b, "output.columnwise_scale_inv", mode, sr, sc)) return false;
      args->columnwise_scale_inv = b->data;
    }
  }
  const te_buffer *amax = slot(output, TE_SLOT_AMAX);
  if (amax != nullptr) {
    if (!check.fp32_scalar(amax, "output.amax")) return false;
    args->amax = static_cast<float *>(amax->data);
  }
  const QuantizeBuffers b = buffers_of(input, output);
  std::vector<Checker::Named> written, read;
  for (const auto &e : b.written) written.push_back({e.buffer, e.name});
  for (const auto &e : b.read) read.push_back({e.buffer, e.name});
  if (!check.disjoint(written, read)) return false;
  if (config != nullptr) {
    if (!(config->amax_epsilon >= 0.0f) || !std::isfinite(config->amax_epsilon)) {
      return check.fail(TE_ERROR_VALUE, "config.amax_epsilon must be finite and >= 0, got " +
                                            std::to_string(config->amax_epsilon));
    }
    args->pow2 = config->force_pow2_scales != 0;
    args->epsilon = config->amax_epsilon;
    args->accumulate_amax = config->accumulate_amax != 0;
  }
  return true;
}

bool check_dequantize(Checker &check, const te_tensor *input, te_tensor *output, DequantizeArgs *args) {
  if (!check.handle(input, "input") || !check.handle(output, "output")) return false;
  const te_buffer *in = slot(input, TE_SLOT_DATA);
  const te_buffer *out = slot(output, TE_SLOT_DATA);
  if (!check.present(in, "input.data") || !check.same_device(*in, "input.data") ||
      !check.dtype_in(*in, "input.data", is_fp8, "float8_e4m3 or float8_e5m2")) {
    return false;
  }
  const int64_t m = rows_of(*in), k = cols_of(*in);
  if (!check.present(out, "output.data") || !check.same_device(*out, "output.data") ||
      !check.dtype_in(*out, "output.data", is_high_precision, "float32, float16 or bfloat16") ||
      !check.matrix_is(*out, "output.data", m, k)) {
    return false;
  }
  const te_scaling_mode mode = input->scaling_mode;
  const te_buffer *sinv = slot(input, TE_SLOT_SCALE_INV);
  if (mode == TE_SCALING_TENSOR) {
    if (!check.fp32_scalar(sinv, "input.scale_inv")) return false;
  } else {
    int64_t sr = 0, sc = 0;
    block_scale_shape(mode, m, k, &sr, &sc);
    if (!check_block_scale_inv(check, sinv, "input.scale_inv", mode, sr, sc)) return false;
  }
  if (!check.disjoint({{out, "output.data"}}, {{in, "input.data"}, {sinv, "input.scale_inv"}})) {
    return false;
  }
  *args = DequantizeArgs{mode, static_cast<const uint8_t *>(in->data), in->dtype, sinv->data,
                         m, k, out->data, out->dtype};
  return true;
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_quantize(const te_tensor *input, te_tensor *output, const te_quantize_config *config,
                      te_stream stream) {
  return te::guarded("quantize", [&]() -> te_status {
    te::Checker check("quantize");
    te::QuantizeArgs args;
    if (!te::check_quantize(check, input, output, config, &args)) return check.status();
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::quantize_cuda(args, stream);
    }
    te::quantize_ref(args);
    return TE_SUCCESS;
  });
}

te_status te_quantize_many(const te_tensor *const *inputs, te_tensor *const *outputs, size_t count,
                           const te_quantize_config *config, te_stream stream) {
  return te::guarded("quantize_many", [&]() -> te_status {
    te::Checker group("quantize_many");
    if (count == 0) return TE_SUCCESS;
    if (inputs == nullptr || outputs == nullptr) {
      return group.reject(TE_ERROR_VALUE, "inputs and outputs must be arrays of count (" + std::to_string(count) +
                                              ") tensors, got NULL");
    }
    std::vector<te::QuantizeArgs> args(count);
    std::vector<te::QuantizeBuffers> buffers(count);
    for (size_t i = 0; i < count; ++i) {
      const std::string op = "quantize_many (tensor " + std::to_string(i) + ")";
      te::Checker check(op.c_str());
      if (!te::check_quantize(check, inputs[i], outputs[i], config, &args[i])) return check.status();
      // One device for the batch: the group checker remembers tensor 0's.
      if (!group.same_device(*te::slot(inputs[i], TE_SLOT_DATA), "every input.data")) return group.status();
      buffers[i] = te::buffers_of(inputs[i], outputs[i]);
    }
    if (!te::check_batch_disjoint(group, buffers)) return group.status();
    if (group.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(group.device_id());
      return te::quantize_many_cuda(args.data(), count, stream);
    }
    for (const te::QuantizeArgs &a : args) te::quantize_ref(a);
    return TE_SUCCESS;
  });
}

te_status te_dequantize(const te_tensor *input, te_tensor *output, te_stream stream) {
  return te::guarded("dequantize", [&]() -> te_status {
    te::Checker check("dequantize");
    te::DequantizeArgs args;
    if (!te::check_dequantize(check, input, output, &args)) return check.status();
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::dequantize_cuda(args, stream);
    }
    te::dequantize_ref(args);
    return TE_SUCCESS;
  });
}

}  // extern "C"
