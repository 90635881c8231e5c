"""MoE token movement (transformer_engine.jax.permutation) against numpy references: the rows'
order, dropping and padding, the weighted sums back, chunk reordering, their gradients and
jit; bad arguments raise naming the op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.permutation import (
    sort_chunks_by_index,
    token_combine,
    token_dispatch,
    token_dispatch_padded,
)


def _routing(tokens: int, experts: int, topk: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    routing = np.zeros((tokens, experts), np.int32)
    for t in range(tokens):
        routing[t, rng.choice(experts, topk, replace=False)] = 1
    return routing


def _reference_dispatch(x: np.ndarray, routing: np.ndarray, rows: int):
    """(permuted rows, their (token, expert)) expert-major, each expert's tokens in order."""
    pairs = [(t, e) for e in range(routing.shape[1]) for t in range(routing.shape[0])
             if routing[t, e]][:rows]
    out = np.zeros((rows, x.shape[1]), x.dtype)
    for r, (t, _) in enumerate(pairs):
        out[r] = x[t]
    return out, pairs


@pytest.mark.parametrize("shape", [(12,), (3, 4)], ids=["2d", "3d"])
def test_dispatch_groups_rows_by_expert_with_their_probs(shape):
    experts, hidden, topk = 5, 8, 2
    tokens = int(np.prod(shape))
    routing = _routing(tokens, experts, topk)
    x = np.random.default_rng(1).standard_normal((tokens, hidden)).astype(np.float32)
    probs = np.random.default_rng(2).random((tokens, experts)).astype(np.float32) * routing
    out, permuted_probs, row_id_map = token_dispatch(
        jnp.asarray(x.reshape(*shape, hidden)), jnp.asarray(routing.reshape(*shape, experts)),
        tokens * topk, probs=jnp.asarray(probs.reshape(*shape, experts)))
    expected, pairs = _reference_dispatch(x, routing, tokens * topk)
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(permuted_probs), [probs[t, e] for t, e in pairs])
    ids = np.full((tokens, experts), -1)
    for r, (t, e) in enumerate(pairs):
        ids[t, e] = r
    np.testing.assert_array_equal(np.asarray(row_id_map), ids)


@pytest.mark.parametrize("extra", [-5, 3], ids=["dropped", "padded"])
def test_dispatch_drops_from_the_last_experts_or_pads_with_zeros(extra):
    tokens, experts, hidden = 10, 4, 6
    routing = _routing(tokens, experts, 2, seed=3)
    x = np.arange(tokens * hidden, dtype=np.float32).reshape(tokens, hidden)
    rows = tokens * 2 + extra
    out, _, row_id_map = token_dispatch(jnp.asarray(x), jnp.asarray(routing), rows)
    expected, pairs = _reference_dispatch(x, routing, rows)
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert int((np.asarray(row_id_map) >= 0).sum()) == len(pairs) == min(rows, tokens * 2)
    # the combine of a dispatch sums each token's kept copies
    back = np.asarray(token_combine(out, row_id_map))
    kept = (np.asarray(row_id_map) >= 0).sum(axis=1)
    np.testing.assert_array_equal(back, x * kept[:, None])


def test_combine_weights_each_row_and_writes_inp_dtype():
    tokens, experts, hidden = 16, 6, 4
    routing = _routing(tokens, experts, 3, seed=4)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((tokens, hidden)), jnp.bfloat16)
    w = np.random.default_rng(6).random((tokens, experts)).astype(np.float32) * routing
    out, _, row_id_map = token_dispatch(x, jnp.asarray(routing), int(routing.sum()))
    back = token_combine(out, row_id_map, jnp.asarray(w))
    assert back.dtype == jnp.bfloat16 and back.shape == (tokens, hidden)
    expected = np.asarray(x, np.float32) * w.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(back, np.float32), expected, rtol=2 ** -7, atol=1e-6)


def test_gradients_equal_the_dense_formulation():
    """Experts that scale their rows by c_e: through dispatch, the experts and a weighted
    combine, the gradients of x and of the weights are the dense formula's."""
    tokens, experts, hidden = 12, 4, 5
    routing = _routing(tokens, experts, 2, seed=7)
    rows = int(routing.sum())
    x = jnp.asarray(np.random.default_rng(8).standard_normal((tokens, hidden)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(9).random((tokens, experts)) * routing, jnp.float32)
    c = jnp.arange(1.0, experts + 1.0)
    _, _, row_id_map = token_dispatch(x, jnp.asarray(routing), rows)
    expert_of_row = np.zeros(rows, np.int32)
    for t, e in zip(*np.nonzero(np.asarray(row_id_map) >= 0), strict=True):
        expert_of_row[int(row_id_map[t, e])] = e

    def moe(x, w):
        permuted, _, ids = token_dispatch(x, jnp.asarray(routing), rows)
        y = permuted * c[expert_of_row][:, None]
        return jnp.sum(jnp.sin(token_combine(y, ids, w)))

    def dense(x, w):
        y = x * jnp.sum(w * jnp.asarray(routing) * c, axis=1, keepdims=True)
        return jnp.sum(jnp.sin(y))

    got = jax.jit(jax.grad(moe, argnums=(0, 1)))(x, w)
    want = jax.grad(dense, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1] * routing, want[1] * routing, rtol=1e-5, atol=1e-6)


