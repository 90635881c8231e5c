"""NVIDIA's path ``transformer_engine.pytorch.module.rmsnorm`` (RMSNorm is defined beside
LayerNorm, in ``layernorm.py``: the two share their code)."""

from .layernorm import RMSNorm

__all__ = ["RMSNorm"]
