"""The mesh axis names of each kind of parallelism, under the names NVIDIA's JAX programs use.

:class:`MeshResource` is the one of :mod:`transformer_engine.jax.autocast`, and
:func:`global_shard_guard` sets the same value that ``autocast(mesh_resource=...)`` sets, so
either way of naming the mesh axes is seen by :func:`global_mesh_resource` (and
``get_mesh_resource``).

The names are recorded, and the modules run unsharded: they never split a weight, a batch or
a sequence over a mesh axis. Data parallelism (``dp_resource``) and pipelining
(``pp_resource``) need nothing from the modules, so they are accepted. Tensor, sequence,
fully-sharded and context parallelism (``tp_resource``, ``tpsp_resource``, ``fsdp_resource``,
``cp_resource``) would change how the modules lay out and compute their tensors, which they do
not do yet: the Flax modules raise NotImplementedError naming the axis instead of silently
running unsharded.

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
from typing import Iterator, Optional

from transformer_engine.jax.autocast import (
    MeshResource,
    autocast,
    get_fp8_recipe,
    get_mesh_resource,
)

__all__ = ["MeshResource", "global_shard_guard", "global_mesh_resource"]

# The MeshResource fields that would change what a module computes, and what they stand for.
_UNSUPPORTED = {"tp_resource": "tensor parallelism", "tpsp_resource": "sequence parallelism",
                "fsdp_resource": "fully-sharded data parallelism",
                "cp_resource": "context parallelism"}


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


def check_unsharded(caller: str) -> None:
    """Raises NotImplementedError, in ``caller``'s name, when the mesh resource in effect asks
    for a kind of parallelism that would change what the modules compute (see the module
    docstring); the modules call it when they are applied."""
    resource = get_mesh_resource()
    for field, feature in _UNSUPPORTED.items():
        axis = getattr(resource, field)
        if axis is not None:
            raise NotImplementedError(
                f"{caller}: {feature} (MeshResource.{field}={axis!r}) is not implemented: the "
                "modules run unsharded. Leave it None; dp_resource and pp_resource are accepted")
