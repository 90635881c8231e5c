"""Sharding rules of the core's custom calls, for ``jax.jit`` over a mesh.

Each op of :mod:`transformer_engine.jax.ops` is one FFI custom call, which XLA cannot see
into: without a rule it gathers every operand onto every device. While a mesh is in
context (``jax.set_mesh``) or a :class:`~transformer_engine.jax.sharding.MeshResource`
names mesh axes, the ops run through ``jax.experimental.custom_partitioning`` instead: a
Shardy rule (einsum-like factors) lets the partitioner propagate shardings through the call,
and a partition function runs the call on each device's shard, adding the collectives that
make the shards add up to the whole:

* row-wise ops (quantize, the norms, the activations, amax) keep the token dimension sharded
  as it comes; the elementwise ones also keep the feature dimension sharded, the norms need
  it whole (a row's statistics span it). The per-tensor amax is reduced (max) over every mesh
  axis the tensor is sharded on, so each shard gets the whole tensor's amax and therefore the
  same scale as the unsharded run; the norm's parameter gradients and the bias gradients,
  which sum over tokens, are summed (psum) over the token dimension's axes.
* the GEMM keeps the output's rows (op(a)'s M) and columns (op(b)'s N) sharded as the
  operands have them (batch parallel, column parallel); a contraction dimension sharded on
  both operands gives each device a partial product, summed with ``psum`` (row parallel, and
  the weight gradient over data-parallel tokens). A mesh axis can split only one of M, N and
  K: where the operands disagree (fully-sharded weights beside a sharded batch) the operand
  is gathered, in the dtype it has there (FP8 for the FP8 GEMMs: half the bytes of bf16).

Per-tensor FP8 (delayed and current scaling) and high precision are partitioned; the block
scaling modes and the small scale-update calls run on whole operands (correct, gathered).
Under ``jax.vmap`` no mesh should be in context (custom_partitioning has no batching rule).
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec
from transformer_engine.jax.autocast import get_mesh_resource

__all__ = ["active", "compute_amax", "quantize", "norm_forward", "norm_backward",
           "activation_forward", "activation_backward", "gemm"]

# The MeshResource fields whose axes the modules lay tensors out on.
_LAYOUT_FIELDS = ("dp_resource", "tp_resource", "fsdp_resource", "cp_resource",
                  "tpsp_resource")

_local = threading.local()

Axes = tuple  # the mesh axes of one tensor dimension, major first ((): not sharded)


def active() -> bool:
    """Whether the ops take their partitioned form: a mesh is in context or the mesh resource
    names axes, and this is not already one device's part of a partitioned op."""
    if getattr(_local, "per_shard", 0):
        return False
    if not jax.sharding.get_abstract_mesh().empty:
        return True
    resource = get_mesh_resource()
    return any(getattr(resource, f) is not None for f in _LAYOUT_FIELDS)


@contextlib.contextmanager
def _per_shard():
    """While set, the ops are the plain custom calls (one device's shard, or the whole)."""
    _local.per_shard = getattr(_local, "per_shard", 0) + 1
    try:
        yield
    finally:
        _local.per_shard -= 1


def _axes(entry) -> Axes:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _dims_of(sharding, ndim: int) -> list:
    """Per dimension, the mesh axes that split it."""
    spec = tuple(getattr(sharding, "spec", ()))
    spec = spec + (None,) * (ndim - len(spec))
    return [_axes(e) for e in spec[:ndim]]


def _named(mesh, dims: Sequence[Axes]) -> NamedSharding:
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in dims]
    return NamedSharding(mesh, PartitionSpec(*entries))


def _without(axes: Axes, used) -> Axes:
    return tuple(a for a in axes if a not in used)


def _whole(ndim: int) -> list:
    return [()] * ndim


def _size(x) -> int:
    return math.prod(x.shape)


