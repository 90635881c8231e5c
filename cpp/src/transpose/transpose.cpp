// C entry point te_transpose.
#include <string>

#include "common/internal.h"
#include "transpose/transpose_impl.h"

extern "C" te_status te_transpose(const te_tensor *input, te_tensor *output, te_stream stream) {
  return te::guarded("transpose", [&]() -> te_status {
    te::Checker check("transpose");
    if (!check.handle(input, "input") || !check.handle(output, "output")) return check.status();
    const te_buffer *in = te::slot(input, TE_SLOT_DATA);
    const te_buffer *out = te::slot(output, TE_SLOT_DATA);
    if (!check.present(in, "input.data") || !check.same_device(*in, "input.data") ||
        !check.present(out, "output.data") || !check.same_device(*out, "output.data") ||
        !check.dtype_is(*out, "output.data", in->dtype)) {
      return check.status();
    }
    const int64_t m = te::rows_of(*in), k = te::cols_of(*in);
    if (out->ndim < 1 || out->shape[0] != k || te::numel(*out) != m * k) {
      return check.reject(TE_ERROR_VALUE, "output.data must be the transpose, shape [" +
                                              std::to_string(k) + ", " + std::to_string(m) +
                                              "], got " + te::describe(*out));
    }
    if (!check.disjoint({{out, "output.data"}}, {{in, "input.data"}})) return check.status();
    te::TransposeArgs args{in->data, out->data, m, k, te_dtype_size(in->dtype)};
    if (check.device() == TE_DEVICE_CUDA) {
      te::CudaDeviceScope on_device(check.device_id());
      return te::transpose_cuda(args, stream);
    }
    te::transpose_ref(args);
    return TE_SUCCESS;
  });
}
