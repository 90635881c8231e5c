"""The quantized-tensor API at NVIDIA's module paths (``transformer_engine.pytorch.tensor``).

``QuantizedTensor`` is :class:`Float8Tensor`, the one quantized tensor type here (per-tensor
or per-block FP8); the quantizers are in ``quantizers.py``.
"""

from ..float8_tensor import Float8Tensor
from .quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Quantizer,
)

QuantizedTensor = Float8Tensor

__all__ = ["Float8BlockQuantizer", "Float8CurrentScalingQuantizer", "Float8Quantizer",
           "Float8Tensor", "QuantizedTensor", "Quantizer"]
