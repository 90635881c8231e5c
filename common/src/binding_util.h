// Shared by the files of the Python binding (`transformer_engine.common._core`): the Tensor
// that Python sees, the conversion of Python arrays into C handles, and error translation.
//
// Arrays are checked here for what only the binding can see (contiguity, writability, device
// kind); the C API checks the rest (dtypes, shapes, how the buffers fit together) and its
// message becomes the exception. Nothing is written unless every check passed.
#ifndef TRANSFORMER_ENGINE_COMMON_SRC_BINDING_UTIL_H_
#define TRANSFORMER_ENGINE_COMMON_SRC_BINDING_UTIL_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "transformer_engine/transformer_engine.h"

namespace te_binding {

namespace nb = nanobind;

// A quantized (or plain) tensor as Python sees it: the arrays of its slots, kept alive here,
// and the FP8 format of its data when the arrays hold raw bytes (uint8).
struct Tensor {
  nb::object slots[TE_SLOT_COUNT];
  std::optional<te_dtype> dtype;
  te_scaling_mode scaling_mode = TE_SCALING_TENSOR;
};

struct HandleDeleter {
  void operator()(te_tensor *t) const { te_tensor_destroy(t); }
};
using Handle = std::unique_ptr<te_tensor, HandleDeleter>;

// Every slot, for make_handle's writable_slots.
// Every slot but the gate, which ops only read.
constexpr unsigned kAllSlots = ((1u << TE_SLOT_COUNT) - 1) & ~(1u << TE_SLOT_GATE);

// Raises the Python exception of a failed status (TypeError, ValueError or RuntimeError).
[[noreturn]] void raise_status(te_status status, const std::string &message);
// Raises with te_last_error() when status is not TE_SUCCESS.
void check_status(te_status status);

// A Python array (DLPack, buffer protocol, or the raw tuple form) as a te_buffer. FP8 data
// held as uint8/int8 is taken as bytes_as.
te_buffer to_buffer(const char *op, const std::string &what, nb::handle obj, bool writable,
                    std::optional<te_dtype> bytes_as);

// A C handle for a Tensor, or for a bare array taken as a plain tensor's data. The slots in
// writable_slots must be writable arrays.
Handle make_handle(const char *op, const char *name, nb::handle obj, unsigned writable_slots);

// make_handle for an optional argument: None gives an empty handle (a NULL tensor to the core).
Handle optional_handle(const char *op, const char *name, nb::handle obj, unsigned writable_slots = 0);

// A plain handle (slot DATA only) for one array.
Handle plain_handle(const char *op, const std::string &what, nb::handle obj, bool writable);

// The memory of a writable scratch array (None: NULL and 0 bytes).
void *workspace_of(const char *op, nb::handle workspace, size_t *bytes);

inline te_stream as_stream(uintptr_t stream) { return reinterpret_cast<te_stream>(stream); }

// The op groups, one file each.
void register_quantize(nb::module_ &m);
void register_gemm(nb::module_ &m);
void register_activation(nb::module_ &m);
void register_norm(nb::module_ &m);
void register_attention(nb::module_ &m);
void register_rope(nb::module_ &m);
void register_dropout(nb::module_ &m);

}  // namespace te_binding

#endif  // TRANSFORMER_ENGINE_COMMON_SRC_BINDING_UTIL_H_
