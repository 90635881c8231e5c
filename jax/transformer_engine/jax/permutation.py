"""Mixture-of-experts token movement (NVIDIA's path ``transformer_engine.jax.permutation``):
tokens to their experts and back, and chunks of rows reordered.

* :func:`token_dispatch`: each token's row copied to every expert the routing map sends it to,
  grouped by expert (expert 0's tokens first, each expert's in token order; the layout
  :func:`transformer_engine.jax.grouped_dense` takes with the experts' row counts), with the
  router's probabilities moved alike.
* :func:`token_dispatch_padded`: the same with each expert's rows padded to a multiple of
  ``align_size`` (zero rows), and the padded row counts: what FP8 grouped GEMMs take (their
  group sizes must be multiples of 16). Ours; NVIDIA's PyTorch API has the like
  ``moe_permute_and_pad_with_probs``.
* :func:`token_combine`: the experts' rows back to their tokens, each token's rows summed,
  weighted by the merging probabilities.
* :func:`sort_chunks_by_index`: chunks of rows put in another order (expert-parallel
  all-to-all layouts).

Everything is jnp gathers and scatters under ``jit`` (the shapes are static:
``num_out_tokens`` is given), differentiated by jax: the gradient of a gather is the
scatter-add back, so a token's gradient sums its copies. The same order and row-id map as the
PyTorch package's ``moe_permute`` (a row's destination per (token, expert), -1 where none).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["token_dispatch", "token_dispatch_padded", "token_combine", "sort_chunks_by_index"]


def _rows(op: str, name: str, x: jax.Array) -> jax.Array:
    """x [tokens, hidden] or [batch, sequence, hidden] as [tokens, hidden]."""
    if jnp.ndim(x) not in (2, 3):
        raise ValueError(f"{op}: {name} must be [tokens, hidden] or [batch, sequence, hidden], "
                         f"got shape {tuple(jnp.shape(x))}")
    return jnp.reshape(x, (-1, jnp.shape(x)[-1]))


def _row_id_map(routing_map: jax.Array, num_out_tokens: int) -> jax.Array:
    """The permuted row of each (token, expert) [tokens, experts] int32, -1 where the token is
    not routed there or its row is past ``num_out_tokens``: rows numbered expert-major, each
    expert's tokens in order."""
    chosen = routing_map != 0
    by_expert = chosen.T.reshape(-1)  # position e * tokens + t
    row = jnp.cumsum(by_expert.astype(jnp.int32)) - 1
    row = jnp.where(by_expert & (row < num_out_tokens), row, -1)
    return row.reshape(chosen.shape[1], chosen.shape[0]).T


def _sources(row_id_map: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """(the flat (token, expert) index of each of ``rows`` permuted rows, whether the row is
    filled): the row-id map inverted by one scatter (rows no entry points at stay unfilled)."""
    flat = row_id_map.reshape(-1)
    target = jnp.where(flat >= 0, flat, rows)  # (out of range: dropped by the scatter)
    index = jnp.arange(flat.shape[0], dtype=jnp.int32)
    source = jnp.zeros((rows,), jnp.int32).at[target].set(index, mode="drop")
    filled = jnp.zeros((rows,), bool).at[target].set(True, mode="drop")
    return source, filled


def _check_dispatch(op: str, inp, routing_map, num_out_tokens, probs) -> tuple:
    """(inp as [tokens, hidden], routing_map as [tokens, experts]) after the checks."""
    x = _rows(op, "inp", inp)
    if jnp.ndim(routing_map) not in (2, 3):
        raise ValueError(f"{op}: routing_map must be [tokens, experts] or [batch, sequence, "
                         f"experts], got shape {tuple(jnp.shape(routing_map))}")
    routing = jnp.reshape(routing_map, (-1, jnp.shape(routing_map)[-1]))
    if routing.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: routing_map must have one row per token of inp "
                         f"({x.shape[0]}), got {routing.shape[0]}")
    if not isinstance(num_out_tokens, int) or isinstance(num_out_tokens, bool) \
            or num_out_tokens < 0:
        raise ValueError(f"{op}: num_out_tokens must be a Python int >= 0 (the output's rows), "
                         f"got {num_out_tokens!r}")
    if probs is not None and tuple(jnp.shape(probs)) != tuple(jnp.shape(routing_map)):
        raise ValueError(f"{op}: probs must have routing_map's shape "
                         f"{tuple(jnp.shape(routing_map))}, got {tuple(jnp.shape(probs))}")
    return x, routing


