"""Context parallelism for the fused attention: the sequence split over a mesh axis.

Under ``jax.jit`` over a mesh whose context-parallel axis (``MeshResource.cp_resource``, or
the ``context_parallel_axis`` given to the attention) has ``n > 1`` devices, each device
holds ``1/n`` of every sequence: its queries and its keys and values. The attention runs by
one of two strategies (``context_parallel_strategy``). The all-gather strategy (the
default):

* forward: each device all-gathers the keys and values along the sequence (``n - 1``
  shards received) and attends its own queries to them;
* backward: the keys and values are gathered again, each device computes its queries'
  gradient and its share of every key's and value's gradient, and those shares are
  reduce-scattered back to the devices that hold the keys.

So no device holds another's queries, outputs or output gradients, and the extra memory is
one layer's whole keys and values. The ring strategy holds one other device's block at a time
instead (see the ring section below): n - 1 exchanges with the next device forward, n - 1 for
the blocks and n for their gradients backward.

Causal masks take each device's offset into account: a device's queries, at global positions
``p``, attend keys ``j <= p``. In the all-gather strategy the core expresses that as a
bottom-right causal mask over the keys up to the device's last query (a padding mask marks the
keys after them), so the mask is a run-time length, not a branch per device.

Causal attention leaves the devices unevenly loaded with a plain split (the last device's
queries see every key, the first's only their own). :func:`reorder_causal_load_balancing`
(NVIDIA's "dual chunk swap") cuts the sequence into ``2n`` chunks and gives device ``r``
chunks ``r`` and ``2n - 1 - r``: every device then attends the same number of keys. A model
run with ``context_parallel_causal_load_balanced=True`` takes its inputs (and labels)
reordered that way and gives its outputs in that order; the attention undoes the order of
the gathered keys and attends each of the device's two chunks with its own offset.

Padding masks (``padding``, ``padding_causal``; both strategies): each sequence's
query and key lengths (``cu_seqlens_q`` / ``cu_seqlens_kv``) are global. A device's run of
queries starting at global position ``s`` holds ``clip(q_len - s, 0, n)`` valid ones, which
attend the first ``kv_len`` keys, or, causally, the first ``s + (valid queries)`` (the
bottom-right diagonal through the device's last valid query). That is the global top-left
causal padding mask where each sequence has at least as many keys as queries (``q_len <=
kv_len``, as in self-attention); a shorter key sequence would let the last valid queries see
keys past its end, so that case is the caller's to avoid. The ring strategy masks each
(query chunk, key chunk) pair the same way: the chunk's valid queries attend the key chunk's
valid keys (causally on the diagonal pair); a row no valid key reaches has lse -inf, which the
log-sum-exp merge gives no weight.

Packed sequences (``thd``) are split per sequence, in NVIDIA's (Megatron-LM's) load-balanced
layout with the global padded offsets (``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded``),
by the all-gather strategy; the ring strategy gathers them too, with a warning:
:mod:`~transformer_engine.jax.context_parallel_thd`.

Supported: the ``bshd`` and ``sbhd`` layouts, ``no_mask``, the causal masks and the padding
masks, GQA/MQA, the heads and the batch split over other axes, both strategies, plain or load
balanced; ``thd`` with the padding masks (above). Refused with an error naming the feature:
the bottom-right padding mask, sliding windows and dropout.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional

import jax
import jax.numpy as jnp

__all__ = ["CPStrategy", "ReorderStrategy", "reorder_causal_load_balancing",
           "inverse_reorder_causal_load_balancing"]


class CPStrategy(str, enum.Enum):
    """How context-parallel attention exchanges the keys and values (NVIDIA's enum)."""

    DEFAULT = "default"  # the all-gather strategy here
    ALL_GATHER = "all_gather"
    RING = "ring"


class ReorderStrategy(str, enum.Enum):
    """How :func:`reorder_causal_load_balancing` orders the sequence (NVIDIA's enum)."""

    DualChunkSwap = "dual_chunk_swap"
    Striped = "striped"


def _seq_dim_of(caller: str, tensor_format) -> int:
    fmt = str(getattr(tensor_format, "value", tensor_format)).lower()
    if fmt not in ("bshd", "sbhd"):
        raise ValueError(f"{caller}: tensor_format must be 'bshd' or 'sbhd' (QKVFormat.BSHD / "
                         f"SBHD), got {tensor_format!r}")
    return 0 if fmt == "sbhd" else 1


def _parse(caller: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(cp_size, seq_dim) from NVIDIA's two signatures: ``(cp_size, tensor_format)`` and
    ``(strategy, cp_size, seq_dim)``."""
    if args and isinstance(args[0], ReorderStrategy) or "strategy" in kwargs:
        names = ("strategy", "cp_size", "seq_dim")
        values = dict(zip(names, args, strict=False), **kwargs)
        strategy = values.get("strategy")
        if strategy != ReorderStrategy.DualChunkSwap:
            raise NotImplementedError(f"{caller}: strategy {strategy!r} is not implemented; "
                                      "ReorderStrategy.DualChunkSwap is")
        return int(values["cp_size"]), int(values["seq_dim"])
    names = ("cp_size", "tensor_format")
    values = dict(zip(names, args, strict=False), **kwargs)
    if set(values) != set(names):
        raise TypeError(f"{caller}: takes (tensor, cp_size, tensor_format) or (tensor, strategy, "
                        f"cp_size, seq_dim), got {len(args)} positional and {sorted(kwargs)}")
    return int(values["cp_size"]), _seq_dim_of(caller, values["tensor_format"])


def _chunk_order(cp_size: int) -> list[int]:
    """The natural chunk at each position of the reordered sequence: device r's two chunks,
    r and 2n - 1 - r, side by side."""
    return [c for r in range(cp_size) for c in (r, 2 * cp_size - 1 - r)]


def _permute_chunks(caller: str, tensor: jax.Array, cp_size: int, seq_dim: int,
                    order: list[int]) -> jax.Array:
    if cp_size < 1:
        raise ValueError(f"{caller}: cp_size must be >= 1, got {cp_size}")
    if cp_size == 1:
        return tensor
    tensor = jnp.asarray(tensor)
    seq_dim = seq_dim % tensor.ndim
    length = tensor.shape[seq_dim]
    if length % (2 * cp_size):
        raise ValueError(f"{caller}: the sequence (dimension {seq_dim}, length {length}) must be "
                         f"a multiple of 2 * cp_size = {2 * cp_size}")
    shape = tensor.shape
    chunks = tensor.reshape(*shape[:seq_dim], 2 * cp_size, length // (2 * cp_size),
                            *shape[seq_dim + 1:])
    return jnp.take(chunks, jnp.asarray(order), axis=seq_dim).reshape(shape)


def reorder_causal_load_balancing(tensor: jax.Array, *args, **kwargs) -> jax.Array:
    """The sequence of ``tensor`` in the load-balanced order of causal context parallelism:
    cut into ``2 * cp_size`` chunks, device r's shard is chunks r and 2 cp_size - 1 - r.

    Takes NVIDIA's ``(tensor, cp_size, tensor_format)`` or ``(tensor, strategy, cp_size,
    seq_dim)`` (``ReorderStrategy.DualChunkSwap`` only)."""
    caller = "reorder_causal_load_balancing"
    cp_size, seq_dim = _parse(caller, args, kwargs)
    return _permute_chunks(caller, tensor, cp_size, seq_dim, _chunk_order(cp_size))


def inverse_reorder_causal_load_balancing(tensor: jax.Array, *args, **kwargs) -> jax.Array:
    """The inverse of :func:`reorder_causal_load_balancing` (same arguments): the sequence
    back in its natural order."""
    caller = "inverse_reorder_causal_load_balancing"
    cp_size, seq_dim = _parse(caller, args, kwargs)
    order = _chunk_order(cp_size)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return _permute_chunks(caller, tensor, cp_size, seq_dim, inverse)


# --- what one device computes ---------------------------------------------------------------


def _gather(t: jax.Array, axis: str, seq: int, size: int, balanced: bool) -> jax.Array:
    """The whole sequence of this device's shard ``t``, in the natural order."""
    whole = jax.lax.all_gather(t, axis, axis=seq, tiled=True)
    if balanced:
        order = _chunk_order(size)
        inverse = sorted(range(len(order)), key=order.__getitem__)
        whole = _permute_chunks("context parallel attention", whole, size, seq, inverse)
    return whole


def _scatter(t: jax.Array, axis: str, seq: int, size: int, balanced: bool) -> jax.Array:
    """This device's shard of the sum over devices of ``t`` (the whole sequence, natural
    order): the reverse of :func:`_gather`."""
    if balanced:
        t = _permute_chunks("context parallel attention", t, size, seq, _chunk_order(size))
    return jax.lax.psum_scatter(t, axis, scatter_dimension=seq, tiled=True)


def _pieces(local: int, size: int, balanced: bool, rank) -> list[tuple[int, int, jax.Array]]:
    """(start in the shard, length, global position of the first query) of each run of
    consecutive positions among this device's queries; ``rank`` is the device's index on the
    axis."""
    if not balanced:
        return [(0, local, rank * local)]
    half = local // 2
    return [(0, half, rank * half), (half, half, (2 * size - 1 - rank) * half)]


def _piece_mask(n: int, first, batch: int, causal: bool, lengths):
    """What the plain call of one run of ``n`` queries at global position ``first`` takes as
    its mask: ``(query lengths, key lengths, causal)``, int32 [batch] each, the causal
    diagonal bottom right (see the module docstring); ``lengths``: each sequence's global
    (query, key) lengths, or None (no padding)."""
    if lengths is None:
        return jnp.full((batch,), n, jnp.int32), jnp.full((batch,), first + n, jnp.int32), True
    q_len, kv_len = lengths
    valid = jnp.clip(q_len - first, 0, n).astype(jnp.int32)
    if causal:
        return valid, jnp.minimum(first + valid, kv_len).astype(jnp.int32), True
    return valid, kv_len.astype(jnp.int32), False


def _slice(x: jax.Array, dim: int, start: int, length: int) -> jax.Array:
    return jax.lax.slice_in_dim(x, start, start + length, axis=dim)


def shard_forward(run: Callable, q, k, v, *, layout: str, causal: bool, axis: str, size: int,
                  balanced: bool, lengths=None):
    """(o, lse) of this device's queries. ``run(q, k, v, mask)`` is the plain forward call:
    ``mask`` "full" for the unmasked attention, else a piece's (query lengths, key lengths,
    causal) (:func:`_piece_mask`); ``lengths``: the sequences' (query, key) lengths under a
    padding mask, else None."""
    seq = 0 if layout == "sbhd" else 1
    k, v = (_gather(t, axis, seq, size, balanced) for t in (k, v))
    if not causal and lengths is None:
        return run(q, k, v, "full")
    rank = jax.lax.axis_index(axis)
    batch = q.shape[1 - seq]
    outs = [run(_slice(q, seq, start, n), k, v, _piece_mask(n, first, batch, causal, lengths))
            for start, n, first in _pieces(q.shape[seq], size, balanced, rank)]
    if len(outs) == 1:
        return outs[0]
    return (jnp.concatenate([o for o, _ in outs], axis=seq),
            jnp.concatenate([lse for _, lse in outs], axis=2))


def shard_backward(run: Callable, q, k, v, o, d_o, lse, *, layout: str, causal: bool, axis: str,
                   size: int, balanced: bool, lengths=None):
    """(dq, dk, dv) of this device's shards. ``run(q, k, v, o, d_o, lse, mask)`` is the
    plain backward call (see :func:`shard_forward`); the keys' and values' gradients of every
    device's queries are summed onto the devices that hold the keys."""
    seq = 0 if layout == "sbhd" else 1
    kg, vg = (_gather(t, axis, seq, size, balanced) for t in (k, v))
    if not causal and lengths is None:
        dq, dk, dv = run(q, kg, vg, o, d_o, lse, "full")
    else:
        rank = jax.lax.axis_index(axis)
        batch = q.shape[1 - seq]
        dqs, dk, dv = [], None, None
        for start, n, first in _pieces(q.shape[seq], size, balanced, rank):
            part = run(_slice(q, seq, start, n), kg, vg,
                       _slice(o, seq, start, n), _slice(d_o, seq, start, n),
                       _slice(lse, 2, start, n), _piece_mask(n, first, batch, causal, lengths))
            dqs.append(part[0])
            # The two pieces' shares are added in fp32: one rounding to the gradient's dtype.
            dk = part[1].astype(jnp.float32) + (0.0 if dk is None else dk)
            dv = part[2].astype(jnp.float32) + (0.0 if dv is None else dv)
        dq = dqs[0] if len(dqs) == 1 else jnp.concatenate(dqs, axis=seq)
        dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    return (dq, _scatter(dk, axis, seq, size, balanced), _scatter(dv, axis, seq, size, balanced))


# --- the ring strategy -----------------------------------------------------------------------
#
# Each device keeps its queries and passes its keys and values round the ring (ppermute to the
# next device, n - 1 times): at each step it attends its queries to the block it holds and
# merges the partial results by their log-sum-exp, so no device ever holds more than one other
# block. The backward passes the blocks round again, each with the running sums of its keys' and
# values' gradients, which a last step brings home. A shard is one chunk of the sequence (plain
# split) or two (load balanced); a (query chunk, key chunk) pair is attended in full (the keys
# come first), causally (the same chunk), or not at all (the keys come later), chosen per
# device at run time.

_SKIP, _CAUSAL, _FULL = 0, 1, 2


def _chunks_of(device, size: int, balanced: bool) -> list:
    """The global chunk indices (traced) of a device's shard, in the order they sit in it."""
    if not balanced:
        return [device]
    return [device, 2 * size - 1 - device]


def _relation(q_chunk, k_chunk, causal: bool):
    if not causal:
        return jnp.int32(_FULL)
    return jnp.where(q_chunk < k_chunk, _SKIP, jnp.where(q_chunk == k_chunk, _CAUSAL, _FULL))


def _pieces_of(x: jax.Array, dim: int, count: int) -> list:
    n = x.shape[dim] // count
    return [_slice(x, dim, i * n, n) for i in range(count)]


def _by_relation(relation, causal: bool, skip: Callable, run_kind: Callable):
    """One (query chunk, key chunk) pair: ``run_kind("full")`` where the keys come first,
    ``run_kind("causal")`` on the diagonal, ``skip()`` where they come later (chosen on the
    device); unmasked attention takes every pair in full."""
    if not causal:
        return run_kind("full")
    return jax.lax.switch(relation, [skip, lambda: run_kind("causal"), lambda: run_kind("full")])


def _pair_mask(kind: str, q_chunk, k_chunk, chunk: int, lengths):
    """The plain call's mask of one (query chunk, key chunk) pair: ``kind`` as it is without
    padding; under a padding mask each sequence's valid queries of the query chunk and valid
    keys of the key chunk ((query lengths, key lengths, causal); the diagonal pair causal,
    where both chunks start at one position)."""
    if lengths is None:
        return kind
    q_len, kv_len = lengths
    q_valid = jnp.clip(q_len - q_chunk * chunk, 0, chunk).astype(jnp.int32)
    kv_valid = jnp.clip(kv_len - k_chunk * chunk, 0, chunk).astype(jnp.int32)
    return q_valid, kv_valid, kind == "causal"


def _ring_next(x, axis: str, size: int):
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])


