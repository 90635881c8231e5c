"""NVIDIA's module path of the FP8 tensor and its per-tensor quantizers."""

from ..float8_tensor import Float8Tensor
from .quantizers import Float8CurrentScalingQuantizer, Float8Quantizer

__all__ = ["Float8CurrentScalingQuantizer", "Float8Quantizer", "Float8Tensor"]
