"""The same layer, inputs and recipe through PyTorch's te.Linear and Flax's DenseGeneral give
the same numbers: the same FP8 scale sequence of delayed scaling, step after step, and, since
both quantize with the same core and multiply with the same core GEMM, bit-identical outputs
and gradients (which they can only be if every quantized operand and scale is identical).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
flax = pytest.importorskip("flax")

import jax.numpy as jnp  # noqa: E402

import transformer_engine.jax as te_jax  # noqa: E402
import transformer_engine.jax.flax as te_flax  # noqa: E402
import transformer_engine.pytorch as te_torch  # noqa: E402
from transformer_engine.common import recipe  # noqa: E402

TOKENS, IN, OUT, STEPS = 32, 64, 48, 4
RECIPES = {
    "delayed_hybrid": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=3),
    "delayed_e4m3_most_recent": recipe.DelayedScaling(
        fp8_format=recipe.Format.E4M3, amax_history_len=2, amax_compute_algo="most_recent", margin=1
    ),
    "current": recipe.Float8CurrentScaling(),
}


def data():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((OUT, IN)) * 0.1).astype(np.float32)
    # Magnitudes change from step to step, so delayed scaling has something to follow.
    xs = [(rng.standard_normal((TOKENS, IN)) * 2.0**s).astype(np.float32) for s in range(STEPS)]
    dys = [(rng.standard_normal((TOKENS, OUT)) * 2.0**-s).astype(np.float32) for s in range(STEPS)]
    return w, xs, dys


def run_torch(r, w, xs, dys):
    model = te_torch.Linear(IN, OUT, bias=True, params_dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(w))
        model.bias.zero_()
    steps = []
    for x, dy in zip(xs, dys, strict=True):
        model.zero_grad()
        xt = torch.from_numpy(x).requires_grad_()
        with te_torch.fp8_autocast(enabled=True, fp8_recipe=r):
            out = model(xt)
        out.backward(torch.from_numpy(dy))
        step = {"out": out.detach().numpy(), "dx": xt.grad.numpy(), "dw": model.weight.grad.numpy()}
        if r.delayed():
            step["scales"] = np.concatenate(
                [model.scale_fwd.numpy(), model.scale_bwd.numpy()]
            ).copy()
        steps.append(step)
    return steps


def run_jax(r, w, xs, dys):
    layer = te_flax.DenseGeneral(features=OUT)
    with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
        variables = layer.init(jax.random.PRNGKey(0), jnp.asarray(xs[0]))
    others, params = flax.core.pop(variables, "params")
    params = {"kernel": jnp.asarray(w.T), "bias": jnp.zeros(OUT, jnp.float32)}

    def loss(params, others, x, dy):
        out = layer.apply({"params": params, **others}, x)
        return jnp.sum(out * dy), out

    def step(params, others, x, dy):
        with te_jax.fp8_autocast(enabled=True, fp8_recipe=r):
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
                params, others, x, dy
            )
        return out, grads

    steps = []
    for x, dy in zip(xs, dys, strict=True):
        out, (g_params, g_others, g_x) = jax.jit(step)(
            params, others, jnp.asarray(x), jnp.asarray(dy)
        )
        result = {
            "out": np.asarray(out),
            "dx": np.asarray(g_x),
            "dw": np.asarray(g_params["kernel"]).T,
        }
        if r.delayed():
            others = te_jax.update_collections(g_others, others)
            metas = others["fp8_metas"]
            result["scales"] = np.concatenate(
                [np.asarray(metas[f"{role}_scale"]).reshape(-1) for role in ("x", "kernel", "grad")]
            )
        steps.append(result)
    return steps


@pytest.mark.parametrize("name", list(RECIPES))
def test_same_numbers_in_both_frameworks(name):
    r = RECIPES[name]
    w, xs, dys = data()
    got_torch = run_torch(r, w, xs, dys)
    got_jax = run_jax(r, w, xs, dys)
    for i, (a, b) in enumerate(zip(got_torch, got_jax, strict=True)):
        for key in a:
            np.testing.assert_array_equal(
                a[key].view(np.uint32),
                np.ascontiguousarray(b[key]).view(np.uint32),
                err_msg=f"{name}, step {i}: {key} differs between PyTorch and JAX",
            )


@pytest.mark.parametrize("name", [n for n in RECIPES if n.startswith("delayed")])
def test_same_first_step_scaled_from_the_tensors_own_amaxes(name):
    # A mean loss's output gradient (2^-22 here) underflows E5M2 at the initial scale of 1;
    # both frameworks scale a tensor whose amax history is empty from its own amax, with the
    # same core calls: the same bits, and a weight gradient near the float32 one.
    r = RECIPES[name]
    w, xs, _ = data()
    dys = [np.full((TOKENS, OUT), 2.0**-22, np.float32)]
    got_torch, got_jax = run_torch(r, w, xs[:1], dys), run_jax(r, w, xs[:1], dys)
    for key in got_torch[0]:
        np.testing.assert_array_equal(got_torch[0][key].view(np.uint32),
                                      np.ascontiguousarray(got_jax[0][key]).view(np.uint32),
                                      err_msg=f"{name}: {key} differs between PyTorch and JAX")
    want = dys[0].T.astype(np.float64) @ xs[0]
    dw = got_torch[0]["dw"]
    assert np.abs(dw).max() > 0
    # E4M3 inputs (2^-4 relative per element), an exact power-of-two gradient.
    assert np.abs(dw - want).max() < 0.1 * np.abs(want).max()
