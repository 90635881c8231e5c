"""NVIDIA's path ``transformer_engine.pytorch.graph`` (the implementation: ``graphs.py``)."""

from .graphs import make_graphed_callables

__all__ = ["make_graphed_callables"]
