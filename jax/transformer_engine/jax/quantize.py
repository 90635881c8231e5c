"""Scaling modes and FP8 availability, under the names NVIDIA's JAX programs use.

* :class:`ScalingMode`: how a tensor's FP8 data is scaled, NVIDIA's names mapped to the core's
  modes (:attr:`ScalingMode.core_mode`) and to the recipe that quantizes with them
  (:attr:`ScalingMode.recipe`). ``BLOCK_1X128_SCALING`` and ``BLOCK_128X128_SCALING`` are ours
  (the two block shapes of ``Float8BlockScaling``); NVIDIA's JAX package has no FP8 block
  scaling.
* :func:`is_scaling_mode_supported` and :func:`is_fp8_available`: ``(bool, reason)``.
* :func:`get_device_compute_capability`: as in :mod:`transformer_engine.jax.cpp_extensions.misc`.

FP8 is available on the CPU: the core's CPU path quantizes and multiplies FP8 operands as the
GPU does (FP8 values, fp32 accumulation), only slowly; this is the answer the PyTorch package's
``is_fp8_available`` gives too. On a GPU it needs compute capability 8.9 and a core built with
its CUDA kernels.

* NVIDIA's quantizer objects, ``QuantizerFactory``, ``Quantizer``, ``ScaledTensor``,
  ``QuantizeLayout`` and ``noop_quantizer_set``, as far as they map onto this package's
  recipes: see :mod:`transformer_engine.jax.quantizer_factory`. Here the recipe decides how
  every tensor of a layer is quantized, and the delayed-scaling state travels as the
  ``fp8_metas`` collection through :class:`~transformer_engine.jax.QuantizerSet` (see
  :mod:`transformer_engine.jax.quantizer`); NVIDIA's per-class quantizers
  (``DelayedScaleQuantizer``, ...) are not provided.

Example:
    >>> from transformer_engine.jax.quantize import ScalingMode, is_scaling_mode_supported
    >>> ScalingMode.DELAYED_TENSOR_SCALING.core_mode.name
    'TENSOR'
    >>> is_scaling_mode_supported(ScalingMode.MXFP8_1D_SCALING)[0]
    False
"""

from __future__ import annotations

import enum
from typing import Optional

from transformer_engine.common import plan as _plan
from transformer_engine.common import recipe as _recipe
from transformer_engine.jax import ops
from transformer_engine.jax._native import load
from transformer_engine.jax.cpp_extensions.misc import _gpus, get_device_compute_capability

__all__ = ["ScalingMode", "is_fp8_available", "is_scaling_mode_supported",
           "get_device_compute_capability", "QuantizeLayout", "Quantizer", "QuantizerFactory",
           "ScaledTensor", "noop_quantizer_set"]

_FP8_MIN_CC = 89  # FP8 tensor cores: Ada (8.9) and newer
_BLOCK_MIN_CC = 90  # cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMM: Hopper and newer


class ScalingMode(enum.Enum):
    """How FP8 data is scaled (NVIDIA's names; the block modes are ours)."""

    NO_SCALING = "no_scaling"  # high precision: no FP8
    DELAYED_TENSOR_SCALING = "delayed_tensor_scaling"
    CURRENT_TENSOR_SCALING = "current_tensor_scaling"
    MXFP8_1D_SCALING = "mxfp8_1d_scaling"
    BLOCK_1X128_SCALING = "block_1x128_scaling"
    BLOCK_128X128_SCALING = "block_128x128_scaling"
    NVFP4_1D_SCALING = "nvfp4_1d_scaling"
    NVFP4_2D_SCALING = "nvfp4_2d_scaling"

    @property
    def core_mode(self) -> Optional[ops.ScalingMode]:
        """The core's scaling mode of the data (None: no FP8 data, or a mode the core lacks)."""
        return _CORE_MODES[self]

    @property
    def recipe(self) -> Optional[_recipe.Recipe]:
        """The recipe (default settings) whose tensors are scaled this way, or None."""
        factory = _RECIPES[self]
        return factory() if factory is not None else None

    def is_tensor_scaling(self) -> bool:
        """One scale per tensor (delayed or current scaling)."""
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)

    def is_1d_block_scaling(self) -> bool:
        """Scales per block of one row (MXFP8's 1x32, our 1x128, NVFP4's 1D)."""
        return self in (ScalingMode.MXFP8_1D_SCALING, ScalingMode.BLOCK_1X128_SCALING,
                        ScalingMode.NVFP4_1D_SCALING)


