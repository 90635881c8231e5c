"""te modules."""

from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm"]