def _lse_as_o(lse: jax.Array, seq: int) -> jax.Array:
    """lse [b, h, s] laid out as o's [b, s, h, 1] (or [s, b, h, 1])."""
    t = jnp.transpose(lse, (2, 0, 1) if seq == 0 else (0, 2, 1))
    return t[..., None]


def ring_forward(run: Callable, q, k, v, *, layout: str, causal: bool, axis: str, size: int,
                 balanced: bool, lengths=None):
    """(o, lse) of this device's queries by the ring strategy. ``run(q, k, v, mask)`` is the
    plain forward of one (query chunk, key chunk) pair, ``mask`` "full" or "causal", or under a
    padding mask (``lengths``: the sequences' query and key lengths) the pair's
    :func:`_pair_mask`. A query row no key reaches has lse -inf and o 0 (the core's rule),
    which the merge keeps."""
    seq = 0 if layout == "sbhd" else 1
    count = 2 if balanced else 1
    rank = jax.lax.axis_index(axis)
    q_chunks = _chunks_of(rank, size, balanced)
    qs = _pieces_of(q, seq, count)
    o_acc = [jnp.zeros(p.shape[:-1] + (v.shape[-1],), jnp.float32) for p in qs]
    lse_acc = [None] * count

    chunk = q.shape[seq] // count

    def attend(qp, kp, vp, relation, q_chunk, k_chunk):
        def skip():
            b, h = (qp.shape[1], qp.shape[2]) if seq == 0 else (qp.shape[0], qp.shape[2])
            return (jnp.zeros(qp.shape[:-1] + (vp.shape[-1],), qp.dtype),
                    jnp.full((b, h, qp.shape[seq]), -jnp.inf, jnp.float32))

        return _by_relation(relation, causal, skip, lambda kind: run(
            qp, kp, vp, _pair_mask(kind, q_chunk, k_chunk, chunk, lengths)))

    for step in range(size):
        src = (rank - step) % size
        k_chunks = _chunks_of(src, size, balanced)
        ks, vs = _pieces_of(k, seq, count), _pieces_of(v, seq, count)
        for i, qp in enumerate(qs):
            for j in range(count):
                o_p, lse_p = attend(qp, ks[j], vs[j], _relation(q_chunks[i], k_chunks[j], causal),
                                    q_chunks[i], k_chunks[j])
                if lse_acc[i] is None:
                    o_acc[i], lse_acc[i] = o_p.astype(jnp.float32), lse_p
                    continue
                new = jnp.logaddexp(lse_acc[i], lse_p)
                # exp(-inf - -inf) is nan: a row no key has reached yet keeps weight 0
                keep = jnp.where(jnp.isneginf(new), 0.0, jnp.exp(lse_acc[i] - new))
                take = jnp.where(jnp.isneginf(new), 0.0, jnp.exp(lse_p - new))
                o_acc[i] = (o_acc[i] * _lse_as_o(keep, seq)
                            + o_p.astype(jnp.float32) * _lse_as_o(take, seq))
                lse_acc[i] = new
        if step < size - 1:
            k, v = _ring_next(k, axis, size), _ring_next(v, axis, size)
    o = jnp.concatenate(o_acc, axis=seq) if count > 1 else o_acc[0]
    lse = jnp.concatenate(lse_acc, axis=2) if count > 1 else lse_acc[0]
    return o.astype(q.dtype), lse


