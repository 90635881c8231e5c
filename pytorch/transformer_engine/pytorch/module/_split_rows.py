"""Weights split into named row blocks (``parameters_split``, the separate query/key/value
weights of attention) laid out back to back in one storage, so that the GEMM can read them as
one tensor without copying them at every forward."""

from __future__ import annotations

import torch


class _JoinRows(torch.autograd.Function):
    """The row blocks as one tensor over their common storage; the gradient splits back."""

    @staticmethod
    def forward(ctx, *parts: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [p.shape[0] for p in parts]
        first = parts[0]
        shape = (sum(ctx.sizes),) + tuple(first.shape[1:])
        # A new tensor on the same storage rather than a view: autograd tracks it through
        # this function alone, as it would a concatenation.
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape,
                                       first.stride())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return tuple(grad.split(ctx.sizes))


def _back_to_back(parts: list[torch.Tensor]) -> bool:
    first = parts[0]
    if type(first) is not torch.nn.Parameter or not first.is_contiguous():
        return False  # e.g. FP8 weights of fp8_model_init: each is its own tensor
    end = first.data_ptr() + first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    for p in parts[1:]:
        if (type(p) is not torch.nn.Parameter or not p.is_contiguous()
                or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != storage or p.data_ptr() != end):
            return False
        end += p.numel() * p.element_size()
    return True


def join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The row blocks as one tensor: no copy when they lie back to back in one storage (as
    :func:`pack_rows` leaves them), else a concatenation."""
    if len(parts) == 1:
        return parts[0]
    if not torch.compiler.is_compiling() and _back_to_back(parts):
        return _JoinRows.apply(*parts)
    return torch.cat(parts)


def pack_rows(parts: list[torch.nn.Parameter]) -> None:
    """Moves the parameters' data into one storage, back to back (the parameters stay the same
    objects, so optimizers holding them are unaffected). A no-op where they already are, or
    where they cannot share one (FP8 weights, mixed dtypes or devices)."""
    if len(parts) < 2 or _back_to_back(parts):
        return
    first = parts[0]
    if any(type(p) is not torch.nn.Parameter or p.dtype != first.dtype
           or p.device != first.device or p.shape[1:] != first.shape[1:] for p in parts):
        return
    with torch.no_grad():
        whole = torch.cat([p.detach() for p in parts])
    start = 0
    for p in parts:
        p.data = whole[start:start + p.shape[0]]
        start += p.shape[0]
