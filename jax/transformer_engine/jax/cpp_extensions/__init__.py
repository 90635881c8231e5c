"""Where NVIDIA's JAX programs find device queries: only :mod:`.misc`'s
``get_device_compute_capability`` and ``get_cudnn_version`` exist here.

The custom calls themselves are :mod:`transformer_engine.jax.ops`; NVIDIA's primitives
(``act_lu``, ``gemm``, ...) have no counterpart under this name, and asking for one says so.
"""

from transformer_engine.jax.cpp_extensions.misc import (
    get_cudnn_version,
    get_device_compute_capability,
)

__all__ = ["get_cudnn_version", "get_device_compute_capability"]


def __getattr__(name: str):
    if name.startswith("__"):  # keep Python's own protocol lookups silent
        raise AttributeError(name)
    raise AttributeError(
        f"transformer_engine.jax.cpp_extensions has no {name!r}: only get_cudnn_version and "
        "get_device_compute_capability are provided under this name; the custom calls are in "
        "transformer_engine.jax.ops")
