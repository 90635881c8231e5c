"""NVIDIA's Flax keywords on our modules: MultiHeadAttention's qkv_layout packings give the
default's numbers from the same weights; RelativePositionBiases' dtype is the parameters'
dtype; the logical-axis keywords annotate and never change numbers; LoRA on the dense
modules against its definition; DotProductAttention's attn_bias_type and bias."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._tolerances import assert_relative_max_error

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.attention import AttnBiasType, QKVLayout
from transformer_engine.jax.flax import (
    DenseGeneral,
    DotProductAttention,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
)

B, S, HIDDEN, HEADS, D = 2, 8, 32, 4, 8


def _x(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)


# ---- MultiHeadAttention(qkv_layout=...) -------------------------------------------------------

def _mha(**kw):
    cfg = dict(head_dim=D, num_attention_heads=HEADS, transpose_batch_sequence=False,
               attn_mask_type="causal", use_bias=True)
    cfg.update(kw)
    return MultiHeadAttention(**cfg)


def _repack(params, packing):
    """The default (one qkv kernel [hidden, 3, H * D]) parameters as the other packings."""
    qkv = params["qkv"]
    norm = {k: qkv[k] for k in ("scale", "ln_bias")}
    kernel, bias = qkv["kernel"], qkv["bias"]
    out = {"out": params["out"],
           "query": dict(norm, kernel=kernel[:, 0], bias=bias[0])}
    if packing == "kv":
        out["kv"] = {"kernel": kernel[:, 1:], "bias": bias[1:]}
    else:
        out["key"] = {"kernel": kernel[:, 1], "bias": bias[1]}
        out["value"] = {"kernel": kernel[:, 2], "bias": bias[2]}
    return out


@pytest.mark.parametrize("layout,packing", [
    ("bshd_bs2hd", "kv"), ("bshd_bshd_bshd", "none"), (QKVLayout.BSHD_BS2HD, "kv"),
    (QKVLayout.BSHD_BSHD_BSHD, "none")])
def test_mha_qkv_layout_packs_the_same_numbers(layout, packing):
    x = _x((B, S, HIDDEN))
    base = _mha()
    params = base.init(jax.random.PRNGKey(1), x, x)["params"]
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * _x(p.shape, 3), params)  # biases != 0
    expected, _ = base.apply({"params": params}, x, x, deterministic=True)

    mha = _mha(qkv_layout=layout)
    fresh = mha.init(jax.random.PRNGKey(1), x, x)["params"]
    repacked = _repack(params, packing)
    assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(repacked)
    assert jax.tree_util.tree_map(jnp.shape, fresh) == jax.tree_util.tree_map(jnp.shape,
                                                                              repacked)
    out, _ = mha.apply({"params": repacked}, x, x, deterministic=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["bs3hd", QKVLayout.BS3HD, None])
def test_mha_bs3hd_is_the_default_packing(layout):
    x = _x((B, S, HIDDEN))
    v = _mha().init(jax.random.PRNGKey(1), x, x)
    w = _mha(qkv_layout=layout).init(jax.random.PRNGKey(1), x, x)
    assert set(w["params"]) == {"qkv", "out"}
    for a, b in zip(jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(w), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_mha_qkv_layout_cross_attention_and_gqa():
    x, enc = _x((B, S, HIDDEN)), _x((B, S + 2, HIDDEN), 1)
    kv = _mha(qkv_layout="bshd_bs2hd").init(jax.random.PRNGKey(0), x, enc)["params"]
    assert set(kv) == {"query", "kv", "out"}
    sep = _mha(qkv_layout="bshd_bshd_bshd", num_gqa_groups=2).init(
        jax.random.PRNGKey(0), x, x)["params"]
    assert set(sep) == {"query", "key", "value", "out"}
    assert sep["key"]["kernel"].shape == (HIDDEN, 2 * D)
    with pytest.raises(ValueError, match="MultiHeadAttention: qkv_layout 'bs3hd' needs "
                       "self-attention.*cross-attention"):
        _mha(qkv_layout="bs3hd").init(jax.random.PRNGKey(0), x, enc)
    with pytest.raises(ValueError, match="bs3hd.*4 heads and 2 groups"):
        _mha(qkv_layout="bs3hd", num_gqa_groups=2).init(jax.random.PRNGKey(0), x, x)


@pytest.mark.parametrize("layout", ["t3hd", "thd_thd_thd", "sbhd_sb2hd", "bogus"])
def test_mha_qkv_layout_refuses_what_it_cannot_take(layout):
    x = _x((B, S, HIDDEN))
    with pytest.raises(ValueError, match=f"MultiHeadAttention: qkv_layout must be None or one "
                       f"of .*'bs3hd'.*got '{layout}'"):
        _mha(qkv_layout=layout).init(jax.random.PRNGKey(0), x, x)


def test_mha_packed_qkv_layout_disagreeing_with_fuse_qkv_params():
    x = _x((B, S, HIDDEN))
    with pytest.raises(ValueError, match="qkv_layout 'bshd_bs2hd' packs the projections but "
                       "fuse_qkv_params is False"):
        _mha(qkv_layout="bshd_bs2hd", fuse_qkv_params=False).init(jax.random.PRNGKey(0), x, x)


def test_mha_deprecated_fuse_qkv_is_read():
    x = _x((B, S, HIDDEN))
    with pytest.warns(DeprecationWarning, match="fuse_qkv is deprecated"):
        params = _mha(fuse_qkv=False).init(jax.random.PRNGKey(0), x, x)["params"]
    assert set(params) == {"query", "key", "value", "out"}


# ---- RelativePositionBiases(dtype=...) --------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_relative_position_biases_dtype_is_the_parameters(dtype):
    rpb = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2,
                                 dtype=dtype)
    v = rpb.init(jax.random.PRNGKey(0), 5, 6)
    table = nn.unbox(v["params"])["rel_embedding"]
    assert table.dtype == dtype
    out = rpb.apply(v, 5, 6)
    assert out.dtype == dtype and out.shape == (1, 2, 5, 6)
    # A gather from the table, nothing computed: offset 0 (the diagonal) is bucket 0.
    for i in range(5):
        np.testing.assert_array_equal(np.asarray(out[0, :, i, i], np.float32),
                                      np.asarray(table[:, 0], np.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, "nonsense"])
def test_relative_position_biases_refuses_a_non_float_dtype(dtype):
    rpb = RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2,
                                 dtype=dtype)
    with pytest.raises(TypeError, match="RelativePositionBiases: dtype must be a "
                       "floating-point dtype"):
        rpb.init(jax.random.PRNGKey(0), 5, 6)


def test_transformer_layer_dtype_reaches_the_relative_bias():
    """TransformerLayer(dtype=bf16) on fp32 inputs: bf16 parameters everywhere (the relative
    embedding's too), a float32 output."""
    layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=64, num_attention_heads=HEADS,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             intermediate_dropout=0.0, dtype=jnp.bfloat16)
    x = _x((B, S, HIDDEN))
    v = layer.init(jax.random.PRNGKey(0), x, deterministic=True)
    dtypes = {p.dtype for p in jax.tree_util.tree_leaves(nn.unbox(v["params"]))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert nn.unbox(v["params"])["relpos_bias"]["rel_embedding"].dtype == jnp.bfloat16
    assert layer.apply(v, x, deterministic=True).dtype == jnp.float32


# ---- logical-axis keywords --------------------------------------------------------------------

# NVIDIA's defaults and usual names for each module's axis keywords.
AXES = {
    DenseGeneral: dict(kernel_axes=("embed", "mlp"), bias_axes=("mlp",),
                       input_axes=("batch", "length", "embed"), transpose_batch_sequence=True),
    LayerNormDenseGeneral: dict(kernel_axes=("embed", "mlp"), bias_axes=("mlp",),
                                scale_axes=("embed",), ln_bias_axes=("embed",),
                                layernorm_input_axes=("batch", "length", "embed"),
                                dot_input_axes=("batch", "length", "embed"),
                                transpose_batch_sequence=True),
    LayerNormMLP: dict(kernel_axes_1=("embed", "act", "mlp"), kernel_axes_2=("mlp", "embed"),
                       bias_axes_1=("act", "mlp"), bias_axes_2=("embed",),
                       scale_axes=("embed",), ln_bias_axes=("embed",),
                       layernorm_input_axes=("batch", "length", "embed"),
                       dot_1_input_axes=("batch", "length", "embed"),
                       dot_2_input_axes=("batch", "length", "mlp"), ffn1_ckpt_name="a",
                       ffn2_ckpt_name="b", transpose_batch_sequence=True, axis=-1),
}
SIZE = {DenseGeneral: dict(features=16), LayerNormDenseGeneral: dict(features=16),
        LayerNormMLP: dict(intermediate_dim=16, activations=("gelu", "linear"))}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("cls", list(AXES))
def test_axis_keywords_annotate_and_change_no_number(cls):
    x = _x((B, S, HIDDEN))
    plain = cls(use_bias=True, **SIZE[cls])
    named = cls(use_bias=True, **SIZE[cls], **AXES[cls])
    v = plain.init(jax.random.PRNGKey(0), x)
    w = named.init(jax.random.PRNGKey(0), x)
    assert not any(isinstance(p, nn.Partitioned) for p in jax.tree_util.tree_leaves(
        v, is_leaf=lambda p: isinstance(p, nn.Partitioned)))
    specs = nn.get_partition_spec(w)["params"]
    for key, value in AXES[cls].items():
        if key.endswith("axes") and not key.endswith("input_axes"):
            param = {"kernel_axes": "kernel", "bias_axes": "bias", "scale_axes": "scale",
                     "ln_bias_axes": "ln_bias"}.get(key)
            param = param or {"kernel_axes_1": "wi_kernel", "kernel_axes_2": "wo_kernel",
                              "bias_axes_1": "wi_bias", "bias_axes_2": "wo_bias"}[key]
            assert tuple(specs[param]) == value, key
    for a, b in zip(jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(nn.unbox(w)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(_first(plain.apply(v, x))),
                                  np.asarray(_first(named.apply(w, x))))


@pytest.mark.parametrize("cls", list(AXES))
def test_axis_keywords_are_checked(cls):
    x = _x((B, S, HIDDEN))
    first = next(iter(AXES[cls]))  # a kernel's
    with pytest.raises(ValueError, match=f"{cls.__name__}: {first} must name each of the "
                       f"[23] axes"):
        cls(**SIZE[cls], **{first: ("embed",)}).init(jax.random.PRNGKey(0), x)
    with pytest.raises(TypeError, match=f"{cls.__name__}: {first} must be None or a tuple"):
        cls(**SIZE[cls], **{first: "embed"}).init(jax.random.PRNGKey(0), x)
    input_key = [k for k in AXES[cls] if k.endswith("input_axes")][0]
    with pytest.raises(ValueError, match=f"{cls.__name__}: {input_key} must name each of the "
                       f"3 axes"):
        cls(**SIZE[cls], **{input_key: ("batch", "embed")}).init(jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("cls", list(AXES))
def test_kernel_init_none_is_the_default(cls):
    x = _x((B, S, HIDDEN))
    v = cls(**SIZE[cls]).init(jax.random.PRNGKey(0), x)
    w = cls(**SIZE[cls], kernel_init=None).init(jax.random.PRNGKey(0), x)
    for a, b in zip(jax.tree_util.tree_leaves(v), jax.tree_util.tree_leaves(w), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layernorm_mlp_takes_activation_params_for_clamped_swiglu_only_and_no_other_axis():
    x = _x((B, S, HIDDEN))
    # (clamped SwiGLU itself: test_clamped_swiglu.py)
    with pytest.raises(ValueError, match="LayerNormMLP: activation_params apply to "
                       r"clamped_swiglu only; \('gelu',\) takes none"):
        LayerNormMLP(intermediate_dim=16, activation_params={"limit": 7.0}).init(
            jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match=r"LayerNormMLP: axis must be the last axis \(-1\).*"
                       "got 1"):
        LayerNormMLP(intermediate_dim=16, axis=1).init(jax.random.PRNGKey(0), x)
    LayerNormMLP(intermediate_dim=16, axis=(2,)).init(jax.random.PRNGKey(0), x)


@pytest.mark.parametrize("enable_layernorm", [True, False])
def test_layernorm_dense_depth_scaling_divides_the_output(enable_layernorm):
    x = _x((B, S, HIDDEN))
    base = LayerNormDenseGeneral(features=16, enable_layernorm=enable_layernorm,
                                 return_layernorm_output=True)
    v = base.init(jax.random.PRNGKey(0), x)
    out, ln = base.apply(v, x)
    scaled, ln2 = base.clone(depth_scaling=4.0).apply(v, x)
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(out) / 4.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ln), np.asarray(ln2))


# ---- LoRA -------------------------------------------------------------------------------------

R = 4


def _lora_ref(x, a, b, alpha):
    """(x @ A @ B) * alpha / r in float64, per output group (A [K, *G, r], B [*G, r, N])."""
    x, a, b = (np.asarray(t, np.float64) for t in (x, a, b))
    a2 = a.reshape(a.shape[0], -1, a.shape[-1])  # [K, G, r]
    b2 = b.reshape(-1, *b.shape[-2:])            # [G, r, N]
    y = np.einsum("...k,kgr,grn->...gn", x, a2, b2)
    y = y.reshape(*x.shape[:-1], *b.shape[:-2], b.shape[-1])
    return y * (1.0 if alpha is None else alpha / a.shape[-1])


def _with_random_b(params, seed=5):
    """LoRA's B kernels made nonzero (they start at zeros)."""
    def fill(path, p):
        name = jax.tree_util.keystr(path)
        return 0.3 * _x(p.shape, seed) if "lora_b_kernel" in name else p
    return jax.tree_util.tree_map_with_path(fill, params)


def _without_lora(params):
    if isinstance(params, dict):
        return {k: _without_lora(v) for k, v in params.items() if "lora" not in k}
    return params


@pytest.mark.parametrize("features,alpha", [(16, None), ((2, 8), 8.0), (16, 2.0)])
def test_dense_general_lora(features, alpha):
    x = _x((B, S, HIDDEN))
    layer = DenseGeneral(features=features, enable_low_rank_adaptation=True,
                         low_rank_adaptation_dim=R, low_rank_adaptation_alpha=alpha)
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    lead = (features[:-1] if isinstance(features, tuple) else ())
    last = features[-1] if isinstance(features, tuple) else features
    assert params["lora_a_kernel"].shape == (HIDDEN, *lead, R)
    assert params["lora_b_kernel"].shape == (*lead, R, last)
    plain = DenseGeneral(features=features)
    base = plain.apply({"params": _without_lora(params)}, x)
    # B starts at zeros: the layer starts as the one without LoRA.
    np.testing.assert_array_equal(np.asarray(layer.apply({"params": params}, x)),
                                  np.asarray(base))
    params = _with_random_b(params)
    out = layer.apply({"params": params}, x)
    expected = np.asarray(base, np.float64) + _lora_ref(x, params["lora_a_kernel"],
                                                         params["lora_b_kernel"], alpha)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
    # Both LoRA kernels learn (B's gradient is nonzero from the start, as A is).
    grads = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x) ** 2))(params)
    assert float(jnp.abs(grads["lora_a_kernel"]).max()) > 0
    assert float(jnp.abs(grads["lora_b_kernel"]).max()) > 0


