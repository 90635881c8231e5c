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

from . import optimizers as optimizers  # te.optimizers, as NVIDIA's package has it
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
from .calibration import QuantizationCalibrationConfig
from .checkpoint import checkpoint
from .cpu_offload import get_cpu_offload_context, mark_not_offload
from .cross_entropy import parallel_cross_entropy
from .distributed import CudaRNGStatesTracker
from .float8_tensor import Float8Tensor
from .fp8 import autocast, fp8_autocast, fp8_model_init
from .graphs import make_graphed_callables
from .inference import InferenceParams
from .model_init import quantized_model_init
from .module import (
    AttentionBackend,
    DotProductAttention,
    Fp8Padding,
    Fp8Unpadding,
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
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from .tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    QuantizedTensor,
    Quantizer,
)

__version__ = "0.1.0"

__all__ = ["AttentionBackend", "CudaRNGStatesTracker", "DotProductAttention",
           "Float8BlockQuantizer", "Float8CurrentScalingQuantizer", "Float8Quantizer",
           "Float8Tensor", "Fp8Padding", "Fp8Unpadding", "GroupedLinear", "InferenceParams",
           "QuantizationCalibrationConfig", "QuantizedTensor", "Quantizer",
           "LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "MultiheadAttention",
           "RMSNorm", "RotaryPositionEmbedding", "TransformerLayer", "__version__",
           "apply_rotary_pos_emb", "autocast", "checkpoint", "fp8_autocast", "fp8_model_init",
           "get_attention_backend", "get_cpu_offload_context", "get_cudnn_version",
           "get_default_recipe", "get_device_compute_capability", "is_bf16_available",
           "is_fp8_available", "is_fp8_block_scaling_available", "is_mxfp8_available",
           "is_nvfp4_available",
           "make_graphed_callables", "mark_not_offload", "moe_permute",
           "moe_permute_and_pad_with_probs", "moe_permute_with_probs",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "moe_unpermute",
           "parallel_cross_entropy", "quantized_model_init"]

# NVIDIA TE's public names that this package does not provide, by what they stand for: asking
# for one raises an error that says so, instead of a bare AttributeError (te.ops does the same
# for NVIDIA's fusible operations).
_NOT_PROVIDED = {
    "initialize_ub": "userbuffers communication overlap",
    "destroy_ub": "userbuffers communication overlap",
    "UserBufferQuantizationMode": "userbuffers communication overlap",
    "ManualOffloadSynchronizer": "activation offloading to the CPU",
    "onnx_export": "ONNX export",
    "GatedDeltaNetAttention": "gated delta-net attention",
    "FusedMLAQUpProjFunction": "the fused multi-latent-attention projections",
    "FusedMLAQUpProjRopeQuant": "the fused multi-latent-attention projections",
    "MXFP8Quantizer": "MXFP8 (Blackwell) tensors",
    "MXFP8Tensor": "MXFP8 (Blackwell) tensors",
    "NVFP4Quantizer": "NVFP4 (FP4) tensors",
    "NVFP4Tensor": "NVFP4 (FP4) tensors",
}


class NotProvidedError(AttributeError, NotImplementedError):
    """An NVIDIA TE name this package does not provide: a NotImplementedError that says why,
    and an AttributeError, so that ``hasattr`` and ``getattr(te, name, default)`` feature
    checks keep working."""


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise NotProvidedError(
            f"transformer_engine.pytorch.{name} (NVIDIA Transformer Engine's) is not "
            f"provided here: {_NOT_PROVIDED[name]} is not implemented. See "
            "docs/nvidia_compat.md for what is.")
    raise AttributeError(f"module 'transformer_engine.pytorch' has no attribute {name!r}")
