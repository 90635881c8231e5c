"""Packed (thd) sequences with padding between them: NVIDIA TE's ``cu_seqlens_q_padded``,
``cu_seqlens_kv_padded`` and ``pad_between_seqs``, as Megatron-LM passes them for packed
sequences whose lengths are rounded up (e.g. to a multiple of 2 * cp).

Sequence b's tokens are rows ``cu_padded[b] .. cu_padded[b] + len(b) - 1`` of the tensor,
``len(b) = cu[b + 1] - cu[b]``; the rows after them up to ``cu_padded[b + 1]`` (and any rows
past ``cu_padded[-1]``) are padding. The core's attention takes the sequences back to back,
so the rows are permuted first: every token to its row in the back-to-back packing (row
``cu[b] + i``), the padding rows after the last token in their order. The permutation is
computed on the device from the two cumulative-length tensors, without reading them on the
host (no stream synchronization). Attention's output comes back through the inverse
permutation with its padding rows 0, and the gradients of the padding rows are 0.

Cost: one row gather of q, k, v and the output in the forward, and one of each gradient in
the backward (what the fused kernels avoid by reading with offsets).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Packing", "packing", "pack", "unpack"]


class Packing(NamedTuple):
    """``to_packed[r]``: the back-to-back row of row r; ``from_packed[p]``: the row that packed
    row p comes from; ``token[r]``: row r holds a token; ``packed_token[p]``: packed row p
    holds one (``p < cu[-1]``)."""

    to_packed: torch.Tensor
    from_packed: torch.Tensor
    token: torch.Tensor
    packed_token: torch.Tensor


def check(op: str, name: str, cu: torch.Tensor, cu_padded: torch.Tensor, rows: int) -> None:
    """Shapes always; values where they are on the CPU (reading CUDA memory would stall the
    stream): each padded length at least the sequence's, and the padded total within the
    tensor's rows."""
    if cu_padded.dim() != 1 or cu_padded.shape != cu.shape:
        raise ValueError(f"{op}: {name}_padded must have the shape of {name} "
                         f"({list(cu.shape)}), got {list(cu_padded.shape)}")
    if cu.device.type != "cpu" or cu_padded.device.type != "cpu":
        return
    if torch.compiler.is_compiling():
        return
    lengths, padded = cu[1:] - cu[:-1], cu_padded[1:] - cu_padded[:-1]
    if int(cu_padded[0]) != 0 or bool((padded < lengths).any()) or int(cu_padded[-1]) > rows:
        raise ValueError(f"{op}: {name}_padded must start at 0, give each sequence at least "
                         f"its length in {name} ({lengths.tolist()}) and end within the "
                         f"tensor's {rows} rows, got {cu_padded.tolist()}")


def packing(cu: torch.Tensor, cu_padded: torch.Tensor, rows: int) -> Packing:
    """The permutation of ``rows`` rows laid out by ``cu_padded`` into the back-to-back
    packing of ``cu`` (both [batch + 1] cumulative lengths on the tensor's device)."""
    cu, cu_padded = cu.to(torch.int64), cu_padded.to(torch.int64)
    batch = cu.shape[0] - 1
    r = torch.arange(rows, device=cu.device)
    # The sequence each row lies in (rows past the last one count as the last's padding).
    seq = torch.searchsorted(cu_padded[1:], r, right=True).clamp_(max=batch - 1)
    offset = r - cu_padded[seq]
    token = offset < (cu[seq + 1] - cu[seq])
    # A padding row follows every token of its sequence and of those before it (cu[seq + 1]
    # of them), so it is padding row number r - cu[seq + 1], after all cu[-1] tokens.
    to_packed = torch.where(token, cu[seq] + offset, cu[-1] + r - cu[seq + 1])
    from_packed = torch.empty_like(to_packed).scatter_(0, to_packed, r)
    return Packing(to_packed, from_packed, token, r < cu[-1])


class _Permute(torch.autograd.Function):
    """``out[i] = x[index[i]]`` where ``keep[i]``, else 0; the gradient goes back through the
    inverse permutation the same way (``grad_x[j] = grad[inverse[j]]`` where
    ``keep_inverse[j]``, else 0)."""

    @staticmethod
    def forward(ctx, x, index, keep, inverse, keep_inverse):
        ctx.save_for_backward(inverse, keep_inverse)
        return _take(x, index, keep)

    @staticmethod
    def backward(ctx, grad):
        inverse, keep_inverse = ctx.saved_tensors
        return _take(grad, inverse, keep_inverse), None, None, None, None


def _take(x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    out = x.index_select(0, index)
    # masked_fill, not a product: a NaN in a padding row must not reach a token's row
    return out.masked_fill_(~keep.view(-1, *([1] * (x.dim() - 1))), 0)


def pack(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """x's rows in the back-to-back packing, the padding rows (after the tokens) zeroed."""
    return _Permute.apply(x, p.from_packed, p.packed_token, p.to_packed, p.token)


def unpack(x: torch.Tensor, p: Packing) -> torch.Tensor:
    """The packed rows of x back in the padded layout, the padding rows 0."""
    return _Permute.apply(x, p.to_packed, p.token, p.from_packed, p.packed_token)
