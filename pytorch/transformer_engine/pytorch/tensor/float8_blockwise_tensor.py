"""NVIDIA's module path of the block-scaled quantizer (here the tensor is a Float8Tensor in a
block scaling mode)."""

from ..float8_tensor import Float8Tensor as Float8BlockwiseQTensor
from .quantizers import Float8BlockQuantizer

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensor"]
