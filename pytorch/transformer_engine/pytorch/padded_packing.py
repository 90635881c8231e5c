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

from typing import Callable, NamedTuple, Optional

import torch

__all__ = ["Packing", "forward_args", "attend", "packing", "pack", "unpack"]


def forward_args(op: str, pad_between_seqs, cu_q_padded, cu_kv_padded,
                 layout: str) -> Optional[tuple]:
    """NVIDIA's forward arguments of packed sequences with padding between them: None where
    there is none (every forward calls this; it returns at once for the defaults), else the
    pair (cu_seqlens_q_padded, cu_seqlens_kv_padded), either possibly None (that side
    unpadded). ``pad_between_seqs=False`` says there is no padding: the padded offsets, if
    given, are then the plain ones and go unused (NVIDIA's meaning)."""
    if not pad_between_seqs and cu_q_padded is None and cu_kv_padded is None:
        return None
    if pad_between_seqs is False:
        return None
    if layout != "thd":
        raise ValueError(f"{op}: cu_seqlens_q_padded / cu_seqlens_kv_padded / "
                         f"pad_between_seqs are for packed sequences (qkv_format 'thd'), got "
                         f"qkv_format {layout!r}")
    if cu_q_padded is None and cu_kv_padded is None:
        raise ValueError(f"{op}: pad_between_seqs=True needs cu_seqlens_q_padded and "
                         "cu_seqlens_kv_padded (where each sequence starts in the tensor)")
    for name, t in (("cu_seqlens_q_padded", cu_q_padded), ("cu_seqlens_kv_padded",
                                                           cu_kv_padded)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor of cumulative lengths, got "
                            f"{type(t).__name__}")
    return cu_q_padded, cu_kv_padded


def check_shape(op: str, name: str, cu: torch.Tensor, cu_padded: torch.Tensor) -> None:
    if cu_padded.dim() != 1 or cu_padded.shape != cu.shape:
        raise ValueError(f"{op}: {name}_padded must have the shape of {name} "
                         f"({list(cu.shape)}), got {list(cu_padded.shape)}")


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
    check_shape(op, name, cu, cu_padded)
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


def attend(op: str, attend_packed: Callable, query, key, value, cu_q: torch.Tensor,
           cu_kv: torch.Tensor, padded: tuple) -> torch.Tensor:
    """``attend_packed(q, k, v)`` (attention of back-to-back packed sequences, [rows, ...]
    out) on q's rows, and k's and v's, permuted into the back-to-back packing of ``cu_q`` /
    ``cu_kv`` from where ``padded`` = (cu_q_padded, cu_kv_padded) puts each sequence (either
    None: that side unpadded); the output goes back to the padded layout, padding rows 0.
    CPU offsets equal to the plain ones skip the permutation (CUDA values are not read)."""
    rows_of = {}
    for name, cu, cu_padded, t in (("cu_seqlens_q", cu_q, padded[0], query),
                                   ("cu_seqlens_kv", cu_kv, padded[1], key)):
        if cu_padded is None:
            continue
        check(op, name, cu, cu_padded, t.shape[0])
        cu, cu_padded = cu.to(device=t.device), cu_padded.to(device=t.device)
        if cu.is_cuda or not torch.equal(cu, cu_padded):
            rows_of[name] = packing(cu, cu_padded, t.shape[0])
    q_rows, kv_rows = rows_of.get("cu_seqlens_q"), rows_of.get("cu_seqlens_kv")
    if kv_rows is not None:
        key, value = pack(key, kv_rows), pack(value, kv_rows)
    if q_rows is not None:
        query = pack(query, q_rows)
    o = attend_packed(query, key, value)
    return o if q_rows is None else unpack(o, q_rows)