def ring_backward(run: Callable, q, k, v, o, d_o, lse, *, layout: str, causal: bool, axis: str,
                  size: int, balanced: bool, lengths=None):
    """(dq, dk, dv) of this device's shards by the ring strategy. ``run(q, k, v, o, d_o, lse,
    mask)`` is the plain backward of one pair (``mask`` as :func:`ring_forward`'s), given the
    final o and lse of its queries (each pair's probabilities are exp(s - lse) with the whole
    row's lse)."""
    seq = 0 if layout == "sbhd" else 1
    count = 2 if balanced else 1
    rank = jax.lax.axis_index(axis)
    q_chunks = _chunks_of(rank, size, balanced)
    qs, os_, dos = (_pieces_of(t, seq, count) for t in (q, o, d_o))
    lses = _pieces_of(lse, 2, count)
    dq = [jnp.zeros(p.shape, jnp.float32) for p in qs]
    dk_acc = jnp.zeros(k.shape, jnp.float32)
    dv_acc = jnp.zeros(v.shape, jnp.float32)

    chunk = q.shape[seq] // count

    def grads(i, kp, vp, relation, k_chunk):
        def skip():
            return (jnp.zeros(qs[i].shape, q.dtype), jnp.zeros(kp.shape, k.dtype),
                    jnp.zeros(vp.shape, v.dtype))

        return _by_relation(relation, causal, skip, lambda kind: run(
            qs[i], kp, vp, os_[i], dos[i], lses[i],
            _pair_mask(kind, q_chunks[i], k_chunk, chunk, lengths)))

    for step in range(size):
        src = (rank - step) % size
        k_chunks = _chunks_of(src, size, balanced)
        ks, vs = _pieces_of(k, seq, count), _pieces_of(v, seq, count)
        dks, dvs = _pieces_of(dk_acc, seq, count), _pieces_of(dv_acc, seq, count)
        for i in range(count):
            for j in range(count):
                dq_p, dk_p, dv_p = grads(i, ks[j], vs[j],
                                         _relation(q_chunks[i], k_chunks[j], causal),
                                         k_chunks[j])
                dq[i] = dq[i] + dq_p.astype(jnp.float32)
                dks[j] = dks[j] + dk_p.astype(jnp.float32)
                dvs[j] = dvs[j] + dv_p.astype(jnp.float32)
        dk_acc = jnp.concatenate(dks, axis=seq) if count > 1 else dks[0]
        dv_acc = jnp.concatenate(dvs, axis=seq) if count > 1 else dvs[0]
        # the block and its gradients move on together; after the last step the gradients
        # take one more hop, home to the device that holds the block
        if step < size - 1:
            k, v = _ring_next(k, axis, size), _ring_next(v, axis, size)
        dk_acc, dv_acc = _ring_next(dk_acc, axis, size), _ring_next(dv_acc, axis, size)
    dq = jnp.concatenate(dq, axis=seq) if count > 1 else dq[0]
    return dq.astype(q.dtype), dk_acc.astype(k.dtype), dv_acc.astype(v.dtype)


