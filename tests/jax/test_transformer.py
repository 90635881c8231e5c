"""MultiHeadAttention, TransformerLayer and RelativePositionBiases against a reference from
plain flax.linen modules with the same parameters (_transformer_reference): encoder and
decoder, pre/post norm, GQA, RoPE in both group methods, every mask, biases, fp32 (values and
gradients) and bf16; FP8 (delayed and current scaling) against fp32 and the fp8_metas that
the gradient returns; decoding step by step against the full causal forward; the named
dropout rng; argument errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import InvalidRngError
from te_jax_tests import _reference as ref
from te_jax_tests import _transformer_reference as tref
from te_jax_tests._tolerances import (
    assert_close,
    assert_relative_max_error,
    assert_relative_rms_error,
)

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import (
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)

B, S, HIDDEN, HEADS, FFN = 2, 16, 64, 4, 128
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)


@jax.jit
def _randomize(params, seed=7):
    """Norm parameters and biases away from (1, 0), so that a wrong one cannot pass."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys, strict=True):
        name = path[-1].key
        noise = 0.2 * jax.random.normal(key, leaf.shape, jnp.float32)
        if name == "scale":
            leaf = (1.0 + noise).astype(leaf.dtype)
        elif name in ("ln_bias", "bias", "wi_bias", "wo_bias"):
            leaf = noise.astype(leaf.dtype)
        out.append(leaf)
    return jax.tree_util.tree_unflatten(tree, out)


def _padding_mask(lq, lk, sq=S, skv=S):
    i = np.arange(sq)[None, :, None]
    j = np.arange(skv)[None, None, :]
    return ((i >= np.array(lq)[:, None, None]) | (j >= np.array(lk)[:, None, None]))[:, None]


def _inputs(dtype=jnp.float32, seq_first=False, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, S, HIDDEN), np.float32) + 0.3
    enc = rng.standard_normal((B, 24, HIDDEN), np.float32)
    if seq_first:
        x, enc = x.swapaxes(0, 1), enc.swapaxes(0, 1)
    return jnp.asarray(x, dtype), jnp.asarray(enc, dtype)


LAYER_CASES = {
    "encoder-causal-rope_consecutive": dict(enable_rotary_pos_emb=True,
                                            enable_relative_embedding=False),
    "encoder-postnorm-padding-gqa-rope_alternate-sbhd-bias-swiglu": dict(
        output_layernorm=True, self_attn_mask_type="padding", num_gqa_groups=2,
        enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate",
        transpose_batch_sequence=True, use_bias=True, enable_relative_embedding=False,
        mlp_activations=("silu", "linear")),
    "encoder-relpos-no_mask-rmsnorm-zero_centered": dict(
        self_attn_mask_type="no_mask", layernorm_type="rmsnorm", zero_centered_gamma=True),
    "decoder-relpos-padding_causal-mqa-residual_post_ln": dict(
        layer_type=TransformerLayerType.DECODER, self_attn_mask_type="padding_causal",
        num_gqa_groups=1, apply_residual_connection_post_layernorm=True,
        scale_attn_logits=True, mlp_activations=("gelu",)),
    "encoder-unfused_qkv-window-gqa": dict(fuse_qkv_params=False, window_size=(3, 0),
                                           num_gqa_groups=2, enable_relative_embedding=False),
}


def _layer_setup(case, dtype=jnp.float32, **overrides):
    kw = dict(LAYER_CASES[case], **overrides)
    layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                             dtype=dtype, **NO_DROPOUT, **kw)
    seq_first = layer.transpose_batch_sequence
    x, enc = _inputs(dtype, seq_first)
    decoder = layer.layer_type == TransformerLayerType.DECODER
    args = dict(encoded=enc if decoder else None)
    if "padding" in layer.self_attn_mask_type:
        args["attention_mask"] = _padding_mask([S, 11], [S, 11])
    if decoder:
        args["encoder_decoder_mask"] = _padding_mask([S, S], [24, 19], S, 24)
    init = jax.jit(lambda k, x: layer.init(k, x, deterministic=True, **args)["params"])
    params = nn.meta.unbox(init(jax.random.PRNGKey(1), x))
    return layer, _randomize(params), x, args


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_flax_reference_fp32(case):
    layer, params, x, args = _layer_setup(case)
    out = jax.jit(lambda p, x: layer.apply({"params": p}, x, deterministic=True, **args))(
        params, x)
    expected = jax.jit(lambda p, x: tref.transformer_layer(layer, p, x, **args))(params, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, expected, "float32")


