"""Weights split into named row blocks (``parameters_split``, the separate query/key/value
weights of attention) laid out back to back in one storage, so that the GEMM can read them as
one tensor without copying them at every forward."""

from __future__ import annotations

import torch


class _JoinRows(torch.autograd.Function):
    """Each group of row blocks as one tensor over the blocks' common storage (a layer's weight
    and bias in one node: each autograd node costs host time); the gradients split back.
    ``counts``: the number of blocks of each group, whose blocks follow in order."""

    @staticmethod
    def forward(ctx, counts: tuple, *parts: torch.Tensor) -> tuple:
        ctx.counts = counts
        ctx.sizes = [p.shape[0] for p in parts]
        ctx.set_materialize_grads(False)  # a group no gradient reaches gets None, not zeros
        joined, at = [], 0
        for n in counts:
            group = parts[at:at + n]
            at += n
            first = group[0]
            shape = (sum(p.shape[0] for p in group),) + tuple(first.shape[1:])
            # A new tensor on the same storage rather than a view: autograd tracks it through
            # this function alone, as it would a concatenation.
            joined.append(first.new_empty(0).set_(first.untyped_storage(),
                                                  first.storage_offset(), shape, first.stride()))
        return tuple(joined)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        out, at = [None], 0
        for n, grad in zip(ctx.counts, grads, strict=True):
            sizes = ctx.sizes[at:at + n]
            at += n
            out += [None] * n if grad is None else list(grad.split(sizes))
        return tuple(out)


def back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether the contiguous parameters ``parts`` of one dtype and row shape follow each
    other in the first one's storage, which can then be read as one tensor of all their rows.
    (Each part is checked to lie inside that storage's bytes rather than to hold that storage
    itself: storages never share bytes, so the two are the same test, and a layer step asks it
    at every call, where each storage object costs host time.)"""
    first = parts[0]
    if type(first) is not torch.nn.Parameter or not first.is_contiguous():
        return False  # e.g. FP8 weights of fp8_model_init: each is its own tensor
    storage = first.untyped_storage()
    limit = storage.data_ptr() + storage.nbytes()
    size = first.element_size()
    end = first.data_ptr() + first.numel() * size
    for p in parts[1:]:
        if (type(p) is not torch.nn.Parameter or p.data_ptr() != end or not p.is_contiguous()
                or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]):
            return False
        end += p.numel() * size
    return end <= limit


def join_rows(*groups: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each group of row blocks as one tensor: no copy when each group's blocks lie back to back
    in one storage (as :func:`pack_rows` leaves them), one autograd node for all the groups;
    else a concatenation per group."""
    compiling = torch.compiler.is_compiling()
    shared = [i for i, g in enumerate(groups)
              if len(g) > 1 and not compiling and back_to_back(g)]
    out = [g[0] if len(g) == 1 else None if i in shared else torch.cat(g)
           for i, g in enumerate(groups)]
    if shared:
        joined = _JoinRows.apply(tuple(len(groups[i]) for i in shared),
                                 *(p for i in shared for p in groups[i]))
        for i, t in zip(shared, joined, strict=True):
            out[i] = t
    return out


def pack_rows(parts: list[torch.nn.Parameter]) -> None:
    """Moves the parameters' data into one storage, back to back (the parameters stay the same
    objects, so optimizers holding them are unaffected). A no-op where they already are, or
    where they cannot share one (FP8 weights, mixed dtypes or devices)."""
    if len(parts) < 2 or back_to_back(parts):
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
