"""``residual + dropout(x)`` as one autograd node over the core's fused op (ops/dropout.py):
one pass over x and the residual forward, one over the gradient backward, and no mask saved
between them (the backward recomputes it from the rng state, a pure function of (seed,
offset) and each element's index). The rng state comes from torch's generator of x's device,
so ``torch.manual_seed`` reproduces it."""

from __future__ import annotations

import torch

from . import ops

__all__ = ["dropout_add", "fuses", "rng_state"]


class _DropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, rng, p):
        ctx.save_for_backward(rng)
        ctx.p = p
        return ops.dropout_add_forward(x, residual, rng, p)

    @staticmethod
    def backward(ctx, dy):
        (rng,) = ctx.saved_tensors
        return ops.dropout_backward(dy, rng, ctx.p), dy, None, None


def fuses(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether dropout_add takes these: one shape, one floating dtype, one device (else the
    caller adds with broadcasting or promotion as torch would)."""
    return (x.shape == residual.shape and x.dtype == residual.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.device == residual.device)


def rng_state(device: torch.device) -> torch.Tensor:
    """A fresh (seed, offset) for the core's dropout, here and in attention: drawn from torch's
    generator of ``device``, so ``torch.manual_seed`` reproduces it, and every caller that
    must draw the same masks as another draws it the same way."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float) -> torch.Tensor:
    """residual + dropout(x, p) in training (see fuses() for what it takes)."""
    return _DropoutAdd.apply(x, residual, rng_state(x.device), float(p))
