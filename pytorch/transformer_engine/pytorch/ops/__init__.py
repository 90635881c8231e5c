"""The custom ops through which the PyTorch package reaches the core (``transformer_engine::``).

Each is a torch operator with a fake implementation (``_backend.custom_op``), so that
torch.compile traces it without running it, and takes the CUDA stream from torch, so that CUDA
graphs capture it.

The same namespace also answers NVIDIA's fusible-operation names (``te.ops.Sequential``,
``te.ops.Linear``, ...: ``fusible_ops.py``); NVIDIA's other operations raise an error that
names them.
"""

from .activation import (
    activation_backward,
    activation_backward_fp8,
    activation_backward_scale,
    activation_forward,
    activation_forward_fp8,
    activation_scale,
)
from .attention import (
    attention_backward,
    attention_backward_fp8,
    attention_backward_packed,
    attention_forward,
    attention_forward_fp8,
    scaled_softmax_backward,
    scaled_softmax_forward,
)
from .dropout import dropout_add_forward, dropout_backward
from .gemm import gemm_fp8, gemm_fp8_to_fp8, grouped_gemm, grouped_gemm_fp8
from .norm import norm_backward, norm_forward, norm_forward_fp8
from .quantize import (
    amax,
    current_scale,
    dequantize,
    quantize,
    quantize_block,
    quantize_current,
    quantize_current_many,
    quantize_delayed,
    quantize_delayed_many,
    transpose,
)
from .rope import rope_backward, rope_forward
from .scaling import delayed_scaling_update, first_step_scale

__all__ = ["activation_backward", "activation_backward_fp8", "activation_backward_scale",
           "activation_forward", "activation_forward_fp8", "activation_scale", "amax",
           "attention_backward", "attention_backward_fp8", "attention_backward_packed",
           "attention_forward", "attention_forward_fp8", "current_scale",
           "delayed_scaling_update", "dequantize", "dropout_add_forward", "dropout_backward",
           "first_step_scale", "gemm_fp8",
           "gemm_fp8_to_fp8", "grouped_gemm", "grouped_gemm_fp8",
           "norm_backward", "norm_forward", "norm_forward_fp8",
           "quantize", "quantize_block", "quantize_current", "quantize_delayed",
           "quantize_current_many", "quantize_delayed_many",
           "rope_backward", "rope_forward", "scaled_softmax_backward", "scaled_softmax_forward",
           "transpose"]


# NVIDIA's te.ops operations that have no counterpart here (fusible_ops.py has the others).
_NVIDIA_UNSUPPORTED = ("FusedOperation", "Quantize",
                       "AddExtraInput", "AddInPlace", "MakeExtraOutput", "AllGather",
                       "AllReduce", "ReduceScatter", "L2Normalization")


def __getattr__(name: str):
    from .. import fusible_ops

    if name in fusible_ops.NAMES:
        return getattr(fusible_ops, name)
    if name in _NVIDIA_UNSUPPORTED:
        raise NotImplementedError(
            f"te.ops.{name} (NVIDIA's fusible-operation API) is not implemented here; the "
            f"supported operations are {', '.join(fusible_ops.NAMES)}, or use the modules "
            "(te.Linear, te.LayerNormLinear, te.LayerNormMLP)")
    raise AttributeError(f"module 'transformer_engine.pytorch.ops' has no attribute {name!r}")
