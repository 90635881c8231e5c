"""NVIDIA's path ``transformer_engine.pytorch.attention.rope`` (the implementation: ``rope.py``)."""

from ..rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]
