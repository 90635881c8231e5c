"""The mesh axes of each kind of parallelism, and how the modules' logical axis names map to
them (under the names NVIDIA's JAX programs use).

:class:`MeshResource` is the one of :mod:`transformer_engine.jax.autocast`, and
:func:`global_shard_guard` sets the same value that ``autocast(mesh_resource=...)`` sets, so
either way of naming the mesh axes is seen by :func:`global_mesh_resource` (and
``get_mesh_resource``).

Under ``jax.jit`` with a mesh in context (``jax.set_mesh(mesh)``, its axes of type
``AxisType.Auto``) the modules lay out their tensors by their logical-axis keywords
(``kernel_axes``, ``input_axes``, ``kernel_axes_1``, ...): each logical name maps to the mesh
axes of a :class:`MeshResource` field (:data:`LOGICAL_RULES`), and the tensor gets that
sharding as a constraint. The core's ops follow the shardings (see
:mod:`transformer_engine.jax.partitioning`), so

* data parallelism (``dp_resource``): the batch is split, weights are whole;
* tensor parallelism (``tp_resource``): a kernel split along its output features
  (``"mlp"``, ``"heads"``, ...) is column parallel, one split along its input features
  row parallel (the partial products are summed); in ``LayerNormMLP`` the first GEMM is
  column parallel and the second row parallel, so the activation stays split between them;
* fully-sharded data parallelism (``fsdp_resource``): the batch is split over the axis and so
  are the weights (their ``"embed"`` dimension); each weight is gathered just before its
  GEMM (in FP8, its FP8 copy), and its gradient is reduced back to the shards.

The attention modules split their heads over tp (QKV column parallel, the output projection
row parallel) and attend each device's heads and batch rows without communication.
Context parallelism (``cp_resource``): the sequence (``"length"``) is split over the axis;
every token-wise op keeps its tokens, and the fused attention all-gathers the keys and values
(see :mod:`transformer_engine.jax.context_parallel`). Pipelining (``pp_resource``) needs
nothing from the modules. ``tpsp_resource`` is tensor parallelism over its axis, and a
TransformerLayer with ``enable_sequence_parallel`` keeps its residual stream split along the
sequence over it (``"length_tp"``) between the blocks: each block's input is gathered along
the sequence before its GEMMs (:func:`token_rows`), its row-parallel output summed and split
again.

Example:
    >>> from transformer_engine.jax.sharding import (MeshResource, global_mesh_resource,
    ...                                              global_shard_guard)
    >>> with global_shard_guard(MeshResource(dp_resource="data")):
    ...     global_mesh_resource().dp_resource
    'data'
    >>> global_mesh_resource().dp_resource is None
    True
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from transformer_engine.jax.autocast import (
    MeshResource,
    autocast,
    get_fp8_recipe,
    get_mesh_resource,
)

__all__ = ["MeshResource", "global_shard_guard", "global_mesh_resource", "LOGICAL_RULES",
           "logical_axis_rules", "logical_to_mesh_spec", "with_sharding_constraint_by_logical_axes",
           "BATCH_AXES", "SEQLEN_AXES", "SEQLEN_CP_AXES", "SEQLEN_TP_AXES", "HIDDEN_AXES",
           "HIDDEN_TP_AXES", "HEAD_AXES", "JOINED_AXES",
           "W_FSDP_AXES", "W_TP_AXES", "W_NO_SHARD_AXES", "W_JOINED_AXES", "token_rows"]

# What each MeshResource field stands for, and the ones no module implements yet.
_FEATURES = {"dp_resource": "data parallelism", "tp_resource": "tensor parallelism",
             "fsdp_resource": "fully-sharded data parallelism",
             "pp_resource": "pipeline parallelism", "tpsp_resource": "sequence parallelism",
             "cp_resource": "context parallelism"}
_UNSUPPORTED = ()

# Logical axis name -> the MeshResource fields whose mesh axes split it (in that order).
# A weight's "embed" (hidden) dimension is split over the FSDP axis; on an activation the
# same name comes after "batch", which already uses that axis, so it stays whole there.
LOGICAL_RULES = {
    "batch": ("dp_resource", "fsdp_resource"),
    "embed": ("fsdp_resource",),
    "mlp": ("tp_resource", "tpsp_resource"),
    "heads": ("tp_resource", "tpsp_resource"),
    "kv_heads": ("tp_resource", "tpsp_resource"),
    "joined_kv": ("tp_resource", "tpsp_resource"),
    "vocab": ("tp_resource", "tpsp_resource"),
    "length": ("cp_resource",),
    "length_cp": ("cp_resource",),
    "length_tp": ("tpsp_resource",),
    "act": (),
    "joined": (),
    "kv": (),
    "head_dim": (),
    "relpos_buckets": (),
}

# NVIDIA's constants for the same names (activations, then weights).
BATCH_AXES = "batch"
SEQLEN_AXES = "length"  # split over cp_resource: NVIDIA's SEQLEN_CP_AXES is the same here
SEQLEN_CP_AXES = "length_cp"
SEQLEN_TP_AXES = "length_tp"  # sequence parallelism's split of the residual stream (tpsp)
JOINED_AXES = "joined"
HIDDEN_AXES = "hidden"  # an activation's features: never split
HIDDEN_TP_AXES = "mlp"
HEAD_AXES = "heads"
W_FSDP_AXES = "embed"
W_TP_AXES = "mlp"
W_NO_SHARD_AXES = "act"
W_JOINED_AXES = "joined"  # the stacked q, k, v (or gate, linear) of a fused kernel: whole


@contextlib.contextmanager
def global_shard_guard(resource: Optional[MeshResource] = None) -> Iterator[None]:
    """Makes ``resource`` the mesh resource inside the block (None: no mesh axes), restoring
    the previous one on exit; the FP8 recipe in effect is left as it is."""
    if resource is None:
        resource = MeshResource()
    if not isinstance(resource, MeshResource):
        raise TypeError(f"global_shard_guard: resource must be a MeshResource or None, got "
                        f"{type(resource).__name__}")
    # autocast holds the mesh resource: re-entering it with the current recipe changes only that.
    recipe = get_fp8_recipe()
    with autocast(enabled=recipe is not None, recipe=recipe, mesh_resource=resource):
        yield


def global_mesh_resource() -> MeshResource:
    """The mesh resource in effect (all names None outside any guard or autocast)."""
    return get_mesh_resource()


def logical_axis_rules(resource: Optional[MeshResource] = None) -> tuple:
    """The ``(logical name, mesh axes)`` pairs of :data:`LOGICAL_RULES` under ``resource``
    (default: the one in effect), in flax's form: pass them to ``nn.logical_to_mesh_sharding``
    to place parameters annotated by the modules (``nn.get_partition_spec(variables)``)."""
    resource = get_mesh_resource() if resource is None else resource
    rules = []
    for name, fields in LOGICAL_RULES.items():
        # (tp_resource and tpsp_resource may name one axis: it splits the dimension once)
        axes = tuple(dict.fromkeys(getattr(resource, f) for f in fields
                                   if getattr(resource, f) is not None))
        rules.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(rules)


def logical_to_mesh_spec(axes: Sequence[Optional[str]],
                         resource: Optional[MeshResource] = None) -> PartitionSpec:
    """The mesh PartitionSpec of a tensor whose dimensions have the logical names ``axes``
    (None or an unknown name: not split). A mesh axis splits at most one dimension: a later
    dimension that asks for an axis already used keeps the rest (or stays whole)."""
    rules = dict(logical_axis_rules(resource))
    used, entries = set(), []
    for name in axes:
        mapped = rules.get(name) if name is not None else None
        mapped = () if mapped is None else (mapped if isinstance(mapped, tuple) else (mapped,))
        free = tuple(a for a in mapped if a not in used)
        used.update(free)
        entries.append(None if not free else free[0] if len(free) == 1 else free)
    return PartitionSpec(*entries)


def _mesh():
    """The mesh in context (``jax.set_mesh``), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def lays_out() -> bool:
    """Whether the mesh resource in effect names mesh axes: then the modules annotate their
    parameters with logical axes and constrain their tensors to them."""
    return get_mesh_resource() != MeshResource()


