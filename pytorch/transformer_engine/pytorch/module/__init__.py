"""te modules."""

from .layernorm import LayerNorm, RMSNorm
from .linear import Linear

__all__ = ["LayerNorm", "Linear", "RMSNorm"]