@pytest.mark.parametrize("enable_layernorm", [True, False])
def test_layernorm_dense_general_lora_reads_the_normed_input(enable_layernorm):
    x = _x((B, S, HIDDEN))
    alpha = 2.0
    layer = LayerNormDenseGeneral(features=16, enable_layernorm=enable_layernorm,
                                  enable_low_rank_adaptation=True, low_rank_adaptation_dim=R,
                                  low_rank_adaptation_alpha=alpha)
    params = _with_random_b(layer.init(jax.random.PRNGKey(0), x)["params"])
    out, ln = layer.apply({"params": params}, x)
    assert ln is None
    plain = LayerNormDenseGeneral(features=16, enable_layernorm=enable_layernorm,
                                  return_layernorm_output=True)
    base, ln_out = plain.apply({"params": _without_lora(params)}, x)
    expected = np.asarray(base, np.float64) + _lora_ref(ln_out, params["lora_a_kernel"],
                                                         params["lora_b_kernel"], alpha)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations,enable_layernorm", [
    (("gelu", "linear"), True), (("relu",), True), (("silu", "linear"), False)])
def test_layernorm_mlp_lora_on_both_gemms(activations, enable_layernorm):
    from transformer_engine.jax.layernorm_mlp import activation

    x = _x((B, S, HIDDEN))
    f, alpha = 16, None
    layer = LayerNormMLP(intermediate_dim=f, activations=activations, use_bias=True,
                         enable_layernorm=enable_layernorm, intermediate_dropout_rate=0.0,
                         enable_low_rank_adaptation=True, low_rank_adaptation_dim=R,
                         low_rank_adaptation_alpha=alpha)
    params = layer.init(jax.random.PRNGKey(0), x)["params"]
    n_act = len(activations)
    assert params["wi_lora_a_kernel"].shape == (HIDDEN, n_act, R)
    assert params["wi_lora_b_kernel"].shape == (n_act, R, f)
    assert params["wo_lora_a_kernel"].shape == (f, R)
    assert params["wo_lora_b_kernel"].shape == (R, HIDDEN)
    plain = layer.clone(enable_low_rank_adaptation=False, return_layernorm_output=True)
    base, ln = plain.apply({"params": _without_lora(params)}, x)
    np.testing.assert_allclose(np.asarray(layer.apply({"params": params}, x)[0]),
                               np.asarray(base), rtol=1e-5, atol=1e-6)
    params = _with_random_b(params)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = np.einsum("...k,kaf->...af", np.asarray(ln, np.float64), p["wi_kernel"]) + p["wi_bias"]
    h = h + _lora_ref(ln, p["wi_lora_a_kernel"], p["wi_lora_b_kernel"], alpha)
    a = np.asarray(activation(jnp.asarray(h.reshape(*h.shape[:-2], -1), jnp.float32),
                              activations), np.float64)
    expected = a @ p["wo_kernel"] + p["wo_bias"] + _lora_ref(a, p["wo_lora_a_kernel"],
                                                             p["wo_lora_b_kernel"], alpha)
    out, ln_none = layer.apply({"params": params}, x)
    assert ln_none is None
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cls", list(AXES))
def test_lora_in_bf16_and_fp8(cls):
    x = _x((B, S, HIDDEN), dtype=jnp.bfloat16)
    layer = cls(**SIZE[cls], enable_low_rank_adaptation=True, low_rank_adaptation_dim=R)
    v = layer.init(jax.random.PRNGKey(0), x)
    assert _first(layer.apply(v, x)).dtype == jnp.bfloat16
    with te.fp8_autocast(enabled=True, fp8_recipe=recipe.Float8CurrentScaling()):
        v = layer.init(jax.random.PRNGKey(0), x)
        with_lora = _first(layer.apply(v, x))
        without = _first(layer.clone(enable_low_rank_adaptation=False).apply(
            {"params": _without_lora(v["params"])}, x))
    # B is zero at init: the FP8 layer with LoRA gives the FP8 layer's numbers; LayerNormMLP's
    # up to its unfused path (the activation's output is no longer written in FP8 by it).
    if cls is LayerNormMLP:
        assert_relative_max_error(with_lora, without, "fp8_forward_vs_fp32")
    else:
        np.testing.assert_array_equal(np.asarray(with_lora, np.float32),
                                      np.asarray(without, np.float32))


