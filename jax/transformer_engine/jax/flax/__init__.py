"""Transformer Engine's Flax (linen) modules: :class:`DenseGeneral`, :class:`LayerNorm`."""

from transformer_engine.jax import __version__
from transformer_engine.jax.flax.module import DenseGeneral, LayerNorm

__all__ = ["__version__", "DenseGeneral", "LayerNorm"]
