"""Training a small MLP of DenseGeneral layers in FP8 with optax (delayed scaling).

The FP8 state lives in the ``fp8_metas`` collection. ``jax.value_and_grad`` over
``(params, other_variables)`` returns the parameter gradients and, as the gradient of
``fp8_metas``, the state for the next step, which ``update_collections`` puts in place.

Run: ``python train_mlp_fp8.py`` (CPU or GPU).
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import transformer_engine.jax as te
import transformer_engine.jax.flax as te_flax
from transformer_engine.common import recipe

FP8_RECIPE = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4, margin=0)


class MLP(nn.Module):
    hidden: int = 64
    out: int = 16

    @nn.compact
    def __call__(self, x):
        x = te_flax.DenseGeneral(features=self.hidden)(x)
        x = nn.gelu(x)
        return te_flax.DenseGeneral(features=self.out)(x)


def make_data(key, n=128, d_in=32, d_out=16):
    kx, kt = jax.random.split(key)
    x = jax.random.normal(kx, (n, d_in))
    teacher = jax.random.normal(kt, (d_in, d_out)) / jnp.sqrt(d_in)
    return x, jnp.tanh(x @ teacher)


def train(steps: int = 40, learning_rate: float = 1e-2, seed: int = 0):
    """Returns the losses and the fp8_metas of every step."""
    x, y = make_data(jax.random.PRNGKey(seed))
    model = MLP()
    tx = optax.adam(learning_rate)
    with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
        variables = model.init(jax.random.PRNGKey(seed + 1), x)
    other_variables, params = flax.core.pop(variables, "params")
    opt_state = tx.init(params)

    def loss_fn(params, other_variables, x, y):
        out = model.apply({"params": params, **other_variables}, x)
        return jnp.mean((out - y) ** 2)

    @jax.jit
    def step(params, other_variables, opt_state, x, y):
        with te.fp8_autocast(enabled=True, fp8_recipe=FP8_RECIPE):
            loss, (param_grads, other_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                params, other_variables, x, y)
        updates, opt_state = tx.update(param_grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return loss, params, te.update_collections(other_grads, other_variables), opt_state

    losses, metas = [], []
    for _ in range(steps):
        loss, params, other_variables, opt_state = step(params, other_variables, opt_state, x, y)
        losses.append(float(loss))
        metas.append(jax.device_get(other_variables["fp8_metas"]))
    return losses, metas


if __name__ == "__main__":
    losses, metas = train()
    for i in range(0, len(losses), 5):
        scale = metas[i]["DenseGeneral_0"]["x_scale"][0]
        print(f"step {i:3d}  loss {losses[i]:.5f}  first layer x_scale {scale:.3f}")
