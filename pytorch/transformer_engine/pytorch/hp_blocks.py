"""LayerNormLinear's and LayerNormMLP's high-precision step (outside fp8_autocast) as one
autograd node each.

Built from separate pieces (the norm's autograd function, F.linear, the activation's autograd
function, F.linear), a block's step is five to nine autograd nodes (F.linear alone adds the
addmm's, the transpose's and the reshapes'), each with its Python or engine overhead: on a
small layer that host time is most of the step (bench_host_profile.py). Here the forward makes
the same calls under no_grad, and the backward makes autograd's own calls for each piece, in
the order autograd would run them: for F.linear ``grad.mm(weight)``, ``grad.t().mm(x)`` and
``grad.sum(0)`` (its formulas for addmm/mm and the transpose, as _deferred_wgrad.py uses them),
for the norm and the activation their own backward ops. So every output and gradient has the
bits of the pieces (tests/pytorch/test_hp_blocks.py). As each piece's node would, the backward
lets go of what the forward made (the norm's output, FC1's output, the activation's output)
once its last reader has run (release.py), or one node would hold them all to its end and
its peak would be above the pieces' (tests/pytorch/test_saved_memory.py).

The modules take them where the block normalizes its own input (not a sequence-parallel
gather of norm outputs), with no deferred weight gradients, no norm output returned, not
calibrating, and plain tensors (``usable``). Everything else keeps the pieces.
``enabled = False`` turns them off (comparisons).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops
from .module.base import with_leading_dims
from .release import may_release, release

enabled = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def usable(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a block's high-precision step can run as one node: plain tensors (no subclass
    such as an FP8 weight; a weight cast to the input's dtype is a plain tensor whose cast
    autograd keeps outside the node)."""
    if not enabled:
        return False
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def linear_grads(ctx_needs: tuple, g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  has_bias: bool):
    """F.linear's gradients of input, weight and bias, by autograd's formulas ([M, N] g and
    [M, K] x): F.linear is addmm (mm without a bias) of x and weight.t(), a column-major
    operand, whose gradient autograd takes as ``(g.t() @ x).t()``, and the transpose's
    backward transposes it back."""
    need_x, need_w, need_b = ctx_needs
    grad_x = g.mm(weight) if need_x else None
    grad_w = g.t().mm(x) if need_w else None
    grad_b = g.sum(0) if has_bias and need_b else None
    return grad_x, grad_w, grad_b


class _LayerNormLinear(torch.autograd.Function):
    """``linear(norm(inp), weight, bias)`` over the last dimension of inp."""

    @staticmethod
    def forward(ctx, inp, gamma, beta, weight, bias, norm: str, eps: float, zero_centered: bool):
        x = _rows(inp)
        ln_out, mu, rsigma = ops.norm_forward(x, gamma, beta, norm, eps, zero_centered)
        out = torch.nn.functional.linear(ln_out, weight, bias)
        ctx.save_for_backward(x, mu, rsigma, gamma, ln_out, weight)
        ctx.norm, ctx.zero_centered = norm, zero_centered
        ctx.has_beta, ctx.has_bias = beta is not None, bias is not None
        ctx.shape = inp.shape
        return out  # [M, N]: the leading dimensions are given outside (with_leading_dims)

    @staticmethod
    def backward(ctx, grad_output):
        x, mu, rsigma, gamma, ln_out, weight = ctx.saved_tensors
        g = _rows(grad_output)
        needs = ctx.needs_input_grad
        d_ln, grad_w, grad_b = linear_grads(
            (any(needs[:3]), needs[3], needs[4]), g, ln_out, weight, ctx.has_bias)
        if may_release():
            release(ln_out)
        dx = dgamma = dbeta = None
        if d_ln is not None:
            dx, dgamma, dbeta = ops.norm_backward(d_ln.contiguous(), x, mu, rsigma, gamma,
                                                  ctx.norm, ctx.zero_centered)
            dx = dx.view(ctx.shape)
        return (dx, dgamma, dbeta if ctx.has_beta else None, grad_w, grad_b, None, None, None)


class _LayerNormMLP(torch.autograd.Function):
    """``linear(act(linear(norm(inp), w1, b1)), w2, b2)`` over the last dimension of inp."""

    @staticmethod
    def forward(ctx, inp, gamma, beta, w1, b1, w2, b2, norm: str, eps: float,
                zero_centered: bool, act: str):
        x = _rows(inp)
        ln_out, mu, rsigma = ops.norm_forward(x, gamma, beta, norm, eps, zero_centered)
        h = torch.nn.functional.linear(ln_out, w1, b1)
        a = ops.activation_forward(h, act)
        out = torch.nn.functional.linear(a, w2, b2)
        ctx.save_for_backward(x, mu, rsigma, gamma, ln_out, w1, h, a, w2)
        ctx.norm, ctx.zero_centered, ctx.act = norm, zero_centered, act
        ctx.has_beta, ctx.has_b1, ctx.has_b2 = beta is not None, b1 is not None, b2 is not None
        ctx.shape = inp.shape
        return out  # [M, N]: the leading dimensions are given outside (with_leading_dims)

    @staticmethod
    def backward(ctx, grad_output):
        x, mu, rsigma, gamma, ln_out, w1, h, a, w2 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        upstream = any(needs[:5])
        g = _rows(grad_output)
        free = may_release()
        d_a, grad_w2, grad_b2 = linear_grads((upstream, needs[5], needs[6]), g, a, w2,
                                              ctx.has_b2)
        if free:
            release(a)
        dx = dgamma = dbeta = grad_w1 = grad_b1 = None
        if d_a is not None:
            d_h, _ = ops.activation_backward(d_a.contiguous(), h, ctx.act, False)
            del d_a
            if free:
                release(h)
            d_ln, grad_w1, grad_b1 = linear_grads((any(needs[:3]), needs[3], needs[4]), d_h,
                                                   ln_out, w1, ctx.has_b1)
            del d_h
            if free:
                release(ln_out)
            if d_ln is not None:
                dx, dgamma, dbeta = ops.norm_backward(d_ln.contiguous(), x, mu, rsigma, gamma,
                                                      ctx.norm, ctx.zero_centered)
                dx = dx.view(ctx.shape)
        return (dx, dgamma, dbeta if ctx.has_beta else None, grad_w1, grad_b1, grad_w2,
                grad_b2, None, None, None, None)


def layernorm_linear(inp, gamma, beta, weight, bias, norm: str, eps: float,
                     zero_centered: bool) -> torch.Tensor:
    return with_leading_dims(
        _LayerNormLinear.apply(inp, gamma, beta, weight, bias, norm, eps, zero_centered), inp)


def layernorm_mlp(inp, gamma, beta, w1, b1, w2, b2, norm: str, eps: float, zero_centered: bool,
                  act: str) -> torch.Tensor:
    return with_leading_dims(
        _LayerNormMLP.apply(inp, gamma, beta, w1, b1, w2, b2, norm, eps, zero_centered, act),
        inp)
