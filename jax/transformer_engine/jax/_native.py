"""Loads the XLA FFI extension ``_te_jax`` and registers its handlers with XLA, once.

Every target is registered for the ``cpu`` and ``CUDA`` platforms under one name, so a jitted
function runs the same custom calls on either (the core picks its CPU path or its CUDA kernels
by the device of the buffers). Registering for a platform that this jaxlib lacks is harmless:
jax keeps the registration until a plugin for that platform appears.
"""

from __future__ import annotations

import jax
from transformer_engine.jax._version import __version__

__all__ = ["TARGETS", "load"]

# The FFI targets of the extension, by op (the names appear in the compiled HLO).
TARGETS = {
    "quantize": "te_quantize_ffi",
    "dequantize": "te_dequantize_ffi",
    "compute_amax": "te_compute_amax_ffi",
    "scale_from_amax": "te_scale_from_amax_ffi",
    "delayed_scaling_update": "te_delayed_scaling_update_ffi",
    "gemm": "te_gemm_ffi",
    "grouped_gemm": "te_grouped_gemm_ffi",
    "norm_forward": "te_norm_forward_ffi",
    "norm_backward": "te_norm_backward_ffi",
    "activation_forward": "te_activation_forward_ffi",
    "activation_backward": "te_activation_backward_ffi",
    # (the same handler, left out of XLA's CUDA graphs: its dbias takes memory of its own)
    "activation_backward_dbias": "te_activation_backward_dbias_ffi",
    "attention_forward": "te_attention_forward_ffi",
    "attention_backward": "te_attention_backward_ffi",
    "attention_forward_packed": "te_attention_forward_packed_ffi",
    "attention_backward_packed": "te_attention_backward_packed_ffi",
    "rope_forward": "te_rope_forward_ffi",
    "rope_backward": "te_rope_backward_ffi",
}

_INSTALL_HINT = (
    "Install the wheel 'transformer-engine-jax' built for this Python and jaxlib together with "
    "the matching 'transformer-engine-common' (pip install --find-links dist "
    "'transformer-engine[jax]==0.1.0', after 'nox -s build'), or rebuild the extension "
    "in place (see jax/CMakeLists.txt)."
)

_module = None


def load():
    """Returns the extension module, loading it and registering its targets on first use."""
    global _module
    if _module is not None:
        return _module
    try:
        from transformer_engine.jax import _te_jax
    except ImportError as err:
        raise ImportError(
            f"transformer_engine.jax: the native extension _te_jax could not be loaded ({err}). "
            + _INSTALL_HINT
        ) from err
    if getattr(_te_jax, "__version__", None) != __version__:
        raise ImportError(
            f"transformer_engine.jax: the native extension _te_jax is version "
            f"{getattr(_te_jax, '__version__', 'unknown')}, the package is {__version__}. "
            + _INSTALL_HINT
        )
    core = _te_jax.core_version()
    if core != __version__:
        raise ImportError(
            f"transformer_engine.jax: the extension loaded libtransformer_engine {core}, the "
            f"package needs {__version__}. " + _INSTALL_HINT
        )
    registrations = _te_jax.registrations()
    missing = sorted(set(TARGETS.values()) - set(registrations))
    if missing:
        raise ImportError(
            f"transformer_engine.jax: the native extension lacks the FFI targets {missing}. "
            + _INSTALL_HINT
        )
    for name, platforms in registrations.items():
        for platform, capsule in platforms.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    _module = _te_jax
    return _module
