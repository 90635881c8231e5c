"""Dropout fused with the residual addition after it, as custom ops
(``transformer_engine::dropout_add_forward`` / ``dropout_backward``) over the core's
``te_dropout_add_forward`` / ``te_dropout_backward``.

``y = residual + dropout(x)``: which elements drop is a pure function of ``rng_state`` (int64
[2]: seed, offset, on x's device) and each element's index, so the backward recomputes the
mask instead of saving it, and the CPU and CUDA paths agree bit for bit (``dropout.h``).
Functional, with fake implementations for tracing.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import core, custom_op, raw, stream_of

_NS = "transformer_engine"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(op: str, x: torch.Tensor, p: float) -> None:
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: p must be in [0, 1), got {p}")


@custom_op(f"{_NS}::dropout_add_forward", mutates_args=())
def dropout_add_forward(x: torch.Tensor, residual: Optional[torch.Tensor], rng_state: torch.Tensor,
                        p: float) -> torch.Tensor:
    """residual + dropout(x) (dropout(x) without a residual)."""
    _check("dropout_add_forward", x, p)
    x, rng_state = x.contiguous(), rng_state.contiguous()
    if residual is not None:
        residual = residual.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    core().dropout_add_forward(p, raw(x), None if residual is None else raw(residual),
                               raw(rng_state), raw(y), stream=stream_of(x))
    return y


@dropout_add_forward.register_fake
def _(x, residual, rng_state, p):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op(f"{_NS}::dropout_backward", mutates_args=())
def dropout_backward(dy: torch.Tensor, rng_state: torch.Tensor, p: float) -> torch.Tensor:
    """The gradient of dropout(x) for the forward with this p and rng_state."""
    _check("dropout_backward", dy, p)
    dy, rng_state = dy.contiguous(), rng_state.contiguous()
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    core().dropout_backward(p, raw(dy), raw(rng_state), raw(dx), stream=stream_of(dy))
    return dx


@dropout_backward.register_fake
def _(dy, rng_state, p):
    return torch.empty_like(dy, memory_format=torch.contiguous_format)
