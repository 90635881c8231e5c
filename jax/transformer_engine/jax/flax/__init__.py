"""Transformer Engine's Flax (linen) modules: :class:`DenseGeneral`, :class:`LayerNorm`,
:class:`DotProductAttention`."""

from transformer_engine.jax import __version__
from transformer_engine.jax.flax.attention import DotProductAttention
from transformer_engine.jax.flax.module import DenseGeneral, LayerNorm

__all__ = ["__version__", "DenseGeneral", "DotProductAttention", "LayerNorm"]