def mesh_axis_size(field: str) -> Optional[int]:
    """The size of the mesh axis that the mesh resource's ``field`` names: 1 when it names
    none, None when it names one but no mesh is in context (the size is not known)."""
    axis = getattr(get_mesh_resource(), field)
    if axis is None:
        return 1
    mesh = _mesh()
    if mesh is None or axis not in mesh.axis_names:
        return None
    return int(dict(mesh.shape)[axis])


def tensor_parallel_size() -> Optional[int]:
    """The size of the tensor-parallel mesh axis (tp_resource's, or tpsp_resource's when only
    that is named): 1 when neither names one, None when no mesh is in context."""
    resource = get_mesh_resource()
    field = "tp_resource" if resource.tp_resource is not None else "tpsp_resource"
    return mesh_axis_size(field)


def with_sharding_constraint_by_logical_axes(x: jax.Array, axes: Optional[Sequence]):
    """``x`` constrained to the sharding its logical ``axes`` name, while a mesh is in context
    and the mesh resource names axes; ``x`` itself otherwise (for empty ``axes``, and outside
    ``jax.jit``, where each op runs on the arrays as they are placed)."""
    if not axes or x is None or not isinstance(x, jax.core.Tracer):
        return x
    mesh = _mesh()
    resource = get_mesh_resource()
    if mesh is None or resource == MeshResource():
        return x
    spec = logical_to_mesh_spec(axes, resource)
    missing = {a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))
               if a not in mesh.axis_names}
    if missing:
        raise ValueError(f"sharding: the MeshResource names mesh axes {sorted(missing)} that the "
                         f"mesh in context does not have (its axes: {list(mesh.axis_names)})")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def token_rows(x: jax.Array, lead: int, lead_axes: Optional[Sequence] = None):
    """``x`` [*lead dims, *rest] as rows [M, prod(rest)] for the GEMMs and row-wise ops, and
    ``back``, which gives an array of rows [M, *tail] the lead dims again ([*lead, *tail]).

    Normally both are reshapes. Under a mesh, when ``lead_axes`` (the lead dims' logical
    names) say that a lead dim after the first is split (the batch of [seq, batch, ...], or
    the sequence under context parallelism), the rows are ordered with the split parts first:
    (context-parallel shard, the split dims, the whole dims, position in the shard). Then each
    device's tokens are one block of rows and nothing moves, where a plain reshape of
    [seq, batch] with the batch split (or of [batch, seq] with both split) is no split of the
    rows, and XLA would gather to make one. The ops between the two calls treat rows
    independently, so their order does not matter to them.
    """
    shape = tuple(x.shape)
    lead_shape, rest = shape[:lead], shape[lead:]
    m = math.prod(lead_shape)

    def plain():
        return x.reshape(m, math.prod(rest)), lambda r: r.reshape(*lead_shape, *r.shape[1:])

    names = tuple(lead_axes or ())
    if len(names) != lead or lead < 2 or _mesh() is None or not lays_out():
        return plain()
    if SEQLEN_TP_AXES in names:
        # Sequence parallelism's split stream: gathered along the sequence here, before the
        # GEMMs (whose weights are split over the same axis), as a constraint on the
        # unflattened tensor, so that XLA moves whole rows.
        names = tuple(SEQLEN_AXES if n == SEQLEN_TP_AXES else n for n in names)
        x = with_sharding_constraint_by_logical_axes(x, (*names, *(None,) * len(rest)))
    spec = tuple(logical_to_mesh_spec(names))
    cp = mesh_axis_size("cp_resource") or 1
    parts, split, whole = [], [], []  # parts: the sizes; split / whole: indices into parts
    for d, (size, entry) in enumerate(zip(lead_shape, spec, strict=True)):
        if names[d] in (SEQLEN_AXES, SEQLEN_CP_AXES) and cp > 1 and size % cp == 0:
            # The shard index goes first: one per device, so the split dim after it still
            # gives each device one block of rows.
            split.insert(0, len(parts))
            whole.append(len(parts) + 1)
            parts += [cp, size // cp]
            continue
        (split if entry is not None else whole).append(len(parts))
        parts.append(size)
    order = split + whole
    if order == sorted(order):
        return plain()
    inverse = sorted(range(len(order)), key=order.__getitem__)
    k = len(rest)
    rows = jnp.transpose(x.reshape(*parts, *rest), (*order, *range(len(parts), len(parts) + k)))
    rows = rows.reshape(m, math.prod(rest))

    def back(r: jax.Array) -> jax.Array:
        tail = r.shape[1:]
        t = r.reshape(*(parts[i] for i in order), *tail)
        t = jnp.transpose(t, (*inverse, *range(len(parts), len(parts) + len(tail))))
        return t.reshape(*lead_shape, *tail)

    return rows, back


def check_supported(caller: str, also_unsupported: Sequence[str] = ()) -> None:
    """Raises NotImplementedError, in ``caller``'s name, when the mesh resource in effect asks
    for a kind of parallelism that the modules do not implement (the fields in
    ``also_unsupported`` that ``caller`` lacks), and
    ValueError when the mesh in context has Explicit axes (the modules constrain shardings
    the way Auto axes take them)."""
    resource = get_mesh_resource()
    unsupported = (*_UNSUPPORTED, *also_unsupported)
    for field in unsupported:
        axis = getattr(resource, field)
        if axis is not None:
            ok = [f for f in _FEATURES if f not in unsupported]
            raise NotImplementedError(
                f"{caller}: {_FEATURES[field]} (MeshResource.{field}={axis!r}) is not "
                f"implemented here. Leave it None; {', '.join(ok)} are supported")
    mesh = _mesh()
    if mesh is not None and resource != MeshResource():
        explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                    if t != jax.sharding.AxisType.Auto]
        if explicit:
            raise ValueError(f"{caller}: the mesh in context must have Auto axes (make it with "
                             "jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)), "
                             f"got non-Auto axes {explicit}")
