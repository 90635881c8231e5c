"""``te.ops``' module API, for programs written against NVIDIA's fusible operations.

NVIDIA TE's ``transformer_engine.pytorch.ops`` holds composable operations (``Sequential``,
``Linear``, ``Bias``, norms, activations) that its ``Sequential`` may fuse. Here they are plain
modules over this package's: ``Linear`` is te.Linear (FP8 inside ``fp8_autocast``),
``GroupedLinear`` te.GroupedLinear, the norms are te.LayerNorm / te.RMSNorm, the activations
compute what the core's activations compute, in torch ops. ``Sequential`` runs them in order
and fuses a norm with the Linear after it (as te.LayerNormLinear computes them); other
neighbours are not fused (for the whole MLP block use te.LayerNormMLP). NVIDIA's operations
not listed in ``NAMES`` raise a NotImplementedError naming themselves (``ops/__init__.py``).
"""

from __future__ import annotations

import abc
from typing import Optional, Union

import torch
import torch.nn.functional as F

from .module._checks import refuse_non_defaults
from .module._deferred_init import DeferredInit
from .module.grouped_linear import GroupedLinear as _GroupedLinear
from .module.layernorm import LayerNorm as _LayerNorm
from .module.layernorm import RMSNorm as _RMSNorm
from .module.layernorm_mlp import apply_activation
from .module.linear import Linear as _Linear
from .ops.activation import clamped_swiglu

Device = Union[torch.device, str, None]


_NO_SPLIT = "te.Linear's tp_group / parallel_mode give tensor parallelism"


class FusibleOperation(torch.nn.Module, metaclass=abc.ABCMeta):
    """NVIDIA's base class of the operations, for ``isinstance`` checks and annotations: the
    operations below are registered as (virtual) subclasses of :class:`BasicOperation`. A
    class that derives from it is a module, which ``Sequential`` runs as it is (NVIDIA's
    operation-fusion interface of ``op_forward`` / ``op_backward`` is not implemented)."""


class BasicOperation(FusibleOperation):
    """NVIDIA's base class of a single (unfused) operation; see :class:`FusibleOperation`."""


class Sequential(torch.nn.Sequential):
    """Runs its operations in order, fusing a ``LayerNorm`` or ``RMSNorm`` with a ``Linear`` /
    ``BasicLinear`` right after it: inside an FP8 autocast the norm then writes the Linear's
    FP8 input in its own pass (te.LayerNormLinear's computation, its bits, with the two
    operations' parameters and the Linear's FP8 state). Other neighbours run one after the
    other. A fused pair runs without the two modules' own forward calls (their forward hooks
    do not fire).

    ``forward(x, *extra_inputs)``: an operation that takes inputs besides ``x`` (its
    ``num_extra_inputs``: a ``GroupedLinear``'s split sizes) takes the next ones in order, as
    NVIDIA's Sequential hands them out; there must be exactly as many as they take."""

    def forward(self, x, *extra_inputs):
        ops = list(self)
        wanted = sum(getattr(op, "num_extra_inputs", 0) for op in ops)
        if len(extra_inputs) != wanted:
            raise ValueError(f"te.ops.Sequential: its operations take {wanted} extra inputs "
                             f"(one split-size list per GroupedLinear), got {len(extra_inputs)}")
        extras = iter(extra_inputs)
        i = 0
        while i < len(ops):
            op = ops[i]
            if (isinstance(op, (LayerNorm, RMSNorm)) and i + 1 < len(ops)
                    and isinstance(ops[i + 1], Linear)):
                x = ops[i + 1]._forward_after_norm(x, op)
                i += 2
            else:
                taken = [next(extras) for _ in range(getattr(op, "num_extra_inputs", 0))]
                x = op(x, *taken)
                i += 1
        return x


class Linear(_Linear):
    """``y = x @ weight^T (+ bias)``: te.Linear under NVIDIA's te.ops keywords."""

    _name = "te.ops.Linear"

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 device: Device = None, dtype: Optional[torch.dtype] = None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None,
                 sequence_parallel: bool = False, rng_state_tracker_function=None,
                 accumulate_into_main_grad: bool = False, userbuffers_options=None) -> None:
        refuse_non_defaults("te.ops.Linear", "userbuffers communication overlap is not "
                            "implemented", userbuffers_options=(userbuffers_options, None))
        refuse_non_defaults(
            "te.ops.Linear", _NO_SPLIT, tensor_parallel_mode=(tensor_parallel_mode, None),
            tensor_parallel_group=(tensor_parallel_group, None),
            sequence_parallel=(sequence_parallel, False),
            rng_state_tracker_function=(rng_state_tracker_function, None),
            accumulate_into_main_grad=(accumulate_into_main_grad, False))
        super().__init__(in_features, out_features, bias=bias, params_dtype=dtype, device=device)