@pytest.mark.parametrize("cls", list(AXES))
def test_lora_keywords_are_checked(cls):
    x = _x((B, S, HIDDEN))
    with pytest.raises(ValueError, match=f"{cls.__name__}: low_rank_adaptation_dim must be "
                       "positive"):
        cls(**SIZE[cls], enable_low_rank_adaptation=True, low_rank_adaptation_dim=0).init(
            jax.random.PRNGKey(0), x)
    with pytest.raises(TypeError, match=f"{cls.__name__}: low_rank_adaptation_alpha must be "
                       "None or a number"):
        cls(**SIZE[cls], enable_low_rank_adaptation=True, low_rank_adaptation_alpha="8").init(
            jax.random.PRNGKey(0), x)
    # Off, the LoRA keywords make no parameter.
    v = cls(**SIZE[cls], low_rank_adaptation_dim=0).init(jax.random.PRNGKey(0), x)
    assert not any("lora" in jax.tree_util.keystr(p) for p, _ in
                   jax.tree_util.tree_leaves_with_path(v))


# ---- DotProductAttention(attn_bias_type=...), bias --------------------------------------------

def _attention_ref(q, k, v, allowed, scale, bias, bias_type):
    """softmax over the allowed keys in float64; q [b, s, h, d], k, v [b, s, g, d]."""
    q, k, v, bias = (np.asarray(t, np.float64) for t in (q, k, v, bias))
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k)
    logits = (logits + bias) * scale if bias_type == "pre_scale_bias" else logits * scale + bias
    logits = np.where(allowed, logits, -np.inf)
    m = np.max(np.where(allowed, logits, -1e300), axis=-1, keepdims=True)
    e = np.where(allowed, np.exp(logits - m), 0.0)
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("bias_type", [None, "post_scale_bias", "pre_scale_bias",
                                       AttnBiasType.PRE_SCALE_BIAS])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding_causal"])