def test_probs_gradient_goes_back_to_its_entry():
    routing = _routing(8, 3, 1, seed=10)
    probs = jnp.asarray(np.random.default_rng(11).random((8, 3)), jnp.float32)
    x = jnp.ones((8, 2))

    def f(p):
        _, permuted, _ = token_dispatch(x, jnp.asarray(routing), 8, probs=p)
        return jnp.sum(permuted * jnp.arange(1.0, 9.0))

    grad = np.asarray(jax.grad(f)(probs))
    _, pairs = _reference_dispatch(np.ones((8, 2)), routing, 8)
    expected = np.zeros((8, 3))
    for r, (t, e) in enumerate(pairs):
        expected[t, e] = r + 1.0
    np.testing.assert_array_equal(grad, expected)


def test_padded_dispatch_pads_each_expert_to_the_alignment():
    tokens, experts, hidden, align = 20, 5, 4, 8
    routing = _routing(tokens, experts, 2, seed=12)
    x = np.arange(tokens * hidden, dtype=np.float32).reshape(tokens, hidden) + 1
    probs = np.random.default_rng(13).random((tokens, experts)).astype(np.float32) * routing
    out, permuted_probs, row_id_map, sizes = jax.jit(
        token_dispatch_padded, static_argnums=(2, 3))(
        jnp.asarray(x), jnp.asarray(routing), tokens * 2, align, jnp.asarray(probs))
    assert out.shape == (tokens * 2 + experts * (align - 1), hidden)
    counts = routing.sum(axis=0)
    np.testing.assert_array_equal(np.asarray(sizes), -(-counts // align) * align)
    out, permuted_probs = np.asarray(out), np.asarray(permuted_probs)
    start = 0
    for e in range(experts):  # each expert's tokens in order, then zero rows
        group = out[start:start + int(sizes[e])]
        np.testing.assert_array_equal(group[:counts[e]], x[routing[:, e] == 1])
        np.testing.assert_array_equal(group[counts[e]:], 0)
        np.testing.assert_array_equal(permuted_probs[start:start + counts[e]],
                                      probs[routing[:, e] == 1, e])
        start += int(sizes[e])
    np.testing.assert_array_equal(out[start:], 0)
    back = np.asarray(token_combine(jnp.asarray(out), row_id_map, jnp.asarray(probs)))
    np.testing.assert_allclose(back, x * probs.sum(axis=1, keepdims=True), rtol=1e-6)


def test_sort_chunks_by_index_reorders_and_its_map_inverts():
    x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    sizes, order = np.array([3, 0, 4, 2]), np.array([2, 0, 3, 1])
    out, row_id_map = jax.jit(sort_chunks_by_index)(jnp.asarray(x), jnp.asarray(sizes),
                                                    jnp.asarray(order))
    chunks = np.split(x[:9], np.cumsum(sizes)[:-1])
    expected = np.concatenate([chunks[i] for i in order] + [x[9:]])
    np.testing.assert_array_equal(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(row_id_map)], x)
    grad = jax.grad(lambda v: jnp.sum(sort_chunks_by_index(v, sizes, order)[0]
                                      * jnp.arange(30.0).reshape(10, 3)))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad),
                                  np.arange(30.0).reshape(10, 3)[np.asarray(row_id_map)])


def test_bad_arguments_name_the_op():
    x, routing = jnp.ones((4, 2)), jnp.ones((4, 3), jnp.int32)
    with pytest.raises(ValueError, match="token_dispatch: routing_map must have one row per "):
        token_dispatch(x, jnp.ones((5, 3)), 4)
    with pytest.raises(ValueError, match="token_dispatch: num_out_tokens must be a Python int"):
        token_dispatch(x, routing, jnp.int32(4))
    with pytest.raises(ValueError, match="token_dispatch: probs must have routing_map's shape"):
        token_dispatch(x, routing, 4, probs=jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="token_dispatch: inp must be"):
        token_dispatch(jnp.ones(4), routing, 4)
    with pytest.raises(ValueError, match="token_dispatch_padded: align_size must be"):
        token_dispatch_padded(x, routing, 4, 0)
    with pytest.raises(ValueError, match="token_combine: merging_probs must be"):
        token_combine(x, jnp.zeros((4, 3), jnp.int32), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="token_combine: row_id_map must be"):
        token_combine(x, jnp.zeros((4, 3)))
    with pytest.raises(ValueError, match="sort_chunks_by_index: split_sizes and sorted_indices"):
        sort_chunks_by_index(x, jnp.array([2, 2]), jnp.array([0, 1, 2]))