# The gradients of the GQA + RoPE + padding encoder and the relative-bias + MQA decoder
# cover every custom VJP in the layer (fused and jnp attention, both norms, every GEMM).
@pytest.mark.parametrize("case", ["encoder-postnorm-padding-gqa-rope_alternate-sbhd-bias-swiglu",
                                  "decoder-relpos-padding_causal-mqa-residual_post_ln"])
def test_layer_gradients_match_flax_reference_fp32(case):
    layer, params, x, args = _layer_setup(case)
    c = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), x.dtype)

    def ours(p, x):
        return jnp.sum(layer.apply({"params": p}, x, deterministic=True, **args) * c)

    def reference(p, x):
        return jnp.sum(tref.transformer_layer(layer, p, x, **args) * c)

    grads = jax.jit(jax.grad(ours, argnums=(0, 1)))(params, x)
    grads_ref = jax.jit(jax.grad(reference, argnums=(0, 1)))(params, x)
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(grads_ref)[0])
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        try:
            assert_close(g, flat_ref[path], "float32")
        except AssertionError as err:
            raise AssertionError(f"{jax.tree_util.keystr(path)}: {err}") from None


def test_layer_bf16_is_close_to_the_fp32_reference():
    # The decoder with RoPE as well: both attention paths, the RoPE kernel and every GEMM.
    layer, params, x, args = _layer_setup("decoder-relpos-padding_causal-mqa-residual_post_ln",
                                          jnp.bfloat16, enable_rotary_pos_emb=True)
    out = jax.jit(lambda p, x: layer.apply({"params": p}, x, deterministic=True, **args))(
        params, x)
    assert out.dtype == jnp.bfloat16
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    expected = tref.transformer_layer(layer, params, x.astype(jnp.float32), **args)
    assert_relative_max_error(out, expected, "bfloat16_layer")


MHA_MASKS = ["no_mask", "causal", "padding", "padding_causal", "causal_padding",
             "causal_bottom_right", "padding_causal_bottom_right"]


@pytest.mark.parametrize("mask_type", MHA_MASKS)
def test_mha_masks_match_the_reference(mask_type):
    # Cross-attention of 12 queries over 16 keys (the bottom-right diagonal differs from the
    # top-left one); seq-first inputs, MultiHeadAttention's default layout.
    sq = 12
    x, _ = _inputs(seq_first=True)
    xq, xkv = x[:sq], x
    mha = MultiHeadAttention(head_dim=16, num_attention_heads=HEADS, num_gqa_groups=2,
                             attn_mask_type=mask_type, use_bias=True)
    mask = _padding_mask([sq, 7], [S, 10], sq, S)
    params = _randomize(mha.init(jax.random.PRNGKey(0), xq, xkv, mask)["params"])
    assert set(params) == {"query", "kv", "out"}
    out, ln = jax.jit(lambda p: mha.apply({"params": p}, xq, xkv, mask, deterministic=True))(
        params)
    assert ln is None
    cfg = dict(heads=HEADS, groups=2, head_dim=16, layernorm_type="layernorm", eps=1e-6,
               zero_centered_gamma=False, mask_type=tref._canon(mask_type))
    e, _ = tref.mha(cfg, params, jnp.swapaxes(xq, 0, 1), jnp.swapaxes(xkv, 0, 1), mask,
                    self_attention=False)
    assert_close(out, jnp.swapaxes(e, 0, 1), "float32")


