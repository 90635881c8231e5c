"""Transformer Engine's Flax (linen) modules: :class:`DenseGeneral`."""

from transformer_engine.jax import __version__
from transformer_engine.jax.flax.module import DenseGeneral

__all__ = ["__version__", "DenseGeneral"]