def test_dot_product_attention_bias(bias_type, mask_type):
    groups = 2
    q, k, v = _x((B, S, HEADS, D), 1), _x((B, S, groups, D), 2), _x((B, S, groups, D), 3)
    bias = _x((1, HEADS, S, S), 4)
    lengths = np.array([S, S - 3])
    valid = np.arange(S)[None, :] < lengths[:, None]
    mask = ~(valid[:, None, :, None] & valid[:, None, None, :])
    attn = DotProductAttention(head_dim=D, num_attention_heads=HEADS, num_gqa_groups=groups,
                               attn_mask_type=mask_type, attn_bias_type=bias_type,
                               scale_factor=0.3)
    out = attn.apply({}, q, k, v, jnp.asarray(mask), jnp.asarray(bias))
    allowed = np.ones((B, 1, S, S), bool)
    if "causal" in mask_type:
        allowed &= np.tril(np.ones((S, S), bool))
    if mask_type.startswith("padding"):
        allowed &= ~mask
    kind = "pre_scale_bias" if bias_type == "pre_scale_bias" else "post_scale_bias"
    expected = _attention_ref(q, k, v, allowed, 0.3, bias, kind)
    expected = np.where(allowed.any(-1)[:, 0, :, None, None], expected, 0.0)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)


def test_dot_product_attention_zero_bias_is_the_fused_result():
    q, k, v = _x((S, B, HEADS, D), 1), _x((S, B, HEADS, D), 2), _x((S, B, HEADS, D), 3)
    attn = DotProductAttention(head_dim=D, num_attention_heads=HEADS, attn_mask_type="causal",
                               transpose_batch_sequence=True)
    fused = attn.apply({}, q, k, v)
    biased = attn.apply({}, q, k, v, None, jnp.zeros((B, HEADS, S, S)))
    np.testing.assert_allclose(np.asarray(biased), np.asarray(fused), rtol=1e-5, atol=1e-5)
    no_bias = attn.clone(attn_bias_type="no_bias").apply({}, q, k, v)
    np.testing.assert_array_equal(np.asarray(no_bias), np.asarray(fused))
    # Gradients reach the bias (a learned relative bias trains through it).
    g = jax.grad(lambda b: jnp.sum(attn.apply({}, q, k, v, None, b) ** 2))(
        _x((1, HEADS, S, S), 5))
    assert float(jnp.abs(g).max()) > 0


