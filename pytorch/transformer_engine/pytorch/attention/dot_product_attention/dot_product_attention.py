"""NVIDIA's path ``transformer_engine.pytorch.attention.dot_product_attention.
dot_product_attention`` (the implementation: ``module/attention.py``)."""

from ...module import DotProductAttention

__all__ = ["DotProductAttention"]
