"""The same routing through PyTorch's moe_permute / moe_unpermute / moe_sort_chunks_by_index
and JAX's token_dispatch / token_combine / sort_chunks_by_index: the same rows in the same
order, the same row-id map, the same sums back (small integers: exact in any order)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from transformer_engine.jax import permutation  # noqa: E402
from transformer_engine.pytorch import permutation as torch_permutation  # noqa: E402


def _case(tokens=24, experts=6, topk=2, hidden=8):
    rng = np.random.default_rng(0)
    routing = np.zeros((tokens, experts), np.int32)
    for t in range(tokens):
        routing[t, rng.choice(experts, topk, replace=False)] = 1
    x = rng.integers(-8, 8, (tokens, hidden)).astype(np.float32)
    probs = (rng.integers(1, 4, (tokens, experts)) * routing).astype(np.float32)
    return routing, x, probs


@pytest.mark.parametrize("dropped", [0, 7])
def test_dispatch_and_combine_match_pytorch(dropped):
    routing, x, probs = _case()
    rows = int(routing.sum()) - dropped
    t_out, t_probs, t_map = torch_permutation.moe_permute_with_probs(
        torch.from_numpy(x), torch.from_numpy(probs), torch.from_numpy(routing), rows)
    j_out, j_probs, j_map = permutation.token_dispatch(jnp.asarray(x), jnp.asarray(routing),
                                                       rows, probs=jnp.asarray(probs))
    np.testing.assert_array_equal(np.asarray(j_out), t_out.numpy())
    np.testing.assert_array_equal(np.asarray(j_probs), t_probs.numpy())
    np.testing.assert_array_equal(np.asarray(j_map), t_map.numpy())
    t_back = torch_permutation.moe_unpermute(t_out, t_map, merging_probs=torch.from_numpy(probs))
    j_back = permutation.token_combine(j_out, j_map, jnp.asarray(probs))
    np.testing.assert_array_equal(np.asarray(j_back), t_back.numpy())


def test_sort_chunks_matches_pytorch():
    _, x, _ = _case()
    sizes, order = np.array([5, 0, 9, 10]), np.array([3, 1, 0, 2])
    t_out = torch_permutation.moe_sort_chunks_by_index(
        torch.from_numpy(x), torch.from_numpy(sizes), torch.from_numpy(order))
    j_out, _ = permutation.sort_chunks_by_index(jnp.asarray(x), jnp.asarray(sizes),
                                                jnp.asarray(order))
    np.testing.assert_array_equal(np.asarray(j_out), t_out.numpy())
