"""The fp8_metas of DenseGeneral over several steps equal a numpy model of the recipe, and
each step quantizes with the scale that the previous step computed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests import _reference as ref
from te_jax_tests._tolerances import assert_close

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import DenseGeneral

M, K, N = 32, 48, 16
STEPS = 5


def _recipes():
    yield "hybrid-max", recipe.DelayedScaling(amax_history_len=3, margin=1)
    yield "e4m3-most-recent", recipe.DelayedScaling(
        fp8_format=recipe.Format.E4M3, amax_history_len=2, amax_compute_algo="most_recent")
    # Callables (written with jax ops) take the jnp path of the same rule.
    yield "callable", recipe.DelayedScaling(
        amax_history_len=3, amax_compute_algo=lambda h: jnp.max(h, axis=0),
        scaling_factor_compute_algo=lambda amax, scale, fp8_max, r: jnp.where(
            amax > 0, fp8_max / amax / 2.0**r.margin, scale))


@pytest.mark.parametrize("name, fp8_recipe", list(_recipes()), ids=[n for n, _ in _recipes()])
def test_fp8_metas_follow_the_recipe(name, fp8_recipe):
    layer = DenseGeneral(features=N, use_bias=False)
    x0 = jax.random.normal(jax.random.PRNGKey(0), (M, K))
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(1), x0)
    kernel0 = variables["params"]["kernel"]
    metas = variables["fp8_metas"]
    for key in ("x", "kernel", "grad"):
        assert float(metas[f"{key}_scale"][0]) == 1.0
        assert metas[f"{key}_amax_history"].shape == (fp8_recipe.amax_history_len,)

    def loss(kernel, metas, x, c):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = layer.apply({"params": {"kernel": kernel}, "fp8_metas": metas}, x)
        return jnp.sum(out * c), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    model = {r: (np.zeros(fp8_recipe.amax_history_len, np.float32), 1.0)
             for r in ("x", "kernel", "grad")}
    fmt = fp8_recipe.fp8_format
    fmts = {"x": fmt.fwd_dtype_name, "kernel": fmt.fwd_dtype_name, "grad": fmt.bwd_dtype_name}
    for t in range(STEPS):
        # Inputs whose range changes from step to step, so the scales must follow.
        x = x0 * (1.0 + 2.0 * t)
        kernel = kernel0 * (1.0 + 0.5 * (t % 3))
        c = jax.random.normal(jax.random.PRNGKey(10 + t), (M, N)) * 10.0 ** (t - 2)
        (_, out), (_, new_metas) = step(kernel, metas, x, c)
        amaxes = {"x": np.abs(x).max(), "kernel": np.abs(kernel).max(), "grad": np.abs(c).max()}
        # The forward pass used the scales of the state it was given (the first step: those
        # of the tensors' own amaxes).
        used = {r: ref.step_scale(model[r][0], model[r][1], amaxes[r], fmts[r], fp8_recipe.margin)
                for r in model}
        expected_out = (ref.fake_quantize(x, used["x"], fmts["x"])
                        @ ref.fake_quantize(kernel, used["kernel"], fmts["kernel"]))
        assert_close(out, expected_out, "fp8_exact")
        for r in model:
            history, scale = model[r]
            history = history.copy()
            history[0] = amaxes[r]
            algo = "most_recent" if fp8_recipe.amax_compute_algo == "most_recent" else "max"
            model[r] = ref.delayed_update(history, scale, fmts[r], fp8_recipe.margin, algo)
            np.testing.assert_array_equal(np.asarray(new_metas[f"{r}_amax_history"]), model[r][0])
            np.testing.assert_allclose(float(new_metas[f"{r}_scale"][0]), model[r][1], rtol=1e-6)
        metas = te.update_collections({"fp8_metas": new_metas}, {"fp8_metas": metas})["fp8_metas"]


def test_update_collections_replaces_whole_collections():
    from flax.core import FrozenDict

    old = FrozenDict({"params": {"a": 1}, "fp8_metas": {"s": 1}})
    new = te.update_collections({"fp8_metas": {"s": 2}}, old)
    assert isinstance(new, FrozenDict) and new["fp8_metas"]["s"] == 2 and new["params"]["a"] == 1
    assert te.update_collections({"fp8_metas": 3}, {"params": 0}) == {"params": 0, "fp8_metas": 3}


def test_current_and_block_scaling_keep_no_state():
    x = jnp.ones((16, 32))
    for r in (recipe.Float8CurrentScaling(), recipe.Float8BlockScaling()):
        with te.fp8_autocast(enabled=True, fp8_recipe=r):
            variables = DenseGeneral(features=16).init(jax.random.PRNGKey(0), x)
        assert set(variables) == {"params"}


def test_autocast_nesting_and_arguments():
    assert te.get_fp8_recipe() is None
    with te.fp8_autocast(enabled=True, mesh_resource=te.MeshResource(dp_resource="data")):
        assert te.get_fp8_recipe() == recipe.DelayedScaling()
        with te.autocast(enabled=False):
            assert not te.is_fp8_enabled()
            assert te.get_mesh_resource().dp_resource == "data"
        assert te.is_fp8_enabled()
    assert te.get_fp8_recipe() is None
    with pytest.raises(TypeError, match="recipe"):
        with te.fp8_autocast(enabled=True, fp8_recipe="delayed"):
            pass


def test_delayed_scaling_under_vmap_updates_the_state_like_one_call_on_the_batch():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=2)
    state = te.new_fp8_state(fp8_recipe)
    ranges = jnp.array([1.0, 5.0, 2.0])[:, None, None]
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 16, 32)) * ranges
    w = jax.random.normal(jax.random.PRNGKey(1), (32, 16))

    def mapped(state, x):
        qset = te.make_quantizer_set(fp8_recipe, state)
        return _loss(jax.vmap(lambda xi: te.dense(xi, w, quantizer_set=qset))(x))

    def whole(state, x):
        return _loss(te.dense(x, w, quantizer_set=te.make_quantizer_set(fp8_recipe, state)))

    (l_mapped, g_mapped), (l_whole, g_whole) = (jax.jit(jax.value_and_grad(f))(state, x)
                                                 for f in (mapped, whole))
    assert_close(l_mapped, l_whole, "fp8_exact")
    # Equal on the CPU; on a GPU the mapped and the whole-batch GEMMs may round differently.
    for a, e in zip(jax.tree.leaves(g_mapped), jax.tree.leaves(g_whole), strict=True):
        assert_close(a, e, "fp8_exact")
    assert float(g_whole["x"]["amax_history"][1]) == float(jnp.max(jnp.abs(x)))


def _loss(out):
    return jnp.sum(jnp.sin(out))
