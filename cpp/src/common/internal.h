// Internals shared by the C entry points: the handle's layout, error reporting, validation.
#ifndef TRANSFORMER_ENGINE_SRC_COMMON_INTERNAL_H_
#define TRANSFORMER_ENGINE_SRC_COMMON_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "transformer_engine/tensor.h"

struct te_tensor_s {
  te_scaling_mode scaling_mode;
  bool present[TE_SLOT_COUNT];
  te_buffer slots[TE_SLOT_COUNT];
};

namespace te {

// Records "<op>: <message>" as this thread's last error and returns code.
te_status fail(te_status code, const char *op, const std::string &message);

// IEEE floating-point mode for the duration of a call: callers may run with subnormals
// flushed to zero (XLA's CPU runtime does, and so do fast-math builds), which would change the
// CPU reference's results (a subnormal amax, say) and part them from the CUDA path's. The
// caller's mode is restored on return. A no-op where the mode is not known (non-x86).
class IeeeFpScope {
 public:
  IeeeFpScope();
  ~IeeeFpScope();
  IeeeFpScope(const IeeeFpScope &) = delete;
  IeeeFpScope &operator=(const IeeeFpScope &) = delete;

 private:
  unsigned saved_ = 0;
};

// Runs body (returning te_status) and turns any C++ exception into TE_ERROR_RUNTIME, so that
// no exception crosses the C boundary.
template <typename Body>
te_status guarded(const char *op, Body &&body) noexcept {
  try {
    IeeeFpScope ieee;
    return body();
  } catch (const std::exception &e) {
    return fail(TE_ERROR_RUNTIME, op, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(TE_ERROR_RUNTIME, op, "internal error");
  }
}

const char *slot_name(te_tensor_slot slot);
const char *device_name(te_device_type device);
const char *scaling_mode_name(te_scaling_mode mode);

// "bfloat16 [2, 3] on cuda:0".
std::string describe(const te_buffer &buffer);
std::string shape_string(const int64_t *shape, int ndim);

int64_t numel(const te_buffer &buffer);
// A CPU call whose gate (Checker::gate_of) holds a nonzero value: sets *amax = 0 and returns
// true, the call then writing nothing else; false when there is no gate or it holds 0.
bool gate_shut_on_cpu(const float *gate, float *amax);
// Whether the two buffers share a byte (on the same device).
bool overlap(const te_buffer &a, const te_buffer &b);
// Whether an output shares a byte with another output or an input (null entries skipped), in
// O(n log n): for calls with many buffers (grouped GEMMs), which then name the clash through
// Checker::disjoint only when there is one.
bool any_output_overlap(const std::vector<const te_buffer *> &outputs,
                        const std::vector<const te_buffer *> &inputs);
// Rows of the [M, K] matrix view: product of all dimensions but the last (1 for rank 0).
int64_t rows_of(const te_buffer &buffer);
// Columns of the [M, K] matrix view: the last dimension (1 for rank 0).
int64_t cols_of(const te_buffer &buffer);

bool is_high_precision(te_dtype dtype);  // fp32, fp16, bf16
bool is_fp8(te_dtype dtype);             // E4M3, E5M2
float fp8_max(te_dtype dtype);           // 448 or 57344

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A read-only view of a slot; null when the slot is empty.
inline const te_buffer *slot(const te_tensor *t, te_tensor_slot s) {
  return (t != nullptr && t->present[s]) ? &t->slots[s] : nullptr;
}

// Validation of a call's arguments. Each check records the error and returns false, so that
// an entry point reads as a list of requirements followed by the work.
class Checker {
 public:
  explicit Checker(const char *op) : op_(op) {}

  bool handle(const void *tensor, const char *name);
  // The slot must be set. what names it in messages, e.g. "output.scale".
  bool present(const te_buffer *buffer, const char *what);
  bool dtype_in(const te_buffer &buffer, const char *what, bool (*pred)(te_dtype),
                const char *expected);
  bool dtype_is(const te_buffer &buffer, const char *what, te_dtype dtype);
  bool numel_is(const te_buffer &buffer, const char *what, int64_t n);
  bool matrix_is(const te_buffer &buffer, const char *what, int64_t rows, int64_t cols);
  // The shape and dtype of `like` (named like_name in the message).
  bool same_as(const te_buffer &buffer, const std::string &what, const te_buffer &like,
               const std::string &like_name);
  // A set slot holding one fp32 value on the call's device (a scale, scale_inv or amax).
  bool fp32_scalar(const te_buffer *buffer, const char *what) {
    return present(buffer, what) && same_device(*buffer, what) &&
           dtype_is(*buffer, what, TE_DTYPE_FLOAT32) && numel_is(*buffer, what, 1);
  }
    // The gate of tensor t (TE_SLOT_GATE, see tensor.h): *gate = null when unset, else its one
  // fp32 value's address. A gated call must write a fresh AMAX and nothing the gate could
  // leave stale behind it: accumulate, transposed and dbias outputs are refused.
  bool gate_of(const te_tensor *t, const char *what, bool has_amax, bool accumulates,
               bool other_outputs, const float **gate);
  // Same device type and id as the first buffer checked with this call.
  bool same_device(const te_buffer &buffer, const char *what);
  // Every output shares no byte with another output or with an input: the CUDA kernels write
  // them concurrently, so an overlap would be a race that the CPU's sequential order hides.
  // Null entries (unset slots) are skipped.
  struct Named {
    const te_buffer *buffer;
    std::string name;
  };
  bool disjoint(const std::vector<Named> &outputs, const std::vector<Named> &inputs);
  bool fail(te_status code, const std::string &message);
  // fail() for an entry point's return statement.
  te_status reject(te_status code, const std::string &message) {
    fail(code, message);
    return status_;
  }

  te_status status() const { return status_; }
  te_device_type device() const { return device_; }
  int device_id() const { return device_id_; }

 private:
  const char *op_;
  te_status status_ = TE_SUCCESS;
  bool have_device_ = false;
  te_device_type device_ = TE_DEVICE_CPU;
  int device_id_ = 0;
};

// major * 10 + minor of a CUDA device (90 for an H100/H200), asked once per device; -1 when it
// cannot be queried. CUDA builds only (the kernels' dispatch asks it).
int device_sm(int device);

// Makes the buffers' CUDA device current for one call and restores the caller's afterwards:
// the caller's stream and our kernels must run on the device that holds the memory, whatever
// device the calling thread had selected. A no-op in a CPU-only build.
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int device);
  ~CudaDeviceScope();
  CudaDeviceScope(const CudaDeviceScope &) = delete;
  CudaDeviceScope &operator=(const CudaDeviceScope &) = delete;

 private:
  int previous_ = -1;  // the caller's device when it was changed, else -1
};

// Error for a CUDA buffer reaching a core built without CUDA.
te_status no_cuda_build(const char *op);

}  // namespace te

#endif  // TRANSFORMER_ENGINE_SRC_COMMON_INTERNAL_H_
