"""NVIDIA Transformer Engine's optimizers (``transformer_engine.pytorch.optimizers``):
:class:`FusedAdam` (Adam / AdamW with master weights and low-precision states, for FP8, bf16 and
fp16 models) and :class:`FusedSGD`, each updating a parameter group with torch's fused kernels.

Example (Megatron-LM's import):

>>> from transformer_engine.pytorch.optimizers import FusedAdam as Adam, FusedSGD as SGD
"""

from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
