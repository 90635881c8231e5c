"""NVIDIA's path ``transformer_engine.pytorch.attention.inference`` (the implementation:
``inference.py``)."""

from ..inference import InferenceParams

__all__ = ["InferenceParams"]
