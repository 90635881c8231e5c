"""Transformer Engine for PyTorch: FP8 linear layers, autocast and the FP8 tensor.

Example (the seed example; on a machine without a GPU use device="cpu"):

>>> import torch  # doctest: +SKIP
>>> import transformer_engine.pytorch as te  # doctest: +SKIP
>>> from transformer_engine.common import recipe  # doctest: +SKIP
>>> model = te.Linear(768, 3072, bias=True)  # doctest: +SKIP
>>> inp = torch.randn(2048, 768, device="cuda")  # doctest: +SKIP
>>> with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):  # doctest: +SKIP
...     out = model(inp)
>>> out.sum().backward()  # doctest: +SKIP
"""

from .availability import (
    get_cudnn_version,
    get_default_recipe,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from .checkpoint import checkpoint
from .float8_tensor import Float8Tensor
from .fp8 import autocast, fp8_autocast, fp8_model_init
from .graphs import make_graphed_callables
from .inference import InferenceParams
from .model_init import quantized_model_init
from .module import (
    AttentionBackend,
    DotProductAttention,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    MultiheadAttention,
    RMSNorm,
    TransformerLayer,
    get_attention_backend,
)
from .moe import (
    moe_permute,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__version__ = "0.1.0"

__all__ = ["AttentionBackend", "DotProductAttention", "Float8Tensor", "GroupedLinear",
           "InferenceParams",
           "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "MultiheadAttention",
           "RMSNorm", "RotaryPositionEmbedding", "TransformerLayer", "__version__",
           "apply_rotary_pos_emb", "autocast", "checkpoint", "fp8_autocast", "fp8_model_init",
           "get_attention_backend", "get_cudnn_version", "get_default_recipe",
           "get_device_compute_capability", "is_bf16_available", "is_fp8_available",
           "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available",
           "make_graphed_callables", "moe_permute", "moe_permute_with_probs",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "moe_unpermute",
           "quantized_model_init"]
