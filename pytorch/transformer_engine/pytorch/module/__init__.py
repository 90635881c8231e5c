"""te modules."""

from .attention import AttentionBackend, DotProductAttention, get_attention_backend
from .fp8_padding import Fp8Padding, Fp8Unpadding
from .grouped_linear import GroupedLinear
from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .multihead_attention import MultiheadAttention
from .transformer_layer import TransformerLayer

__all__ = ["AttentionBackend", "DotProductAttention", "Fp8Padding", "Fp8Unpadding",
           "GroupedLinear", "LayerNorm",
           "LayerNormLinear",
           "LayerNormMLP", "Linear", "MultiheadAttention", "RMSNorm", "TransformerLayer",
           "get_attention_backend"]