_CORE_MODES = {
    ScalingMode.NO_SCALING: None,
    ScalingMode.DELAYED_TENSOR_SCALING: ops.ScalingMode.TENSOR,
    ScalingMode.CURRENT_TENSOR_SCALING: ops.ScalingMode.TENSOR,
    ScalingMode.MXFP8_1D_SCALING: ops.ScalingMode.MXFP8,
    ScalingMode.BLOCK_1X128_SCALING: ops.ScalingMode.BLOCK_1X128,
    ScalingMode.BLOCK_128X128_SCALING: ops.ScalingMode.BLOCK_128X128,
    ScalingMode.NVFP4_1D_SCALING: None,
    ScalingMode.NVFP4_2D_SCALING: None,
}

# Float8BlockScaling quantizes activations and gradients in 1x128 blocks and, by default,
# weights in 128x128 blocks: both modes belong to it.
_RECIPES = {
    ScalingMode.NO_SCALING: None,
    ScalingMode.DELAYED_TENSOR_SCALING: _recipe.DelayedScaling,
    ScalingMode.CURRENT_TENSOR_SCALING: _recipe.Float8CurrentScaling,
    ScalingMode.MXFP8_1D_SCALING: _recipe.MXFP8BlockScaling,
    ScalingMode.BLOCK_1X128_SCALING: _recipe.Float8BlockScaling,
    ScalingMode.BLOCK_128X128_SCALING: _recipe.Float8BlockScaling,
    ScalingMode.NVFP4_1D_SCALING: None,
    ScalingMode.NVFP4_2D_SCALING: None,
}


def _as_mode(scaling_mode, caller: str) -> ScalingMode:
    if isinstance(scaling_mode, ScalingMode):
        return scaling_mode
    if isinstance(scaling_mode, str):
        try:
            return ScalingMode[scaling_mode.upper()]
        except KeyError:
            pass
    raise TypeError(f"{caller}: scaling_mode must be a ScalingMode (one of "
                    f"{[m.name for m in ScalingMode]}), got {scaling_mode!r}")


def _device_fp8(gpu_id: Optional[int]) -> tuple[bool, str]:
    """Whether the device can run FP8 GEMMs at all: the CPU always (emulated), a GPU from
    compute capability 8.9 with a core built with CUDA."""
    gpus = _gpus()
    if not gpus:
        return True, ("no GPU: FP8 is emulated by the core's CPU path (FP8 values, fp32 math)")
    gpu = 0 if gpu_id is None else gpu_id
    if not 0 <= gpu < len(gpus):
        return False, f"JAX has {len(gpus)} GPU(s), no GPU {gpu}"
    cc = get_device_compute_capability(gpu)
    if cc < _FP8_MIN_CC:
        return False, (f"GPU {gpu} has compute capability {cc // 10}.{cc % 10}; FP8 needs 8.9 "
                       "or newer")
    if not load().core_built_with_cuda():
        return False, "the core (transformer-engine-common) was built without its CUDA kernels"
    return True, f"GPU {gpu} (compute capability {cc // 10}.{cc % 10}) has FP8 tensor cores"


def is_scaling_mode_supported(scaling_mode, gpu_id: Optional[int] = None) -> tuple[bool, str]:
    """Whether the modules can compute with ``scaling_mode`` here (on JAX's GPU ``gpu_id``,
    default the first; on the CPU when JAX has no GPU), and why (or why not)."""
    mode = _as_mode(scaling_mode, "is_scaling_mode_supported")
    if mode is ScalingMode.NO_SCALING:
        return True, "no scaling: the modules compute in their dtype"
    recipe = mode.recipe
    if recipe is None:
        return False, f"{mode.name}: NVFP4 (FP4 data) is not implemented"
    try:  # the recipes the core's GEMM cannot run are refused when their plan is made
        _plan.make_plan(recipe, mode.name)
    except NotImplementedError as err:
        return False, str(err)
    ok, reason = _device_fp8(gpu_id)
    if ok and mode.core_mode in (ops.ScalingMode.BLOCK_1X128, ops.ScalingMode.BLOCK_128X128):
        gpu = 0 if gpu_id is None else gpu_id
        cc = get_device_compute_capability(gpu) if _gpus() else None
        if cc is not None and cc < _BLOCK_MIN_CC:
            return False, (f"GPU {gpu} has compute capability {cc // 10}.{cc % 10}; block-scaled "
                           "FP8 GEMMs need 9.0 or newer")
    return ok, reason


def is_fp8_available(scaling_mode=None, gpu_id: Optional[int] = None) -> tuple[bool, str]:
    """Whether FP8 with ``scaling_mode`` (default: delayed tensor scaling) can run here, and
    why (or why not): see :func:`is_scaling_mode_supported`."""
    if scaling_mode is None:
        scaling_mode = ScalingMode.DELAYED_TENSOR_SCALING
    return is_scaling_mode_supported(scaling_mode, gpu_id)


# NVIDIA's quantizer objects (they use ScalingMode above, so they come after it).
from transformer_engine.jax.quantizer_factory import (  # noqa: E402
    QuantizeLayout,
    Quantizer,
    QuantizerFactory,
    ScaledTensor,
    noop_quantizer_set,
)