class _Rule:
    """Builds a Shardy rule string: each array lists one factor name per dimension; None
    gives each dimension a factor of its own (a scale, an empty placeholder)."""

    def __init__(self):
        self._n = 0

    def _fresh(self) -> str:
        self._n += 1
        return f"u{self._n}"

    def array(self, x, factors: Optional[Sequence[str]]) -> str:
        if factors is None or _size(x) == 0:
            return " ".join(self._fresh() for _ in x.shape)
        return " ".join(factors)

    def __call__(self, operands, results) -> str:
        ops_ = ", ".join(self.array(x, f) for x, f in operands)
        res = ", ".join(self.array(x, f) for x, f in results)
        return f"{ops_} -> {res}"


def _run(body: Callable, args: Sequence[jax.Array], rule: str, plan: Callable,
         **rule_kwargs):
    """``body(*args)`` (the plain custom call(s), a tuple of arrays) as one partitioned op.

    ``plan(arg_dims, result_dims, axis_sizes)`` gets the mesh axes of each argument's and
    result's dimensions as the partitioner proposes them (and the mesh's axis sizes) and
    returns ``(arg_dims, result_dims, per_shard)``: the layouts it wants
    (the partitioner reshards the arguments to them) and the function that computes each
    device's results from its shards, collectives included.
    """

    def whole(*a):
        with _per_shard():
            return tuple(body(*a))

    op = custom_partitioning(whole)

    def partition(mesh, arg_shapes, result_shapes):
        dims = [_dims_of(s.sharding, len(s.shape)) for s in arg_shapes]
        proposed = [_dims_of(r.sharding, len(r.shape)) for r in result_shapes]
        arg_dims, result_dims, per_shard = plan(dims, proposed, dict(mesh.shape))

        def lower(*shards):
            with _per_shard():
                return tuple(per_shard(*shards))

        return (mesh, lower, tuple(_named(mesh, d) for d in result_dims),
                tuple(_named(mesh, d) for d in arg_dims))

    # Shardy wants the special factors in the order the rule first names them.
    names = rule.replace(",", " ").replace("->", " ").split()
    for key, factors in rule_kwargs.items():
        rule_kwargs[key] = tuple(sorted((f for f in factors if f in names), key=names.index))
    op.def_partition(partition=partition, sharding_rule=rule,
                     **{k: v for k, v in rule_kwargs.items() if v})
    return op(*args)


def _pmax(x, axes: Axes):
    return jax.lax.pmax(x, tuple(axes)) if axes else x


def _psum(x, axes: Axes):
    return jax.lax.psum(x, tuple(axes)) if axes else x


def _flat(dims: Sequence[Axes]) -> Axes:
    return tuple(a for d in dims for a in d)


# --- row-wise ops --------------------------------------------------------------------------


def compute_amax(x: jax.Array, gate: jax.Array) -> jax.Array:
    """ops.compute_amax, its result the max over every shard of ``x``."""
    from transformer_engine.jax import ops

    rule = _Rule()
    factors = [f"d{i}" for i in range(x.ndim)]
    spec = rule([(x, factors), (gate, None)], [(jnp.zeros((1,)), None)])

    def plan(dims, proposed, sizes):
        del sizes
        x_dims = dims[0]

        def per_shard(xs, g):
            return (_pmax(plain(xs, g)[0], _flat(x_dims)),)

        return [x_dims, _whole(gate.ndim)], [_whole(1)], per_shard

    def plain(xs, g):
        return (ops.compute_amax(xs, gate=g if g.size else None),)

    return _run(plain, (x, gate), spec, plan)[0]


def quantize(x2: jax.Array, scale: jax.Array, body: Callable, results: Sequence, *,
             rowwise: bool, columnwise: bool, compute_amax: bool):
    """The per-tensor quantization of ``x2`` [M, K] (``body(x, scale)`` the plain call,
    ``results`` its result shapes). Both dimensions may stay sharded (it is elementwise);
    the amax is the max over all shards."""
    rule = _Rule()
    data, col, si, csi, amax = results
    spec = rule([(x2, ("m", "k")), (scale, None)],
                [(data, ("m", "k") if rowwise else None),
                 (col, ("k", "m") if columnwise else None), (si, None), (csi, None),
                 (amax, None)])

    def plan(dims, proposed, sizes):
        del sizes
        m, k = dims[0]
        out = [[m, k] if rowwise else _whole(data.ndim),
               [k, m] if columnwise else _whole(col.ndim),
               _whole(si.ndim), _whole(csi.ndim), _whole(amax.ndim)]

        def per_shard(xs, s):
            outs = list(body(xs, s))
            if compute_amax:
                outs[4] = _pmax(outs[4], m + k)
            return outs

        return [[m, k], _whole(scale.ndim)], out, per_shard

    return _run(body, (x2, scale), spec, plan)


