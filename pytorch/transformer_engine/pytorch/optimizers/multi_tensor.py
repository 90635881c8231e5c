"""NVIDIA's multi-tensor entry points (``transformer_engine.pytorch.optimizers``), as Megatron-LM
calls them for gradient clipping and for copies between model and main parameters:

    multi_tensor_applier(multi_tensor_l2norm, noop_flag, [grads], False)  # -> (norm, per_tensor)
    multi_tensor_applier(multi_tensor_scale, noop_flag, [src, dst], scale)

Each op takes NVIDIA's arguments ``(chunk_size, noop_flag, tensor_lists, *args)``: ``noop_flag``
is an int tensor [1] that the op sets to 1 when it meets a non-finite value and never reads or
clears; ``chunk_size`` is how NVIDIA's kernels cut the tensors into blocks, which changes no
value and is unused here. They run over torch's foreach kernels (few launches for many tensors
on CUDA) and read nothing back on the host, so they do not synchronize with the device.
"""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed
    _DTensor = ()

__all__ = ["MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm", "multi_tensor_scale"]


class MultiTensorApply:
    """``multi_tensor_applier(op, noop_flag, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag, tensor_lists, *args)``, first replacing each DTensor in
    ``tensor_lists`` (in place, as NVIDIA's does) by its local shard."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer: torch.Tensor, tensor_lists: list, *args):
        for tensors in tensor_lists:
            for i, t in enumerate(tensors):
                if isinstance(t, _DTensor):
                    tensors[i] = t.to_local()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)  # NVIDIA's chunk size


def _flag_if(noop_flag: torch.Tensor, non_finite: torch.Tensor) -> None:
    noop_flag.masked_fill_(non_finite.to(noop_flag.device), 1)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list,
                        per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all of ``tensor_lists[0]`` together, float32 [1], and, with
    ``per_tensor``, each tensor's, float32 [n] (else an empty float32 tensor). Squares are summed
    in float32, as NVIDIA's kernel does; ``noop_flag`` is set to 1 when the norm is not finite.
    An empty list gives norm 0 on noop_flag's device (NVIDIA's kernel does not take one)."""
    del chunk_size  # NVIDIA's kernel blocks; the values do not depend on it
    tensors = tensor_lists[0]
    if not tensors:
        zero = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)
        return zero, torch.zeros(0, dtype=torch.float32, device=noop_flag.device)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    _flag_if(noop_flag, ~torch.isfinite(total))
    return total, norms if per_tensor else norms.new_zeros(0)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list,
                       scale: float) -> None:
    """``tensor_lists[1][i] = tensor_lists[0][i] * scale`` (the two lists may be the same:
    in place): the float32 product (float64 for float64 tensors) rounded once to the output's
    dtype, as NVIDIA's kernel gives it. ``noop_flag`` is set
    to 1 when an input holds an inf or NaN (not when a finite product overflows); the outputs
    are written anyway, as NVIDIA's are. A scale of 1.0 is a copy (Megatron-LM's copies between
    model and main parameters)."""
    del chunk_size  # NVIDIA's kernel blocks; the values do not depend on it
    src, dst = tensor_lists[0], tensor_lists[1]
    if len(src) != len(dst):
        raise ValueError(f"multi_tensor_scale: tensor_lists[0] and [1] must have one tensor "
                         f"each per pair, got {len(src)} and {len(dst)}")
    if not src:
        return
    # max |x| is inf or NaN exactly when x holds one (it cannot overflow, a sum of squares can)
    # (the inf norm of an empty tensor is undefined: skip those)
    filled = [t for t in src if t.numel() > 0]
    if filled:
        maxima = torch.stack(torch._foreach_norm(filled, float("inf")))
        _flag_if(noop_flag, ~torch.isfinite(maxima).all())
    if scale == 1.0:  # a copy
        copies = [(s, d) for s, d in zip(src, dst, strict=True) if s is not d]
        if copies:
            torch._foreach_copy_([d for _, d in copies], [s for s, _ in copies])
        return
    # The products in float32 (float64 for float64 inputs), the scale a Python float over
    # float32 tensors: one float32 multiply on every device, then one rounding into each
    # output. (torch's foreach ops on 16-bit tensors round a scale to 16 bits first on the CPU,
    # and a 0-d float32 scale to the list's dtype on CUDA.)
    full = [s if s.dtype in (torch.float32, torch.float64) else s.float() for s in src]
    in_place = [f for f, d in zip(full, dst, strict=True) if f is d]
    if in_place:
        torch._foreach_mul_(in_place, scale)
    others = [(f, d) for f, d in zip(full, dst, strict=True) if f is not d]
    if others:
        torch._foreach_copy_([d for _, d in others],
                             torch._foreach_mul([f for f, _ in others], scale))
