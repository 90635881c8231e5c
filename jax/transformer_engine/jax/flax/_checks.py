"""Attribute and argument checks shared by the flax modules, so that a bad setting is
reported in the module's own words (module, attribute, what it takes, what it got) rather
than by an error from deep inside flax, jax or the core."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Optional

import flax.linen as nn

import jax.numpy as jnp
from transformer_engine.jax.quantizer import make_quantizer_set


def check_sizes(op: str, **sizes) -> None:
    """Each size (an int, or a sequence of them such as DenseGeneral's features) must be
    positive: a zero one makes empty parameters and divides by zero in the initializers."""
    for name, value in sizes.items():
        values = tuple(value) if isinstance(value, Sequence) else (value,)
        for v in values or (0,):  # an empty sequence is no size either
            try:  # ints of any kind (numpy's too), not floats or bools
                ok = not isinstance(v, bool) and operator.index(v) > 0
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"{op}: {name} must be positive (an int > 0, or a sequence "
                                 f"of them), got {value!r}")


def check_input_features(module: Any, op: str, inputs: jnp.ndarray, param: str,
                         axis: int = 0) -> None:
    """The input's last axis against the existing parameter ``param`` (its ``axis``) when the
    module is applied to variables made for another size (flax's own error names neither the
    module nor the input)."""
    if not module.has_variable("params", param):
        return
    have = jnp.shape(nn.unbox(module.get_variable("params", param)))
    if inputs.shape[-1] != have[axis]:
        raise ValueError(f"{op}: inputs must have {have[axis]} features on the last axis (the "
                         f"size its parameters were made for; {param} has shape "
                         f"{list(have)}), got shape {list(inputs.shape)}")


def check_float_dtype(op: str, name: str, dtype: Any) -> None:
    """Parameters and computations must be floating point (float32, bfloat16, float16)."""
    try:
        ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        ok = False
    if not ok:
        got = jnp.dtype(dtype).name if _is_dtype(dtype) else repr(dtype)
        raise TypeError(f"{op}: {name} must be a floating-point dtype (float32, bfloat16 or "
                        f"float16), got {got}")


def _is_dtype(dtype: Any) -> bool:
    try:
        jnp.dtype(dtype)
        return True
    except TypeError:
        return False


def quantizer_set_for(op: str, recipe: Any, state: Optional[dict]):
    """make_quantizer_set for a module's GEMM, with a recipe it cannot run reported in the
    module's name."""
    try:
        return make_quantizer_set(recipe, state, use_autocast=False)
    except NotImplementedError as e:
        raise NotImplementedError(f"{op}: the fp8_autocast recipe (fp8_recipe) cannot run "
                                  f"here: {e}") from None


def check_mask(op: str, mask: Any, shape: Optional[tuple], name: str = "mask") -> jnp.ndarray:
    """The attention mask, True (or 1) = masked out, of ``shape`` ([batch, 1, sq, skv]; None:
    not checked). A float mask is refused: it could mean 1 = keep, or be an additive bias, and
    either would be misread."""
    mask = jnp.asarray(mask)
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise TypeError(f"{op}: {name} must be bool (or integer 0/1), True = masked out, got "
                        f"dtype {mask.dtype}")
    if shape is not None and mask.shape != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape [batch, 1, sq, skv] = {list(shape)} "
                         f"(True = masked out), got {list(mask.shape)}")
    return mask


def param_dtype_of(op: str, dtype: Any, param_dtype: Any) -> Any:
    """The parameters' dtype. ``dtype`` has NVIDIA's meaning, the parameters' dtype (the
    computation follows the input's dtype); ``param_dtype``, the name these modules used for
    it while ``dtype`` meant the computation's dtype, is accepted only when it agrees, so an
    old call that asked for a computation dtype fails here instead of running another way."""
    check_float_dtype(op, "dtype", dtype)
    if param_dtype is None:
        return dtype
    check_float_dtype(op, "param_dtype", param_dtype)
    if jnp.dtype(param_dtype) != jnp.dtype(dtype):
        raise TypeError(
            f"{op}: dtype is the parameters' dtype (NVIDIA's meaning; the computation follows "
            f"the input's dtype), and param_dtype, its former name, must be None or equal to "
            f"it, got dtype={jnp.dtype(dtype).name}, param_dtype={jnp.dtype(param_dtype).name}. "
            f"For {jnp.dtype(param_dtype).name} parameters and a {jnp.dtype(dtype).name} "
            f"computation pass dtype={jnp.dtype(param_dtype).name} and an input in "
            f"{jnp.dtype(dtype).name}")
    return dtype


def compute_dtype_of(inputs: jnp.ndarray, param_dtype: Any) -> Any:
    """The computation's dtype: the input's when it is floating point (NVIDIA's convention);
    an integer or bool input is cast to the parameters' dtype."""
    if jnp.issubdtype(inputs.dtype, jnp.floating):
        return inputs.dtype
    return jnp.dtype(param_dtype)


def check_logical_axes(op: str, name: str, axes: Any, rank: Optional[int] = None) -> None:
    """A logical-axis keyword (``kernel_axes``, ``input_axes``, ...): None or a sequence of
    axis names (str, or None for an unnamed axis), one per axis of its tensor when ``rank`` is
    known and the sequence is not empty. Checked here because a wrong one would otherwise be
    found only when a mesh partitions the model."""
    if axes is None:
        return
    ok = isinstance(axes, Sequence) and not isinstance(axes, str)
    if ok and all(a is None or isinstance(a, str) for a in axes):
        if rank is None or len(axes) in (0, rank):
            return
        raise ValueError(f"{op}: {name} must name each of the {rank} axes of its tensor (or be "
                         f"empty), got {tuple(axes)!r}")
    raise TypeError(f"{op}: {name} must be None or a tuple of logical axis names (str or "
                    f"None), got {axes!r}")
