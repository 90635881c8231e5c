"""NVIDIA's path ``transformer_engine.pytorch.utils``: the device queries (from
``availability.py``) and the weight-initializer factories that Megatron-style programs pass as
``init_method`` / ``output_layer_init_method``."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .availability import get_cudnn_version, get_device_compute_capability, is_bf16_available
from .module.multihead_attention import DEFAULT_INIT_STD

__all__ = ["divide", "get_cudnn_version", "get_default_init_method",
           "get_device_compute_capability", "init_method_constant", "init_method_normal",
           "is_bf16_available", "make_weak_ref", "scaled_init_method_normal"]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer drawing from N(0, sigma^2)."""
    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor],
                                                                          torch.Tensor]:
    """N(0, (sigma / sqrt(2 num_layers))^2): the output projections' initializer of GPT-2, so
    that the residual stream's variance does not grow with depth."""
    if num_layers <= 0:
        raise ValueError(f"scaled_init_method_normal: num_layers must be positive, got "
                         f"{num_layers}")
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def init_method_constant(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An initializer filling the tensor with ``value``."""
    def init(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.constant_(tensor, value)
    return init


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """The attention modules' default weight initializer, N(0, 0.023^2)."""
    return init_method_normal(DEFAULT_INIT_STD)


def divide(numerator: int, denominator: int) -> int:
    """numerator // denominator, which must divide exactly (ValueError naming both otherwise)."""
    if denominator == 0 or numerator % denominator:
        raise ValueError(f"divide: {numerator} is not divisible by {denominator}")
    return numerator // denominator


class _DeviceBytes:
    """The bytes of a CUDA allocation as ``__cuda_array_interface__`` describes them (uint8),
    holding its address only: a tensor torch makes over it does not keep the memory alive."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


def make_weak_ref(x):
    """NVIDIA's: a CUDA tensor over the same memory as ``x`` (same dtype, shape, strides and
    address) that does not keep that memory alive, for a CUDA graph's static outputs whose
    pool owns the memory; tuples, lists and dicts element by element. CPU tensors, numbers
    and None come back as they are; any other value raises TypeError (as NVIDIA's)."""
    if isinstance(x, torch.Tensor):
        return _weak_tensor(x) if x.is_cuda else x
    if isinstance(x, tuple):
        return tuple(make_weak_ref(v) for v in x)
    if isinstance(x, list):
        return [make_weak_ref(v) for v in x]
    if isinstance(x, dict):
        return {k: make_weak_ref(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float)):
        return x
    raise TypeError(f"make_weak_ref: expected tensors (or tuples, lists, dicts of them), "
                    f"numbers or None, got {type(x).__name__}")


def _weak_tensor(x: torch.Tensor) -> torch.Tensor:
    storage = x.untyped_storage()
    if storage.nbytes() == 0:  # no memory to share (and no address to describe)
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        raw = torch.as_tensor(_DeviceBytes(storage.data_ptr(), storage.nbytes()),
                              device=x.device)
    # The whole storage as x's dtype, then x's view of it: the same address as x.
    out = raw.view(x.dtype).as_strided(x.shape, x.stride(), x.storage_offset())
    if out.data_ptr() != x.data_ptr():
        raise RuntimeError("make_weak_ref: the new tensor does not start at the address of "
                           "the given one")
    return out
