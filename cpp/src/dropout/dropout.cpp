// C entry points te_dropout_add_forward and te_dropout_backward: validate every argument against
// dropout.h, then dispatch to the CPU reference or the CUDA kernel by the buffers' device.
#include <string>

#include "common/internal.h"
#include "dropout/dropout_impl.h"
#include "transformer_engine/dropout.h"

namespace te {
namespace {

// A DATA buffer on the call's device (fp32/fp16/bf16 unless `dtype` is given).
const te_buffer *data_of(Checker &check, const te_tensor *t, const char *name) {
  if (!check.handle(t, name)) return nullptr;
  const te_buffer *b = slot(t, TE_SLOT_DATA);
  const std::string what = std::string(name) + ".data";
  if (!check.present(b, what.c_str()) || !check.same_device(*b, what.c_str())) return nullptr;
  return b;
}

te_status run(const char *op, float p, const te_tensor *x, const char *x_name, const te_tensor *residual,
              const te_tensor *rng_state, te_tensor *out, const char *out_name, te_stream stream) {
  return guarded(op, [&]() -> te_status {
    Checker check(op);
    if (!(p >= 0.0f && p < 1.0f)) {
      return check.reject(TE_ERROR_VALUE, "p must be in [0, 1), got " + std::to_string(p));
    }
    const std::string x_data = std::string(x_name) + ".data", out_data = std::string(out_name) + ".data";
    const te_buffer *xb = data_of(check, x, x_name);
    if (xb == nullptr ||
        !check.dtype_in(*xb, x_data.c_str(), is_high_precision, "float32, float16 or bfloat16")) {
      return check.status();
    }
    const te_buffer *rb = nullptr;
    if (residual != nullptr && (!(rb = data_of(check, residual, "residual")) ||
                                !check.same_as(*rb, "residual.data", *xb, x_data))) {
      return check.status();
    }
    const te_buffer *rng = data_of(check, rng_state, "rng_state");
    if (rng == nullptr || !check.dtype_is(*rng, "rng_state.data", TE_DTYPE_INT64) ||
        !check.numel_is(*rng, "rng_state.data", 2)) {
      return check.status();
    }
    const te_buffer *ob = data_of(check, out, out_name);
    if (ob == nullptr || !check.same_as(*ob, out_data, *xb, x_data)) return check.status();
    // The output may be x's or the residual's own buffer (an in-place update, element by
    // element), but must not overlap either otherwise, nor the rng state.
    auto partial = [&](const te_buffer *in) { return in != nullptr && in->data != ob->data && overlap(*ob, *in); };
    if (partial(xb) || partial(rb)) {
      return check.reject(TE_ERROR_VALUE, out_data + " must be " + x_data + "'s or residual.data's buffer or "
                                          "not overlap them, got overlapping memory");
    }
    if (!check.disjoint({{ob, out_data}}, {{rng, "rng_state.data"}})) return check.status();
    DropoutArgs a{};
    a.p = p;
    a.x = xb->data;
    a.residual = rb != nullptr ? rb->data : nullptr;
    a.out = ob->data;
    a.dtype = xb->dtype;
    a.n = numel(*xb);
    a.rng = static_cast<const int64_t *>(rng->data);
    if (a.n == 0) return TE_SUCCESS;
    if (check.device() == TE_DEVICE_CUDA) {
      CudaDeviceScope on_device(check.device_id());
      return dropout_cuda(a, stream);
    }
    dropout_ref(a);
    return TE_SUCCESS;
  });
}

}  // namespace
}  // namespace te

extern "C" {

te_status te_dropout_add_forward(float p, const te_tensor *x, const te_tensor *residual, const te_tensor *rng_state,
                                 te_tensor *y, te_stream stream) {
  return te::run("dropout_add_forward", p, x, "x", residual, rng_state, y, "y", stream);
}

te_status te_dropout_backward(float p, const te_tensor *dy, const te_tensor *rng_state, te_tensor *dx,
                              te_stream stream) {
  return te::run("dropout_backward", p, dy, "dy", nullptr, rng_state, dx, "dx", stream);
}

}  // extern "C"
