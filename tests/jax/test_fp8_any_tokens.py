"""FP8 layers take any token count: the GEMMs' FP8 operands are padded to the tensor cores'
granule of 16 inside (_fused.fp8_gemm), while the feature dimensions keep their rule of
multiples of 16 with a clear error.

The reference of a run on T tokens is the same layer (same variables) on P = T rounded up to
16 tokens, a shape the GEMMs take without padding: the input's extra rows repeat its last
row, so every amax and scale (after a LayerNorm, after GELU, by blocks) is that of the T real
rows, and the output gradient's extra rows are zeros, so they add exact zeros to the kernel
and bias gradients. The first T rows of that run, its gradients and its next FP8 state (the
gradient of ``fp8_metas`` under delayed scaling) must equal the T-token run's bit for bit.
Besides, the outputs stay within FP8 error of the high-precision layer, and the amax
recorded for DenseGeneral's input is that of the T rows.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import ops
from transformer_engine.jax._fused import fp8_gemm
from transformer_engine.jax.flax import DenseGeneral, LayerNormDenseGeneral, LayerNormMLP
from transformer_engine.jax.quantizer import (
    make_quantizer_set,
    new_fp8_state,
    quantize_role,
    role_mode,
)

RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling}
TOKENS = [1, 8, 17, 1000]
K, N = 32, 48  # features (multiples of 16); LayerNormMLP: hidden K, intermediate N
_INIT = dict(bias_init=nn.initializers.normal(0.5))
_LN_INIT = dict(ln_bias_init=nn.initializers.normal(0.5), scale_init=nn.initializers.normal(1.0))


def _layer(kind: str) -> nn.Module:
    if kind == "DenseGeneral":
        return DenseGeneral(features=N, **_INIT)
    if kind == "LayerNormDenseGeneral":
        return LayerNormDenseGeneral(features=N, use_bias=True, **_INIT, **_LN_INIT)
    return LayerNormMLP(intermediate_dim=N, use_bias=True, **_INIT, **_LN_INIT)


def _apply(layer, variables, x):
    """The layer's output (the fused blocks return NVIDIA's (out, ln_out) pair)."""
    y = layer.apply(variables, x)
    return y if isinstance(layer, DenseGeneral) else y[0]


def _step(layer, fp8_recipe):
    """jitted (params, state, x, dy) -> (output, gradients of (params, state, x)) of
    sum(output * dy)."""

    def loss(p, s, x, dy):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            y = _apply(layer, {"params": p, **s}, x)
        return jnp.sum(y * dy), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    def step(variables, x, dy):
        state = {k: v for k, v in variables.items() if k != "params"}
        (_, y), grads = grad(variables["params"], state, x, dy)
        return y, grads

    return jax.jit(step)


def _check_layer(kind: str, scaling: str, tokens: int, device=None) -> None:
    fp8_recipe = RECIPES[scaling]()
    layer = _layer(kind)
    padded = -(-tokens // 16) * 16
    ks = jax.random.split(jax.random.PRNGKey(tokens), 4)
    x = jax.random.normal(ks[0], (tokens, K)) * 2
    n_out = K if kind == "LayerNormMLP" else N
    dy = jax.random.normal(ks[1], (tokens, n_out))
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = layer.init(ks[2], x)
    # The reference's extra rows: the last real row again (input), zeros (gradient).
    x_ref = jnp.concatenate([x, jnp.repeat(x[-1:], padded - tokens, axis=0)])
    dy_ref = jnp.concatenate([dy, jnp.zeros((padded - tokens, n_out))])
    if device is not None:
        x, dy, x_ref, dy_ref, variables = jax.device_put((x, dy, x_ref, dy_ref, variables),
                                                         device)
    step = _step(layer, fp8_recipe)
    # Delayed scaling: a second step runs with the first step's state (the others keep none).
    for _ in range(2 if scaling == "delayed" else 1):
        y, grads = step(variables, x, dy)
        y_ref, grads_ref = step(variables, x_ref, dy_ref)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref)[:tokens])
        g_params, g_state, g_x = grads
        r_params, r_state, r_x = grads_ref
        np.testing.assert_array_equal(np.asarray(g_x), np.asarray(r_x)[:tokens])
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path((g_params, g_state)),
                                jax.tree.leaves((r_params, r_state)), strict=True):
            if "bias" in jax.tree_util.keystr(path):
                # A bias gradient is a sum over the tokens, which XLA may order differently
                # for 1000 and 1008 rows (the GPU's reduction tiles): a few ulps of fp32.
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)
            else:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if scaling == "delayed" and kind == "DenseGeneral":
            history = np.asarray(g_state["fp8_metas"]["x_amax_history"])
            assert np.max(history) == np.max(np.abs(np.asarray(x)))
        if g_state:
            variables = {"params": variables["params"], **g_state}  # the next state
    y_hp = _apply(layer, {"params": variables["params"]}, x)
    assert float(jnp.max(jnp.abs(y - y_hp)) / jnp.max(jnp.abs(y_hp))) < 0.25


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("kind", ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"])
def test_any_token_count_equals_the_padded_run(kind, scaling, tokens):
    _check_layer(kind, scaling, tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [17, 1000])
@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("kind", ["DenseGeneral", "LayerNormDenseGeneral", "LayerNormMLP"])
def test_cuda_any_token_count_equals_the_padded_run(kind, scaling, tokens):
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    _check_layer(kind, scaling, tokens, device)


@pytest.mark.parametrize("scaling", list(RECIPES))
@pytest.mark.parametrize("m, k", [(17, 32), (1000, 64), (32, 1000), (1, 17)])
def test_gemm_pads_by_hand(scaling, m, k):
    """fp8_gemm on any M and K against the plain GEMM op fed operands padded by hand: the
    quantized rows with FP8 zero rows below (block scale_inv 1 for them) and zero columns
    after K."""
    fp8_recipe = RECIPES[scaling]()
    state = new_fp8_state(fp8_recipe) if fp8_recipe.delayed() else None
    qset = make_quantizer_set(fp8_recipe, state)
    ks = jax.random.split(jax.random.PRNGKey(m + k))
    qa = quantize_role(jax.random.normal(ks[0], (m, k)), qset, "grad")
    qb = quantize_role(jax.random.normal(ks[1], (48, k)), qset, "kernel")
    mode_a, mode_b = role_mode(fp8_recipe, "grad"), role_mode(fp8_recipe, "kernel")
    got = fp8_gemm(qa.data, qa.scale_inv, mode_a, qb.data, qb.scale_inv, mode_b,
                   out_dtype=jnp.float32)
    pm, pk = -(-m // 16) * 16, -(-k // 16) * 16
    a = np.zeros((pm, pk), np.asarray(qa.data).dtype)
    b = np.zeros((48, pk), np.asarray(qb.data).dtype)
    a[:m, :k], b[:, :k] = np.asarray(qa.data), np.asarray(qb.data)
    a_si = np.asarray(qa.scale_inv)
    if ops.ScalingMode(mode_a) == ops.ScalingMode.BLOCK_1X128:
        a_si = np.ones((pm, a_si.shape[1]), np.float32)
        a_si[:m] = np.asarray(qa.scale_inv)
    want = ops.gemm(jnp.asarray(a), jnp.asarray(b), a_scale_inv=jnp.asarray(a_si),
                    b_scale_inv=qb.scale_inv, a_scaling_mode=mode_a, b_scaling_mode=mode_b,
                    transpose_b=True, out_dtype=jnp.float32)[:m]
    assert got.shape == (m, 48)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("make, x_features, match", [
    (lambda: DenseGeneral(features=40), 32, "K=32, N=40"),
    (lambda: DenseGeneral(features=32), 24, "K=24, N=32"),
    (lambda: LayerNormDenseGeneral(features=40), 32, "K=32, N=40"),
    (lambda: LayerNormMLP(intermediate_dim=40), 32, "F=40"),
    (lambda: LayerNormMLP(intermediate_dim=32), 24, "K=24"),
])
def test_feature_dims_must_still_be_multiples_of_16(make, x_features, match):
    x = jnp.ones((17, x_features))
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()), \
            pytest.raises(ValueError, match=rf"multiple of 16, got .*{match}"):
        make().init(jax.random.PRNGKey(0), x)
