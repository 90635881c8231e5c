// The tensor handle, error reporting and the validation helpers of the C entry points.
#include <algorithm>
#include <cstdarg>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#include <cstdio>
#include <new>
#include <string>

#include "common/internal.h"
#include "transformer_engine/tensor.h"

namespace te {
namespace {

thread_local std::string last_error;

const char *const kDtypeNames[TE_DTYPE_COUNT] = {
    "float32", "float16", "bfloat16", "float8_e4m3", "float8_e5m2", "float8_e8m0",
    "int8",    "uint8",   "int16",    "int32",       "int64"};
const size_t kDtypeSizes[TE_DTYPE_COUNT] = {4, 2, 2, 1, 1, 1, 1, 1, 2, 4, 8};

}  // namespace

te_status fail(te_status code, const char *op, const std::string &message) {
  last_error = std::string(op) + ": " + message;
  return code;
}

const char *slot_name(te_tensor_slot slot) {
  switch (slot) {
    case TE_SLOT_DATA: return "data";
    case TE_SLOT_COLUMNWISE_DATA: return "columnwise_data";
    case TE_SLOT_SCALE: return "scale";
    case TE_SLOT_SCALE_INV: return "scale_inv";
    case TE_SLOT_COLUMNWISE_SCALE_INV: return "columnwise_scale_inv";
    case TE_SLOT_AMAX: return "amax";
    case TE_SLOT_GATE: return "gate";
    default: return "invalid slot";
  }
}

const char *device_name(te_device_type device) {
  return device == TE_DEVICE_CPU ? "cpu" : device == TE_DEVICE_CUDA ? "cuda" : "invalid device";
}

const char *scaling_mode_name(te_scaling_mode mode) {
  switch (mode) {
    case TE_SCALING_TENSOR: return "tensor";
    case TE_SCALING_BLOCK_1X128: return "block_1x128";
    case TE_SCALING_BLOCK_128X128: return "block_128x128";
    case TE_SCALING_MXFP8: return "mxfp8";
    default: return "invalid scaling mode";
  }
}

std::string shape_string(const int64_t *shape, int ndim) {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string describe(const te_buffer &b) {
  std::string s = std::string(te_dtype_name(b.dtype)) + " " + shape_string(b.shape, b.ndim) +
                  " on " + device_name(b.device);
  if (b.device == TE_DEVICE_CUDA) s += ":" + std::to_string(b.device_id);
  return s;
}

int64_t numel(const te_buffer &b) {
  int64_t n = 1;
  for (int i = 0; i < b.ndim; ++i) n *= b.shape[i];
  return n;
}

int64_t cols_of(const te_buffer &b) { return b.ndim == 0 ? 1 : b.shape[b.ndim - 1]; }

int64_t rows_of(const te_buffer &b) {
  int64_t n = 1;
  for (int i = 0; i + 1 < b.ndim; ++i) n *= b.shape[i];
  return n;
}

bool is_high_precision(te_dtype d) {
  return d == TE_DTYPE_FLOAT32 || d == TE_DTYPE_FLOAT16 || d == TE_DTYPE_BFLOAT16;
}

bool is_fp8(te_dtype d) { return d == TE_DTYPE_FLOAT8_E4M3 || d == TE_DTYPE_FLOAT8_E5M2; }

float fp8_max(te_dtype d) { return d == TE_DTYPE_FLOAT8_E4M3 ? 448.0f : 57344.0f; }

bool Checker::fail(te_status code, const std::string &message) {
  if (status_ == TE_SUCCESS) {
    status_ = code;
    te::fail(code, op_, message);
  }
  return false;
}

bool Checker::handle(const void *tensor, const char *name) {
  if (tensor != nullptr) return true;
  return fail(TE_ERROR_VALUE, std::string(name) + " must be a tensor handle, got NULL");
}

bool Checker::present(const te_buffer *buffer, const char *what) {
  if (buffer != nullptr) return true;
  return fail(TE_ERROR_VALUE, std::string(what) + " must be set, got nothing");
}

bool Checker::dtype_in(const te_buffer &b, const char *what, bool (*pred)(te_dtype),
                       const char *expected) {
  if (pred(b.dtype)) return true;
  return fail(TE_ERROR_TYPE, std::string(what) + " must be " + expected + ", got " + describe(b));
}

bool Checker::dtype_is(const te_buffer &b, const char *what, te_dtype dtype) {
  if (b.dtype == dtype) return true;
  return fail(TE_ERROR_TYPE,
              std::string(what) + " must be " + te_dtype_name(dtype) + ", got " + describe(b));
}

bool Checker::numel_is(const te_buffer &b, const char *what, int64_t n) {
  if (numel(b) == n) return true;
  return fail(TE_ERROR_VALUE, std::string(what) + " must have " + std::to_string(n) +
                                  (n == 1 ? " element" : " elements") + ", got " + describe(b));
}

bool Checker::same_as(const te_buffer &b, const std::string &what, const te_buffer &like,
                      const std::string &like_name) {
  bool same = b.ndim == like.ndim && b.dtype == like.dtype;
  for (int d = 0; same && d < b.ndim; ++d) same = b.shape[d] == like.shape[d];
  if (same) return true;
  return fail(TE_ERROR_VALUE, what + " must have the shape and dtype of " + like_name + " (" + describe(like) +
                                  "), got " + describe(b));
}

bool Checker::matrix_is(const te_buffer &b, const char *what, int64_t rows, int64_t cols) {
  if (rows_of(b) == rows && cols_of(b) == cols && b.ndim >= 1) return true;
  return fail(TE_ERROR_VALUE, std::string(what) + " must have shape [" + std::to_string(rows) +
                                  ", " + std::to_string(cols) + "], got " + describe(b));
}

bool Checker::same_device(const te_buffer &b, const char *what) {
  if (!have_device_) {
    have_device_ = true;
    device_ = b.device;
    device_id_ = b.device_id;
    return true;
  }
  if (b.device == device_ && (b.device == TE_DEVICE_CPU || b.device_id == device_id_)) return true;
  std::string expected = device_name(device_);
  if (device_ == TE_DEVICE_CUDA) expected += ":" + std::to_string(device_id_);
  return fail(TE_ERROR_VALUE, std::string(what) + " must be on " + expected +
                                  " like the other arguments, got " + describe(b));
}

bool Checker::gate_of(const te_tensor *t, const char *what, bool has_amax, bool accumulates,
                      bool other_outputs, const float **gate) {
  const te_buffer *g = slot(t, TE_SLOT_GATE);
  *gate = nullptr;
  if (g == nullptr) return true;
  const std::string name = std::string(what) + ".gate";
  if (!fp32_scalar(g, name.c_str())) return false;
  if (!has_amax) return fail(TE_ERROR_VALUE, name + " needs " + what + ".amax set (a gated call computes only the amax)");
  if (accumulates) return fail(TE_ERROR_VALUE, name + " needs accumulate_amax = 0, got 1");
  if (other_outputs) {
    return fail(TE_ERROR_VALUE, name + " allows no transposed (columnwise_data) or dbias output, got one");
  }
  *gate = static_cast<const float *>(g->data);
  return true;
}

// A gated CPU call whose gate is shut: AMAX = 0 and nothing else written.
bool gate_shut_on_cpu(const float *gate, float *amax) {
  if (gate == nullptr || *gate == 0.0f) return false;
  *amax = 0.0f;
  return true;
}

bool overlap(const te_buffer &a, const te_buffer &b) {
  if (a.device != b.device || (a.device == TE_DEVICE_CUDA && a.device_id != b.device_id)) return false;
  const auto begin_a = reinterpret_cast<uintptr_t>(a.data), begin_b = reinterpret_cast<uintptr_t>(b.data);
  const uintptr_t end_a = begin_a + static_cast<uintptr_t>(numel(a)) * te_dtype_size(a.dtype);
  const uintptr_t end_b = begin_b + static_cast<uintptr_t>(numel(b)) * te_dtype_size(b.dtype);
  return begin_a < end_b && begin_b < end_a;  // empty ranges never overlap
}

bool any_output_overlap(const std::vector<const te_buffer *> &outputs,
                        const std::vector<const te_buffer *> &inputs) {
  struct Span {
    int device;  // type and id in one key: buffers on different devices never overlap
    uintptr_t begin, end;
    bool output;
  };
  std::vector<Span> spans;
  spans.reserve(outputs.size() + inputs.size());
  auto add = [&](const te_buffer *b, bool output) {
    if (b == nullptr) return;
    const auto begin = reinterpret_cast<uintptr_t>(b->data);
    const uintptr_t end = begin + static_cast<uintptr_t>(numel(*b)) * te_dtype_size(b->dtype);
    if (begin == end) return;  // empty ranges never overlap
    const int device = b->device == TE_DEVICE_CUDA ? 1 + b->device_id : 0;
    spans.push_back({device, begin, end, output});
  };
  for (const te_buffer *b : outputs) add(b, true);
  for (const te_buffer *b : inputs) add(b, false);
  std::sort(spans.begin(), spans.end(), [](const Span &x, const Span &y) {
    return x.device != y.device ? x.device < y.device : x.begin < y.begin;
  });
  // In start order, a span meets an earlier one iff an earlier end lies past its start: the
  // latest end among earlier outputs (for any span), among all earlier spans (for an output).
  uintptr_t end_any = 0, end_output = 0;
  int device = -1;
  for (const Span &sp : spans) {
    if (sp.device != device) {
      device = sp.device;
      end_any = end_output = 0;
    }
    if (end_output > sp.begin || (sp.output && end_any > sp.begin)) return true;
    end_any = std::max(end_any, sp.end);
    if (sp.output) end_output = std::max(end_output, sp.end);
  }
  return false;
}

bool Checker::disjoint(const std::vector<Named> &outputs, const std::vector<Named> &inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].buffer == nullptr) continue;
    auto clash = [&](const Named &other) {
      return other.buffer != nullptr && overlap(*outputs[i].buffer, *other.buffer);
    };
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      if (clash(outputs[j])) {
        return fail(TE_ERROR_VALUE, outputs[i].name + " must not overlap " + outputs[j].name +
                                        " (both are written), got overlapping memory");
      }
    }
    for (const Named &in : inputs) {
      if (clash(in)) {
        return fail(TE_ERROR_VALUE, outputs[i].name + " must not overlap the input " + in.name +
                                        ", got overlapping memory");
      }
    }
  }
  return true;
}