def _gather(x, probs, row_id_map, rows: int) -> tuple:
    """(the permuted rows [rows, hidden], their probs or None): each row the token (and
    probability) the row-id map sends there, zero where none does."""
    source, filled = _sources(row_id_map, rows)
    experts = row_id_map.shape[1]
    out = jnp.where(filled[:, None], x[source // experts], jnp.zeros((), x.dtype))
    if probs is None:
        return out, None
    flat_probs = jnp.reshape(probs, (-1,))
    return out, jnp.where(filled, flat_probs[source], jnp.zeros((), flat_probs.dtype))


def token_dispatch(inp: jax.Array, routing_map: jax.Array, num_out_tokens: int,
                   probs: Optional[jax.Array] = None
                   ) -> tuple[jax.Array, Optional[jax.Array], jax.Array]:
    """``inp`` [tokens, hidden] (or [batch, sequence, hidden]) grouped by expert:
    (permuted [num_out_tokens, hidden], permuted probs [num_out_tokens] or None, row_id_map
    [tokens, experts] for :func:`token_combine`).

    ``routing_map`` [tokens, experts] (or [batch, sequence, experts]), nonzero where a token
    goes to an expert. ``num_out_tokens`` (a Python int: it sizes the output under jit) is
    usually the routing map's sum; fewer keeps the first rows (dropping from the last
    experts), more leaves zero rows at the end. ``probs``, the router's [tokens, experts]
    probabilities, come out in the rows' order."""
    x, routing = _check_dispatch("token_dispatch", inp, routing_map, num_out_tokens, probs)
    row_id_map = _row_id_map(routing, num_out_tokens)
    out, permuted_probs = _gather(x, probs, row_id_map, num_out_tokens)
    return out, permuted_probs, row_id_map


def token_dispatch_padded(inp: jax.Array, routing_map: jax.Array, num_out_tokens: int,
                          align_size: int, probs: Optional[jax.Array] = None
                          ) -> tuple[jax.Array, Optional[jax.Array], jax.Array, jax.Array]:
    """:func:`token_dispatch` with each expert's rows followed by zero rows up to a multiple of
    ``align_size``: (permuted [num_out_tokens + experts * (align_size - 1), hidden], permuted
    probs or None, row_id_map, group_sizes [experts] int32, the padded row counts).

    The output's row count is the bound of the padding (a static shape; the routing is known
    on the device only): the padded groups come first, zero rows after them. Every routed
    (token, expert) must fit, so ``num_out_tokens`` must be at least the routing map's sum;
    rows past the bound are dropped and the sizes clipped to it. ``row_id_map`` points at the
    real rows, so :func:`token_combine` skips the padding."""
    op = "token_dispatch_padded"
    x, routing = _check_dispatch(op, inp, routing_map, num_out_tokens, probs)
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size < 1:
        raise ValueError(f"{op}: align_size must be a Python int >= 1, got {align_size!r}")
    chosen = routing != 0
    experts = chosen.shape[1]
    rows = num_out_tokens + experts * (align_size - 1)
    counts = jnp.sum(chosen, axis=0, dtype=jnp.int32)
    padded = (counts + align_size - 1) // align_size * align_size
    starts = jnp.cumsum(padded) - padded
    rank = jnp.cumsum(chosen.astype(jnp.int32), axis=0) - 1  # a token's place in its expert
    row = starts[None, :] + rank
    row_id_map = jnp.where(chosen & (row < rows), row, -1)
    ends = jnp.minimum(starts + padded, rows)
    group_sizes = ends - jnp.minimum(starts, rows)
    out, permuted_probs = _gather(x, probs, row_id_map, rows)
    return out, permuted_probs, row_id_map, group_sizes


def token_combine(inp: jax.Array, row_id_map: jax.Array,
                  merging_probs: Optional[jax.Array] = None) -> jax.Array:
    """The experts' rows ``inp`` [rows, hidden] back to their tokens: [tokens, hidden], each
    token's rows summed (in float32, written in inp's dtype), weighted by ``merging_probs``
    ([tokens, experts], or [batch, sequence, experts]; None: plain sums). ``row_id_map`` is
    :func:`token_dispatch`'s."""
    op = "token_combine"
    x = _rows(op, "inp", inp)
    if jnp.ndim(row_id_map) != 2 or not jnp.issubdtype(row_id_map.dtype, jnp.integer):
        raise ValueError(f"{op}: row_id_map must be token_dispatch's [tokens, experts] integer "
                         f"map, got shape {tuple(jnp.shape(row_id_map))} of "
                         f"{jnp.result_type(row_id_map)}")
    tokens, experts = row_id_map.shape
    source, filled = _sources(row_id_map, x.shape[0])
    contribution = x.astype(jnp.float32)
    if merging_probs is not None:
        if jnp.size(merging_probs) != tokens * experts:
            raise ValueError(f"{op}: merging_probs must be [tokens, experts] = "
                             f"[{tokens}, {experts}], got shape "
                             f"{tuple(jnp.shape(merging_probs))}")
        weight = jnp.reshape(merging_probs, (-1,))[source].astype(jnp.float32)
        contribution = contribution * weight[:, None]
    token = jnp.where(filled, source // experts, tokens)  # (unfilled rows: dropped)
    out = jnp.zeros((tokens, x.shape[1]), jnp.float32).at[token].add(contribution, mode="drop")
    return out.astype(x.dtype)


def sort_chunks_by_index(inp: jax.Array, split_sizes: jax.Array,
                         sorted_indices: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``inp``'s rows in chunks of ``split_sizes`` [chunks] put in the order ``sorted_indices``
    [chunks] gives (chunk ``sorted_indices[0]`` first): (the reordered rows [tokens, hidden],
    row_id_map [tokens]: where each input row went). Rows past the chunks stay where they are.
    Both arrays may live on the device (no host read)."""
    op = "sort_chunks_by_index"
    x = _rows(op, "inp", inp)
    if jnp.ndim(split_sizes) != 1 or jnp.shape(sorted_indices) != jnp.shape(split_sizes):
        raise ValueError(f"{op}: split_sizes and sorted_indices must both be [chunks], got "
                         f"shapes {tuple(jnp.shape(split_sizes))} and "
                         f"{tuple(jnp.shape(sorted_indices))}")
    sizes = jnp.asarray(split_sizes, jnp.int32)
    order = jnp.asarray(sorted_indices, jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    # where each chunk begins in the output: the sizes of the chunks placed before it
    out_sizes = sizes[order]
    out_starts = jnp.cumsum(out_sizes) - out_sizes
    place = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=jnp.int32))
    r = jnp.arange(x.shape[0], dtype=jnp.int32)
    chunk = jnp.searchsorted(ends, r, side="right")
    inside = chunk < sizes.shape[0]
    c = jnp.minimum(chunk, sizes.shape[0] - 1)
    row_id_map = jnp.where(inside, out_starts[place[c]] + (r - starts[c]), r)
    out = jnp.zeros_like(x).at[row_id_map].set(x)
    return out, row_id_map
