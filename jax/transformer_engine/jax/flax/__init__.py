"""Transformer Engine's Flax (linen) modules: :class:`DenseGeneral`, :class:`LayerNorm`,
:class:`LayerNormDenseGeneral`, :class:`LayerNormMLP` and :class:`DotProductAttention`."""

from transformer_engine.jax import __version__
from transformer_engine.jax.flax.attention import DotProductAttention
from transformer_engine.jax.flax.layernorm_dense import LayerNormDenseGeneral
from transformer_engine.jax.flax.layernorm_mlp import LayerNormMLP
from transformer_engine.jax.flax.module import DenseGeneral, LayerNorm

__all__ = ["__version__", "DenseGeneral", "DotProductAttention", "LayerNorm",
           "LayerNormDenseGeneral", "LayerNormMLP"]
