"""NVIDIA's path ``transformer_engine.pytorch.graph`` (the implementation: ``graphs.py``)."""

from .graphs import (
                     is_graph_capturing,
                     make_graphed_callables,
                     restore_fp8_tensors,
                     save_fp8_tensors,
                     set_capture_end,
                     set_capture_start,
)

__all__ = ["is_graph_capturing", "make_graphed_callables", "restore_fp8_tensors",
           "save_fp8_tensors", "set_capture_end", "set_capture_start"]
