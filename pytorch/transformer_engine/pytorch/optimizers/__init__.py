"""NVIDIA Transformer Engine's optimizers (``transformer_engine.pytorch.optimizers``):
:class:`FusedAdam` (Adam / AdamW with master weights and low-precision states, for FP8, bf16 and
fp16 models) and :class:`FusedSGD`, each updating a parameter group with torch's fused kernels;
and NVIDIA's multi-tensor entry points ``multi_tensor_applier``, ``multi_tensor_l2norm`` and
``multi_tensor_scale`` (multi_tensor.py), which Megatron-LM's gradient clipping and parameter
copies call.

Example (Megatron-LM's import):

>>> from transformer_engine.pytorch.optimizers import FusedAdam as Adam, FusedSGD as SGD
"""

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor import (
    MultiTensorApply,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
)

__all__ = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier",
           "multi_tensor_l2norm", "multi_tensor_scale"]
