"""``te.LayerNorm`` and ``te.RMSNorm``: normalization over the last dimension by the core's
norm kernels (statistics in fp32, one fixed summation order on the CPU and CUDA; norm.h).

Both run in high precision inside and outside ``fp8_autocast``: the output has the input's
dtype. The parameters may be float32 or the input's dtype as they are; any other dtype is cast
to the input's for the kernels (autograd casts the gradient back).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import ops
from ._checks import check_device, check_sizes
from .base import with_leading_dims
from .linear import _default_device

__all__ = ["LayerNorm", "RMSNorm"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _NormFunction(torch.autograd.Function):
    """``y = norm(input) * g (+ beta)`` over the last dimension of ``input`` (any rank), as the
    matrix [M, N] (apply it through :func:`apply_norm`); saves the input (as that matrix), mu,
    rsigma and the weight for the backward."""

    @staticmethod
    def forward(ctx, inp, weight, bias, norm: str, eps: float, zero_centered_gamma: bool):
        x = inp.reshape(-1, inp.shape[-1])
        y, mu, rsigma = ops.norm_forward(x, weight, bias, norm, eps, zero_centered_gamma)
        ctx.save_for_backward(x, mu, rsigma, weight)
        ctx.norm, ctx.zero_centered_gamma = norm, zero_centered_gamma
        ctx.has_bias = bias is not None
        ctx.input_shape = inp.shape
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, mu, rsigma, weight = ctx.saved_tensors
        dy = grad_output.reshape(x.shape).to(x.dtype).contiguous()
        dx, dgamma, dbeta = ops.norm_backward(dy, x, mu, rsigma, weight, ctx.norm,
                                              ctx.zero_centered_gamma)
        return (dx.view(ctx.input_shape), dgamma, dbeta if ctx.has_bias else None,
                None, None, None)


def apply_norm(inp, weight, bias, kind: str, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """The norm of ``inp`` over its last dimension, in inp's shape (see with_leading_dims)."""
    return with_leading_dims(
        _NormFunction.apply(inp, weight, bias, kind, eps, zero_centered_gamma), inp)


class _Norm(torch.nn.Module):
    _norm = ""
    _name = ""

    def __init__(self, hidden_size: int, eps: float, zero_centered_gamma: bool,
                 params_dtype: Optional[torch.dtype], device, sequence_parallel: bool,
                 bias: bool) -> None:
        super().__init__()
        check_sizes(self._name, hidden_size=hidden_size)
        if eps < 0:
            raise ValueError(f"{self._name}: eps must be >= 0, got {eps}")
        dtype = params_dtype or torch.get_default_dtype()
        if dtype not in _DTYPES:
            raise TypeError(f"{self._name}: params_dtype must be float32, bfloat16 or float16, "
                            f"got {dtype}")
        device = _default_device(device)
        self.hidden_size, self.eps = int(hidden_size), float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype, device=device))
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(self.hidden_size, dtype=dtype,
                                                       device=device))
        else:
            self.register_parameter("bias", None)
        for p in self.parameters():
            # With sequence parallelism every rank sees a slice of the tokens: the gradients of
            # these replicated parameters must be summed over the group by whoever drives it.
            p.sequence_parallel = self.sequence_parallel
        self.reset_parameters()

    def reset_parameters(self, defer_init: bool = False) -> None:
        """weight = 1 (0 with zero_centered_gamma, which stores g - 1), bias = 0
        (``defer_init=True``: nothing, NVIDIA's argument for a later call)."""
        if defer_init:
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, "
                f"zero_centered_gamma={self.zero_centered_gamma}")

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """``inp`` [..., hidden_size] -> the same shape and dtype, normalized over the last
        dimension."""
        if inp.dim() == 0 or inp.shape[-1] != self.hidden_size:
            raise ValueError(f"{self._name}: input must have hidden_size={self.hidden_size} "
                             f"as its last dimension, got shape {list(inp.shape)}")
        if inp.dtype not in _DTYPES:
            raise TypeError(f"{self._name}: input must be float32, bfloat16 or float16, got "
                            f"{inp.dtype}")
        weight, bias = self.weight, self.bias
        check_device(self._name, "input", inp, weight)
        if weight.dtype not in (inp.dtype, torch.float32):
            weight = weight.to(inp.dtype)
            bias = None if bias is None else bias.to(inp.dtype)
        return apply_norm(inp, weight, bias, self._norm, self.eps, self.zero_centered_gamma)


