"""transformer_engine.jax.router on its own (tests/cross/test_same_router.py compares it with
the PyTorch package's router): shapes and dtypes, the finite gradient of sqrt(softplus) where
softplus underflows, the bitmap layout, and errors that name the op and argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.router import (
    RoutingMapFormat,
    ScoreFunction,
    fused_moe_aux_loss,
    fused_topk_with_score_function,
)


def test_probs_keep_the_logits_shape_and_dtype():
    logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 8), jnp.bfloat16)
    probs, routing_map = fused_topk_with_score_function(logits, 2)
    assert probs.shape == (2, 5, 8) and probs.dtype == jnp.bfloat16
    assert routing_map.shape == (2, 5, 8) and routing_map.dtype == jnp.bool_
    assert np.all(np.asarray(routing_map).sum(-1) == 2)
    np.testing.assert_allclose(np.asarray(probs, np.float32).sum(-1), 1.0, rtol=2 ** -7)
    assert np.all((np.asarray(probs) != 0) == np.asarray(routing_map))


def test_sqrtsoftplus_gradient_is_finite_where_softplus_underflows():
    logits = jnp.array([[-200.0, -150.0, 1.0, 0.5]])
    grad = jax.grad(lambda x: jnp.sum(fused_topk_with_score_function(
        x, 3, score_function="sqrtsoftplus")[0] * jnp.arange(4.0)))(logits)
    assert np.all(np.isfinite(np.asarray(grad)))


def test_bitmap_sets_bit_e_mod_8_of_byte_e_div_8():
    logits = jnp.zeros((1, 12)).at[0, jnp.array([1, 9, 11])].set(5.0)
    _, bits = fused_topk_with_score_function(logits, 3, score_function=ScoreFunction.SIGMOID,
                                             routing_map_format=RoutingMapFormat.BITMAP_U8)
    assert bits.dtype == jnp.uint8 and bits.shape == (1, 2)
    np.testing.assert_array_equal(np.asarray(bits), [[1 << 1, (1 << 1) | (1 << 3)]])


def test_aux_loss_formula():
    probs = jnp.full((4, 2), 0.5)
    loss = fused_moe_aux_loss(probs, jnp.array([3, 5]), topk=1, coeff=0.1)
    np.testing.assert_allclose(float(loss), 2 * 0.1 / (1 * 16) * (2.0 * 3 + 2.0 * 5), rtol=1e-6)


def test_bad_arguments_name_the_op():
    logits = jnp.zeros((4, 8))
    with pytest.raises(ValueError, match="fused_topk_with_score_function: topk must be"):
        fused_topk_with_score_function(logits, 9)
    with pytest.raises(ValueError, match="fused_topk_with_score_function: score_function"):
        fused_topk_with_score_function(logits, 2, score_function="relu")
    with pytest.raises(ValueError, match="expert_bias must be None with score_function"):
        fused_topk_with_score_function(logits, 2, expert_bias=jnp.zeros(8))
    with pytest.raises(ValueError, match="num_groups must divide"):
        fused_topk_with_score_function(logits, 2, num_groups=3, group_topk=1)
    with pytest.raises(TypeError, match="scaling_factor must be a Python float"):
        fused_topk_with_score_function(logits, 2, scaling_factor=jnp.float32(2.0))
    with pytest.raises(ValueError, match="fused_moe_aux_loss: tokens_per_expert must be"):
        fused_moe_aux_loss(logits, jnp.zeros(3), 2, 0.1)
