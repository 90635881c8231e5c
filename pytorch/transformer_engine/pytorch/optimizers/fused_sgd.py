"""``FusedSGD``: NVIDIA Transformer Engine's SGD with momentum (``te.optimizers.FusedSGD``).

NVIDIA's runs its own multi-tensor CUDA kernel; here each parameter group is updated by torch's
fused SGD kernel (``torch._fused_sgd_``, on CPU and CUDA) on float32 values, one call per device
and first-step-or-not, which computes what NVIDIA's kernel computes (torch.optim.SGD's update).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Optional

import torch
from torch.optim.optimizer import required

from ..float8_tensor import Float8Tensor
from .fused_adam import _checked_work, _closure_loss, _resolve_set_to_none

__all__ = ["FusedSGD"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedSGD(torch.optim.Optimizer):
    """SGD, optionally with momentum (Nesterov's too), as torch.optim.SGD computes it.

    NVIDIA TE's arguments, order and defaults. Per element, with ``g`` the gradient and ``b``
    the momentum buffer (``g`` itself on its first step, as in torch)::

        g = g + weight_decay * p                       (unless wd_after_momentum)
        b = momentum * b + (1 - dampening) * g;   g = g + momentum * b if nesterov else b
        g = g + weight_decay * p                       (wd_after_momentum only)
        p = p - lr * g

    Parameters may be float32, fp16 or bf16, updated in float32 and rounded back (the momentum
    buffer has the parameter's dtype, as in NVIDIA's); those without a gradient are left alone.
    (NVIDIA's leaves bf16 parameters out without a word; FP8 weights need master weights,
    which :class:`FusedAdam` keeps.)

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate (required, as in NVIDIA's).
        momentum, dampening, weight_decay, nesterov: as torch.optim.SGD.
        wd_after_momentum: add the weight decay after the momentum instead of before.
        materialize_master_grads: accepted for NVIDIA's signature; it only chooses how apex
            amp's float32 master gradients are made, and apex amp has no place here.
        set_grad_none: deprecated (use ``zero_grad(set_to_none=...)``).

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step()
    """

    def __init__(self, params: Iterable, lr: float = required, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 wd_after_momentum: bool = False, materialize_master_grads: bool = True,
                 set_grad_none: Optional[bool] = None):
        if lr is not required and lr < 0.0:
            raise ValueError(f"FusedSGD: lr must be >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"FusedSGD: momentum must be >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"FusedSGD: weight_decay must be >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0.0 or dampening != 0.0):
            raise ValueError(f"FusedSGD: nesterov=True needs momentum > 0 and dampening 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening,
                    "weight_decay": weight_decay, "nesterov": nesterov}
        super().__init__(params, defaults)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = set_grad_none
        if set_grad_none is not None:
            warnings.warn("FusedSGD: set_grad_none is deprecated; use zero_grad(set_to_none=...)",
                          DeprecationWarning, stacklevel=2)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Sets the gradients to None, or to zeros with ``set_to_none=False``."""
        set_to_none = _resolve_set_to_none("FusedSGD", self.set_grad_none, set_to_none)
        super().zero_grad(set_to_none=set_to_none)

    @staticmethod
    def _check(param: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise TypeError("FusedSGD: gradients must be dense, got a sparse gradient of "
                            f"shape {list(grad.shape)}")
        if isinstance(param, Float8Tensor) or param.dtype not in _PARAM_DTYPES:
            got = "an FP8 Float8Tensor" if isinstance(param, Float8Tensor) else param.dtype
            raise TypeError(f"FusedSGD: parameters must be torch.float32, torch.float16 or "
                            f"torch.bfloat16, got {got} of shape {list(param.shape)} (FP8 "
                            f"weights: FusedAdam with master_weights=True)")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient."""
        loss = _closure_loss(closure)
        work = _checked_work(self.param_groups, lambda p: p.grad, self._check)
        for group, items in zip(self.param_groups, work, strict=True):
            self._step_group(group, items)
        return loss

    def _step_group(self, group: dict, items: list) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        # The kernel runs on float32 values only: torch's CPU kernel leaves bf16 and fp16
        # tensors unchanged (torch 2.13), and NVIDIA's computes in float32 anyway.
        calls = {}  # (device, first step) -> (weights, grads, momentum buffers), float32
        after = []  # (tensor, its float32 values) where they are not the same tensor
        for p, g in items:
            state = self.state[p]
            first = momentum != 0.0 and "momentum_buffer" not in state
            if first:  # the kernel's first step copies the gradient into it
                state["momentum_buffer"] = torch.empty_like(p)
            weights, grads, buffers = calls.setdefault((p.device, first), ([], [], []))
            weights.append(p if p.dtype == torch.float32 else p.float())
            grads.append(g.float())
            after.append((p, weights[-1]))
            if momentum != 0.0:
                buffer = state["momentum_buffer"]
                buffers.append(buffer.float())
                after.append((buffer, buffers[-1]))
        for (_, first), (weights, grads, buffers) in calls.items():
            if self.wd_after_momentum and decay != 0.0:
                # p - lr * (d + decay * p) = p * (1 - lr * decay) - lr * d, d being what the
                # kernel makes of the gradient without weight decay.
                torch._foreach_mul_(weights, 1.0 - lr * decay)
            torch._fused_sgd_(weights, grads, buffers,
                              weight_decay=0.0 if self.wd_after_momentum else decay,
                              momentum=momentum, lr=lr, dampening=group["dampening"],
                              nesterov=group["nesterov"], maximize=False, is_first_step=first)
        copies = [(t, v) for t, v in after if v is not t]
        if copies:
            torch._foreach_copy_([t for t, _ in copies], [v for _, v in copies])
