"""NVIDIA's path ``transformer_engine.pytorch.attention.multi_head_attention`` (the
implementation: ``module/multihead_attention.py``)."""

from ..module import MultiheadAttention

__all__ = ["MultiheadAttention"]
