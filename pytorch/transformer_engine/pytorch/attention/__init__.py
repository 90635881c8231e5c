"""NVIDIA Transformer Engine's module path for attention (``transformer_engine.pytorch.attention``
and its submodules): programs import the attention modules, RoPE and the KV cache from here.
The modules themselves live in ``module/`` (attention.py, multihead_attention.py), ``rope.py``
and ``inference.py``; these files only give them NVIDIA's paths."""

from ..inference import InferenceParams
from ..module import DotProductAttention, MultiheadAttention
from ..rope import RotaryPositionEmbedding

__all__ = ["DotProductAttention", "InferenceParams", "MultiheadAttention",
           "RotaryPositionEmbedding"]
