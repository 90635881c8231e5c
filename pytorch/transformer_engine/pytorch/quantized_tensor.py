"""NVIDIA's path ``transformer_engine.pytorch.quantized_tensor`` (newer releases; older ones
use ``tensor.quantized_tensor``): the base classes of the quantized tensors and quantizers.
Here Float8Tensor is the one quantized tensor type (``tensor/__init__.py``)."""

from .tensor import QuantizedTensor, Quantizer

__all__ = ["QuantizedTensor", "Quantizer"]