def norm_forward(args: Sequence[jax.Array], body: Callable, results: Sequence):
    """The norm's forward (``body(x, gamma, beta, scale, gate)`` the plain call, x [M, N]):
    rows stay sharded, the normalized dimension is made whole; the amax is the max over the
    row shards."""
    x2 = args[0]
    rule = _Rule()
    y, mu, rsigma, data, col, si, amax = results
    spec = rule([(x2, ("m", "n")), (args[1], ("n",)), (args[2], ("n",)), (args[3], None),
                 (args[4], None)],
                [(y, ("m", "n")), (mu, ("m",)), (rsigma, ("m",)), (data, ("m", "n")),
                 (col, ("n", "m")), (si, None), (amax, None)])

    def plan(dims, proposed, sizes):
        del sizes
        m = dims[0][0]

        def rows(arr, layout):
            return layout if _size(arr) else _whole(arr.ndim)

        out = [rows(y, [m, ()]), rows(mu, [m]), rows(rsigma, [m]), rows(data, [m, ()]),
               rows(col, [(), m]), _whole(si.ndim), _whole(amax.ndim)]

        def per_shard(*shards):
            outs = list(body(*shards))
            outs[6] = _pmax(outs[6], m)
            return outs

        arg_dims = [[m, ()]] + [_whole(a.ndim) for a in args[1:]]
        return arg_dims, out, per_shard

    return _run(body, args, spec, plan, need_replication_factors=("n",))


def norm_backward(args: Sequence[jax.Array], body: Callable, results: Sequence):
    """The norm's backward (``body(dy, x, mu, rsigma, gamma)``, x [M, N]): rows stay
    sharded; gamma's and beta's gradients, sums over the rows, are summed over the shards."""
    dy, x2, mu, rsigma, gamma = args
    rule = _Rule()
    dx, dgamma, dbeta = results
    spec = rule([(dy, ("m", "n")), (x2, ("m", "n")), (mu, ("m",)), (rsigma, ("m",)),
                 (gamma, ("n",))],
                [(dx, ("m", "n")), (dgamma, ("n",)), (dbeta, ("n",))])

    def plan(dims, proposed, sizes):
        del sizes
        m = dims[1][0]

        def per_shard(*shards):
            d_x, d_gamma, d_beta = body(*shards)
            return d_x, _psum(d_gamma, m), _psum(d_beta, m)

        arg_dims = [[m, ()], [m, ()], [m] if _size(mu) else _whole(1), [m],
                    _whole(gamma.ndim)]
        return arg_dims, [[m, ()], _whole(1), _whole(1)], per_shard

    return _run(body, args, spec, plan, need_replication_factors=("n",))


def activation_forward(args: Sequence[jax.Array], body: Callable, results: Sequence, *,
                       gated: bool, rowwise: bool, columnwise: bool, compute_amax: bool):
    """The activation's forward (``body(x, scale, gate)``, x [M, K]): rows stay sharded, and
    so do the features unless the activation is gated (its two halves pair up across the
    whole last dimension); the amax is the max over all shards."""
    x2 = args[0]
    rule = _Rule()
    data, col, si, amax = results
    out_k = "f" if gated else "k"
    spec = rule([(x2, ("m", "k")), (args[1], None), (args[2], None)],
                [(data, ("m", out_k) if rowwise else None),
                 (col, (out_k, "m") if columnwise else None), (si, None), (amax, None)])

    def plan(dims, proposed, sizes):
        del sizes
        m, k = dims[0]
        if gated:
            k = ()
        out = [[m, k] if rowwise else _whole(data.ndim),
               [k, m] if columnwise else _whole(col.ndim), _whole(si.ndim),
               _whole(amax.ndim)]

        def per_shard(*shards):
            outs = list(body(*shards))
            if compute_amax:
                outs[3] = _pmax(outs[3], m + k)
            return outs

        return [[m, k], _whole(args[1].ndim), _whole(args[2].ndim)], out, per_shard

    kwargs = {"need_replication_factors": ("k", "f")} if gated else {}
    return _run(body, args, spec, plan, **kwargs)


