// The Python binding of the core's C API: `transformer_engine.common._core`.
//
// It takes any array that speaks DLPack or the buffer protocol (torch, jax, numpy, cupy), on
// the CPU or a CUDA device, and compiles against no framework (see binding_util.h). This file
// holds the module, its enums and the Tensor class; each group of ops has its own file.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>

#include <optional>

#include "binding_util.h"

namespace nb = nanobind;
using namespace nb::literals;
using te_binding::Tensor;

namespace {

void init_tensor(Tensor *t, nb::object data, std::optional<te_dtype> dtype, te_scaling_mode mode,
                 nb::object scale, nb::object scale_inv, nb::object amax, nb::object columnwise_data,
                 nb::object columnwise_scale_inv, nb::object gate) {
  new (t) Tensor();
  t->slots[TE_SLOT_DATA] = data;
  t->slots[TE_SLOT_COLUMNWISE_DATA] = columnwise_data;
  t->slots[TE_SLOT_SCALE] = scale;
  t->slots[TE_SLOT_SCALE_INV] = scale_inv;
  t->slots[TE_SLOT_COLUMNWISE_SCALE_INV] = columnwise_scale_inv;
  t->slots[TE_SLOT_AMAX] = amax;
  t->slots[TE_SLOT_GATE] = gate;
  t->dtype = dtype;
  t->scaling_mode = mode;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "Binding of the Transformer Engine core C API (internal; use the framework packages).";

  nb::enum_<te_dtype>(m, "DType", "Element types of the core.")
      .value("float32", TE_DTYPE_FLOAT32)
      .value("float16", TE_DTYPE_FLOAT16)
      .value("bfloat16", TE_DTYPE_BFLOAT16)
      .value("float8_e4m3", TE_DTYPE_FLOAT8_E4M3)
      .value("float8_e5m2", TE_DTYPE_FLOAT8_E5M2)
      .value("float8_e8m0", TE_DTYPE_FLOAT8_E8M0)
      .value("int8", TE_DTYPE_INT8)
      .value("uint8", TE_DTYPE_UINT8)
      .value("int16", TE_DTYPE_INT16)
      .value("int32", TE_DTYPE_INT32)
      .value("int64", TE_DTYPE_INT64);

  nb::enum_<te_scaling_mode>(m, "ScalingMode", "How FP8 data is scaled (see tensor.h).")
      .value("tensor", TE_SCALING_TENSOR)
      .value("block_1x128", TE_SCALING_BLOCK_1X128)
      .value("block_128x128", TE_SCALING_BLOCK_128X128)
      .value("mxfp8", TE_SCALING_MXFP8);

  nb::enum_<te_amax_compute_algo>(m, "AmaxComputeAlgo")
      .value("max", TE_AMAX_COMPUTE_MAX)
      .value("most_recent", TE_AMAX_COMPUTE_MOST_RECENT);

  nb::class_<Tensor>(m, "Tensor",
                     "A tensor as the core sees it: its arrays by role. FP8 data may be given as "
                     "uint8 arrays with `dtype` naming the format; MXFP8 scale_inv arrays are "
                     "uint8 (E8M0 bytes). The arrays are not copied.")
      .def("__init__", &init_tensor, "data"_a = nb::none(), nb::kw_only(), "dtype"_a = nb::none(),
           "scaling_mode"_a = TE_SCALING_TENSOR, "scale"_a = nb::none(), "scale_inv"_a = nb::none(),
           "amax"_a = nb::none(), "columnwise_data"_a = nb::none(),
           "columnwise_scale_inv"_a = nb::none(), "gate"_a = nb::none())
      .def_prop_ro("data", [](const Tensor &t) { return t.slots[TE_SLOT_DATA]; })
      .def_prop_ro("columnwise_data", [](const Tensor &t) { return t.slots[TE_SLOT_COLUMNWISE_DATA]; })
      .def_prop_ro("scale", [](const Tensor &t) { return t.slots[TE_SLOT_SCALE]; })
      .def_prop_ro("scale_inv", [](const Tensor &t) { return t.slots[TE_SLOT_SCALE_INV]; })
      .def_prop_ro("columnwise_scale_inv",
                   [](const Tensor &t) { return t.slots[TE_SLOT_COLUMNWISE_SCALE_INV]; })
      .def_prop_ro("amax", [](const Tensor &t) { return t.slots[TE_SLOT_AMAX]; })
      .def_prop_ro("gate", [](const Tensor &t) { return t.slots[TE_SLOT_GATE]; })
      .def_prop_ro("dtype", [](const Tensor &t) { return t.dtype; })
      .def_prop_ro("scaling_mode", [](const Tensor &t) { return t.scaling_mode; });

  te_binding::register_quantize(m);
  te_binding::register_gemm(m);
  te_binding::register_activation(m);
  te_binding::register_norm(m);
  te_binding::register_attention(m);
  te_binding::register_rope(m);
  te_binding::register_dropout(m);

  m.def("built_with_cuda", []() { return te_built_with_cuda() != 0; },
        "True when the core was compiled with its CUDA kernels.");
  m.attr("__version__") = te_version();
}
