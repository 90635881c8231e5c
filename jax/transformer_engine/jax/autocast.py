"""``fp8_autocast``: the recipe in effect while a model is traced, and the mesh names.

The context only matters at trace time: modules read the recipe when ``jax.jit`` (or eager
execution) traces them, so a function jitted inside the context keeps FP8 even when it is
called outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

from transformer_engine.common.recipe import DelayedScaling, Recipe

__all__ = ["MeshResource", "fp8_autocast", "autocast", "get_fp8_recipe", "get_mesh_resource",
           "is_fp8_enabled"]


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Names of the mesh axes that each kind of parallelism uses (``None``: not used).

    Attributes:
        dp_resource: data-parallel axis (the batch is split over it).
        tp_resource: tensor-parallel axis (weights split along features).
        fsdp_resource: fully-sharded data-parallel axis (weights and batch split over it).
        pp_resource: pipeline-parallel axis.
        cp_resource: context-parallel axis (the sequence split over it).
        tpsp_resource: tensor- and sequence-parallel axis (tensor parallelism over it, and the
            residual stream of a TransformerLayer with ``enable_sequence_parallel`` split
            along the sequence between the blocks).

    Under ``jax.jit`` over a mesh with these axes the dense modules (``DenseGeneral``,
    ``LayerNormDenseGeneral``, ``LayerNormMLP``) lay out their inputs and parameters by their
    logical axes (:mod:`transformer_engine.jax.sharding`): data, tensor, fully-sharded,
    context (the sequence split; the attention modules run context parallel) and sequence
    parallelism.
    """

    dp_resource: Optional[str] = None
    tp_resource: Optional[str] = None
    fsdp_resource: Optional[str] = None
    pp_resource: Optional[str] = None
    cp_resource: Optional[str] = None
    tpsp_resource: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class _Config:
    recipe: Optional[Recipe] = None  # None: FP8 off
    mesh_resource: MeshResource = MeshResource()


_local = threading.local()


def _config() -> _Config:
    return getattr(_local, "config", _Config())


@contextlib.contextmanager
def autocast(enabled: bool = False, recipe: Optional[Recipe] = None,
             mesh_resource: Optional[MeshResource] = None) -> Iterator[None]:
    """Runs the modules traced inside in FP8 with ``recipe`` (``DelayedScaling()`` if None).

    Args:
        enabled: FP8 on (True) or off (False; the modules compute in their dtype).
        recipe: a recipe of :mod:`transformer_engine.common.recipe`.
        mesh_resource: the mesh axis names (recorded; see :class:`MeshResource`).

    Example:
        >>> import transformer_engine.jax as te
        >>> from transformer_engine.common import recipe
        >>> with te.autocast(enabled=True, recipe=recipe.DelayedScaling()):
        ...     te.get_fp8_recipe() == recipe.DelayedScaling()
        True
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"autocast: enabled must be a bool, got {enabled!r}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError("autocast: recipe must be a transformer_engine.common.recipe recipe or "
                        f"None, got {type(recipe).__name__}")
    if mesh_resource is not None and not isinstance(mesh_resource, MeshResource):
        raise TypeError(f"autocast: mesh_resource must be a MeshResource or None, got "
                        f"{type(mesh_resource).__name__}")
    previous = _config()
    _local.config = _Config(
        recipe=(recipe if recipe is not None else DelayedScaling()) if enabled else None,
        mesh_resource=mesh_resource if mesh_resource is not None else previous.mesh_resource,
    )
    try:
        yield
    finally:
        _local.config = previous


@contextlib.contextmanager
def fp8_autocast(enabled: bool = False, fp8_recipe: Optional[Recipe] = None,
                 mesh_resource: Optional[MeshResource] = None) -> Iterator[None]:
    """The same as :func:`autocast`, with the recipe argument named ``fp8_recipe``."""
    with autocast(enabled=enabled, recipe=fp8_recipe, mesh_resource=mesh_resource):
        yield


def get_fp8_recipe() -> Optional[Recipe]:
    """The recipe of the innermost enabled autocast, or None when FP8 is off."""
    return _config().recipe


def is_fp8_enabled() -> bool:
    return _config().recipe is not None


def get_mesh_resource() -> MeshResource:
    return _config().mesh_resource
