"""``delay_wgrad_compute``: a layer's backward computes the input's (and bias's) gradient and
puts its weight-gradient GEMM aside; the module's ``backward_dw()`` runs what was put aside,
oldest first, and adds each result to the weight's gradient (NVIDIA TE's contract, which
Megatron-LM's schedules use to overlap the weight GEMMs with communication).

What is put aside is a closure over the GEMM's operands as the backward made them: for an FP8
layer the FP8 column-wise grad_output and input (so the gradient has the bits it would have had
in the backward), for a high-precision one grad_output and the input. The closures hold those
operands until ``backward_dw()`` runs. A module keeps them in ``_wgrad_store`` (a list).

The modules with the switch: te.Linear, te.LayerNormLinear and te.LayerNormMLP (one list
per weight) here, te.GroupedLinear with its own grouped store.
"""

from __future__ import annotations

from typing import Optional

import torch


def add_weight_grad(weight: torch.Tensor, grad: torch.Tensor, fuse_wgrad_accumulation: bool):
    """Adds a weight's gradient computed outside autograd: to ``main_grad`` under
    fuse_wgrad_accumulation (module/_main_grad.py's contract), else to ``.grad``."""
    if not weight.requires_grad:
        return
    if fuse_wgrad_accumulation:
        weight.main_grad.add_(grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
    elif weight.grad is None:
        weight.grad = grad.to(weight.dtype).clone()
    else:
        weight.grad.add_(grad.to(weight.grad.dtype))


def run_store(store: list, weights: list, fuse_wgrad_accumulation: bool) -> None:
    """backward_dw() of a te.Linear / te.LayerNormLinear: each put-aside GEMM's gradient [N, K]
    added to the weights, split by rows where the layer keeps its weight as several parameters
    (parameters_split)."""
    while store:
        grad = store.pop(0)()
        rows = [w.shape[0] for w in weights]
        for weight, part in zip(weights, torch.split(grad, rows), strict=True):
            add_weight_grad(weight, part, fuse_wgrad_accumulation)


class DeferredWgradLinear(torch.autograd.Function):
    """``x @ weight^T (+ bias)`` in x's dtype whose backward computes the input's and bias's
    gradients and puts the weight's on ``store`` (the high-precision path of a layer with
    delay_wgrad_compute). The gradients are autograd's formulas for F.linear, in its order,
    so ``backward_dw()`` gives the bits autograd would have."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: list):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.has_bias = store, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        g = grad_output.reshape(-1, grad_output.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        if ctx.needs_input_grad[1]:
            # autograd's: the gradient of weight.t(), a column-major operand of addmm, is
            # (g.t() @ x).t(), and the transpose's backward transposes it back
            ctx.store.append(lambda: g.t().mm(x2))
        grad_x = g.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           store: Optional[list]) -> torch.Tensor:
    """F.linear, its weight gradient put on ``store`` where one is given."""
    if store is None:
        return torch.nn.functional.linear(x, weight, bias)
    return DeferredWgradLinear.apply(x, weight, bias, store)