class BasicLinear(Linear):
    """``y = x @ weight^T``: the Linear without a bias."""

    _name = "te.ops.BasicLinear"

    def __init__(self, in_features: int, out_features: int, *, device: Device = None,
                 dtype: Optional[torch.dtype] = None, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype,
                         **kwargs)


class GroupedLinear(_GroupedLinear):
    """``y_i = x_i @ weight_i^T (+ bias_i)`` over consecutive row groups of ``x``:
    te.GroupedLinear (FP8 inside ``fp8_autocast``; NVIDIA's ``weight{i}`` / ``bias{i}``
    names) under NVIDIA's te.ops keywords. ``forward(x, split_sizes)``, in a ``Sequential``
    the next extra input: the rows of each group, a list of ints or a 1-D integer tensor. A
    tensor is read on the host (``tolist()``): on a GPU that waits for the device, where
    NVIDIA's operation keeps the sizes on the device."""

    _name = "te.ops.GroupedLinear"
    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *,
                 bias: bool = True, device: Device = None, dtype: Optional[torch.dtype] = None,
                 rng_state_tracker_function=None, accumulate_into_main_grad: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False,
                 delay_wgrad_compute: bool = False, scale_bias: bool = False) -> None:
        op = self._name
        refuse_non_defaults(op, "the groups' weights and biases are separate parameters here",
                            single_grouped_weight=(single_grouped_weight, False),
                            single_grouped_bias=(single_grouped_bias, False))
        refuse_non_defaults(op, "the bias is added unscaled here (te.moe_unpermute applies "
                            "the routing probabilities)", scale_bias=(scale_bias, False))
        refuse_non_defaults(op, "use te.GroupedLinear(fuse_wgrad_accumulation=True, "
                            "get_rng_state_tracker=...) for these",
                            rng_state_tracker_function=(rng_state_tracker_function, None),
                            accumulate_into_main_grad=(accumulate_into_main_grad, False))
        super().__init__(num_groups, in_features, out_features, bias=bias, params_dtype=dtype,
                         device=device, delay_wgrad_compute=delay_wgrad_compute)
        self.num_groups = self.num_gemms  # (NVIDIA's attribute)

    def forward(self, x: torch.Tensor, split_sizes) -> torch.Tensor:
        if isinstance(split_sizes, torch.Tensor):
            if (split_sizes.dim() != 1 or split_sizes.is_floating_point()
                    or split_sizes.is_complex()):
                raise TypeError(f"{self._name}: split_sizes must be a 1-D integer tensor or a "
                                f"list of ints, got a {split_sizes.dim()}-D {split_sizes.dtype} "
                                "tensor")
            split_sizes = split_sizes.tolist()
        return super().forward(x, split_sizes)


