"""The same pre-norm encoder layer, weights, inputs and recipe through PyTorch's
``te.TransformerLayer`` and Flax's ``TransformerLayer`` give the same numbers.

In FP8 every step of the layer runs through the same core op in both frameworks: the norms
fused with the GEMM after them (the norm writes that GEMM's FP8 input), the core's FP8 GEMM,
the GELU of the MLP (it writes FC2's FP8 input) and its backward, and attention, which both
send to the core's attention entry point (its CPU reference here: torch's DotProductAttention
picks the core's "cpu" backend, Flax's MultiHeadAttention calls fused_attn, an FFI call of the
same entry point). Only the residual additions are each framework's own, and an fp32 addition
rounds the same everywhere. So the outputs and the gradients agree bit for bit, and under
delayed scaling the scale of every GEMM's operands follows the same sequence step after step.
The bias gradients too: every linear layer of both takes its bias gradient from the core's
fused bias gradient + cast of its output gradient (after that gradient's amax under current
scaling).

Without FP8 the torch blocks multiply with torch's own GEMM (F.linear) and the Flax blocks
with the core's, so there the two agree to the rounding of the GEMMs' sums only.
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

BATCH, SEQ, HIDDEN, FFN, HEADS = 2, 16, 64, 128, 4
EPS = 1e-5
STEPS = 3
DELAYED = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=2)
CURRENT = recipe.Float8CurrentScaling()

# ------------------------------------------------------------------------------- weights
# Canonical names and layouts are PyTorch's ([out, in]); Q, K, V sit one after the other as
# qkv_weight [3 * hidden, hidden] ([q | k | v] rows, each head's rows together).


def make_weights(seed: int = 0) -> dict:
    """Non-trivial norms and biases: ones or zeros would hide a swapped parameter."""
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return {
        "ln1_gamma": 1.0 + normal(HIDDEN, 0.1), "ln1_beta": normal(HIDDEN, 0.1),
        "qkv_weight": normal((3 * HIDDEN, HIDDEN), HIDDEN**-0.5),
        "qkv_bias": normal(3 * HIDDEN, 0.05),
        "proj_weight": normal((HIDDEN, HIDDEN), HIDDEN**-0.5), "proj_bias": normal(HIDDEN, 0.05),
        "ln2_gamma": 1.0 + normal(HIDDEN, 0.1), "ln2_beta": normal(HIDDEN, 0.1),
        "fc1_weight": normal((FFN, HIDDEN), HIDDEN**-0.5), "fc1_bias": normal(FFN, 0.05),
        "fc2_weight": normal((HIDDEN, FFN), FFN**-0.5), "fc2_bias": normal(HIDDEN, 0.05),
    }


def make_data(steps: int, seed: int = 1):
    """Inputs and output gradients whose magnitudes change from step to step, so that
    delayed scaling has something to follow."""
    rng = np.random.default_rng(seed)
    xs = [(rng.standard_normal((BATCH, SEQ, HIDDEN)) * 2.0**s).astype(np.float32)
          for s in range(steps)]
    dys = [(rng.standard_normal((BATCH, SEQ, HIDDEN)) * 2.0**-s).astype(np.float32)
           for s in range(steps)]
    return xs, dys


def _interleave(rows: np.ndarray) -> np.ndarray:
    """[q | k | v] rows -> per head h [q_h | k_h | v_h]: the fused torch weight's order with
    qkv_weight_interleaved and as many key/value groups as heads."""
    parts = rows.reshape(3, HEADS, -1, *rows.shape[1:])
    return np.swapaxes(parts, 0, 1).reshape(rows.shape).copy()


def _deinterleave(rows: np.ndarray) -> np.ndarray:
    parts = rows.reshape(HEADS, 3, -1, *rows.shape[1:])
    return np.swapaxes(parts, 0, 1).reshape(rows.shape).copy()


# ------------------------------------------------------------------------------- PyTorch


def torch_layer(qkv: str):
    """``qkv``: "separate" (the default query/key/value_weight parameters, [q | k | v]),
    "fused" (fuse_qkv_params, one weight [q | k | v]) or "interleaved" (fuse_qkv_params, one
    weight in head order, NVIDIA TE's default for a fused weight)."""
    return te_torch.TransformerLayer(
        HIDDEN, FFN, HEADS, layernorm_epsilon=EPS, hidden_dropout=0.0, attention_dropout=0.0,
        self_attn_mask_type="causal", params_dtype=torch.float32, device="cpu",
        attn_input_format="bshd", fuse_qkv_params=qkv != "separate",
        qkv_weight_interleaved=qkv == "interleaved", activation="gelu",
        normalization="LayerNorm", bias=True)


def _torch_places(layer, qkv: str) -> dict:
    """Canonical name -> the torch parameter (a list of three for separate q, k, v)."""
    attn, mlp = layer.self_attention.layernorm_qkv, layer.layernorm_mlp
    places = {
        "ln1_gamma": attn.layer_norm_weight, "ln1_beta": attn.layer_norm_bias,
        "proj_weight": layer.self_attention.proj.weight,
        "proj_bias": layer.self_attention.proj.bias,
        "ln2_gamma": mlp.layer_norm_weight, "ln2_beta": mlp.layer_norm_bias,
        "fc1_weight": mlp.fc1_weight, "fc1_bias": mlp.fc1_bias,
        "fc2_weight": mlp.fc2_weight, "fc2_bias": mlp.fc2_bias,
    }
    for kind in ("weight", "bias"):
        if qkv == "separate":
            places[f"qkv_{kind}"] = [getattr(attn, f"{part}_{kind}")
                                     for part in ("query", "key", "value")]
        else:
            places[f"qkv_{kind}"] = getattr(attn, kind)
    return places


def fill_torch(layer, weights: dict, qkv: str) -> None:
    with torch.no_grad():
        for name, place in _torch_places(layer, qkv).items():
            value = weights[name]
            if isinstance(place, list):
                for p, part in zip(place, np.split(value, 3), strict=True):
                    p.copy_(torch.from_numpy(part.copy()))
            else:
                interleave = qkv == "interleaved" and name.startswith("qkv")
                place.copy_(torch.from_numpy(_interleave(value) if interleave else value))


def torch_grads(layer, qkv: str) -> dict:
    grads = {}
    for name, place in _torch_places(layer, qkv).items():
        if isinstance(place, list):
            grads[name] = np.concatenate([p.grad.numpy() for p in place])
        elif qkv == "interleaved" and name.startswith("qkv"):
            grads[name] = _deinterleave(place.grad.numpy())
        else:
            grads[name] = place.grad.numpy().copy()
    return grads


def torch_scales(layer) -> dict:
    """Delayed scaling's scale per GEMM and role, named as in the Flax collection. A
    module's forward columns are (input, weight) per GEMM, its backward column the output
    gradient; the MLP's GEMM 0 is FC1, GEMM 1 is FC2."""
    attn, mlp = layer.self_attention, layer.layernorm_mlp
    scales = {}
    for name, module, gemm in (("qkv", attn.layernorm_qkv, 0), ("out", attn.proj, 0),
                               ("wi", mlp, 0), ("wo", mlp, 1)):
        fwd, bwd = module.scale_fwd.numpy(), module.scale_bwd.numpy()
        scales[f"{name}_x"] = fwd[2 * gemm: 2 * gemm + 1].copy()
        scales[f"{name}_kernel"] = fwd[2 * gemm + 1: 2 * gemm + 2].copy()
        scales[f"{name}_grad"] = bwd[gemm: gemm + 1].copy()
    return scales


def run_torch(weights, xs, dys, fp8_recipe=None, qkv="separate"):
    layer = torch_layer(qkv)
    fill_torch(layer, weights, qkv)
    steps = []
    for x, dy in zip(xs, dys, strict=True):
        layer.zero_grad()
        xt = torch.from_numpy(x).requires_grad_()
        with te_torch.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            out = layer(xt)
        out.backward(torch.from_numpy(dy))
        step = {"out": out.detach().numpy().copy(), "dx": xt.grad.numpy().copy(),
                **{f"d_{k}": v for k, v in torch_grads(layer, qkv).items()}}
        if fp8_recipe is not None and fp8_recipe.delayed():
            step.update({f"scale_{k}": v for k, v in torch_scales(layer).items()})
        steps.append(step)
    return steps


# ---------------------------------------------------------------------------------- Flax


def flax_layer():
    # use_bias, gelu, eps and 1/sqrt(head_dim) on the logits (scale_attn_logits) as the torch
    # layer has them; no relative position biases (torch has none, and they would send
    # attention to the jnp path instead of the core's).
    return te_flax.TransformerLayer(
        hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
        layernorm_type="layernorm", layernorm_epsilon=EPS, hidden_dropout=0.0,
        attention_dropout=0.0, intermediate_dropout=0.0, mlp_activations=("gelu",),
        use_bias=True, self_attn_mask_type="causal", enable_relative_embedding=False,
        fuse_qkv_params=True, transpose_batch_sequence=False, scale_attn_logits=True,
        dtype=jnp.float32)


def flax_params(w: dict) -> dict:
    return {
        "attention": {
            "qkv": {"scale": w["ln1_gamma"], "ln_bias": w["ln1_beta"],
                    # [in, 3, out]: the transposed [q | k | v] rows, split in three.
                    "kernel": w["qkv_weight"].T.reshape(HIDDEN, 3, HIDDEN),
                    "bias": w["qkv_bias"].reshape(3, HIDDEN)},
            "out": {"kernel": w["proj_weight"].T, "bias": w["proj_bias"]},
        },
        "mlp": {"scale": w["ln2_gamma"], "ln_bias": w["ln2_beta"],
                "wi_kernel": w["fc1_weight"].T[:, None, :], "wi_bias": w["fc1_bias"][None],
                "wo_kernel": w["fc2_weight"].T, "wo_bias": w["fc2_bias"]},
    }


def flax_grads(g: dict) -> dict:
    g = jax.tree_util.tree_map(np.asarray, g)
    qkv, out, mlp = g["attention"]["qkv"], g["attention"]["out"], g["mlp"]
    return {
        "ln1_gamma": qkv["scale"], "ln1_beta": qkv["ln_bias"],
        "qkv_weight": qkv["kernel"].reshape(HIDDEN, 3 * HIDDEN).T,
        "qkv_bias": qkv["bias"].reshape(-1),
        "proj_weight": out["kernel"].T, "proj_bias": out["bias"],
        "ln2_gamma": mlp["scale"], "ln2_beta": mlp["ln_bias"],
        "fc1_weight": mlp["wi_kernel"][:, 0, :].T, "fc1_bias": mlp["wi_bias"][0],
        "fc2_weight": mlp["wo_kernel"].T, "fc2_bias": mlp["wo_bias"],
    }


def flax_scales(metas: dict) -> dict:
    attn, mlp = metas["attention"], metas["mlp"]
    scales = {}
    for role in ("x", "kernel", "grad"):
        scales[f"qkv_{role}"] = np.asarray(attn["qkv"][f"{role}_scale"]).reshape(-1)
        scales[f"out_{role}"] = np.asarray(attn["out"][f"{role}_scale"]).reshape(-1)
        scales[f"wi_{role}"] = np.asarray(mlp[f"wi_{role}_scale"]).reshape(-1)
        scales[f"wo_{role}"] = np.asarray(mlp[f"wo_{role}_scale"]).reshape(-1)
    return scales


def run_flax(weights, xs, dys, fp8_recipe=None):
    layer = flax_layer()
    enabled = fp8_recipe is not None
    with te_jax.fp8_autocast(enabled=enabled, fp8_recipe=fp8_recipe):
        variables = layer.init(jax.random.PRNGKey(0), jnp.asarray(xs[0]), deterministic=True)
    others, _ = flax.core.pop(variables, "params")
    params = jax.tree_util.tree_map(jnp.asarray, flax_params(weights))

    def loss(params, others, x, dy):
        out = layer.apply({"params": params, **others}, x, deterministic=True)
        return jnp.sum(out * dy), out

    @jax.jit
    def step(params, others, x, dy):
        with te_jax.fp8_autocast(enabled=enabled, fp8_recipe=fp8_recipe):
            (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
                params, others, x, dy)
        return out, grads

    steps = []
    for x, dy in zip(xs, dys, strict=True):
        out, (g_params, g_others, g_x) = step(params, others, jnp.asarray(x), jnp.asarray(dy))
        result = {"out": np.asarray(out), "dx": np.asarray(g_x),
                  **{f"d_{k}": v for k, v in flax_grads(g_params).items()}}
        if enabled and fp8_recipe.delayed():
            others = te_jax.update_collections(g_others, others)
            result.update({f"scale_{k}": v for k, v in flax_scales(others["fp8_metas"]).items()})
        steps.append(result)
    return steps


# --------------------------------------------------------------------------------- tests

EPS32 = float(np.finfo(np.float32).eps)
# Two orders of the same fp32 sums (a GEMM's K <= FFN = 128 products, a bias gradient's
# BATCH * SEQ = 32 rows) differ by a few units of the result's precision; measured here: at
# most 6 eps of the tensor's largest magnitude. A swapped or mis-laid parameter, a wrong eps,
# scale or activation moves the results by far more.
SUM_ORDER_TOL = 32 * EPS32

def _compare(got_torch, got_flax, what):
    """({key: a line per step where its bits differ}, [the lines beyond SUM_ORDER_TOL])."""
    differ, far = {}, []
    for i, (a, b) in enumerate(zip(got_torch, got_flax, strict=True)):
        assert a.keys() == b.keys(), what
        for key in a:
            x, y = np.ascontiguousarray(a[key]), np.ascontiguousarray(b[key])
            assert x.shape == y.shape, f"{what}, step {i}: {key} shapes {x.shape} {y.shape}"
            n = int(np.sum(x.view(np.uint32) != y.view(np.uint32)))
            if not n:
                continue
            diff, top = float(np.max(np.abs(x - y))), float(np.max(np.abs(y)))
            line = (f"step {i} {key}: {n}/{x.size} elements differ, max |diff| {diff:.3g} "
                    f"({diff / top / EPS32:.2g} eps of max |value| {top:.3g})")
            differ.setdefault(key, []).append(line)
            if diff > SUM_ORDER_TOL * top:
                far.append(line)
    return differ, far


def assert_same_bits(got_torch, got_flax, what):
    """Every tensor the same bits, the bias gradients included: both frameworks take them
    from the core's fused bias gradient + cast of the output gradient."""
    differ, _ = _compare(got_torch, got_flax, what)
    wrong = [line for lines in differ.values() for line in lines]
    assert not wrong, f"{what}: differs between PyTorch and Flax:\n" + "\n".join(wrong)


@pytest.mark.parametrize("qkv", ["separate", "fused", "interleaved"])
def test_fp32_same_to_sum_order(qkv):
    """Without FP8, PyTorch's blocks run their GEMMs through torch (F.linear: te.LayerNorm
    followed by nn.Linear, module/layernorm_linear.py) and Flax's through the core GEMM, so
    the two can only agree to the rounding of the GEMMs' sums (the norms, GELU and attention
    are the same core ops but see inputs a few ulps apart)."""
    weights = make_weights()
    xs, dys = make_data(1)
    got_torch, got_flax = run_torch(weights, xs, dys, qkv=qkv), run_flax(weights, xs, dys)
    _, far = _compare(got_torch, got_flax, "fp32")
    assert not far, "fp32: PyTorch and Flax further apart than their sums' rounding:\n" + \
        "\n".join(far)


# Not "interleaved": its QKV weight holds the same rows in another order, so the GEMM of the
# QKV input's gradient sums over the 3 * hidden features in another order (one element of dx
# rounds differently at step 2 here).
@pytest.mark.parametrize("qkv", ["separate", "fused"])
def test_fp8_delayed_scaling_same_scales_and_bits(qkv):
    """Three steps of HYBRID delayed scaling with inputs growing 2x and output gradients
    shrinking 2x per step: the scale of every GEMM's x, kernel and grad after each step, the
    outputs and the gradients."""
    weights = make_weights()
    xs, dys = make_data(STEPS)
    got_torch = run_torch(weights, xs, dys, DELAYED, qkv=qkv)
    got_flax = run_flax(weights, xs, dys, DELAYED)
    # The scales must have moved, or the sequence would test nothing.
    assert not np.all(got_torch[-1]["scale_qkv_x"] == 1.0)
    assert not np.all(got_torch[-1]["scale_wo_grad"] == 1.0)
    assert_same_bits(got_torch, got_flax, f"delayed scaling, torch qkv {qkv}")


def test_fp8_current_scaling_same_bits():
    weights = make_weights()
    xs, dys = make_data(1)
    assert_same_bits(run_torch(weights, xs, dys, CURRENT), run_flax(weights, xs, dys, CURRENT),
                     "current scaling")
