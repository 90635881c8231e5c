"""layernorm_mlp and LayerNormMLP against flax (LayerNorm / RMSNorm + Dense + activation +
Dense) in fp32, values and gradients, for every activation; FP8 against numpy models and
fp32 for every recipe; fp8_metas of both GEMMs over steps; the HLO; trace-time errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests import _reference as ref
from te_jax_tests._flax_reference import EPS, JAX_ACTIVATIONS, flax_norm
from te_jax_tests._tolerances import TOLERANCES, assert_close, assert_relative_max_error

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax import hlo
from transformer_engine.jax.flax import LayerNormMLP
from transformer_engine.jax.layernorm_mlp import activation_of

M, K, F = 32, 64, 48
ACTIVATIONS = [("gelu",), ("relu",), ("silu",), ("quick_gelu",), ("squared_relu",),
               ("linear",), ("gelu", "linear"), ("silu", "linear"), ("relu", "linear")]


def _inputs(activations, seed=0):
    a = len(activations)
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    x = jax.random.normal(ks[0], (2, M // 2, K)) * 2 + 0.5
    gamma = 1 + 0.2 * jax.random.normal(ks[1], (K,))
    beta = 0.2 * jax.random.normal(ks[2], (K,))
    k1 = jax.random.normal(ks[3], (K, a, F)) / np.sqrt(K)
    b1 = 0.3 * jax.random.normal(ks[4], (a, F))
    k2 = jax.random.normal(ks[5], (F, K)) / np.sqrt(F)
    b2 = 0.3 * jax.random.normal(ks[6], (K,))
    dy = jax.random.normal(ks[7], (2, M // 2, K))
    return x, gamma, beta, k1, b1, k2, b2, dy


def _reference(norm_type, activations):
    act = JAX_ACTIVATIONS[activation_of(activations)]
    a = len(activations)

    def f(x, gamma, beta, k1, b1, k2, b2):
        y = flax_norm(norm_type, x, gamma, beta)
        h = nn.DenseGeneral((a, F)).apply({"params": {"kernel": k1, "bias": b1}}, y)
        # The gated forms act on [activated half, linear half] along the last axis.
        h = h.reshape(*h.shape[:-2], a * F)
        return nn.Dense(K).apply({"params": {"kernel": k2, "bias": b2}}, act(h))

    return f


# Every activation is checked against jax.nn in test_activation; here the block with four.
@pytest.mark.parametrize("activations", [ACTIVATIONS[0], ACTIVATIONS[4], ACTIVATIONS[6],
                                         ACTIVATIONS[7]], ids="-".join)
def test_matches_flax_values_and_gradients(activations):
    norm_type = "rmsnorm" if len(activations) == 2 else "layernorm"
    x, gamma, beta, k1, b1, k2, b2, dy = _inputs(activations)
    ln = norm_type == "layernorm"

    def ours(x, gamma, beta, k1, b1, k2, b2):
        return te.layernorm_mlp(x, gamma, beta if ln else None, (k1, k2), (b1, b2),
                                norm_type=norm_type, epsilon=EPS, activations=activations)

    args = (x, gamma, beta, k1, b1, k2, b2)
    out, vjp = jax.vjp(jax.jit(ours), *args)
    expected, vjp_ref = jax.vjp(jax.jit(_reference(norm_type, activations)), *args)
    assert out.shape == x.shape
    assert_close(out, expected, "float32")
    names = ("dx", "dgamma", "dbeta", "dk1", "db1", "dk2", "db2")
    for name, a, e in zip(names, vjp(dy), vjp_ref(dy), strict=True):
        if name == "dbeta" and not ln:
            continue
        try:
            assert_close(a, e, "float32")
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _delayed_sets(scales):
    r = recipe.DelayedScaling(amax_history_len=2)
    sets = []
    for s in scales:
        state = te.new_fp8_state(r)
        for role, value in s.items():
            state[role]["scale"] = jnp.array([value], jnp.float32)
        for role in state:  # a history from an earlier step: the stored scales apply
            state[role]["amax_history"] = jnp.array([0.0, 1.0], jnp.float32)
        sets.append(te.make_quantizer_set(r, state))
    return tuple(sets)


@pytest.mark.parametrize("activations", [("gelu",), ("silu", "linear")], ids="-".join)
def test_delayed_fp8_operands_and_output_equal_the_numpy_model(activations):
    x, gamma, beta, k1, b1, k2, b2, _ = _inputs(activations)
    qsets = _delayed_sets([{"x": 8.0, "kernel": 64.0}, {"x": 16.0, "kernel": 32.0}])
    kw = dict(activations=activations, quantizer_sets=qsets)
    out = jax.jit(lambda *a: te.layernorm_mlp(*a[:3], a[3:5], a[5:], **kw))(
        x, gamma, beta, k1, k2, b1, b2)
    q = jax.jit(lambda *a: te.layernorm_mlp_fp8_operands(*a[:3], a[3:5], a[5:], **kw))(
        x, gamma, beta, k1, k2, b1, b2)
    y = np.asarray(te.layernorm(x, gamma, beta, epsilon=EPS)).reshape(M, K)
    e_ln = ref.quantize(y, 8.0, "float8_e4m3")
    np.testing.assert_array_equal(np.asarray(q["ln_out"].data).view(np.uint8), e_ln.view(np.uint8))
    a = len(activations)
    k1_2d, b1_1d = np.asarray(k1).reshape(K, a * F), np.asarray(b1).reshape(a * F)
    # fc1 runs on the FP8 values; its output is kept in fp32 (what the activation reads).
    h = (ref.fake_quantize(y, 8.0, "float8_e4m3") @ ref.fake_quantize(k1_2d, 64.0, "float8_e4m3")
         + b1_1d)
    assert_close(q["fc1_out"], h, "fp8_exact")
    # The activation's FP8 output is the quantization of act(h) (checked bit for bit in
    # test_activation): here against jax.nn, within one E4M3 rounding (2^-4 relative).
    act = JAX_ACTIVATIONS[activation_of(activations)]
    e_act = np.asarray(act(jnp.asarray(q["fc1_out"])))
    got_act = np.asarray(q["act_out"].data, np.float32) / 16.0
    np.testing.assert_allclose(got_act, e_act, rtol=2.0**-4, atol=2.0**-9 / 16)
    np.testing.assert_array_equal(np.asarray(q["act_out"].columnwise_data).view(np.uint8),
                                  np.asarray(q["act_out"].data).T.view(np.uint8))
    e_out = (got_act.astype(np.float64) @ ref.fake_quantize(k2, 32.0, "float8_e4m3")
             + np.asarray(b2))
    assert_close(np.asarray(out).reshape(M, K), e_out, "fp8_exact")


FP8_CASES = [(recipe.DelayedScaling(amax_history_len=4), ("silu", "linear")),
             (recipe.Float8CurrentScaling(), ("gelu",)),
             (recipe.Float8BlockScaling(), ("silu", "linear"))]


@pytest.mark.parametrize("fp8_recipe, activations", FP8_CASES,
                         ids=["delayed-swiglu", "current-gelu", "block-swiglu"])
def test_fp8_module_is_close_to_fp32(fp8_recipe, activations):
    x = _inputs(activations)[0]
    mlp = LayerNormMLP(intermediate_dim=F, activations=activations, use_bias=True,
                       bias_init=nn.initializers.normal(0.3))
    params = jax.jit(mlp.init)(jax.random.PRNGKey(4), x)["params"]
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(mlp.init)(jax.random.PRNGKey(4), x)
    state = {k: v for k, v in variables.items() if k != "params"}

    def loss(p, s, x, fp8):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            out, _ = mlp.apply({"params": p, **s}, x)
        return jnp.sum(jnp.sin(out)), out

    (_, out), g = jax.jit(jax.value_and_grad(lambda p, s, x: loss(p, s, x, True),
                                             argnums=(0, 2), has_aux=True))(params, state, x)
    (_, out_ref), g_ref = jax.jit(jax.value_and_grad(lambda p, x: loss(p, {}, x, False),
                                                     argnums=(0, 1), has_aux=True))(params, x)
    assert_relative_max_error(out, out_ref, "fp8_forward_vs_fp32")
    for a, e in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert_relative_max_error(a, e, "fp8_backward_vs_fp32")


def test_module_parameters_options_and_unfused_paths():
    x = _inputs(("gelu",))[0]
    mlp = LayerNormMLP(intermediate_dim=F, activations=("silu", "linear"), use_bias=True,
                       layernorm_type="rmsnorm", intermediate_dropout_rate=0.5,
                       return_layernorm_output=True)
    v = jax.jit(mlp.init)(jax.random.PRNGKey(0), x)
    shapes = jax.tree.map(jnp.shape, v["params"])
    assert shapes == {"scale": (K,), "wi_kernel": (K, 2, F), "wi_bias": (2, F),
                      "wo_kernel": (F, K), "wo_bias": (K,)}
    fused, ln = jax.jit(lambda v, x: mlp.apply(v, x, deterministic=True))(v, x)
    assert_close(ln, te.layernorm(x, v["params"]["scale"], None, norm_type="rmsnorm",
                                  epsilon=EPS), "norm_float32")
    # Dropout runs the unfused parts: the same block where the mask keeps an element.
    dropped, _ = jax.jit(lambda v, x: mlp.apply(v, x, rngs={"dropout": jax.random.PRNGKey(1)}))(
        v, x)
    assert dropped.shape == fused.shape and not np.allclose(dropped, fused)
    no_drop = mlp.clone(intermediate_dropout_rate=1e-9)
    unfused, _ = jax.jit(lambda v, x: no_drop.apply(v, x, rngs={"dropout": jax.random.PRNGKey(1)}))(
        v, x)
    assert_close(unfused, fused, "float32")
    plain = LayerNormMLP(intermediate_dim=F, enable_layernorm=False)
    vp = jax.jit(plain.init)(jax.random.PRNGKey(0), x)
    assert set(vp["params"]) == {"wi_kernel", "wo_kernel"}
    e = jax.nn.gelu(x @ vp["params"]["wi_kernel"][:, 0]) @ vp["params"]["wo_kernel"]
    out, no_ln = jax.jit(plain.apply)(vp, x)
    assert no_ln is None  # NVIDIA's (out, ln_out) pair, ln_out None unless asked for
    assert_close(out, e, "float32")
    # Without a norm, ln_out is the input itself (what the first GEMM reads).
    _, ln_in = jax.jit(plain.clone(return_layernorm_output=True).apply)(vp, x)
    assert_close(ln_in, x, "float32")


def test_fp8_metas_of_both_gemms_follow_the_recipe_over_steps():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=3)
    x0 = _inputs(("gelu",))[0]
    mlp = LayerNormMLP(intermediate_dim=F)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(mlp.init)(jax.random.PRNGKey(1), x0)
    params, metas = variables["params"], variables["fp8_metas"]
    roles = [(g, r) for g in ("wi", "wo") for r in ("x", "kernel", "grad")]
    assert sorted(metas) == sorted(f"{g}_{r}_{k}" for g, r in roles
                                   for k in ("scale", "amax_history"))

    def loss(p, metas, x, c):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out, _ = mlp.apply({"params": p, "fp8_metas": metas}, x)
        return jnp.sum(out * c)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    model = {gr: (np.zeros(3, np.float32), 1.0) for gr in roles}
    fmts = {"x": "float8_e4m3", "kernel": "float8_e4m3", "grad": "float8_e5m2"}
    for t in range(3):
        x = x0 * (1.0 + 2.0 * t)
        c = jax.random.normal(jax.random.PRNGKey(10 + t), x.shape) * 10.0 ** (t - 1)
        qsets = tuple(te.make_quantizer_set(fp8_recipe, {
            r: {"scale": metas[f"{g}_{r}_scale"], "amax_history": metas[f"{g}_{r}_amax_history"]}
            for r in ("x", "kernel", "grad")}) for g in ("wi", "wo"))
        q = te.layernorm_mlp_fp8_operands(x, params["scale"], params["ln_bias"],
                                          (params["wi_kernel"], params["wo_kernel"]),
                                          quantizer_sets=qsets)
        _, (_, new_metas) = step(params, metas, x, c)
        y = np.asarray(te.layernorm(x, params["scale"], params["ln_bias"], epsilon=EPS))
        # The gradient of fc1's output from the FP8 values of the step (fp64 GEMM).
        # (The first step's scales are those of the tensors' own amaxes.)
        s_g2 = ref.step_scale(*model[("wo", "grad")], np.abs(c).max(), "float8_e5m2")
        s_k2 = ref.step_scale(*model[("wo", "kernel")], np.abs(params["wo_kernel"]).max(),
                              "float8_e4m3")
        da = (ref.fake_quantize(np.asarray(c).reshape(M, K), s_g2, "float8_e5m2")
              @ ref.fake_quantize(params["wo_kernel"], s_k2, "float8_e4m3").T)
        h = jnp.asarray(q["fc1_out"])
        dh = jax.vjp(jax.nn.gelu, h)[1](jnp.asarray(da, jnp.float32))[0]
        amaxes = {("wi", "x"): np.abs(y).max(), ("wi", "kernel"): np.abs(params["wi_kernel"]).max(),
                  ("wi", "grad"): np.abs(dh).max(), ("wo", "x"): float(q["act_out"].amax[0]),
                  ("wo", "kernel"): np.abs(params["wo_kernel"]).max(),
                  ("wo", "grad"): np.abs(c).max()}
        for g, r in roles:
            history = model[(g, r)][0].copy()
            history[0] = amaxes[(g, r)]
            model[(g, r)] = ref.delayed_update(history, model[(g, r)][1], fmts[r])
            # fc1's gradient comes from a GEMM, whose accumulation differs on tensor cores.
            on_gpu = jax.default_backend() == "gpu" and (g, r) == ("wi", "grad")
            rtol = TOLERANCES["amax_cuda_vs_cpu"] if on_gpu else 1e-5
            np.testing.assert_allclose(np.asarray(new_metas[f"{g}_{r}_amax_history"]),
                                       model[(g, r)][0], rtol=rtol, err_msg=f"{g}_{r}")
            np.testing.assert_allclose(float(new_metas[f"{g}_{r}_scale"][0]), model[(g, r)][1],
                                       rtol=rtol, err_msg=f"{g}_{r}")
        metas = new_metas


@pytest.mark.parametrize("activations", [("gelu",), ("silu", "linear")], ids="-".join)
def test_hlo_each_kernel_writes_the_next_fp8_operand(activations):
    x = _inputs(activations)[0]
    mlp = LayerNormMLP(intermediate_dim=F, activations=activations, use_bias=True)
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.DelayedScaling()):
        variables = jax.jit(mlp.init)(jax.random.PRNGKey(1), x)

        def loss(v, x):
            return jnp.sum(jnp.sin(mlp.apply(v, x)[0]))

        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).compile().as_text()
    counts = hlo.target_counts(text)
    assert hlo.count_fp8_gemms(text) == 6
    # Each delayed-scaling cast comes with its first-step twin: the same op gated on the
    # role's history (one early return once the history holds an amax); that step's scale
    # is jnp, which XLA fuses.
    assert counts["te_quantize_ffi"] == 2  # the two kernels; every activation comes fused
    assert counts["te_norm_forward_ffi"] == 2 and counts["te_activation_forward_ffi"] == 2
    # The bias gradient + cast of d_out, and dact + dbias + cast of fc1's output gradient;
    # the calls with dbias go to their own target (left out of XLA's CUDA graphs), their
    # gated twins write no dbias.
    assert counts["te_activation_backward_dbias_ffi"] == 2
    assert counts["te_activation_backward_ffi"] == 2
    assert counts["te_delayed_scaling_update_ffi"] == 2  # the step's: one per GEMM


def test_bad_inputs_fail_at_trace_time():
    x, gamma, beta, k1, b1, k2, b2, _ = _inputs(("gelu",))
    f = te.layernorm_mlp
    with pytest.raises(ValueError, match="activations must be one of"):
        f(x, gamma, beta, (k1, k2), activations=("tanh",))
    with pytest.raises(ValueError, match=r"kernel_1 must have shape \[64, 2 \* F\]"):
        f(x, gamma, beta, (k1, k2), activations=("silu", "linear"))
    with pytest.raises(ValueError, match=r"kernel_2 must have shape \[48, N\]"):
        f(x, gamma, beta, (k1, k2[:16]))
    with pytest.raises(ValueError, match="bias_2 must have shape"):
        f(x, gamma, beta, (k1, k2), (b1, b2[:3]))
    with pytest.raises(TypeError, match="biases must be None or a pair"):
        f(x, gamma, beta, (k1, k2), (b1,))
    with pytest.raises(TypeError, match="quantizer_sets must be None or a pair"):
        f(x, gamma, beta, (k1, k2), quantizer_sets=te.make_quantizer_set())
    mixed = (te.make_quantizer_set(recipe.Float8CurrentScaling()),
             te.make_quantizer_set(recipe.Float8BlockScaling()))
    with pytest.raises(ValueError, match="the same recipe"):
        f(x, gamma, beta, (k1, k2), quantizer_sets=mixed)
    current = (te.make_quantizer_set(recipe.Float8CurrentScaling()),) * 2
    with pytest.raises(ValueError, match="multiple of 16.*F=40"):
        f(x, gamma, beta, (k1[..., :40], k2[:40]), quantizer_sets=current)
    with pytest.raises(ValueError, match="layernorm_mlp: norm_type must be"):
        f(x, gamma, beta, (k1, k2), norm_type="groupnorm")
    with pytest.raises(ValueError, match="intermediate_dropout_rate"):
        LayerNormMLP(intermediate_dim=F, intermediate_dropout_rate=1.0).init(
            jax.random.PRNGKey(0), x)


def test_vmap_and_layernorm_output_gradient():
    x, gamma, beta, k1, b1, k2, b2, dy = _inputs(("gelu",))

    def block(x):
        return te.layernorm_mlp(x, gamma, beta, (k1, k2), (b1, b2), epsilon=EPS,
                                return_layernorm_output=True)

    mapped = jax.jit(jax.vmap(block))(x)
    whole = jax.jit(block)(x)
    for a, e in zip(mapped, whole, strict=True):
        assert_close(a, e, "float32")
    # The norm's output has its own cotangent, added to the block's before the norm's VJP.
    ref_fn = _reference("layernorm", ("gelu",))

    def reference(x):
        return ref_fn(x, gamma, beta, k1, b1, k2, b2), flax_norm("layernorm", x, gamma, beta)

    dln = jax.random.normal(jax.random.PRNGKey(3), x.shape)
    (dx,) = jax.vjp(jax.jit(block), x)[1]((dy, dln))
    (e_dx,) = jax.vjp(jax.jit(reference), x)[1]((dy, dln))
    assert_close(dx, e_dx, "float32")


def test_dtype_is_the_parameters_and_the_output_follows_the_input():
    x = _inputs(("gelu",))[0]
    mlp = LayerNormMLP(intermediate_dim=F, use_bias=True, dtype=jnp.bfloat16)
    v = jax.jit(mlp.init)(jax.random.PRNGKey(0), x)
    assert {a.dtype for a in jax.tree.leaves(v)} == {jnp.dtype(jnp.bfloat16)}
    out, _ = jax.jit(mlp.apply)(v, x)
    assert out.dtype == jnp.float32
    # fp32 math on the bf16 parameters: the same as fp32 parameters holding those values.
    as_fp32 = jax.tree.map(lambda a: a.astype(jnp.float32), v)
    want, _ = jax.jit(LayerNormMLP(intermediate_dim=F, use_bias=True).apply)(as_fp32, x)
    assert_close(out, want, "float32")
    out_bf16, _ = jax.jit(mlp.apply)(v, x.astype(jnp.bfloat16))
    assert out_bf16.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="param_dtype, its former name"):
        LayerNormMLP(intermediate_dim=F, dtype=jnp.bfloat16, param_dtype=jnp.float32).init(
            jax.random.PRNGKey(0), x)
