"""Training a small mixture-of-experts layer with optax: the router picks each token's top-2
experts, the tokens move to their experts (token_dispatch), the experts' two dense layers run
as grouped GEMMs over the sorted tokens (grouped_dense, group sizes on the device), and the
results come back weighted by the router's probabilities (token_combine); the load-balancing
loss keeps the experts in use. One jitted step, whatever the routing.

``--fp8`` runs the experts' GEMMs in FP8 (current scaling): FP8 grouped GEMMs need group sizes
that are multiples of 16, so the tokens move with token_dispatch_padded, which pads each
expert's rows with zero rows and gives the padded sizes.

Run: ``python train_moe.py [--fp8]`` (CPU or GPU).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.permutation import (
    token_combine,
    token_dispatch,
    token_dispatch_padded,
)
from transformer_engine.jax.router import fused_moe_aux_loss, fused_topk_with_score_function

TOKENS, HIDDEN, FFN, EXPERTS, TOPK = 256, 32, 64, 8, 2
AUX_COEFF = 1e-2


def init(key):
    k_router, k_in, k_out = jax.random.split(key, 3)
    return {
        "router": jax.random.normal(k_router, (HIDDEN, EXPERTS)) * 0.1,
        "fc1": jax.random.normal(k_in, (EXPERTS, HIDDEN, FFN)) / jnp.sqrt(HIDDEN),
        "fc2": jax.random.normal(k_out, (EXPERTS, FFN, HIDDEN)) / jnp.sqrt(FFN),
    }


def moe(params, x, fp8: bool = False):
    """x [tokens, hidden] -> (y [tokens, hidden], the load-balancing loss)."""
    logits = x @ params["router"]
    probs, routing_map = fused_topk_with_score_function(logits, TOPK)
    tokens_per_expert = jnp.sum(routing_map, axis=0, dtype=jnp.int32)  # on the device
    if fp8:  # (each expert's rows padded to 16; the padding rows are zeros)
        rows, _, row_id_map, sizes = token_dispatch_padded(x, routing_map, TOKENS * TOPK, 16)
        quantizers = te.make_quantizer_set(recipe.Float8CurrentScaling())
    else:
        rows, _, row_id_map = token_dispatch(x, routing_map, num_out_tokens=TOKENS * TOPK)
        sizes, quantizers = tokens_per_expert, None
    h = jax.nn.gelu(te.grouped_dense(rows, params["fc1"], sizes, quantizer_set=quantizers))
    out = te.grouped_dense(h, params["fc2"], sizes, quantizer_set=quantizers)
    y = token_combine(out, row_id_map, probs)
    scores, _ = fused_topk_with_score_function(logits, TOPK, compute_aux_scores=True)
    return y, fused_moe_aux_loss(scores, tokens_per_expert, TOPK, AUX_COEFF)


def make_data(key):
    """Inputs and targets of a piecewise map: each of four regions has its own linear map,
    which experts can learn one each."""
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (TOKENS, HIDDEN))
    maps = jax.random.normal(kw, (4, HIDDEN, HIDDEN)) / jnp.sqrt(HIDDEN)
    region = (x[:, 0] > 0).astype(jnp.int32) * 2 + (x[:, 1] > 0).astype(jnp.int32)
    return x, jnp.einsum("th,thk->tk", x, maps[region])


def train(steps: int = 60, learning_rate: float = 3e-3, seed: int = 0, fp8: bool = False):
    """Returns the losses (task loss, aux loss) of every step and the last step's tokens per
    expert."""
    x, y = make_data(jax.random.PRNGKey(seed))
    params = init(jax.random.PRNGKey(seed + 1))
    tx = optax.adam(learning_rate)
    opt_state = tx.init(params)

    def loss_fn(params):
        out, aux = moe(params, x, fp8)
        task = jnp.mean((out - y) ** 2)
        return task + aux, (task, aux)

    @jax.jit
    def step(params, opt_state):
        (_, (task, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, task, aux

    losses = []
    for _ in range(steps):
        params, opt_state, task, aux = step(params, opt_state)
        losses.append((float(task), float(aux)))
    _, routing_map = fused_topk_with_score_function(x @ params["router"], TOPK)
    return losses, jax.device_get(jnp.sum(routing_map, axis=0))


if __name__ == "__main__":
    losses, per_expert = train(fp8="--fp8" in sys.argv[1:])
    for i in range(0, len(losses), 10):
        print(f"step {i:3d}  loss {losses[i][0]:.4f}  aux {losses[i][1]:.4f}")
    print("tokens per expert:", per_expert.tolist())
