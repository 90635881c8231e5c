"""The GPU's compute capability and the cuDNN version, under NVIDIA's names.

Both answer 0 (or (0, 0, 0)) where there is nothing to report: JAX running on the CPU, no such
GPU, or no cuDNN found. The GPU is JAX's: they ask ``jax.devices("gpu")``.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax

__all__ = ["get_device_compute_capability", "get_cudnn_version"]

# The soname the core's fused attention opens (cpp/src/attention/cudnn/cudnn_library.cpp).
_CUDNN_SONAME = "libcudnn.so.9"


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this jaxlib, or none initialised
        return []


@functools.lru_cache(maxsize=None)
def get_device_compute_capability(gpu_id: int = 0) -> int:
    """The compute capability of JAX's GPU ``gpu_id`` as major * 10 + minor (90 on an H100,
    89 on an L40); 0 when JAX has no such GPU (the CPU, an index out of range)."""
    gpus = _gpus()
    if not 0 <= gpu_id < len(gpus):
        return 0
    cc = getattr(gpus[gpu_id], "compute_capability", None)  # "9.0" on CUDA devices
    if not cc:
        return 0
    major, _, minor = str(cc).partition(".")
    return int(major) * 10 + int(minor or 0)


@functools.lru_cache(maxsize=None)
def _cudnn_encoded() -> int:
    if not _gpus():
        return 0
    # As the core does: the copy already loaded (JAX's, usually), else the linker's search.
    lib = None
    for mode in (os.RTLD_NOLOAD | os.RTLD_LAZY, os.RTLD_LAZY):
        try:
            lib = ctypes.CDLL(_CUDNN_SONAME, mode=mode)
            break
        except OSError:
            continue
    if lib is None:
        return 0
    get_version = lib.cudnnGetVersion
    get_version.restype = ctypes.c_size_t
    return int(get_version())


def get_cudnn_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the cuDNN the core's fused attention uses (the one loaded in
    this process, else the one the dynamic linker finds); (0, 0, 0) on the CPU or without one."""
    encoded = _cudnn_encoded()
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch; cuDNN 8 used major * 1000.
    major, rest = divmod(encoded, 10000 if encoded >= 90000 else 1000)
    minor, patch = divmod(rest, 100)
    return (major, minor, patch)
