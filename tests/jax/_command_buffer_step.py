"""Three jitted FP8 training steps of a small Flax TransformerLayer on the GPU, for
test_command_buffers.py, which runs this script in fresh processes under different XLA flags
(they are read once, when the GPU backend starts).

    python _command_buffer_step.py OUT.npz HLO.txt

OUT.npz: each step's loss and the last step's input gradient, parameters and FP8 state;
HLO.txt: the compiled step.
"""

from __future__ import annotations

import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import TransformerLayer


def main(out_path: str, hlo_path: str) -> None:
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    layer = TransformerLayer(hidden_size=256, mlp_hidden_size=1024, num_attention_heads=2,
                             hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
                             layernorm_type="layernorm", mlp_activations=("gelu",), use_bias=True,
                             self_attn_mask_type="causal", transpose_batch_sequence=False,
                             enable_relative_embedding=False, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 128, 256), jnp.bfloat16)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
    other, params = flax.core.pop(variables, "params")

    def loss_fn(params, other, x):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = layer.apply({"params": params, **other}, x, deterministic=True)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    @jax.jit
    def step(params, other, x):
        loss, (g_params, g_other, g_x) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
            params, other, x)
        params = jax.tree.map(lambda p, g: p - 1e-2 * g.astype(p.dtype), params, g_params)
        return params, te.update_collections(g_other, other), loss, g_x

    with open(hlo_path, "w") as f:
        f.write(step.lower(params, other, x).compile().as_text())
    losses = []
    for _ in range(3):
        params, other, loss, g_x = step(params, other, x)
        losses.append(loss)
    leaves = jax.tree.leaves((params, other))
    arrays = {"losses": np.asarray(jnp.stack(losses)), "g_x": np.asarray(g_x.astype(jnp.float32))}
    arrays.update({f"leaf{i}": np.asarray(v.astype(jnp.float32)) for i, v in enumerate(leaves)})
    np.savez(out_path, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
