"""Four jitted FP8 training steps on the GPU, for test_cuda_graphs.py: writes every array of
the final state and the losses to an .npz. The test runs it with XLA's command buffers forced
on for every kind of call and off (XLA_FLAGS) and compares: an FFI handler captured into a
CUDA graph must compute what it computes launched from the host.

    python _graph_steps_script.py OUT.npz
"""

from __future__ import annotations

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import (
    DenseGeneral,
    DotProductAttention,
    LayerNormDenseGeneral,
    LayerNormMLP,
)

HIDDEN, HEADS, HEAD_DIM, FFN, SEQ, BATCH = 256, 2, 128, 512, 128, 2


class Block(nn.Module):
    """Every op kind of a layer: the norm with its QKV projection, attention (forward only:
    cuDNN's backward may reduce dq in any order, which would make the comparison flaky),
    the MLP with biases (the activation's backward with dbias runs outside the graphs) and an
    output projection."""

    @nn.compact
    def __call__(self, x):
        qkv, _ = LayerNormDenseGeneral(features=3 * HIDDEN, use_bias=True)(x)
        q, k, v = jnp.split(jax.lax.stop_gradient(qkv).reshape(BATCH, SEQ, 3, HEADS, HEAD_DIM),
                            3, axis=2)
        o = DotProductAttention(head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                attn_mask_type="causal", qkv_layout="bshd",
                                transpose_batch_sequence=False)(
            q[:, :, 0], k[:, :, 0], v[:, :, 0], deterministic=True)
        h = qkv[..., :HIDDEN] + o.reshape(BATCH, SEQ, HIDDEN).astype(qkv.dtype)
        mlp, _ = LayerNormMLP(intermediate_dim=FFN, activations=("gelu",), use_bias=True)(
            h, deterministic=True)
        h = h + mlp
        return DenseGeneral(features=HIDDEN, use_bias=True)(h)


def main(out: str) -> None:
    model = Block()
    fp8_recipe = recipe.DelayedScaling(amax_history_len=4)
    x = jax.random.normal(jax.random.PRNGKey(0), (BATCH, SEQ, HIDDEN), jnp.bfloat16)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(model.init)(jax.random.PRNGKey(1), x)

    def loss_fn(params, other, x):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = model.apply({"params": params, **other}, x)
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    @jax.jit
    def step(params, other, x):
        loss, (grads, g_other) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, other, x)
        params = jax.tree.map(lambda p, g: p - 1e-2 * g.astype(p.dtype), params, grads)
        # The gradient of the FP8 state (fp8_metas) is its next value.
        return params, te.update_collections(g_other, other), loss

    params = variables["params"]
    other = {k: v for k, v in variables.items() if k != "params"}
    losses = []
    for _ in range(4):
        params, other, loss = step(params, other, x)
        losses.append(loss)
    arrays = {"loss": np.asarray(jnp.stack(losses))}
    for path, leaf in jax.tree_util.tree_leaves_with_path({"params": params, **other}):
        arrays[jax.tree_util.keystr(path)] = np.asarray(leaf.astype(jnp.float32))
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
