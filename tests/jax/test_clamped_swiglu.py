"""Clamped SwiGLU in JAX (NVIDIA's ``activations=("clamped_silu", "clamped_linear")`` with
``activation_params``): the ops against jax's own clamp, sigmoid and autodiff, FP8 bytes against
the quantization of the fp32 values, the same bytes as PyTorch's, and the fused MLP block and
the Flax modules against an unfused jnp reference (the kernel: tests/common)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import ops
from transformer_engine.jax.activation import activation
from transformer_engine.jax.flax import LayerNormMLP, TransformerLayer

ACT = ("clamped_silu", "clamped_linear")


def clamped_swiglu(h, limit=7.0, alpha=1.702, offset=1.0):
    """The formula with torch.clamp's gradient at the bounds (it passes there), the core's
    convention; jnp.minimum and jnp.clip would split it at a tie."""
    a, b = jnp.split(h, 2, axis=-1)
    g = jnp.where(a > limit, limit, a)
    u = jnp.where(b > limit, limit, jnp.where(b < -limit, -limit, b))
    return g * jax.nn.sigmoid(alpha * g) * (u + offset)


def _x(shape, scale=2.0, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * scale


def test_ops_against_jax_autodiff():
    act = ops.ClampedSwiGLU(0.75, 1.702, 0.5)
    x = _x((48, 64)).at[0, :4].set(0.75).at[1, 32:36].set(-0.75)  # at the bounds too
    ref = clamped_swiglu(x, 0.75, 1.702, 0.5)
    np.testing.assert_allclose(ops.activation_forward(x, act), ref, rtol=1e-6, atol=1e-6)
    dy = _x((48, 32), 1.0, 1)
    dx, dbias, _ = ops.activation_backward(dy, x, act, dbias_dtype=jnp.float32)
    want = jax.vjp(lambda v: clamped_swiglu(v, 0.75, 1.702, 0.5), x)[1](dy)[0]
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dbias, dx.sum(0), rtol=1e-5, atol=1e-5)


def test_fp8_bytes_are_the_quantized_fp32_values():
    act = ops.ClampedSwiGLU()
    x = _x((64, 128), 4.0)
    wide = ops.activation_forward(x, act)
    scale = jnp.array([448.0 / float(jnp.abs(wide).max())], jnp.float32)
    q = ops.activation_forward_fp8(x, act, scale, jnp.float8_e4m3fn)
    want = ops.quantize(wide, scale, jnp.float8_e4m3fn, rowwise=True, columnwise=True)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8),
                                  np.asarray(want.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.columnwise_data).view(np.uint8),
                                  np.asarray(want.columnwise_data).view(np.uint8))


def test_the_same_bytes_as_pytorch():
    torch = pytest.importorskip("torch")
    from transformer_engine.pytorch import ops as torch_ops

    x = _x((32, 96), 3.0)
    dy = _x((32, 48), 1.0, 1)
    mine = ops.ClampedSwiGLU(2.0, 1.5, 1.0)
    theirs = torch_ops.activation.clamped_swiglu(2.0, 1.5, 1.0)
    xt, dyt = (torch.from_numpy(np.array(v)) for v in (x, dy))
    np.testing.assert_array_equal(np.asarray(ops.activation_forward(x, mine)),
                                  torch_ops.activation_forward(xt, theirs).numpy())
    np.testing.assert_array_equal(np.asarray(ops.activation_backward(dy, x, mine)[0]),
                                  torch_ops.activation_backward(dyt, xt, theirs, False)[0].numpy())


def test_nvidia_activation_call_takes_act_params():
    x = _x((4, 2, 16))
    got = activation(x, ACT, act_params={"limit": 0.5, "alpha": 1.0})
    np.testing.assert_allclose(got, clamped_swiglu(x.reshape(4, 32), 0.5, 1.0), rtol=1e-6,
                               atol=1e-6)


def _mlp_reference(v, x, limit):
    p = v["params"]
    mu = x.mean(-1, keepdims=True)
    ln = (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6)
    ln = ln * p["scale"] + p["ln_bias"]
    h = jnp.einsum("bsk,kaf->bsaf", ln, p["wi_kernel"]) + p["wi_bias"]
    a = clamped_swiglu(h.reshape(*h.shape[:-2], -1), limit)
    return a @ p["wo_kernel"] + p["wo_bias"]


@pytest.mark.parametrize("name", ["bf16", "current", "delayed"])
def test_flax_layernorm_mlp_against_the_unfused_reference(name):
    r = {"bf16": None, "current": recipe.Float8CurrentScaling(),
         "delayed": recipe.DelayedScaling()}[name]
    x = _x((2, 16, 64))
    m = LayerNormMLP(intermediate_dim=64, activations=ACT, activation_params={"limit": 1.5},
                     use_bias=True)
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        v = m.init(jax.random.PRNGKey(1), x)
        out, _ = m.apply(v, x)
        grads = jax.grad(lambda p: jnp.sum(m.apply({**v, "params": p}, x)[0] ** 2))(
            v["params"])
    want = _mlp_reference(v, x, 1.5)
    want_grads = jax.grad(lambda p: jnp.sum(_mlp_reference({"params": p}, x, 1.5) ** 2))(
        v["params"])
    # fp32: a few roundings; FP8: the error norm of one E4M3 rounding of each operand (2^-4),
    # and gradients through E5M2 (2^-3) too; a wrong activation errs by O(1).
    rel = 1e-5 if r is None else 2 * 2.0**-4
    assert float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)) < rel
    grel = 1e-5 if r is None else 3 * 2.0**-3
    for k in ("wi_kernel", "wo_kernel", "scale"):
        g, w = grads[k], want_grads[k]
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < grel, k


def test_transformer_layer_takes_mlp_activation_params():
    x = _x((2, 8, 32))
    layer = TransformerLayer(hidden_size=32, mlp_hidden_size=64, num_attention_heads=4,
                             mlp_activations=ACT, mlp_activation_params={"limit": 2.0},
                             hidden_dropout=0.0, attention_dropout=0.0,
                             intermediate_dropout=0.0)
    v = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
    out = layer.apply(v, x, deterministic=True)
    assert out.shape == x.shape and bool(jnp.isfinite(out).all())


@pytest.mark.parametrize("params, error, message", [
    ({"beta": 1.0}, ValueError, r"activation_params of clamped_swiglu "
                                r"takes the keys \('limit', 'alpha', 'glu_linear_offset'\), "
                                r"got unknown \['beta'\]"),
    ({"limit": 0.0}, ValueError, r"activation_params: clamped_swiglu: limit must be a finite "
                                 r"number > 0, got 0.0"),
    ([7.0], TypeError, r"activation_params must be a dict or None, got (list|tuple)"),
])
def test_bad_params_are_clear_errors(params, error, message):
    with pytest.raises(error, match="LayerNormMLP: " + message):
        LayerNormMLP(intermediate_dim=16, activations=ACT, activation_params=params).init(
            jax.random.PRNGKey(0), _x((2, 4, 16)))
    with pytest.raises(ValueError, match=r"CLAMPED_SWIGLU takes parameters"):
        ops.activation_forward(_x((2, 8)), ops.Activation.CLAMPED_SWIGLU)