@pytest.mark.parametrize("bias_type", ["pre_scale_bias", "post_scale_bias", None])
def test_mha_bias_and_window_take_the_jnp_path(bias_type):
    x, _ = _inputs()
    mha = MultiHeadAttention(head_dim=16, num_attention_heads=HEADS, attn_bias_type=bias_type,
                             transpose_batch_sequence=False, scale_attn_logits=True,
                             window_size=(4, 2), attn_mask_type="no_mask",
                             return_layernorm_output=True)
    bias = jax.random.normal(jax.random.PRNGKey(5), (1, HEADS, S, S))
    params = _randomize(mha.init(jax.random.PRNGKey(0), x, x, None, bias)["params"])
    out, ln = jax.jit(lambda p: mha.apply({"params": p}, x, x, None, bias,
                                          deterministic=True))(params)
    cfg = dict(heads=HEADS, groups=HEADS, head_dim=16, layernorm_type="layernorm", eps=1e-6,
               zero_centered_gamma=False, mask_type="no_mask", scale_attn_logits=True,
               window=(4, 2), bias_type=bias_type or "post_scale_bias")
    e, e_ln = tref.mha(cfg, params, x, x, None, bias)
    assert_close(out, e, "float32")
    assert_close(ln, e_ln, "norm_float32")


def test_relative_position_biases_match_t5_buckets():
    for bidirectional, (sq, skv) in ((True, (9, 200)), (False, (150, 150))):
        rpb = RelativePositionBiases(num_buckets=32, max_distance=128, num_attention_heads=3)
        v = rpb.init(jax.random.PRNGKey(0), sq, skv, bidirectional)
        table = nn.meta.unbox(v["params"])["rel_embedding"]
        assert table.shape == (3, 32)
        out = rpb.apply(v, sq, skv, bidirectional)
        expected = tref.relative_bias(table, sq, skv, bidirectional)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_defaults_and_parameter_names_follow_nvidia_te():
    mha = MultiHeadAttention(head_dim=16, num_attention_heads=4)
    assert (mha.transpose_batch_sequence, mha.attn_mask_type, mha.fuse_qkv_params,
            mha.scale_attn_logits, mha.scaled_query_init, mha.rotary_pos_emb_windows,
            mha.rotary_pos_emb_group_method, mha.layernorm_epsilon) == (
                True, "causal", True, False, True, (1, 10000), "consecutive", 1e-6)
    layer = TransformerLayer()
    assert (layer.hidden_size, layer.mlp_hidden_size, layer.num_attention_heads,
            layer.hidden_dropout, layer.attention_dropout, layer.intermediate_dropout,
            layer.mlp_activations, layer.transpose_batch_sequence,
            layer.enable_relative_embedding, layer.layer_type) == (
                512, 2048, 8, 0.1, 0.1, 0.1, ("relu",), False, True,
                TransformerLayerType.ENCODER)
    layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                             layer_type=TransformerLayerType.DECODER, output_layernorm=True)
    x, enc = _inputs()
    shapes = jax.tree.map(jnp.shape, jax.eval_shape(
        lambda: layer.init(jax.random.PRNGKey(0), x, enc, deterministic=True))["params"])
    # NVIDIA's relative embedding has logical axes: its parameter comes boxed.
    assert isinstance(shapes["relpos_bias"]["rel_embedding"], nn.LogicallyPartitioned)
    shapes = nn.meta.unbox(shapes)
    assert shapes["relpos_bias"] == {"rel_embedding": (HEADS, 32)}
    assert shapes["self_attention"]["qkv"]["kernel"] == (HIDDEN, 3, HIDDEN)
    assert "scale" not in shapes["self_attention"]["qkv"]  # post-norm: no input norm
    assert set(shapes["encoder_decoder_attention"]) == {"query", "kv", "out"}
    assert shapes["encoder_decoder_attention"]["kv"]["kernel"] == (HIDDEN, 2, HIDDEN)
    assert shapes["mlp"]["wi_kernel"] == (HIDDEN, 1, FFN)
    assert set(shapes["output_layernorm"]) == {"scale", "ln_bias"}


