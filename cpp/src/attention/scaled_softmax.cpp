// C entry points of the unfused path's scaled masked softmax (attention.h): checks, then the
// CPU reference or the CUDA kernels by the device of the buffers.
#include <cmath>
#include <string>

#include "attention/attention_math.h"
#include "common/internal.h"

namespace te {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

const te_buffer *hp_data(Checker &check, const te_tensor *t, const char *name) {
  if (!check.handle(t, name)) return nullptr;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  const std::string what = std::string(name) + ".data";
  if (!check.present(b, what.c_str()) || !check.same_device(*b, what.c_str()) ||
      !check.dtype_in(*b, what.c_str(), is_high_precision, "float32, float16 or bfloat16")) {
    return nullptr;
  }
  return b;
}

bool check_forward(Checker &check, te_softmax_mask_type mask_type, float scale, const te_tensor *x,
                   const te_tensor *mask, te_tensor *y, SoftmaxForwardArgs *a) {
  if (mask_type < 0 || mask_type >= TE_SOFTMAX_MASK_COUNT) {
    return check.fail(TE_ERROR_VALUE, "mask_type must be a te_softmax_mask_type, got " + num(mask_type));
  }
  if (!std::isfinite(scale)) return check.fail(TE_ERROR_VALUE, "scale must be finite, got " + std::to_string(scale));
  const te_buffer *xb = hp_data(check, x, "x");
  if (xb == nullptr) return false;
  if (xb->ndim != 4) {
    return check.fail(TE_ERROR_VALUE, "x.data must have 4 dimensions [batch, heads, sq, sk], got " + describe(*xb));
  }
  const te_buffer *yb = hp_data(check, y, "y");
  if (yb == nullptr || !check.same_as(*yb, "y.data", *xb, "x")) return false;
  *a = SoftmaxForwardArgs{};
  a->mask_type = mask_type;
  a->scale = scale;
  a->x = xb->data;
  a->y = yb->data;
  a->dtype = xb->dtype;
  a->batch = xb->shape[0];
  a->heads = xb->shape[1];
  a->sq = xb->shape[2];
  a->sk = xb->shape[3];
  const te_buffer *mb = nullptr;
  if (mask_type == TE_SOFTMAX_MASK_ARBITRARY) {
    if (!check.handle(mask, "mask")) return false;
    mb = slot(mask, TE_SLOT_DATA);
    if (!check.present(mb, "mask.data") || !check.same_device(*mb, "mask.data") ||
        !check.dtype_is(*mb, "mask.data", TE_DTYPE_UINT8)) {
      return false;
    }
    const bool ok = mb->ndim == 4 && (mb->shape[0] == 1 || mb->shape[0] == a->batch) &&
                    (mb->shape[1] == 1 || mb->shape[1] == a->heads) && mb->shape[2] == a->sq && mb->shape[3] == a->sk;
    if (!ok) {
      return check.fail(TE_ERROR_VALUE, "mask.data must have shape [" + num(a->batch) + " or 1, " + num(a->heads) +
                                            " or 1, " + num(a->sq) + ", " + num(a->sk) + "], got " + describe(*mb));
    }
    a->mask = static_cast<const uint8_t *>(mb->data);
    a->mask_batch = mb->shape[0];
    a->mask_heads = mb->shape[1];
  } else if (mask != nullptr) {
    return check.fail(TE_ERROR_VALUE, "mask must be NULL unless mask_type is TE_SOFTMAX_MASK_ARBITRARY, got a tensor");
  }
  return check.disjoint({{yb, "y.data"}}, {{xb, "x.data"}, {mb, "mask.data"}});
}

bool check_backward(Checker &check, float scale, const te_tensor *dy, const te_tensor *y, te_tensor *dx,
                    SoftmaxBackwardArgs *a) {
  if (!std::isfinite(scale)) return check.fail(TE_ERROR_VALUE, "scale must be finite, got " + std::to_string(scale));
  const te_buffer *dyb = hp_data(check, dy, "dy"), *yb = dyb ? hp_data(check, y, "y") : nullptr;
  const te_buffer *dxb = yb ? hp_data(check, dx, "dx") : nullptr;
  if (dxb == nullptr || !check.same_as(*yb, "y.data", *dyb, "dy") || !check.same_as(*dxb, "dx.data", *dyb, "dy")) {
    return false;
  }
  if (dyb->ndim < 1) return check.fail(TE_ERROR_VALUE, "dy.data must have at least 1 dimension, got a scalar");
  *a = SoftmaxBackwardArgs{scale, dyb->data, yb->data, dxb->data, dyb->dtype, rows_of(*dyb), cols_of(*dyb)};
  return check.disjoint({{dxb, "dx.data"}}, {{dyb, "dy.data"}, {yb, "y.data"}});
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_scaled_softmax_forward(te_softmax_mask_type mask_type, float scale, const te_tensor *x,
                                    const te_tensor *mask, te_tensor *y, te_stream stream) {
  return te::guarded("scaled_softmax_forward", [&]() -> te_status {
    te::Checker check("scaled_softmax_forward");
    te::SoftmaxForwardArgs args;
    if (!te::check_forward(check, mask_type, scale, x, mask, y, &args)) return check.status();
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::scaled_softmax_forward_cuda(args, stream);
    }
    te::scaled_softmax_forward_ref(args);
    return TE_SUCCESS;
  });
}

te_status te_scaled_softmax_backward(float scale, const te_tensor *dy, const te_tensor *y, te_tensor *dx,
                                     te_stream stream) {
  return te::guarded("scaled_softmax_backward", [&]() -> te_status {
    te::Checker check("scaled_softmax_backward");
    te::SoftmaxBackwardArgs args;
    if (!te::check_backward(check, scale, dy, y, dx, &args)) return check.status();
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::scaled_softmax_backward_cuda(args, stream);
    }
    te::scaled_softmax_backward_ref(args);
    return TE_SUCCESS;
  });
}

}  // extern "C"