def activation_backward(args: Sequence[jax.Array], body: Callable, results: Sequence, *,
                        gated: bool, rowwise: bool, columnwise: bool, compute_amax: bool):
    """The activation's backward (``body(dy, x, scale, gate)``; dy [M, F], x [M, K] or
    empty for IDENTITY): as the forward, with the bias gradient (column sums) summed over
    the row shards."""
    dy, x = args[0], args[1]
    rule = _Rule()
    data, col, si, amax, dbias = results
    spec = rule([(dy, ("m", "f" if gated else "k")), (x, ("m", "k")), (args[2], None),
                 (args[3], None)],
                [(data, ("m", "k") if rowwise else None),
                 (col, ("k", "m") if columnwise else None), (si, None), (amax, None),
                 (dbias, ("k",))])

    def plan(dims, proposed, sizes):
        del sizes
        m, k = dims[0]
        if gated:
            k = ()
        has_x = _size(x) > 0
        out = [[m, k] if rowwise else _whole(data.ndim),
               [k, m] if columnwise else _whole(col.ndim), _whole(si.ndim),
               _whole(amax.ndim), [k] if _size(dbias) else _whole(1)]

        def per_shard(*shards):
            outs = list(body(*shards))
            if compute_amax:
                outs[3] = _pmax(outs[3], m + k)
            outs[4] = _psum(outs[4], m)
            return outs

        arg_dims = [[m, k], [m, k] if has_x else _whole(1), _whole(args[2].ndim),
                    _whole(args[3].ndim)]
        return arg_dims, out, per_shard

    kwargs = {"need_replication_factors": ("k", "f")} if gated else {}
    return _run(body, args, spec, plan, **kwargs)


# --- the GEMM ------------------------------------------------------------------------------


