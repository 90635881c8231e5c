"""NVIDIA's path ``transformer_engine.pytorch.transformer`` (the implementation:
``module/transformer_layer.py``)."""

from .module import TransformerLayer

__all__ = ["TransformerLayer"]
