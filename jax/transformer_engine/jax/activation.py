"""``activation(x, activation_type)``: NVIDIA's JAX activation call over the core's kernels.

NVIDIA's convention, kept here: ``x`` is [..., A, K] with A = ``len(activation_type)``, and the
result is [..., K]. For a gated pair such as ``("gelu", "linear")`` (GeGLU), ``x[..., 0, :]``
goes through the activation and multiplies ``x[..., 1, :]``. That is the layout
:func:`transformer_engine.jax.layernorm_mlp.activation` reads on its last axis ([a, b]), so
the call is a reshape around it.

Example:
    >>> import jax.numpy as jnp
    >>> from transformer_engine.jax.activation import activation
    >>> activation(jnp.ones((4, 2, 8)), ("silu", "linear")).shape
    (4, 8)
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

# (the package's name layernorm_mlp is the function, so import from the module by path)
from transformer_engine.jax.layernorm_mlp import activation as _activation
from transformer_engine.jax.layernorm_mlp import activation_of

__all__ = ["activation"]


def activation(x: jax.Array, activation_type: Sequence[str] = ("gelu",),
               quantizer=None, act_params: Optional[dict] = None) -> jax.Array:
    """``activation_type`` applied to ``x`` [..., len(activation_type), K], differentiable;
    returns [..., K] in x's dtype. The activations are the ones
    :func:`transformer_engine.jax.layernorm_mlp.activation_of` names (``("gelu",)``,
    ``("relu",)``, ``("silu",)``, ``("quick_gelu",)``, ``("squared_relu",)``, ``("linear",)``
    and the gated ``("gelu" | "silu" | "relu", "linear")``, ``("clamped_silu",
    "clamped_linear")`` with ``act_params`` ``{"limit", "alpha", "glu_linear_offset"}``)."""
    if quantizer is not None:
        raise NotImplementedError(
            "activation: quantizer is not supported: NVIDIA's quantizer objects have no "
            "counterpart here (the FP8 output of an activation is part of layernorm_mlp)")
    if isinstance(activation_type, str):
        activation_type = (activation_type,)
    activation_type = tuple(activation_type)
    try:
        activation_of(activation_type, act_params)
    except (TypeError, ValueError) as err:
        raise ValueError(f"activation: unsupported activation_type {activation_type!r} ({err})")\
            from None
    x = jnp.asarray(x)
    n = len(activation_type)
    if x.ndim < 2 or x.shape[-2] != n:
        raise ValueError(f"activation: x must have shape [..., {n}, K] for activation_type "
                         f"{activation_type!r} (axis -2 of size len(activation_type)), got "
                         f"{x.shape}")
    return _activation(x.reshape(*x.shape[:-2], n * x.shape[-1]), activation_type, act_params)