def gemm(a, a_scale_inv, b, b_scale_inv, bias, *, transpose_a: bool, transpose_b: bool,
         fp8: bool, compute_amax: bool, run: Callable):
    """D = op(a) @ op(b) (+ bias) over sharded operands (a 2-D), ``run(a, a_si, b, b_si,
    bias)`` the plain GEMM giving ``(D, amax)``.

    M (op(a)'s rows) and N (op(b)'s columns) keep their axes; K, when both operands (or
    one, the other then sliced locally) are split over the same axes, gives partial products
    summed with psum, the bias added once after the sum. An axis already used by M (or N)
    cannot also split K: that operand is gathered along K. FP8 shards are padded to the
    GEMM's granule of 16 on each device.
    """
    from transformer_engine.jax import ops

    rule = _Rule()
    out = jax.ShapeDtypeStruct((1, 1), jnp.float32)  # only its rank matters to the rule
    spec = rule([(a, ("k", "m") if transpose_a else ("m", "k")), (a_scale_inv, None),
                 (b, ("n", "k") if transpose_b else ("k", "n")), (b_scale_inv, None),
                 (bias, ("n",))],
                [(out, ("m", "n")), (jax.ShapeDtypeStruct((1,), jnp.float32), None)])

    def plan(dims, proposed, sizes):
        a_dims, b_dims = dims[0], dims[2]
        a_m, a_k = (a_dims[1], a_dims[0]) if transpose_a else (a_dims[0], a_dims[1])
        b_n, b_k = (b_dims[0], b_dims[1]) if transpose_b else (b_dims[1], b_dims[0])
        m = a_m
        n = _without(b_n, m)
        k = _without(a_k, m + n) or _without(b_k, m + n)
        want_a = [k, m] if transpose_a else [m, k]
        want_b = [n, k] if transpose_b else [k, n]
        has_bias = _size(bias) > 0
        # Where the result is wanted split over axes that split K (a weight gradient under
        # FSDP), the partial products are reduce-scattered to the shards instead of summed
        # whole: half the bytes of an all-reduce, and no slicing after it.
        local_m = (a.shape[1] if transpose_a else a.shape[0]) // _count(m, sizes)
        local_n = (b.shape[0] if transpose_b else b.shape[1]) // _count(n, sizes)
        scatter_m = _scatter_axes(proposed[0][0], k, local_m, sizes) if not has_bias else ()
        scatter_n = (_scatter_axes(_without(proposed[0][1], scatter_m), k, local_n, sizes)
                     if not has_bias else ())
        summed = _without(k, scatter_m + scatter_n)

        def per_shard(a_s, a_si, b_s, b_si, bias_s):
            # A bias joins the partial products once, after their sum.
            bias_after = bool(k) and has_bias
            d = _padded_gemm(run, a_s, a_si, b_s, b_si,
                             jnp.zeros((0,), bias_s.dtype) if bias_after else bias_s,
                             transpose_a=transpose_a, transpose_b=transpose_b, fp8=fp8)
            if k:
                # Scattered first: what is summed whole after it is the smaller piece.
                for dim, axes in ((0, scatter_m), (1, scatter_n)):
                    if axes:
                        d = jax.lax.psum_scatter(d, axes, scatter_dimension=dim, tiled=True)
                d = _psum(d, summed)
                if bias_after:
                    d = d + bias_s.astype(d.dtype)
            amax = jnp.zeros((0,), jnp.float32)
            if compute_amax:
                amax = _pmax(ops.compute_amax(d), m + n + scatter_m + scatter_n)
            return d, amax

        arg_dims = [want_a, _whole(a_scale_inv.ndim), want_b, _whole(b_scale_inv.ndim),
                    [n] if has_bias else _whole(1)]
        return arg_dims, [[m + scatter_m, n + scatter_n], _whole(1)], per_shard

    def whole(a_, a_si, b_, b_si, bias_):
        d = _padded_gemm(run, a_, a_si, b_, b_si, bias_, transpose_a=transpose_a,
                         transpose_b=transpose_b, fp8=fp8)
        amax = ops.compute_amax(d) if compute_amax else jnp.zeros((0,), jnp.float32)
        return d, amax

    return _run(whole, (a, a_scale_inv, b, b_scale_inv, bias), spec, plan,
                reduction_factors=("k",))


def _count(axes: Axes, sizes: dict) -> int:
    return math.prod(sizes[a] for a in axes)


def _scatter_axes(wanted: Axes, k: Axes, length: int, sizes: dict) -> Axes:
    """The axes of ``k`` (the summed ones) that the result's dimension of ``length`` is
    wanted split over, as long as they split it evenly."""
    axes = tuple(a for a in wanted if a in k)
    return axes if axes and length % _count(axes, sizes) == 0 else ()


def _padded_gemm(run, a, a_si, b, b_si, bias, *, transpose_a, transpose_b, fp8):
    """``run`` (the plain GEMM, giving D) on one device's operands. FP8 operands are padded
    with zeros to multiples of 16 in M, N and K (the core's granule: a shard of a multiple
    of 16 need not be one), and the padding is sliced off D; zeros add exact zeros to each
    sum, so D is the unpadded product."""
    granule = 16
    if not fp8 or transpose_a:
        return run(a, a_si, b, b_si, bias)
    m, kk = a.shape
    n = b.shape[0] if transpose_b else b.shape[1]
    pm, pk, pn = -m % granule, -kk % granule, -n % granule
    if pm or pk:
        a = jnp.pad(a, ((0, pm), (0, pk)))
    if pk or pn:
        b = jnp.pad(b, ((0, pn), (0, pk)) if transpose_b else ((0, pk), (0, pn)))
    if pn and _size(bias):
        bias = jnp.pad(bias, (0, pn))
    return run(a, a_si, b, b_si, bias)[:m, :n]


