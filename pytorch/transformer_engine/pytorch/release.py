"""Freeing what a fused backward saved as soon as its last reader has run.

A fused block is one autograd node (the MLP: norm, two GEMMs and the activation), and torch
frees a node's saved tensors only when its backward returns. Unfused, each op is a node of its
own whose inputs go as soon as it has run, so a fused backward that kept everything to its end
would hold, at its peak, the tensors of every step behind it (FC2's saved FP8 input while FC1's
gradient is made, ...): in an MLP that is more than FP8 saves over bf16. So the fused
backwards free each tensor that the node itself made (FP8 copies, the activation's input) once
they are done with it; never an input of the block or a tensor someone else may hold (a cached
FP8 weight, a Float8Tensor parameter's transpose).

Freeing means pointing the tensor at an empty storage (``t.data = empty``): the node's saved
variable holds that very tensor, so its memory goes now, whatever still refers to it. That is
only right when nothing reads it again: not when the graph is kept (``retain_graph``,
``create_graph``: a second backward reads the same saved tensors), and not under
torch.compile, whose traced backward frees its buffers by itself.
"""

from __future__ import annotations

import torch

_keep_graph = torch._C._autograd._get_current_graph_task_keep_graph
# device index (-1: CPU) -> an empty tensor the freed ones point at (one per device, so that
# freeing allocates nothing)
_EMPTY: dict[int, torch.Tensor] = {}


def may_release() -> bool:
    """Whether the running backward may free its node's own saved tensors (see the module
    docstring); asked once per backward."""
    return not torch.compiler.is_compiling() and not _keep_graph()


def release(*tensors) -> None:
    """Frees the memory of each tensor (None and empty ones are skipped): it becomes an empty
    tensor. Only for tensors that nothing else holds or will read; see may_release."""
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        device = t.get_device()
        empty = _EMPTY.get(device)
        if empty is None:
            empty = _EMPTY[device] = t.new_empty(0)
        t.data = empty
