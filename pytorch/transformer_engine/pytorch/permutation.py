"""NVIDIA's path ``transformer_engine.pytorch.permutation`` (the implementation: ``moe.py``)."""

from .moe import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)

__all__ = ["moe_permute", "moe_permute_and_pad_with_probs", "moe_permute_with_probs",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "moe_unpermute"]