# --- fused attention -----------------------------------------------------------------------


def _attention_factors(layout: str) -> dict:
    """The rule's factors of q, k, v, o and the row log-sum-exp in ``layout``: batch ``b``,
    query heads ``h``, key/value heads ``g`` (a factor of their own: GQA gives them another
    size), and the dimensions that must stay whole (sequences, head dims)."""
    if layout == "thd":  # tokens of packed sequences: only the heads can be split
        return dict(q=("tq", "h", "d"), k=("tkv", "g", "d"), v=("tkv", "g", "dv"),
                    o=("tq", "h", "dv"), lse=None)
    seq_first = layout == "sbhd"

    def lay(s, h, d):
        return (s, "b", h, d) if seq_first else ("b", s, h, d)

    return dict(q=lay("sq", "h", "d"), k=lay("skv", "g", "d"), v=lay("skv", "g", "dv"),
                o=lay("sq", "h", "dv"), lse=("b", "h", "sq"))


_ATTENTION_WHOLE = ("sq", "skv", "tq", "tkv", "d", "dv")


def _attention_layout(q_dims, layout: str, shape, sizes):
    """(batch axes, query-head axes, key/value-head axes) of one attention call from q's
    proposed layout: the heads stay split when every shard gets whole groups of query heads
    with their key/value heads (or all shards share MQA's single one), else they are made
    whole; the batch stays split (not for thd, whose sequences are packed)."""
    batch, heads, groups = shape[0], shape[1], shape[2]
    b_axes = () if layout == "thd" else q_dims[1 if layout == "sbhd" else 0]
    h_axes = q_dims[-2]
    n = _count(h_axes, sizes)
    if n > 1 and (heads % n or (groups % n and groups != 1)):
        h_axes = ()
    if b_axes and batch % _count(b_axes, sizes):
        b_axes = ()
    g_axes = h_axes if groups % max(_count(h_axes, sizes), 1) == 0 else ()
    return b_axes, h_axes, g_axes


def _attention_dims(layout: str, ndim: int, b_axes: Axes, h_axes: Axes,
                    s_axes: Axes = ()) -> list:
    if layout == "thd":
        return [s_axes, h_axes, ()]
    dims = [s_axes, b_axes, h_axes, ()] if layout == "sbhd" else [b_axes, s_axes, h_axes, ()]
    return dims[:ndim]


def _dropout_counter_table(shards: int, counters: int) -> jax.Array:
    """uint32 [shards, 2]: the (low, high) words of ``shard * counters`` for each shard."""
    import numpy as np

    values = [i * counters for i in range(shards)]
    return jnp.asarray(np.array([[v & 0xFFFFFFFF, (v >> 32) & 0xFFFFFFFF] for v in values],
                                np.uint32))


def _shard_rng(rng: jax.Array, axes: Axes, sizes: dict, counters: int) -> jax.Array:
    """The dropout (seed, offset) of this shard: the offset (the 64-bit words 2 and 3) moved
    past the counters of the shards before it, so no two shards draw the same random
    numbers. The kernel numbers each shard's elements (batch row, head, query, key) from
    the offset on, so with only the batch split each element keeps the number it has in the
    unsharded call, and so its dropout decision."""
    if not _size(rng) or not axes:
        return rng
    table = _dropout_counter_table(_count(axes, sizes), counters)
    add_lo, add_hi = table[jax.lax.axis_index(tuple(axes))]
    lo = rng[2] + add_lo
    carry = (lo < add_lo).astype(jnp.uint32)
    return jnp.stack([rng[0], rng[1], lo, rng[3] + add_hi + carry])