class Bias(DeferredInit, torch.nn.Module):
    """``y = x + bias`` over the last dimension (``bias`` [size], zeros at init)."""

    def __init__(self, size: int, *, device: Device = None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel: bool = False,
                 tensor_parallel_group=None) -> None:
        super().__init__()
        refuse_non_defaults("te.ops.Bias", _NO_SPLIT, tensor_parallel=(tensor_parallel, False),
                            tensor_parallel_group=(tensor_parallel_group, None))
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"te.ops.Bias: size must be a positive int, got {size!r}")
        device = torch.device("cuda" if device is None and torch.cuda.is_available()
                              else device or "cpu")
        self.bias = torch.nn.Parameter(torch.zeros(size, device=device,
                                                   dtype=dtype or torch.get_default_dtype()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.bias.shape[0]:
            raise ValueError(f"te.ops.Bias: input's last dimension must be "
                             f"{self.bias.shape[0]}, got shape {list(x.shape)}")
        return x + self.bias.to(x.dtype)


class _NormKeywords:
    """NVIDIA's te.ops keyword-only signature over te.LayerNorm / te.RMSNorm's."""

    def __init__(self, normalized_shape, *, eps: float = 1e-5, device: Device = None,
                 dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 sm_margin: int = 0) -> None:
        super().__init__(normalized_shape, eps, zero_centered_gamma=zero_centered_gamma,
                         device=device, dtype=dtype, sm_margin=sm_margin)


class LayerNorm(_NormKeywords, _LayerNorm):
    """te.LayerNorm under NVIDIA's te.ops keywords."""

    _name = "te.ops.LayerNorm"


class RMSNorm(_NormKeywords, _RMSNorm):
    """te.RMSNorm under NVIDIA's te.ops keywords."""

    _name = "te.ops.RMSNorm"


class Identity(torch.nn.Identity):
    """``y = x``."""


class Reshape(torch.nn.Module):
    """``y = x.reshape(shape)``."""

    def __init__(self, shape) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(self.shape)


class ConstantScale(torch.nn.Module):
    """``y = scale * x``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Dropout(torch.nn.Dropout):
    """Dropout with probability ``p`` (training only)."""

    def __init__(self, p: float) -> None:
        super().__init__(p)


# The activations, as the core defines them (activation.h): GELU is the tanh approximation,
# QGELU x * sigmoid(1.702 x), SReLU relu(x)^2; a gated one (GLU) activates the first half of
# the last dimension and multiplies by the second.
def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.relu(x).square()


class _Activation(torch.nn.Module):
    fn = staticmethod(torch.relu)
    gated = False

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        refuse_non_defaults(f"te.ops.{type(self).__name__}", "the activation keeps no "
                            "quantized copy of its input",
                            cache_quantized_input=(cache_quantized_input, False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return type(self).fn(x)
        if x.shape[-1] % 2:
            raise ValueError(f"te.ops.{type(self).__name__}: a gated activation needs an even "
                             f"last dimension, got shape {list(x.shape)}")
        a, b = x.chunk(2, dim=-1)
        return type(self).fn(a) * b


class GELU(_Activation):
    fn = staticmethod(_gelu)


class QGELU(_Activation):
    fn = staticmethod(_qgelu)


class ReLU(_Activation):
    fn = staticmethod(torch.relu)


class SReLU(_Activation):
    fn = staticmethod(_srelu)


class SiLU(_Activation):
    fn = staticmethod(F.silu)


class GEGLU(_Activation):
    fn, gated = staticmethod(_gelu), True


class QGEGLU(_Activation):
    fn, gated = staticmethod(_qgelu), True


class ReGLU(_Activation):
    fn, gated = staticmethod(torch.relu), True


class SReGLU(_Activation):
    fn, gated = staticmethod(_srelu), True


class SwiGLU(_Activation):
    fn, gated = staticmethod(F.silu), True


class ClampedSwiGLU(torch.nn.Module):
    """SwiGLU with both halves clamped (GPT-OSS's): ``g sigmoid(alpha g) * (u + 1)`` with
    ``g = min(a, limit)``, ``u = clamp(b, -limit, limit)`` over the [a, b] halves of the last
    dimension; the core's kernel, as te.LayerNormMLP(activation="clamped_swiglu") runs it."""

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702,
                 cache_quantized_input: bool = False) -> None:
        super().__init__()
        refuse_non_defaults("te.ops.ClampedSwiGLU", "the activation keeps no quantized copy "
                            "of its input", cache_quantized_input=(cache_quantized_input, False))
        try:
            self._act = clamped_swiglu(limit, alpha)
        except ValueError as e:
            raise ValueError(f"te.ops.ClampedSwiGLU: {e}") from None
        self.limit, self.alpha = float(limit), float(alpha)

    def extra_repr(self) -> str:
        return f"limit={self.limit}, alpha={self.alpha}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"te.ops.ClampedSwiGLU: a gated activation needs an even last "
                             f"dimension, got shape {list(x.shape)}")
        return apply_activation(x, self._act)


NAMES = ("Sequential", "FusibleOperation", "BasicOperation", "Linear", "BasicLinear",
         "GroupedLinear", "Bias", "LayerNorm", "RMSNorm", "Identity", "Reshape", "ConstantScale",
         "Dropout", "GELU", "QGELU", "ReLU", "SReLU", "SiLU", "GEGLU", "QGEGLU", "ReGLU",
         "SReGLU", "SwiGLU", "ClampedSwiGLU")

for _op in (Linear, GroupedLinear, Bias, LayerNorm, RMSNorm, Identity, Reshape, ConstantScale,
            Dropout, _Activation, ClampedSwiGLU):
    BasicOperation.register(_op)
