"""Transformer Engine's Flax (linen) modules: :class:`DenseGeneral`, :class:`LayerNorm`,
:class:`LayerNormDenseGeneral`, :class:`LayerNormMLP` and :class:`DotProductAttention`; the
Transformer blocks :class:`MultiHeadAttention`, :class:`TransformerLayer` (with
:class:`TransformerLayerType`) and :class:`RelativePositionBiases`."""

from transformer_engine.jax import __version__
from transformer_engine.jax.flax.attention import DotProductAttention
from transformer_engine.jax.flax.layernorm_dense import LayerNormDenseGeneral
from transformer_engine.jax.flax.layernorm_mlp import LayerNormMLP
from transformer_engine.jax.flax.module import DenseGeneral, LayerNorm
from transformer_engine.jax.flax.multi_head_attention import MultiHeadAttention
from transformer_engine.jax.flax.transformer import (
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)

__all__ = ["__version__", "DenseGeneral", "DotProductAttention", "LayerNorm",
           "LayerNormDenseGeneral", "LayerNormMLP", "MultiHeadAttention", "RelativePositionBiases",
           "TransformerLayer", "TransformerLayerType"]
