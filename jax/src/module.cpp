// The Python module `transformer_engine.jax._te_jax`: capsules of the FFI handlers, which the
// package registers with XLA, and the versions it checks at import.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "handlers.h"
#include "transformer_engine/transformer_engine.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule capsule_of(Fn *fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error *, Fn, XLA_FFI_CallFrame *>,
                "an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void *>(fn));
}

}  // namespace

NB_MODULE(_te_jax, m) {
  m.doc() = "XLA FFI handlers over the Transformer Engine core (internal; use transformer_engine.jax).";
  m.def(
      "registrations",
      []() {
        nb::dict targets;
#define TE_JAX_ADD_TARGET(target, prefix)                              \
  {                                                                    \
    nb::dict per_platform;                                             \
    per_platform["cpu"] = capsule_of(te_jax::prefix##Cpu);             \
    per_platform["CUDA"] = capsule_of(te_jax::prefix##Cuda);           \
    targets[target] = per_platform;                                    \
  }
        TE_JAX_FOR_EACH_HANDLER(TE_JAX_ADD_TARGET)
#undef TE_JAX_ADD_TARGET
        return targets;
      },
      "{target name: {platform: handler capsule}} of every FFI target.");
  m.def("core_version", []() { return std::string(te_version()); },
        "Version of the libtransformer_engine this module loaded.");
  m.def("core_built_with_cuda", []() { return te_built_with_cuda() != 0; },
        "True when the loaded core has its CUDA kernels.");
  m.attr("__version__") = TE_JAX_VERSION;
}
