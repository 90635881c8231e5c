"""What this machine can run, asked the way NVIDIA Transformer Engine's functions ask it.

Each ``is_*_available`` returns a plain bool, so ``if not te.is_fp8_available():`` reads
right; ``return_reason=True`` returns ``(bool, reason)`` instead. The answers follow what
the modules actually do here:

* FP8 (delayed, current and block scaling) is available on a machine without CUDA: the
  core's CPU path quantizes and multiplies FP8 operands as a GPU would (FP8 values, FP32
  accumulation), only slowly. On CUDA, per-tensor FP8 needs compute capability 8.9 and block
  scaling 9.0, and a core built with its CUDA kernels.
* MXFP8 and NVFP4 are never available: the recipe plan refuses them (no MXFP8 or FP4 GEMM
  here), and the reason given is that refusal.

Example:

>>> import transformer_engine.pytorch as te  # doctest: +SKIP
>>> if not te.is_fp8_available():  # doctest: +SKIP
...     print(te.is_fp8_available(return_reason=True)[1])
"""

from __future__ import annotations

from typing import Union

import torch

from transformer_engine.common import plan as _plan
from transformer_engine.common.recipe import (
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

from . import fp8

__all__ = ["is_fp8_available", "is_bf16_available", "is_fp8_block_scaling_available",
           "is_mxfp8_available", "is_nvfp4_available", "get_device_compute_capability",
           "get_cudnn_version", "get_default_recipe"]

Answer = Union[bool, tuple[bool, str]]

# Block-scaled FP8 GEMMs run on Hopper (9.0) and newer.
_BLOCK_MIN_CC = (9, 0)


def _answer(ok: bool, reason: str, return_reason: bool) -> Answer:
    return (bool(ok), reason) if return_reason else bool(ok)


def is_fp8_available(return_reason: bool = False) -> Answer:
    """Whether te modules can run per-tensor FP8 (delayed or current scaling) here.

    True on a machine without CUDA (the core's CPU path); on CUDA, compute capability 8.9 or
    newer and a core built with its CUDA kernels. ``return_reason=True``: ``(bool, reason)``.
    """
    ok, reason = fp8.is_fp8_available()  # the check fp8_autocast makes at its entry
    return _answer(ok, reason, return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Answer:
    """Whether te modules can run :class:`Float8BlockScaling` here: FP8 available and, on
    CUDA, compute capability 9.0 or newer. ``return_reason=True``: ``(bool, reason)``."""
    ok, reason = fp8.is_fp8_available()
    if ok and torch.cuda.is_available():
        cc = get_device_compute_capability()
        if cc < _BLOCK_MIN_CC:
            ok, reason = False, (f"compute capability {cc[0]}.{cc[1]}; block-scaled FP8 GEMMs "
                                 "need 9.0 or newer")
    if ok:
        _plan.make_plan(Float8BlockScaling(), "is_fp8_block_scaling_available")
    return _answer(ok, reason, return_reason)


def _refused(recipe: Recipe, caller: str, return_reason: bool) -> Answer:
    """The plan's verdict on ``recipe``: it refuses MXFP8 and NVFP4 on every machine."""
    try:
        _plan.make_plan(recipe, caller)
    except NotImplementedError as err:
        return _answer(False, str(err), return_reason)
    return _answer(True, f"{type(recipe).__name__} has a plan", return_reason)


def is_mxfp8_available(return_reason: bool = False) -> Answer:
    """Always False: no MXFP8 GEMM here (the plan refuses :class:`MXFP8BlockScaling`).
    ``return_reason=True``: ``(False, reason)``."""
    return _refused(MXFP8BlockScaling(), "is_mxfp8_available", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> Answer:
    """Always False: no FP4 GEMM here (the plan refuses :class:`NVFP4BlockScaling`).
    ``return_reason=True``: ``(False, reason)``."""
    return _refused(NVFP4BlockScaling(), "is_nvfp4_available", return_reason)


def is_bf16_available(return_reason: bool = False) -> Answer:
    """Whether bfloat16 compute runs here: on CUDA, what torch says of the current GPU
    (Ampere, 8.0, and newer); on a machine without CUDA, True (torch's CPU kernels take
    bfloat16). ``return_reason=True``: ``(bool, reason)``."""
    if not torch.cuda.is_available():
        return _answer(True, "no CUDA device: torch's CPU kernels compute in bfloat16",
                       return_reason)
    ok = torch.cuda.is_bf16_supported()
    name = torch.cuda.get_device_name()
    return _answer(ok, f"{name} {'supports' if ok else 'does not support'} bfloat16",
                   return_reason)


def get_device_compute_capability() -> tuple[int, int]:
    """``(major, minor)`` compute capability of the current CUDA device.

    On a machine without CUDA: ``(0, 0)``, lower than every GPU's, so a check written as
    ``get_device_compute_capability() >= (8, 9)`` reads False there; ask
    :func:`is_fp8_available` whether FP8 runs (on the CPU it does, through the core's CPU
    path).
    """
    if not torch.cuda.is_available():
        return (0, 0)
    major, minor = torch.cuda.get_device_capability()
    return (int(major), int(minor))


def get_cudnn_version() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the cuDNN that torch loads (the attention modules' cuDNN
    path runs through it). Without CUDA or without cuDNN: ``(0, 0, 0)``, lower than every
    release, so version checks read False."""
    if not torch.cuda.is_available() or not torch.backends.cudnn.is_available():
        return (0, 0, 0)
    version = torch.backends.cudnn.version()
    if not version:
        return (0, 0, 0)
    # torch encodes it as major * 10000 + minor * 100 + patch since cuDNN 9 (major * 1000
    # + minor * 100 + patch before).
    if version >= 90000:
        return (version // 10000, version // 100 % 100, version % 100)
    return (version // 1000, version // 100 % 10, version % 100)


def get_default_recipe() -> Recipe:
    """The recipe ``fp8_autocast`` / ``autocast`` use when given none: ``DelayedScaling()``
    on every machine (NVIDIA's package may pick another by GPU generation; this one always
    picks a recipe its modules run)."""
    return fp8._DEFAULT_RECIPE