def test_scaled_query_init_divides_the_query_kernel_by_sqrt_head_dim():
    x = jnp.ones((2, 4, 256))
    for scaled, ratio in ((True, 0.25), (False, 1.0)):
        mha = MultiHeadAttention(head_dim=16, num_attention_heads=16, scaled_query_init=scaled)
        k = mha.init(jax.random.PRNGKey(0), x, x)["params"]["qkv"]["kernel"]
        # Each part is variance_scaling(1, fan_in) of its own [256, 256] matrix: std 1/16.
        np.testing.assert_allclose(float(jnp.std(k[:, 1])), 1 / 16, rtol=0.05)
        np.testing.assert_allclose(float(jnp.std(k[:, 0]) / jnp.std(k[:, 2])), ratio, rtol=0.05)


def _fp8_step(layer, fp8_recipe, x, c):
    """jit(step)(params, state) -> (out, (dparams, new state)) of sum(out * c) in FP8."""

    def loss(p, s):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out = layer.apply({"params": p, **s}, x, deterministic=True)
        return jnp.sum(out * c), out

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def _fp32_step(layer, x, c):
    def loss(p):
        out = layer.apply({"params": p}, x, deterministic=True)
        return jnp.sum(out * c), out

    return jax.jit(jax.grad(loss, has_aux=True))


def test_fp8_delayed_scaling_metas_follow_the_gradient_and_stay_close_to_fp32():
    fp8_recipe = recipe.DelayedScaling(amax_history_len=2)
    layer, params, x, _ = _layer_setup("encoder-causal-rope_consecutive")
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(lambda k, x: layer.init(k, x, deterministic=True))(
            jax.random.PRNGKey(1), x)
    metas = variables["fp8_metas"]
    gemms = [(("attention", "qkv"), ""), (("attention", "out"), ""), (("mlp",), "wi_"),
             (("mlp",), "wo_")]
    roles = ("x", "kernel", "grad")
    assert set(metas) == {"attention", "mlp"} and set(metas["attention"]) == {"qkv", "out"}
    assert set(metas["mlp"]) == {f"{g}_{r}_{k}" for g in ("wi", "wo") for r in roles
                                 for k in ("scale", "amax_history")}
    c = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), x.dtype)
    step = _fp8_step(layer, fp8_recipe, x, c)
    (_, new), _ = step(params, {"fp8_metas": metas})
    new = new["fp8_metas"]
    # The amaxes this step saw: the normed input and the kernels (fp32 values), from the
    # reference norm and the parameters; then recipe.DelayedScaling's update (numpy model).
    p = params
    ln = tref.norm(p["attention"]["qkv"], x, "layernorm", 1e-6, False)
    seen = {("attention", "qkv", "x"): np.abs(ln).max(),
            ("attention", "qkv", "kernel"): np.abs(p["attention"]["qkv"]["kernel"]).max(),
            ("attention", "out", "kernel"): np.abs(p["attention"]["out"]["kernel"]).max(),
            ("mlp", "wi_", "kernel"): np.abs(p["mlp"]["wi_kernel"]).max(),
            ("mlp", "wo_", "kernel"): np.abs(p["mlp"]["wo_kernel"]).max()}
    for (*path, role), amax in seen.items():
        prefix = path[1] if path[0] == "mlp" else ""
        group = new["mlp"] if path[0] == "mlp" else new["attention"][path[1]]
        history, scale = ref.delayed_update(np.array([amax, 0.0], np.float32), 1.0,
                                            "float8_e4m3")
        np.testing.assert_allclose(np.asarray(group[f"{prefix}{role}_amax_history"]), history,
                                   rtol=1e-5, err_msg=f"{path} {role}")
        np.testing.assert_allclose(float(group[f"{prefix}{role}_scale"][0]), scale, rtol=1e-5)
    # Every GEMM's three roles were measured: an amax (now in the history's last slot) > 0.
    for path, prefix in gemms:
        group = new["attention"][path[1]] if path[0] == "attention" else new["mlp"]
        for role in roles:
            assert float(group[f"{prefix}{role}_amax_history"][-1]) > 0, (path, prefix, role)
    # The second step runs on those scales: close to the fp32 layer.
    (g8, _), out8 = step(params, {"fp8_metas": new})
    g32, out32 = _fp32_step(layer, x, c)(params)
    assert_relative_max_error(out8, out32, "fp8_forward_vs_fp32")
    for a, e in zip(jax.tree.leaves(g8), jax.tree.leaves(g32), strict=True):
        assert_relative_rms_error(a, e, "fp8_backward_vs_fp32")


