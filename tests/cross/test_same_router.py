"""The same logits through PyTorch's and JAX's MoE routers (transformer_engine.pytorch.router,
transformer_engine.jax.router): the same experts, the same probabilities and scores, the same
gradients of the logits (float32 arithmetic in both, by different libraries: within a few
ulps), the same load-balancing loss."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from transformer_engine.jax import router as jax_router  # noqa: E402
from transformer_engine.pytorch import router as torch_router  # noqa: E402

TOKENS, EXPERTS = 16, 8
CASES = {
    "softmax": dict(topk=2, use_pre_softmax=False, score_function="softmax"),
    "softmax_pre": dict(topk=3, use_pre_softmax=True, score_function="softmax"),
    "sigmoid_bias": dict(topk=2, score_function="sigmoid", bias=True, scaling_factor=2.5),
    "sqrtsoftplus_groups": dict(topk=4, score_function="sqrtsoftplus", num_groups=4,
                                group_topk=2),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid"),
}


def _logits(seed=0):
    return np.random.default_rng(seed).standard_normal((TOKENS, EXPERTS)).astype(np.float32) * 3


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fmt", ["bytemap", "bitmap_u8"])
def test_topk_matches_pytorch(name, fmt):
    c = CASES[name]
    x = _logits()
    g = np.random.default_rng(1).standard_normal((TOKENS, EXPERTS)).astype(np.float32)
    bias = (np.linspace(-1, 1, EXPERTS).astype(np.float32) if c.get("bias") else None)
    groups = (c.get("num_groups"), c.get("group_topk"))
    tx = torch.from_numpy(x).requires_grad_(True)
    t_probs, t_map = torch_router.fused_topk_with_score_function(
        tx, c["topk"], c.get("use_pre_softmax", False), groups[0], groups[1],
        c.get("scaling_factor"), c["score_function"],
        None if bias is None else torch.from_numpy(bias), routing_map_format=fmt)
    (t_probs * torch.from_numpy(g)).sum().backward()

    def f(logits):
        probs, routing_map = jax_router.fused_topk_with_score_function(
            logits, c["topk"], c.get("use_pre_softmax", False), groups[0] or -1,
            groups[1] or -1, c.get("scaling_factor", 1.0), c["score_function"],
            None if bias is None else jnp.asarray(bias), routing_map_format=fmt)
        return jnp.sum(probs * g), (probs, routing_map)

    (_, (j_probs, j_map)), j_grad = jax.jit(jax.value_and_grad(f, has_aux=True))(
        jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(j_map), t_map.numpy())
    np.testing.assert_allclose(np.asarray(j_probs), t_probs.detach().numpy(), rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(j_grad), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_and_loss_match_pytorch(score_function):
    x = _logits(2)
    tx = torch.from_numpy(x).requires_grad_(True)
    t_map, t_scores = torch_router.fused_compute_score_for_moe_aux_loss(tx, 2, score_function)
    tokens_per_expert = t_map.sum(0)
    t_loss = torch_router.fused_moe_aux_loss(t_scores, tokens_per_expert, TOKENS, EXPERTS, 2,
                                             0.01)
    t_loss.backward()

    def f(logits):
        scores, routing_map = jax_router.fused_topk_with_score_function(
            logits, 2, score_function=score_function, compute_aux_scores=True)
        loss = jax_router.fused_moe_aux_loss(scores, jnp.sum(routing_map, 0), 2, 0.01)
        return loss, (scores, routing_map)

    (j_loss, (j_scores, j_map)), j_grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(j_map), t_map.numpy())
    np.testing.assert_allclose(np.asarray(j_scores), t_scores.detach().numpy(), rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(float(j_loss), float(t_loss.detach()), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(j_grad), tx.grad.numpy(), rtol=1e-5, atol=1e-9)
