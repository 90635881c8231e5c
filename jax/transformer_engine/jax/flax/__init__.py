"""Transformer Engine's Flax (linen) modules."""

from transformer_engine.jax import __version__

__all__ = ["__version__"]
