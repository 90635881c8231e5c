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
           "is_bf16_available", "scaled_init_method_normal"]


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
