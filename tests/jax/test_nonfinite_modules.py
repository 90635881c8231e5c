"""No silent wrong answers in the Flax modules: an infinity in the input of an FP8 layer gives
a non-finite output wherever the bf16 layer gives one, under every recipe that runs here, so
that overflow checks and loss scalers see it. Delayed scaling records the non-finite amax and
keeps the scale it had."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "delayed-e4m3": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.E4M3,
                                                  amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
MODULES = {
    "DenseGeneral": lambda: DenseGeneral(features=64),
    "LayerNormDenseGeneral": lambda: LayerNormDenseGeneral(features=64),
    "LayerNormMLP": lambda: LayerNormMLP(intermediate_dim=256),
}
M, K = 32, 128


def _input(special: float) -> jax.Array:
    x = np.array(jax.random.normal(jax.random.PRNGKey(0), (M, K)), np.float32)
    x[5, 17] = special
    return jnp.asarray(x, jnp.bfloat16)


def _output(out):
    return out[0] if isinstance(out, tuple) else out  # the fused modules also return ln output


def _bad_rows(y) -> np.ndarray:
    return ~np.isfinite(np.asarray(y, np.float32)).all(axis=-1)


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("name", RECIPES)
def test_nonfinite_input_gives_nonfinite_output(name, module, special):
    layer, r, x = MODULES[module](), RECIPES[name](), _input(special)
    params = layer.init(jax.random.PRNGKey(1), jnp.ones((M, K), jnp.bfloat16))["params"]
    want = _output(layer.apply({"params": params}, x))
    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        state = layer.init(jax.random.PRNGKey(1), jnp.ones((M, K), jnp.bfloat16))
        state = {k: v for k, v in state.items() if k != "params"}
        if state:  # delayed scaling: its fp8_metas are updated in place of the old ones
            out = layer.apply({"params": params, **state}, x, mutable=list(state))[0]
        else:
            out = layer.apply({"params": params}, x)
        got = _output(out)
    assert _bad_rows(want)[5], "the bf16 layer should carry the non-finite row"
    # The same rows are non-finite: the bad row is not hidden, and the finite rows stay finite.
    np.testing.assert_array_equal(_bad_rows(got), _bad_rows(want))


def test_delayed_scaling_keeps_the_scale_after_a_nonfinite_step():
    """The Inf step's amax is recorded in the history; the input's scale stays what it was (a
    non-finite amax changes no scale); the next finite step's output is finite again. (The new
    fp8_metas come back as the gradient of the old ones, as in a training step.)"""
    r = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    layer = DenseGeneral(features=64, use_bias=False)
    x0 = jnp.asarray(jax.random.normal(jax.random.PRNGKey(2), (M, K)), jnp.bfloat16)
    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        variables = layer.init(jax.random.PRNGKey(1), x0)
    kernel, metas = variables["params"]["kernel"], variables["fp8_metas"]

    def loss(kernel, metas, x):
        with te.fp8_autocast(enabled=True, fp8_recipe=r):
            out = layer.apply({"params": {"kernel": kernel}, "fp8_metas": metas}, x)
        return jnp.sum(out.astype(jnp.float32)), out

    grad_step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    def step(metas, x):
        (_, out), (_, new_metas) = grad_step(kernel, metas, x)
        new = te.update_collections({"fp8_metas": new_metas}, {"fp8_metas": metas})
        return out, new["fp8_metas"]

    _, metas = step(metas, x0)
    before = float(metas["x_scale"][0])
    assert before != 1.0, "a finite step updates the scale"
    out, metas = step(metas, _input(float("inf")))
    assert not np.isfinite(np.asarray(out, np.float32)).all()
    assert not np.isfinite(np.asarray(metas["x_amax_history"])).all(), "the Inf amax is recorded"
    assert float(metas["x_scale"][0]) == before
    out, metas = step(metas, x0)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert float(metas["x_scale"][0]) == before  # the Inf is still in the (max) history