def test_first_step_rule_changes_no_bit_after_the_first_step(monkeypatch):
    """Past its first step the delayed-scaling state takes every gated call's early return, so
    a step traced without the rule (quantizer.first_step_rule, the benchmarks' probe of its
    cost) gives the same output, gradients and next state, bit for bit; on a first step the
    two differ (the rule's scales come from the tensors' own amaxes)."""
    from transformer_engine.jax import quantizer

    fp8_recipe = recipe.DelayedScaling(amax_history_len=3)
    layer, params, x, _ = _layer_setup("encoder-causal-rope_consecutive")
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(lambda k, x: layer.init(k, x, deterministic=True))(
            jax.random.PRNGKey(1), x)
    c = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), x.dtype) * 1e-3
    first = {"fp8_metas": variables["fp8_metas"]}
    (_, state), _ = _fp8_step(layer, fp8_recipe, x, c)(params, first)  # the first step
    runs = {}
    for rule in (True, False):
        monkeypatch.setattr(quantizer, "first_step_rule", rule)
        step = _fp8_step(layer, fp8_recipe, x, c)  # (traced afresh: the rule is read then)
        runs[rule] = (step(params, state), step(params, first))
    later_on, first_on = runs[True]
    later_off, first_off = runs[False]
    for a, b in zip(jax.tree.leaves(later_on), jax.tree.leaves(later_off), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(first_on), jax.tree.leaves(first_off),
                               strict=True))


def test_fp8_current_scaling_is_close_to_fp32_and_keeps_no_state():
    fp8_recipe = recipe.Float8CurrentScaling()
    layer, params, x, args = _layer_setup("decoder-relpos-padding_causal-mqa-residual_post_ln")
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = jax.jit(lambda k, x: layer.init(k, x, deterministic=True, **args))(
            jax.random.PRNGKey(1), x)
    assert set(variables) == {"params"}
    c = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), x.dtype)

    def loss(p, fp8):
        with te.fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe):
            out = layer.apply({"params": p}, x, deterministic=True, **args)
        return jnp.sum(out * c), out

    g8, out8 = jax.jit(jax.grad(lambda p: loss(p, True), has_aux=True))(params)
    g32, out32 = jax.jit(jax.grad(lambda p: loss(p, False), has_aux=True))(params)
    assert_relative_max_error(out8, out32, "fp8_forward_vs_fp32")
    for a, e in zip(jax.tree.leaves(g8), jax.tree.leaves(g32), strict=True):
        assert_relative_rms_error(a, e, "fp8_backward_vs_fp32")


class _Stack(nn.Module):
    """Two TransformerLayers, as a model stacks them."""

    layer_kw: dict

    @nn.compact
    def __call__(self, x, encoded=None, encoder_decoder_mask=None, decode=False,
                 max_decode_length=None):
        for i in range(2):
            x = TransformerLayer(name=f"layer_{i}", **self.layer_kw)(
                x, encoded, encoder_decoder_mask=encoder_decoder_mask, deterministic=True,
                decode=decode, max_decode_length=max_decode_length)
        return x


