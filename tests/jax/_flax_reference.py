"""The unfused blocks as flax and jax.nn write them: the references of the fused norm,
activation and MLP tests."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_engine.jax.ops import Activation as A

EPS = 1e-6


def _gated(fn):
    def gated(x):
        a, b = jnp.split(x, 2, axis=-1)
        return fn(a) * b

    return gated


# Each activation as jax.nn writes it (GELU: jax's default tanh approximation).
JAX_ACTIVATIONS = {
    A.IDENTITY: lambda x: x,
    A.GELU: jax.nn.gelu,
    A.RELU: jax.nn.relu,
    A.SILU: jax.nn.silu,
    A.QGELU: lambda x: x * jax.nn.sigmoid(1.702 * x),
    A.SRELU: lambda x: jnp.square(jax.nn.relu(x)),
    A.GEGLU: _gated(jax.nn.gelu),
    A.SWIGLU: _gated(jax.nn.silu),
    A.REGLU: _gated(jax.nn.relu),
    A.QGEGLU: _gated(lambda x: x * jax.nn.sigmoid(1.702 * x)),
    A.SREGLU: _gated(lambda x: jnp.square(jax.nn.relu(x))),
    A.GLU: _gated(jax.nn.sigmoid),
}


def flax_norm(norm_type, x, gamma, beta, zero_centered=False):
    """flax's LayerNorm or RMSNorm with this scale (1 + gamma when zero-centered) and bias."""
    scale = gamma + (1.0 if zero_centered else 0.0)
    if norm_type == "layernorm":
        return nn.LayerNorm(epsilon=EPS).apply({"params": {"scale": scale, "bias": beta}}, x)
    return nn.RMSNorm(epsilon=EPS).apply({"params": {"scale": scale}}, x)