#if defined(__x86_64__) || defined(_M_X64)
// MXCSR bits: flush-to-zero (15) and denormals-are-zero (6).
constexpr unsigned kFlushBits = (1u << 15) | (1u << 6);
IeeeFpScope::IeeeFpScope() : saved_(_mm_getcsr()) {
  if (saved_ & kFlushBits) _mm_setcsr(saved_ & ~kFlushBits);
}
IeeeFpScope::~IeeeFpScope() {
  if (saved_ & kFlushBits) _mm_setcsr(saved_);
}
#else
IeeeFpScope::IeeeFpScope() {}
IeeeFpScope::~IeeeFpScope() {}
#endif

te_status no_cuda_build(const char *op) {
  return fail(TE_ERROR_UNSUPPORTED, op,
              "arguments are on cuda, but this build of the core has no CUDA kernels "
              "(rebuild with a CUDA toolkit, or pass CPU arrays)");
}

}  // namespace te

extern "C" {

te_status te_tensor_create(te_scaling_mode scaling_mode, te_tensor **tensor) {
  if (tensor == nullptr) return te::fail(TE_ERROR_VALUE, "tensor_create", "tensor must be a pointer, got NULL");
  if (static_cast<unsigned>(scaling_mode) > TE_SCALING_MXFP8) {
    return te::fail(TE_ERROR_VALUE, "tensor_create",
                    "scaling_mode must be one of tensor, block_1x128, block_128x128, mxfp8, got " +
                        std::to_string(static_cast<int>(scaling_mode)));
  }
  te_tensor *t = new (std::nothrow) te_tensor_s();
  if (t == nullptr) return te::fail(TE_ERROR_RUNTIME, "tensor_create", "out of host memory");
  t->scaling_mode = scaling_mode;
  *tensor = t;
  return TE_SUCCESS;
}

void te_tensor_destroy(te_tensor *tensor) { delete tensor; }

te_status te_tensor_set(te_tensor *tensor, te_tensor_slot slot, const te_buffer *buffer) {
  const char *op = "tensor_set";
  if (tensor == nullptr) return te::fail(TE_ERROR_VALUE, op, "tensor must be a tensor handle, got NULL");
  if (static_cast<unsigned>(slot) >= TE_SLOT_COUNT) {
    return te::fail(TE_ERROR_VALUE, op, "slot must be in [0, " + std::to_string(TE_SLOT_COUNT) +
                                            "), got " + std::to_string(static_cast<int>(slot)));
  }
  if (buffer == nullptr) {
    tensor->present[slot] = false;
    return TE_SUCCESS;
  }
  const std::string what = std::string(te::slot_name(slot));
  if (static_cast<unsigned>(buffer->dtype) >= TE_DTYPE_COUNT) {
    return te::fail(TE_ERROR_TYPE, op, what + " dtype must be a te_dtype, got " +
                                           std::to_string(static_cast<int>(buffer->dtype)));
  }
  if (buffer->ndim < 0 || buffer->ndim > TE_MAX_DIMS) {
    return te::fail(TE_ERROR_VALUE, op, what + " ndim must be in [0, " +
                                            std::to_string(TE_MAX_DIMS) + "], got " +
                                            std::to_string(buffer->ndim));
  }
  for (int i = 0; i < buffer->ndim; ++i) {
    if (buffer->shape[i] < 0) {
      return te::fail(TE_ERROR_VALUE, op, what + " shape must be non-negative, got " +
                                              te::shape_string(buffer->shape, buffer->ndim));
    }
  }
  if (buffer->device != TE_DEVICE_CPU && buffer->device != TE_DEVICE_CUDA) {
    return te::fail(TE_ERROR_VALUE, op, what + " device must be cpu or cuda, got " +
                                            std::to_string(static_cast<int>(buffer->device)));
  }
  if (buffer->data == nullptr && te::numel(*buffer) != 0) {
    return te::fail(TE_ERROR_VALUE, op, what + " data must be non-NULL for " +
                                            te::describe(*buffer));
  }
  tensor->slots[slot] = *buffer;
  tensor->present[slot] = true;
  return TE_SUCCESS;
}

te_status te_tensor_get(const te_tensor *tensor, te_tensor_slot slot, te_buffer *buffer) {
  const char *op = "tensor_get";
  if (tensor == nullptr || buffer == nullptr) {
    return te::fail(TE_ERROR_VALUE, op, "tensor and buffer must be non-NULL, got NULL");
  }
  if (static_cast<unsigned>(slot) >= TE_SLOT_COUNT || !tensor->present[slot]) {
    return te::fail(TE_ERROR_VALUE, op, "slot must be set, got an empty slot");
  }
  *buffer = tensor->slots[slot];
  return TE_SUCCESS;
}

te_scaling_mode te_tensor_scaling_mode(const te_tensor *tensor) {
  return tensor == nullptr ? TE_SCALING_TENSOR : tensor->scaling_mode;
}

const char *te_last_error(void) { return te::last_error.c_str(); }

const char *te_dtype_name(te_dtype dtype) {
  return static_cast<unsigned>(dtype) < TE_DTYPE_COUNT ? te::kDtypeNames[dtype] : "invalid";
}

size_t te_dtype_size(te_dtype dtype) {
  return static_cast<unsigned>(dtype) < TE_DTYPE_COUNT ? te::kDtypeSizes[dtype] : 0;
}

int te_built_with_cuda(void) {
#ifdef TE_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

const char *te_version(void) { return TE_VERSION_STRING; }

}  // extern "C"