def _attention_op(args, body, results, *, layout: str, shape, arg_names, result_names,
                  cp: Optional[tuple] = None):
    """One attention custom call (forward or backward) as a partitioned op; ``shape`` is
    (batch, heads, groups, max query length, max key length). ``cp``: (mesh axis, the
    per-device function) when the sequences are split over that axis (context
    parallelism: :mod:`transformer_engine.jax.context_parallel`); the per-device function
    takes the shards ``body`` takes and does its own communication."""
    factors = _attention_factors(layout)
    if cp is not None and layout == "thd":  # (context_parallel_thd: the lse per query row)
        factors["lse"] = ("tq", "h")
    rule = _Rule()
    per_seq = layout != "thd"  # lengths [batch] ride along with the batch

    def tagged(arrays, names):
        out = []
        for x, name in zip(arrays, names, strict=True):
            if name == "lengths":
                out.append((x, ("b",) if per_seq else None))
            else:
                out.append((x, factors.get(name)))
        return out

    spec = rule(tagged(args, arg_names), tagged(results, result_names))
    batch, heads, _, sq, skv = shape

    def plan(dims, proposed, sizes):
        del proposed
        b_axes, h_axes, g_axes = _attention_layout(dims[0], layout, shape, sizes)
        s_axes = (cp[0],) if cp is not None else ()
        b_axes, h_axes, g_axes = (_without(a, s_axes) for a in (b_axes, h_axes, g_axes))

        def layout_of(x, name):
            if name in ("q", "o", "dq", "d_o"):
                return _attention_dims(layout, x.ndim, b_axes, h_axes, s_axes)
            if name in ("k", "v", "dk", "dv"):
                return _attention_dims(layout, x.ndim, b_axes, g_axes, s_axes)
            if name == "lse" and layout != "thd":
                return [b_axes, h_axes, s_axes]
            if name == "lse":  # thd: [batch, heads, max tokens], or under cp per query row
                return [s_axes, h_axes] if cp is not None else [(), h_axes, ()]
            if name == "lengths" and per_seq and _size(x):
                return [b_axes]
            return _whole(x.ndim)

        counters = (batch // _count(b_axes, sizes)) * (heads // _count(h_axes, sizes)) * sq * skv
        rng_at = arg_names.index("rng")

        def per_shard(*shards):
            if cp is not None:
                return cp[1](*shards)
            shards = list(shards)
            shards[rng_at] = _shard_rng(shards[rng_at], b_axes + h_axes, sizes, counters)
            return body(*shards)

        arg_dims = [layout_of(x, n) for x, n in zip(args, arg_names, strict=True)]
        result_dims = [layout_of(x, n) for x, n in zip(results, result_names, strict=True)]
        return arg_dims, result_dims, per_shard

    names = spec.replace(",", " ").replace("->", " ").split()
    # split over the context-parallel axis
    kept = ("sq", "skv", "tq", "tkv") if cp is not None else ()
    whole = tuple(f for f in _ATTENTION_WHOLE if f in names and f not in kept)
    return _run(body, args, spec, plan, need_replication_factors=whole)


def attention_forward(args: Sequence[jax.Array], body: Callable, results: Sequence, *,
                      layout: str, shape, cp: Optional[tuple] = None):
    """The fused attention's forward (``body(q, k, v, lengths_q, lengths_kv, rng)`` giving
    ``(o, lse)``; the lengths int32 [batch], or cu_seqlens for thd): each shard attends its
    own batch rows and heads, so nothing is communicated. The sequences and head dims are
    made whole (a query attends to every key), unless ``cp`` splits them (see
    :func:`_attention_op`). Dropout: see :func:`_shard_rng`."""
    return _attention_op(args, body, results, layout=layout, shape=shape,
                         arg_names=("q", "k", "v", "lengths", "lengths", "rng"),
                         result_names=("o", "lse"), cp=cp)


def attention_backward(args: Sequence[jax.Array], body: Callable, results: Sequence, *,
                       layout: str, shape, cp: Optional[tuple] = None):
    """The fused attention's backward (``body(q, k, v, o, d_o, lse, lengths_q, lengths_kv,
    rng)`` giving ``(dq, dk, dv)``), split as the forward: each shard's key/value heads
    serve only its own query heads, so dk and dv need no sum over shards."""
    return _attention_op(args, body, results, layout=layout, shape=shape,
                         arg_names=("q", "k", "v", "o", "d_o", "lse", "lengths", "lengths",
                                    "rng"),
                         result_names=("dq", "dk", "dv"), cp=cp)