DECODE_CASES = {
    # A GPT block: causal encoder layers with RoPE and GQA, one token at a time, then a chunk.
    "gpt-rope-gqa-bshd": (dict(enable_rotary_pos_emb=True, enable_relative_embedding=False,
                               num_gqa_groups=2), (1, 1, 1, 1, 12)),
    # T5 decoder layers: relative biases over the whole cache, cross-attention, seq-first.
    "decoder-relpos-rope_alternate-sbhd": (
        dict(layer_type=TransformerLayerType.DECODER, transpose_batch_sequence=True,
             enable_rotary_pos_emb=True, rotary_pos_emb_group_method="alternate"), (5, 1, 10)),
    # Attention sinks: the full forward and the cache both in jnp, one sink logit per head.
    "gpt-sinks-bshd": (dict(enable_rotary_pos_emb=True, enable_relative_embedding=False,
                            num_gqa_groups=2, softmax_type="learnable"), (3, 1, 12)),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decoding_step_by_step_equals_the_full_causal_forward(case):
    kw, chunks = DECODE_CASES[case]
    stack = _Stack(dict(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                        **NO_DROPOUT, **kw))
    seq_first = kw.get("transpose_batch_sequence", False)
    x, enc = _inputs(seq_first=seq_first)
    decoder = "layer_type" in kw
    extra = dict(encoded=enc, encoder_decoder_mask=_padding_mask([S, S], [24, 17], S, 24),
                 max_decode_length=S) if decoder else {}
    variables = jax.jit(lambda k, x: stack.init(k, x, decode=True, **extra))(
        jax.random.PRNGKey(0), x)
    cache = variables["cache"]
    assert cache["layer_0"]["self_attention" if decoder else "attention"]["cached_key"].shape == (
        (S, B, 2 if not decoder else HEADS, HIDDEN // HEADS) if seq_first
        else (B, S, 2, HIDDEN // HEADS))
    params = nn.meta.unbox(variables["params"])
    full = jax.jit(lambda p, x: stack.apply({"params": p}, x, **extra))(params, x)
    step = jax.jit(lambda p, c, x, m: stack.apply({"params": p, "cache": c}, x, decode=True,
                                                  mutable=["cache"], **dict(extra, **m)))
    seq_axis = 0 if seq_first else 1
    start = 0
    for n in chunks:
        tokens = jax.lax.slice_in_dim(x, start, start + n, axis=seq_axis)
        # The cross-attention's mask covers this call's queries.
        m = dict(encoder_decoder_mask=_padding_mask([n, n], [24, 17], n, 24)) if decoder else {}
        out, mutated = step(params, cache, tokens, m)
        cache = mutated["cache"]
        expected = jax.lax.slice_in_dim(full, start, start + n, axis=seq_axis)
        assert_close(out, expected, "float32")
        start += n
    assert int(cache["layer_1"]["self_attention" if decoder else "attention"]["cache_index"]) == S


@pytest.mark.parametrize("which", ["hidden_dropout", "intermediate_dropout",
                                   "attention_dropout-fused", "attention_dropout-jnp",
                                   "drop_path"])
def test_dropout_draws_from_the_named_rng(which):
    rate_name, _, path = which.partition("-")
    layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS,
                             dropout_rng_name="noise", enable_relative_embedding=path == "jnp",
                             **dict(NO_DROPOUT, **{rate_name: 0.5}))
    x, _ = _inputs()
    params = jax.jit(lambda k, x: layer.init(k, x, deterministic=True))(
        jax.random.PRNGKey(0), x)["params"]
    noisy = jax.jit(lambda p, k: layer.apply({"params": p}, x, rngs={"noise": k}))
    a, b = noisy(params, jax.random.PRNGKey(1)), noisy(params, jax.random.PRNGKey(1))
    c = noisy(params, jax.random.PRNGKey(2))
    clean = jax.jit(lambda p: layer.apply({"params": p}, x, deterministic=True))(params)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.allclose(a, c) and not np.allclose(a, clean)
    with pytest.raises(InvalidRngError):
        jax.eval_shape(lambda: layer.apply({"params": params}, x,
                                           rngs={"dropout": jax.random.PRNGKey(1)}))


def _raises(exc, match, module, *args, **kwargs):
    with pytest.raises(exc, match=match):
        jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args, **kwargs))


def test_bad_arguments_give_clear_errors():
    x, enc = _inputs()
    kw = dict(hidden_size=HIDDEN, mlp_hidden_size=FFN, num_attention_heads=HEADS)
    _raises(ValueError, "hidden_size must be a multiple of num_attention_heads",
            TransformerLayer(hidden_size=HIDDEN, num_attention_heads=5), x)
    _raises(ValueError, r"inputs must be \[batch, seqlen, hidden_size=32\]",
            TransformerLayer(hidden_size=32, num_attention_heads=4), x)
    _raises(ValueError, "DECODER layer needs encoded",
            TransformerLayer(layer_type=TransformerLayerType.DECODER, **kw), x)
    _raises(TypeError, "layer_type must be a TransformerLayerType",
            TransformerLayer(layer_type="decoder", **kw), x)
    _raises(ValueError, r"hidden_dropout must be in \[0, 1\)",
            TransformerLayer(hidden_dropout=1.0, **kw), x)
    _raises(ValueError, "hidden_dropout_dims must be axes",
            TransformerLayer(hidden_dropout_dims=(3,), **kw), x)
    _raises(ValueError, r"mlp_activations / mlp_activation_params: activation_params apply "
            r"to clamped_swiglu only; \('relu',\) takes none",
            TransformerLayer(mlp_activation_params={"limit": 7.0}, **kw), x)
    mha = dict(head_dim=16, num_attention_heads=HEADS, transpose_batch_sequence=False)
    _raises(ValueError, "attn_mask_type must be one of",
            MultiHeadAttention(attn_mask_type="upper", **mha), x, x)
    _raises(ValueError, "attn_bias_type must be one of",
            MultiHeadAttention(attn_bias_type="bias", **mha), x, x)
    _raises(ValueError, "rotary_pos_emb_group_method must be one of",
            MultiHeadAttention(enable_rotary_pos_emb=True, rotary_pos_emb_group_method="pairs",
                               **mha), x, x)
    _raises(ValueError, "head dim must be even",
            MultiHeadAttention(enable_rotary_pos_emb=True, head_dim=15, num_attention_heads=4,
                               transpose_batch_sequence=False), x, x)
    _raises(ValueError, "num_gqa_groups dividing num_attention_heads",
            MultiHeadAttention(num_gqa_groups=3, **mha), x, x)
    _raises(ValueError, "needs a mask",
            MultiHeadAttention(attn_mask_type="padding", **mha), x, x)
    _raises(ValueError, "a bias was given but attn_bias_type is 'no_bias'",
            MultiHeadAttention(attn_bias_type="no_bias", **mha), x, x, None,
            jnp.zeros((1, HEADS, S, S)))
    _raises(ValueError, "low_rank_adaptation_scope must be one of",
            MultiHeadAttention(low_rank_adaptation_scope="everything", **mha), x, x)
    _raises(ValueError, r"attention_dropout must be in \[0, 1\)",
            MultiHeadAttention(attention_dropout=-0.1, **mha), x, x)
    _raises(TypeError, "the same dtype", MultiHeadAttention(**mha), x,
            x.astype(jnp.bfloat16))
    # Decoding more tokens than the cache holds.
    m = MultiHeadAttention(**mha)
    cache = m.init(jax.random.PRNGKey(0), x[:, :4], x[:, :4], decode=True)["cache"]
    with pytest.raises(ValueError, match="at most 4 positions"):
        m.apply({"params": m.init(jax.random.PRNGKey(0), x, x)["params"], "cache": cache}, x, x,
                decode=True, mutable=["cache"])