def _size_of(op: str, normalized_shape, hidden_size) -> int:
    """The normalized size from NVIDIA's ``normalized_shape`` (an int or a 1-element
    tuple/list, as torch.nn.LayerNorm takes it) or its older name ``hidden_size``; the size
    itself is checked, as ``hidden_size``, by _Norm."""
    if normalized_shape is None and hidden_size is None:
        raise TypeError(f"{op}: give normalized_shape (or its older name hidden_size)")
    size = hidden_size
    if normalized_shape is not None:
        shape = normalized_shape
        if isinstance(shape, (tuple, list)):
            if len(shape) != 1:
                raise ValueError(f"{op}: normalized_shape must be an int or a 1-element "
                                 f"tuple/list (normalization over the last dimension only), "
                                 f"got {normalized_shape!r}")
            (shape,) = shape
        if hidden_size is not None and hidden_size != shape:
            raise ValueError(f"{op}: normalized_shape ({normalized_shape!r}) and hidden_size "
                             f"({hidden_size!r}) name the same size and must agree; give one")
        size = shape
    return size


def _dtype_of(op: str, params_dtype, dtype):
    """NVIDIA's ``dtype`` keyword is ``params_dtype``'s newer name."""
    if params_dtype is not None and dtype is not None and params_dtype != dtype:
        raise ValueError(f"{op}: params_dtype ({params_dtype}) and dtype ({dtype}) name the "
                         f"same thing and must agree; give one")
    return dtype if dtype is not None else params_dtype


def _check_sm_margin(name: str, sm_margin) -> None:
    """NVIDIA's sm_margin (SMs left free for overlapped communication) is accepted: the core's
    norm kernels size their grid themselves, so it changes nothing here, numbers included."""
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"{name}: sm_margin must be an int >= 0, got {sm_margin!r}")


class LayerNorm(_Norm):
    """``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dimension,
    like ``torch.nn.LayerNorm(normalized_shape, eps)``.

    Args (NVIDIA Transformer Engine's, in its order):
        normalized_shape: size of the last dimension, normalized over: an int or a
            1-element tuple/list (other shapes raise).
        eps: added to the variance.
        sequence_parallel: marks the parameters (``param.sequence_parallel``) for a caller
            that sums their gradients over a sequence-parallel group; the module itself
            computes on the tokens it is given.
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``);
            ``dtype`` is its newer name.
        zero_centered_gamma: ``weight`` holds ``gamma - 1`` (initialized to 0), so the scale
            is ``1 + weight``: better precision near 1 in low-precision parameters.
        hidden_size: the older name of ``normalized_shape`` (an int).
        device: where the parameters live (default: the current CUDA device when there is
            one, else the CPU).
    """

    _norm, _name = "layernorm", "te.LayerNorm"

    def __init__(self, normalized_shape: Union[int, tuple, list, None] = None,
                 eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, *,
                 device: Union[torch.device, str, None] = None,
                 dtype: Optional[torch.dtype] = None, sm_margin: int = 0) -> None:
        _check_sm_margin(self._name, sm_margin)
        super().__init__(_size_of(self._name, normalized_shape, hidden_size), eps,
                         zero_centered_gamma, _dtype_of(self._name, params_dtype, dtype), device,
                         bool(sequence_parallel), bias=True)


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, like
    ``torch.nn.RMSNorm(normalized_shape, eps)``; the arguments are those of :class:`LayerNorm`
    (there is no bias)."""

    _norm, _name = "rmsnorm", "te.RMSNorm"

    def __init__(self, normalized_shape: Union[int, tuple, list, None] = None,
                 eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, *,
                 device: Union[torch.device, str, None] = None,
                 dtype: Optional[torch.dtype] = None, sm_margin: int = 0) -> None:
        _check_sm_margin(self._name, sm_margin)
        super().__init__(_size_of(self._name, normalized_shape, hidden_size), eps,
                         zero_centered_gamma, _dtype_of(self._name, params_dtype, dtype), device,
                         bool(sequence_parallel), bias=False)