def strategy_name(strategy) -> str:
    """``"default"``, ``"all_gather"`` or ``"ring"`` from a string (any case) or a
    :class:`CPStrategy` member."""
    return str(getattr(strategy, "value", strategy)).lower()


def check_call(caller: str, *, layout: str, mask: str, window: Optional[tuple], dropout: float,
               strategy, sq: int, skv: int, size: int, balanced: bool) -> None:
    """Raises, naming the feature, for what context parallelism does not do here."""
    name = strategy_name(strategy)
    if name not in ("default", "all_gather", "ring"):
        raise ValueError(f"{caller}: context_parallel_strategy must be 'default', 'all_gather' "
                         f"or 'ring' (or a CPStrategy member), got {strategy!r}")
    if window is not None and tuple(window) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"{caller}: sliding windows are not implemented under context "
                                  f"parallelism, got window_size {tuple(window)}")
    if dropout > 0.0:
        raise NotImplementedError(f"{caller}: attention dropout is not implemented under context "
                                  f"parallelism, got dropout_probability {dropout}")
    if layout == "thd":  # its masks and lengths: context_parallel_thd
        return
    padding = mask in ("padding", "padding_causal")
    if mask not in ("no_mask", "causal", "causal_bottom_right") and not padding:
        raise NotImplementedError(f"{caller}: context parallelism takes attn_mask_type "
                                  f"'no_mask', a causal mask, 'padding' or 'padding_causal', "
                                  f"got {mask!r}")
    if "causal" in mask and sq != skv:
        raise NotImplementedError(f"{caller}: causal context parallelism needs as many queries "
                                  f"as keys, got {sq} and {skv}")
    granule = 2 * size if balanced else size
    for what, n in (("query", sq), ("key", skv)):
        if n % granule:
            raise ValueError(f"{caller}: the {what} sequence length {n} must be a multiple of "
                             f"{granule} ({'2 x ' if balanced else ''}the context-parallel "
                             f"axis's {size} devices)")
