"""``fuse_wgrad_accumulation``: the GEMM weights' gradients go into their ``main_grad`` buffers
(Megatron-LM's fp32 gradient buffers), NVIDIA TE's contract for them:

- each backward adds the weight's gradient to ``weight.main_grad`` (which the caller made);
- where the weight has the attribute ``grad_added_to_main_grad`` (Megatron's DDP sets it), it
  becomes True and autograd gets a dummy gradient of the weight's shape (zeros when the weight
  has ``zero_out_wgrad`` set, else uninitialized memory), which the caller ignores;
- without that attribute the weight gets no ``.grad`` at all.

Here the gradient is added by a hook on the weight when autograd hands it over, after the
weight-gradient GEMM wrote it (NVIDIA TE accumulates inside that GEMM): the same sums, one
gradient-sized buffer more for the moment of the addition. The hooks go on each weight
parameter once, at the module's first forward after the parameter was made (a parameter
made later, by deferred initialization or a tensor-parallel split, gets its own then).
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch

_MARK = "_te_main_grad_hooks"  # set on a parameter once its hooks are registered


def _to_main_grad(param: torch.nn.Parameter):
    ref = weakref.ref(param)

    def hook(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if grad is None:  # none this backward (delay_wgrad_compute: backward_dw adds it)
            return None
        p = ref()
        main = getattr(p, "main_grad", None)
        if not isinstance(main, torch.Tensor) or main.shape != grad.shape:
            raise RuntimeError(
                f"fuse_wgrad_accumulation: the weight of shape {list(grad.shape)} needs a "
                f"main_grad tensor of that shape to accumulate into (Megatron-LM's gradient "
                f"buffer), got {type(main).__name__ if main is None else list(main.shape)}")
        main.add_(grad)
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = True
            if getattr(p, "zero_out_wgrad", False):
                return torch.zeros(p.shape, dtype=grad.dtype, device=grad.device)
            return torch.empty(p.shape, dtype=grad.dtype, device=grad.device)
        return grad  # dropped after accumulation (_drop_grad)

    return hook


def _drop_grad(param: torch.nn.Parameter) -> None:
    # Without grad_added_to_main_grad the weight keeps no .grad (NVIDIA returns None for it).
    if not hasattr(param, "grad_added_to_main_grad"):
        param.grad = None


def route_to_main_grad(weights: Iterable) -> None:
    """Hooks each weight parameter (once) so that its gradients go into ``main_grad``."""
    for p in weights:
        if isinstance(p, torch.nn.Parameter) and p.requires_grad and not getattr(p, _MARK,
                                                                                  False):
            p.register_hook(_to_main_grad(p))
            p.register_post_accumulate_grad_hook(_drop_grad)
            setattr(p, _MARK, True)


def route_tree(module: torch.nn.Module) -> None:
    """:func:`route_to_main_grad` for the GEMM weights of ``module`` and of every module in
    it (the blocks of a te.MultiheadAttention or te.TransformerLayer)."""
    for m in module.modules():
        weights = getattr(m, "_gemm_weights", None)
        if weights is not None:
            route_to_main_grad(weights())

