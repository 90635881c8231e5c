"""Token routing of a mixture-of-experts layer, under NVIDIA TE's names: ``moe_permute`` groups
the tokens by the expert they go to, ``moe_unpermute`` brings the experts' outputs back to the
tokens (weighted by the router's probabilities), ``moe_permute_with_probs`` carries those
probabilities along, ``moe_sort_chunks_by_index`` reorders per-expert chunks (the exchange of
expert parallelism).

A routing is given as ``routing_map``: a ``"mask"`` [tokens, experts] (nonzero: the token goes
to the expert) or an ``"index"`` [tokens, top_k] of expert ids. The permuted rows are grouped
by expert, in expert order, and within an expert in token order (``"mask"``) or in the order
of the (token, slot) pairs (``"index"``). The ``row_id_map`` that ``moe_permute`` returns is
[tokens, slots] (slots: experts for a mask, top_k for an index): the permuted row of each
(token, slot), -1 where the token does not go. ``moe_unpermute`` takes it back.

Everything is torch indexing (gather, index_add), so it runs on any device, is differentiable
in the tokens and the probabilities, and needs no host synchronization when
``num_out_tokens`` is given (a mask without it counts its entries on the host).

FP8 dispatch: a per-tensor :class:`~transformer_engine.pytorch.Float8Tensor` input (the
tokens quantized once, before top-k duplicates them) is permuted as its bytes, one byte per
element moved instead of two, and comes out a Float8Tensor with the same scale, which
te.GroupedLinear takes as its FP8 input. Its gradient is high precision, as for any FP8
activation here.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs",
           "moe_unpermute", "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]

MAP_TYPES = ("mask", "index")


def _check_tokens(op: str, inp: torch.Tensor) -> None:
    if not isinstance(inp, torch.Tensor) or inp.dim() != 2:
        raise ValueError(f"{op}: inp must be a [tokens, hidden] tensor, got "
                         f"{list(inp.shape) if isinstance(inp, torch.Tensor) else type(inp)}")


def _routing_order(op: str, routing_map: torch.Tensor, tokens: int, map_type: str,
                   num_out_tokens: int) -> tuple[torch.Tensor, int, int]:
    """The flat positions (token * slots + slot) of the permuted rows, in row order; the slot
    count; the number of rows."""
    if map_type not in MAP_TYPES:
        raise ValueError(f"{op}: map_type must be one of {MAP_TYPES}, got {map_type!r}")
    if not isinstance(routing_map, torch.Tensor) or routing_map.dim() != 2 \
            or routing_map.shape[0] != tokens:
        raise ValueError(f"{op}: routing_map must be [tokens={tokens}, "
                         f"{'experts' if map_type == 'mask' else 'top_k'}], got "
                         f"{list(getattr(routing_map, 'shape', []))}")
    if routing_map.is_floating_point() and map_type == "index":
        raise TypeError(f"{op}: an 'index' routing_map holds expert ids (an integer tensor), "
                        f"got {routing_map.dtype}")
    if not isinstance(num_out_tokens, int) or num_out_tokens < -1:
        raise ValueError(f"{op}: num_out_tokens must be an int >= 0, or -1 for all the routed "
                         f"tokens, got {num_out_tokens!r}")
    slots = routing_map.shape[1]
    if map_type == "mask":
        chosen = routing_map != 0
        # expert-major: position e * tokens + t; the chosen ones first, each group in order
        key = (~chosen).t().reshape(-1).to(torch.int8)
        count = int(chosen.sum()) if num_out_tokens == -1 else num_out_tokens
        order = torch.argsort(key, stable=True)[:count]
        token, expert = order % tokens, torch.div(order, tokens, rounding_mode="floor")
        return token * slots + expert, slots, count
    count = tokens * slots if num_out_tokens == -1 else num_out_tokens
    order = torch.argsort(routing_map.reshape(-1), stable=True)[:count]
    return order, slots, count


def _row_id_map(flat: torch.Tensor, tokens: int, slots: int) -> torch.Tensor:
    rows = torch.full((tokens * slots,), -1, dtype=torch.int64, device=flat.device)
    rows[flat] = torch.arange(flat.numel(), device=flat.device)
    return rows.view(tokens, slots)


class _PermuteFp8Rows(torch.autograd.Function):
    """Rows ``token`` of a per-tensor Float8Tensor, as a Float8Tensor over the same scale (the
    bytes gathered); the gradient (high precision) is scattered back, summed over a token's
    copies."""

    @staticmethod
    def forward(ctx, inp, token):
        from .float8_tensor import Float8Tensor

        ctx.save_for_backward(token)
        ctx.rows = inp.shape[0]
        return Float8Tensor(inp._data.index_select(0, token), inp._scale_inv, inp._fp8_dtype,
                            inp.dtype)

    @staticmethod
    def backward(ctx, grad):
        (token,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, grad.shape[1])).index_add(0, token, grad)
        return out, None


def _take_rows(inp: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    from .float8_tensor import Float8Tensor

    if isinstance(inp, Float8Tensor) and inp._scaling_mode == "tensor":
        return _PermuteFp8Rows.apply(inp, token)
    return inp.index_select(0, token)


def moe_permute(inp: torch.Tensor, routing_map: torch.Tensor, num_out_tokens: int = -1,
                max_token_num: int = -1, map_type: str = "mask"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``inp`` [tokens, hidden] grouped by expert: (permuted [num_out_tokens, hidden],
    row_id_map). ``num_out_tokens``: the rows kept (-1: every routed (token, expert); fewer
    keeps the first ones, dropping from the last experts); ``max_token_num`` is accepted and
    unused (the buffers are sized by the inputs). A per-tensor Float8Tensor ``inp`` moves as
    its bytes (see the module doc)."""
    op = "moe_permute"
    _check_tokens(op, inp)
    flat, slots, _ = _routing_order(op, routing_map, inp.shape[0], map_type, num_out_tokens)
    token = torch.div(flat, slots, rounding_mode="floor")
    return _take_rows(inp, token), _row_id_map(flat, inp.shape[0], slots)


