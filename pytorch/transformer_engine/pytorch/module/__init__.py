"""te modules."""

from .attention import AttentionBackend, DotProductAttention, get_attention_backend
from .layernorm import LayerNorm, RMSNorm
from .linear import Linear

__all__ = ["AttentionBackend", "DotProductAttention", "LayerNorm", "Linear", "RMSNorm",
           "get_attention_backend"]
