"""NVIDIA's path ``transformer_engine.pytorch.tensor.quantized_tensor``: the base classes of
its quantized tensors and quantizers (here Float8Tensor is the one quantized tensor type)."""

from . import QuantizedTensor, Quantizer

__all__ = ["QuantizedTensor", "Quantizer"]