def moe_permute_with_probs(inp: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                           num_out_tokens: int = -1
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_permute` of a ``"mask"`` routing, with the router's ``probs`` [tokens,
    experts] permuted alike: (permuted, permuted_probs [num_out_tokens], row_id_map)."""
    op = "moe_permute_with_probs"
    _check_tokens(op, inp)
    if not isinstance(probs, torch.Tensor) or probs.shape != routing_map.shape:
        raise ValueError(f"{op}: probs must have routing_map's shape "
                         f"{list(routing_map.shape)}, got {list(getattr(probs, 'shape', []))}")
    flat, slots, _ = _routing_order(op, routing_map, inp.shape[0], "mask", num_out_tokens)
    token = torch.div(flat, slots, rounding_mode="floor")
    return (_take_rows(inp, token), probs.reshape(-1).index_select(0, flat),
            _row_id_map(flat, inp.shape[0], slots))


def moe_permute_and_pad_with_probs(inp: torch.Tensor, probs: torch.Tensor,
                                   routing_map: torch.Tensor, tokens_per_expert: torch.Tensor,
                                   align_size: int) -> tuple:
    """:func:`moe_permute_with_probs` of every routed token, each expert's rows followed by
    zero rows up to a multiple of ``align_size`` (what FP8 grouped GEMMs want: 16): (permuted
    [sum of the padded counts, hidden], permuted_probs (0 on padding rows), row_id_map,
    pad_offsets, target_tokens_per_expert). ``tokens_per_expert`` [experts] are the routing's
    counts; ``pad_offsets`` [experts] the padding rows before each expert's block (None where
    no expert needs any), which :func:`moe_unpermute` takes to drop them again. Sizing the
    output reads the padded total on the host (one synchronization, as NVIDIA's call)."""
    op = "moe_permute_and_pad_with_probs"
    _check_tokens(op, inp)
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0:
        raise ValueError(f"{op}: align_size must be a positive int, got {align_size!r}")
    experts = routing_map.shape[1] if isinstance(routing_map, torch.Tensor) else -1
    if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.shape != (experts,):
        raise ValueError(f"{op}: tokens_per_expert must be a [{experts}] tensor (one count per "
                         f"expert), got {list(getattr(tokens_per_expert, 'shape', []))}")
    from .float8_tensor import Float8Tensor

    if isinstance(inp, Float8Tensor):
        raise NotImplementedError(f"{op}: a Float8Tensor input is not implemented (the padding "
                                  "is written in high precision); permute it with "
                                  "moe_permute_with_probs, then pad with te.Fp8Padding")
    permuted, permuted_probs, row_id_map = moe_permute_with_probs(inp, probs, routing_map)
    counts = tokens_per_expert.to(device=inp.device, dtype=torch.int64)
    target = torch.div(counts + align_size - 1, align_size, rounding_mode="floor") * align_size
    pad = target - counts
    pad_offsets = torch.cumsum(pad, 0) - pad  # (exclusive)
    total, padding = torch.stack([target.sum(), pad.sum()]).tolist()  # (one synchronization)
    if padding == 0:
        return permuted, permuted_probs, row_id_map, None, target
    rows = _padded_rows(row_id_map, pad_offsets, permuted.shape[0])
    out = permuted.new_zeros((total, permuted.shape[1])).index_copy(0, rows, permuted)
    out_probs = permuted_probs.new_zeros((total,)).index_copy(0, rows, permuted_probs)
    return out, out_probs, row_id_map, pad_offsets, target


def _padded_rows(row_id_map: torch.Tensor, pad_offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Where each of the ``rows`` permuted rows of a mask routing sits once every expert's
    block is padded: its row plus the padding before its expert's block (the rows come expert
    by expert, as many per expert as its column of the map holds; no host synchronization)."""
    per_expert = (row_id_map >= 0).sum(0)
    before = torch.repeat_interleave(pad_offsets.to(torch.int64), per_expert, output_size=rows)
    return torch.arange(rows, device=row_id_map.device) + before


def moe_unpermute(inp: torch.Tensor, row_id_map: torch.Tensor,
                  merging_probs: Optional[torch.Tensor] = None,
                  restore_shape: Optional[torch.Size] = None, map_type: str = "mask",
                  probs: Optional[torch.Tensor] = None,
                  pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The permuted rows ``inp`` back to their tokens: each token's rows summed, weighted by
    ``merging_probs`` ([tokens, experts] for a mask, [tokens, top_k] for an index; None: plain
    sums; ``probs`` is its older name), in a [tokens, hidden] output (``restore_shape``, when
    given, must have that many elements). ``pad_offsets`` (a mask routing permuted by
    :func:`moe_permute_and_pad_with_probs`): ``inp`` holds padding rows, which are skipped
    (counting the rows to keep reads one number on the host)."""
    op = "moe_unpermute"
    _check_tokens(op, inp)
    if map_type not in MAP_TYPES:
        raise ValueError(f"{op}: map_type must be one of {MAP_TYPES}, got {map_type!r}")
    if pad_offsets is not None:
        if map_type != "mask":
            raise ValueError(f"{op}: pad_offsets come with a 'mask' routing "
                             "(moe_permute_and_pad_with_probs), got map_type 'index'")
        kept = int((row_id_map >= 0).sum())  # (the one synchronization: the rows to keep)
        inp = inp.index_select(0, _padded_rows(row_id_map, pad_offsets, kept))
    if probs is not None:
        if merging_probs is not None:
            raise ValueError(f"{op}: give merging_probs or probs (its older name), not both")
        merging_probs = probs
    if not isinstance(row_id_map, torch.Tensor) or row_id_map.dim() != 2:
        raise ValueError(f"{op}: row_id_map must be moe_permute's [tokens, slots] map, got "
                         f"{list(getattr(row_id_map, 'shape', []))}")
    tokens, slots = row_id_map.shape
    if merging_probs is not None and merging_probs.shape != row_id_map.shape:
        raise ValueError(f"{op}: merging_probs must be [tokens, slots] = "
                         f"{list(row_id_map.shape)}, got {list(merging_probs.shape)}")
    rows = inp.shape[0]
    # the (token, slot) of each permuted row, in row order: the map's kept entries sorted by
    # their row (the dropped ones, -1, go last and past `rows`)
    key = torch.where(row_id_map.reshape(-1) < 0, tokens * slots, row_id_map.reshape(-1))
    flat = torch.argsort(key)[:rows]
    token = torch.div(flat, slots, rounding_mode="floor")
    src = inp
    if merging_probs is not None:
        weight = merging_probs.reshape(-1).index_select(0, flat)
        src = inp * weight.to(inp.dtype).unsqueeze(1)
    out = inp.new_zeros((tokens, inp.shape[1])).index_add(0, token, src)
    if restore_shape is not None:
        if torch.Size(restore_shape).numel() != out.numel():
            raise ValueError(f"{op}: restore_shape must hold tokens x hidden = "
                             f"{tokens} x {inp.shape[1]} elements, got {list(restore_shape)}")
        out = out.view(restore_shape)
    return out


def _sorted_chunks(op: str, t: torch.Tensor, split_sizes: torch.Tensor,
                   sorted_index: torch.Tensor) -> torch.Tensor:
    sizes = [int(s) for s in split_sizes.tolist()]
    order = [int(i) for i in sorted_index.tolist()]
    if sum(sizes) != t.shape[0] or sorted(order) != list(range(len(sizes))):
        raise ValueError(f"{op}: split_sizes must sum to the rows ({t.shape[0]}) and "
                         f"sorted_index must order its {len(sizes)} chunks, got {sizes} and "
                         f"{order}")
    chunks = torch.split(t, sizes)
    return torch.cat([chunks[i] for i in order]) if chunks else t


def moe_sort_chunks_by_index(inp: torch.Tensor, split_sizes: torch.Tensor,
                             sorted_index: torch.Tensor) -> torch.Tensor:
    """``inp``'s row chunks (``split_sizes``) in the order ``sorted_index`` gives (chunk
    ``sorted_index[0]`` first)."""
    _check_tokens("moe_sort_chunks_by_index", inp)
    return _sorted_chunks("moe_sort_chunks_by_index", inp, split_sizes, sorted_index)


def moe_sort_chunks_by_index_with_probs(inp: torch.Tensor, probs: torch.Tensor,
                                        split_sizes: torch.Tensor, sorted_index: torch.Tensor
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_sort_chunks_by_index` of ``inp`` and of its per-row ``probs`` alike."""
    op = "moe_sort_chunks_by_index_with_probs"
    _check_tokens(op, inp)
    if probs.shape[0] != inp.shape[0]:
        raise ValueError(f"{op}: probs must have one entry per row of inp ({inp.shape[0]}), "
                         f"got {list(probs.shape)}")
    return (_sorted_chunks(op, inp, split_sizes, sorted_index),
            _sorted_chunks(op, probs, split_sizes, sorted_index))