def test_dot_product_attention_bias_errors():
    q = _x((B, S, HEADS, D))
    bias = jnp.zeros((1, HEADS, S, S))
    attn = DotProductAttention(head_dim=D, num_attention_heads=HEADS)
    with pytest.raises(ValueError, match="DotProductAttention: a bias was given but "
                       "attn_bias_type is 'no_bias'"):
        attn.clone(attn_bias_type="no_bias").apply({}, q, q, q, None, bias)
    with pytest.raises(ValueError, match="DotProductAttention: attn_bias_type "
                       "'post_scale_bias' needs the call's bias"):
        attn.clone(attn_bias_type="post_scale_bias").apply({}, q, q, q)
    with pytest.raises(ValueError, match="DotProductAttention: attn_bias_type must be one of"):
        attn.clone(attn_bias_type="alibi").apply({}, q, q, q)
    with pytest.raises(ValueError, match=r"DotProductAttention: bias must have shape \[1 or "
                       rf"{B}, {HEADS}, {S}, {S}\]"):
        attn.apply({}, q, q, q, None, jnp.zeros((HEADS, S, S)))
    t = _x((2 * S, HEADS, D))
    cu = jnp.array([0, S, 2 * S], jnp.int32)
    with pytest.raises(NotImplementedError, match="DotProductAttention: attn_bias_type "
                       "'post_scale_bias' .*not implemented for the thd layouts"):
        DotProductAttention(head_dim=D, num_attention_heads=HEADS, qkv_layout="thd_thd_thd",
                            attn_mask_type="padding").apply(
            {}, t, t, t, None, bias, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def test_dot_product_attention_other_nvidia_keywords():
    q = _x((B, S, HEADS, D))
    base = DotProductAttention(head_dim=D, num_attention_heads=HEADS, attention_dropout=0.5)
    expected = base.apply({}, q, q, q, rngs={"dropout": jax.random.PRNGKey(3)})
    named = base.clone(dropout_rng_name="attn", dtype=jnp.bfloat16, float32_logits=True,
                       max_segments_per_seq=2, context_checkpoint_name="ctx")
    out = named.apply({}, q, q, q, rngs={"attn": jax.random.PRNGKey(3)})
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    # No mesh in context: nothing to split, the call runs as it is.
    plain = base.apply({}, q, q, q, deterministic=True)
    for kw in (dict(context_parallel_axis="cp"), dict(context_parallel_strategy="ALL_GATHER"),
               dict(context_parallel_causal_load_balanced=True)):
        np.testing.assert_array_equal(
            np.asarray(base.clone(**kw).apply({}, q, q, q, deterministic=True)),
            np.asarray(plain))
    with pytest.raises(TypeError, match="DotProductAttention: dtype must be a floating"):
        base.clone(dtype=jnp.int8).apply({}, q, q, q, deterministic=True)


# ---- LoRA scopes of MultiHeadAttention and TransformerLayer ------------------------------------

def _merged(params, alpha):
    """Each LoRA pair folded into its kernel: W + A @ B * alpha / r (LoRA is linear in x)."""
    if not isinstance(params, dict):
        return params
    out = {k: _merged(v, alpha) for k, v in params.items() if "lora" not in k}
    if "lora_a_kernel" in params:
        a, b = params["lora_a_kernel"], params["lora_b_kernel"]
        lead = a.ndim - b.ndim + 1  # the contracted axes of the kernel
        a2 = a.reshape(int(np.prod(a.shape[:lead])), -1, a.shape[-1])   # [in, G, r]
        b2 = b.reshape(-1, *b.shape[-2:])                                # [G, r, N]
        delta = jnp.einsum("igr,grn->ign", a2, b2).reshape(out["kernel"].shape)
        out["kernel"] = out["kernel"] + delta * (1.0 if alpha is None else alpha / a.shape[-1])
    return out


@pytest.mark.parametrize("scope,where", [
    ("all", {"qkv", "out"}), ("qkv_proj", {"qkv"}), ("OUTPUT_PROJ", {"out"}),
    ("exclude_qkv_proj", {"out"}), ("exclude_output_proj", {"qkv"}), ("mlp", set())])
def test_mha_lora_scope(scope, where):
    x = _x((B, S, HIDDEN))
    alpha = 2.0
    mha = _mha(low_rank_adaptation_scope=scope, low_rank_adaptation_dim=R,
               low_rank_adaptation_alpha=alpha)
    params = _with_random_b(mha.init(jax.random.PRNGKey(0), x, x)["params"])
    assert {k for k, v in params.items() if "lora_a_kernel" in v} == where
    if "qkv" in where:
        assert params["qkv"]["lora_a_kernel"].shape == (HIDDEN, 3, R)
        assert params["qkv"]["lora_b_kernel"].shape == (3, R, HEADS * D)
    out, _ = mha.apply({"params": params}, x, x, deterministic=True)
    # The same as the layer without LoRA whose kernels hold W + A @ B * alpha / r.
    expected, _ = _mha().apply({"params": _merged(params, alpha)}, x, x, deterministic=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
    if where:
        plain, _ = _mha().apply({"params": _without_lora(params)}, x, x, deterministic=True)
        assert not np.allclose(np.asarray(out), np.asarray(plain), atol=1e-3)


def test_mha_lora_scope_with_separate_projections():
    x = _x((B, S, HIDDEN))
    mha = _mha(low_rank_adaptation_scope="qkv_proj", low_rank_adaptation_dim=R,
               qkv_layout="bshd_bshd_bshd")
    params = _with_random_b(mha.init(jax.random.PRNGKey(0), x, x)["params"])
    assert {k for k, v in params.items() if "lora_a_kernel" in v} == {"query", "key", "value"}
    out, _ = mha.apply({"params": params}, x, x, deterministic=True)
    expected, _ = _mha(qkv_layout="bshd_bshd_bshd").apply({"params": _merged(params, None)},
                                                           x, x, deterministic=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scope,attention,mlp", [
    ("mlp", False, True), ("exclude_mlp", True, False), ("all", True, True),
    ("none", False, False)])
def test_transformer_layer_lora_scope(scope, attention, mlp):
    layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=64, num_attention_heads=HEADS,
                             hidden_dropout=0.0, attention_dropout=0.0,
                             intermediate_dropout=0.0, low_rank_adaptation_scope=scope,
                             low_rank_adaptation_dim=R)
    x = _x((B, S, HIDDEN))
    params = nn.unbox(layer.init(jax.random.PRNGKey(0), x, deterministic=True)["params"])
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    assert any("'attention']['qkv']['lora_a_kernel'" in n for n in names) == attention
    assert any("'attention']['out']['lora_b_kernel'" in n for n in names) == attention
    assert any("'mlp']['wi_lora_a_kernel'" in n for n in names) == mlp
    assert any("'mlp']['wo_lora_b_kernel'" in n for n in names) == mlp
    # B starts at zeros: the layer starts as the one without LoRA.
    plain = layer.clone(low_rank_adaptation_scope="none")
    np.testing.assert_allclose(
        np.asarray(layer.apply({"params": params}, x, deterministic=True)),
        np.asarray(plain.apply({"params": _without_lora(params)}, x, deterministic=True)),
        rtol=1e-5, atol=1e-5)
