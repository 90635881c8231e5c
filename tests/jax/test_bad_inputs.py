"""Bad settings and inputs of every Flax module, one row each: ``init`` or ``apply`` raises the
expected exception type, its message names the module (or op) and the attribute or argument,
and the variables given to ``apply`` (parameters and the fp8_metas collection) are unchanged
afterwards (no buffer donated, deleted or written)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import (
    DenseGeneral,
    DotProductAttention,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    TransformerLayer,
    TransformerLayerType,
)

KEY = jax.random.PRNGKey(0)
DELAYED = recipe.DelayedScaling()
CURRENT = recipe.Float8CurrentScaling()
MXFP8 = recipe.MXFP8BlockScaling()


def _p(case_id, *values):
    return pytest.param(*values, id=case_id)


def _x(*shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def _mask(*shape, dtype=jnp.bool_):
    return jnp.zeros(shape, dtype)


def _mha(**kw):
    kw = {"head_dim": 16, "num_attention_heads": 2, "attention_dropout": 0.0,
          "transpose_batch_sequence": False, **kw}
    return MultiHeadAttention(**kw)


def _tl(**kw):
    kw = {"hidden_size": 32, "mlp_hidden_size": 64, "num_attention_heads": 2,
          "hidden_dropout": 0.0, "attention_dropout": 0.0, "intermediate_dropout": 0.0,
          "enable_relative_embedding": False, "transpose_batch_sequence": False, **kw}
    return TransformerLayer(**kw)


X = _x(4, 32)
SEQ = _x(2, 8, 32)  # [batch, seqlen, hidden]
QKV = (_x(2, 8, 2, 16),) * 3  # bshd
NARROW = _x(2, 8, 16)  # one object as inputs_q and inputs_kv: self-attention
PADDED_SEQ = (SEQ, SEQ, _mask(2, 1, 8, 8))  # a call of a padding mask type

# ------------------------------------------------------------------ settings (at init)

SETTINGS = [
    _p("dense-zero-features", DenseGeneral(features=0), (X,), ValueError,
       ["DenseGeneral", "features", "0"]),
    _p("dense-negative-features", DenseGeneral(features=-1), (X,), ValueError,
       ["DenseGeneral", "features", "-1"]),
    _p("dense-zero-in-tuple", DenseGeneral(features=(16, 0)), (X,), ValueError,
       ["DenseGeneral", "features", "(16, 0)"]),
    _p("dense-int8-params", DenseGeneral(features=16, param_dtype=jnp.int8), (X,), TypeError,
       ["DenseGeneral", "param_dtype", "int8"]),
    _p("dense-int32-dtype", DenseGeneral(features=16, dtype=jnp.int32), (X,), TypeError,
       ["DenseGeneral", "dtype", "int32"]),
    _p("dense-repeated-axis", DenseGeneral(features=16, axis=(-1, 1)), (X,), ValueError,
       ["DenseGeneral", "axis"]),
    _p("dense-scalar", DenseGeneral(features=16), (jnp.ones(()),), ValueError,
       ["DenseGeneral", "inputs", "rank"]),
    _p("layernorm-int8-params", LayerNorm(param_dtype=jnp.int8), (X,), TypeError,
       ["LayerNorm", "param_dtype", "int8"]),
    _p("layernorm-int8-dtype", LayerNorm(dtype=jnp.int8), (X,), TypeError,
       ["LayerNorm", "dtype", "int8"]),
    _p("layernorm-type", LayerNorm(layernorm_type="batchnorm"), (X,), ValueError,
       ["LayerNorm", "layernorm_type", "batchnorm"]),
    _p("layernorm-scalar", LayerNorm(), (jnp.ones(()),), ValueError,
       ["LayerNorm", "input", "rank"]),
    _p("lndense-zero-features", LayerNormDenseGeneral(features=0), (X,), ValueError,
       ["LayerNormDenseGeneral", "features", "0"]),
    _p("lndense-int8-params", LayerNormDenseGeneral(features=16, param_dtype=jnp.int8), (X,),
       TypeError, ["LayerNormDenseGeneral", "param_dtype", "int8"]),
    _p("lndense-type", LayerNormDenseGeneral(features=16, layernorm_type="batch"), (X,),
       ValueError, ["LayerNormDenseGeneral", "layernorm_type", "batch"]),
    _p("lndense-axis", LayerNormDenseGeneral(features=16, axis=0), (X,), ValueError,
       ["LayerNormDenseGeneral", "axis"]),
    _p("lndense-scalar", LayerNormDenseGeneral(features=16), (jnp.ones(()),), ValueError,
       ["LayerNormDenseGeneral", "input", "rank"]),
    _p("mlp-zero-intermediate", LayerNormMLP(intermediate_dim=0), (X,), ValueError,
       ["LayerNormMLP", "intermediate_dim", "0"]),
    _p("mlp-negative-intermediate", LayerNormMLP(intermediate_dim=-4), (X,), ValueError,
       ["LayerNormMLP", "intermediate_dim", "-4"]),
    _p("mlp-int8-params", LayerNormMLP(intermediate_dim=16, param_dtype=jnp.int8), (X,),
       TypeError, ["LayerNormMLP", "param_dtype", "int8"]),
    _p("mlp-activation", LayerNormMLP(intermediate_dim=16, activations=("tanh",)), (X,),
       ValueError, ["LayerNormMLP", "activations", "tanh"]),
    _p("mlp-dropout", LayerNormMLP(intermediate_dim=16, intermediate_dropout_rate=1.5), (X,),
       ValueError, ["LayerNormMLP", "intermediate_dropout_rate"]),
    _p("mlp-scalar", LayerNormMLP(intermediate_dim=16), (jnp.ones(()),), ValueError,
       ["LayerNormMLP", "input", "rank"]),
    _p("dpa-zero-head-dim", DotProductAttention(0, 2), QKV, ValueError,
       ["DotProductAttention", "head_dim"]),
    _p("dpa-zero-heads", DotProductAttention(16, 0), QKV, ValueError,
       ["DotProductAttention", "num_attention_heads"]),
    _p("dpa-zero-groups", DotProductAttention(16, 2, num_gqa_groups=0), QKV, ValueError,
       ["DotProductAttention", "num_gqa_groups"]),
    _p("dpa-dropout", DotProductAttention(16, 2, attention_dropout=1.5), QKV, ValueError,
       ["DotProductAttention", "attention_dropout"]),
    _p("dpa-window", DotProductAttention(16, 2, attn_mask_type="no_mask", window_size=(-3, 0)),
       QKV, ValueError, ["DotProductAttention", "window_size", "(-3, 0)"]),
    _p("dpa-mask-type", DotProductAttention(16, 2, attn_mask_type="pad"), QKV, ValueError,
       ["fused_attn", "attn_mask_type", "pad"]),
    _p("dpa-layout", DotProductAttention(16, 2, qkv_layout="hsbd"), QKV, ValueError,
       ["qkv_layout", "hsbd"]),
    _p("mha-zero-head-dim", _mha(head_dim=0), (SEQ, SEQ), ValueError,
       ["MultiHeadAttention", "head_dim"]),
    _p("mha-zero-heads", _mha(num_attention_heads=0), (SEQ, SEQ), ValueError,
       ["MultiHeadAttention", "num_attention_heads"]),
    _p("mha-groups", _mha(num_attention_heads=4, num_gqa_groups=3), (SEQ, SEQ), ValueError,
       ["MultiHeadAttention", "num_gqa_groups"]),
    _p("mha-int8-dtype", _mha(dtype=jnp.int8), (SEQ, SEQ), TypeError,
       ["MultiHeadAttention", "dtype", "int8"]),
    _p("mha-mask-type", _mha(attn_mask_type="pad"), (SEQ, SEQ), ValueError,
       ["MultiHeadAttention", "attn_mask_type", "pad"]),
    _p("mha-dropout", _mha(attention_dropout=1.5), (SEQ, SEQ), ValueError,
       ["MultiHeadAttention", "attention_dropout"]),
    _p("mha-window", _mha(attn_mask_type="no_mask", window_size=(-2, 0)), (SEQ, SEQ),
       ValueError, ["MultiHeadAttention", "window_size"]),
    _p("mha-lora", _mha(low_rank_adaptation_scope="everything"), (SEQ, SEQ), ValueError,
       ["MultiHeadAttention", "low_rank_adaptation_scope", "everything"]),
    _p("tl-zero-hidden", _tl(hidden_size=0), (SEQ,), ValueError,
       ["TransformerLayer", "hidden_size"]),
    _p("tl-zero-mlp", _tl(mlp_hidden_size=0), (SEQ,), ValueError,
       ["TransformerLayer", "mlp_hidden_size"]),
    _p("tl-zero-heads", _tl(num_attention_heads=0), (SEQ,), ValueError,
       ["TransformerLayer", "num_attention_heads"]),
    _p("tl-indivisible-heads", _tl(num_attention_heads=3), (SEQ,), ValueError,
       ["TransformerLayer", "hidden_size", "num_attention_heads"]),
    _p("tl-int8-dtype", _tl(dtype=jnp.int8), (SEQ,), TypeError,
       ["TransformerLayer", "dtype", "int8"]),
    _p("tl-dropout", _tl(hidden_dropout=1.5), (SEQ,), ValueError,
       ["TransformerLayer", "hidden_dropout"]),
    _p("tl-layer-type", _tl(layer_type="enc"), (SEQ,), TypeError,
       ["TransformerLayer", "layer_type"]),
    _p("tl-activation-params", _tl(mlp_activation_params={"a": 1}), (SEQ,),
       ValueError, ["TransformerLayer", "mlp_activation_params"]),
    _p("tl-decoder-no-encoded", _tl(layer_type=TransformerLayerType.DECODER), (SEQ,),
       ValueError, ["TransformerLayer", "encoded"]),
]


@pytest.mark.parametrize("module, inputs, exc, words", SETTINGS)
def test_init_rejects(module, inputs, exc, words):
    with pytest.raises(exc) as info:
        module.init(KEY, *inputs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ------------------------------------------------------------------ inputs (at apply)

def _dpa(mask="padding", **kw):
    return DotProductAttention(16, 2, attn_mask_type=mask, **kw)


CALLS = [
    # (module, init inputs, apply inputs, apply keywords, recipe of the init and apply)
    _p("dense-wrong-features", DenseGeneral(features=16), (X,), (_x(4, 8),), {}, None,
       ValueError, ["DenseGeneral", "inputs", "[4, 8]"]),
    # (any token count is taken in FP8; the feature dimensions keep the rule of 16; the
    # variables come from a run without FP8, as the current-scaling recipe makes no state)
    _p("dense-fp8-features", DenseGeneral(features=24), (_x(5, 32),), (_x(5, 32),), {},
       CURRENT, ValueError, ["dense", "N=24"]),
    _p("dense-mxfp8", DenseGeneral(features=32), (_x(32, 32),), (_x(32, 32),), {}, MXFP8,
       NotImplementedError, ["DenseGeneral", "fp8_recipe", "MXFP8BlockScaling"]),
    _p("layernorm-wrong-features", LayerNorm(), (X,), (_x(4, 16),), {}, None, ValueError,
       ["LayerNorm", "inputs", "[4, 16]"]),
    _p("lndense-wrong-features", LayerNormDenseGeneral(features=16), (X,), (_x(4, 16),), {},
       None, ValueError, ["LayerNormDenseGeneral", "inputs", "[4, 16]"]),
    _p("lndense-fp8-features", LayerNormDenseGeneral(features=24), (_x(5, 32),),
       (_x(5, 32),), {}, CURRENT, ValueError, ["layernorm_dense", "N=24"]),
    _p("lndense-mxfp8", LayerNormDenseGeneral(features=32), (_x(32, 32),), (_x(32, 32),), {},
       MXFP8, NotImplementedError, ["LayerNormDenseGeneral", "fp8_recipe", "MXFP8"]),
    _p("mlp-wrong-features", LayerNormMLP(intermediate_dim=16), (X,), (_x(4, 16),), {}, None,
       ValueError, ["LayerNormMLP", "inputs", "[4, 16]"]),
    _p("mlp-fp8-features", LayerNormMLP(intermediate_dim=24), (_x(5, 32),), (_x(5, 32),), {},
       CURRENT, ValueError, ["layernorm_mlp", "F=24"]),
    _p("mlp-mxfp8", LayerNormMLP(intermediate_dim=32), (_x(32, 32),), (_x(32, 32),), {},
       MXFP8, NotImplementedError, ["LayerNormMLP", "fp8_recipe", "MXFP8"]),
    # DotProductAttention (no variables): the mask is bool or 0/1 integers, True = masked out
    _p("dpa-float-mask", _dpa(), None, QKV + (_mask(2, 1, 8, 8, dtype=jnp.float32),), {}, None,
       TypeError, ["DotProductAttention", "mask", "float32"]),
    _p("dpa-keep-convention-float-mask", _dpa(), None, QKV + (_x(2, 1, 8, 8),), {}, None,
       TypeError, ["DotProductAttention", "mask", "float32"]),
    _p("dpa-sb-mask", _dpa(), None, QKV + (_mask(8, 2),), {}, None, ValueError,
       ["DotProductAttention", "mask", "[8, 2]", "[2, 1, 8, 8]"]),
    _p("dpa-bss-mask", _dpa(), None, QKV + (_mask(2, 8, 8),), {}, None, ValueError,
       ["DotProductAttention", "mask", "[2, 8, 8]"]),
    _p("dpa-mask-batch", _dpa(), None, QKV + (_mask(3, 1, 8, 8),), {}, None, ValueError,
       ["DotProductAttention", "mask", "[3, 1, 8, 8]"]),
    _p("dpa-sbhd-mask-layout", _dpa(transpose_batch_sequence=True), None,
       QKV + (_mask(2, 1, 8, 8),), {}, None, ValueError,
       ["DotProductAttention", "mask", "[2, 1, 8, 8]", "[8, 1, 2, 2]"]),
    _p("dpa-padding-no-mask", _dpa(), None, QKV, {}, None, ValueError,
       ["DotProductAttention", "mask", "cu_seqlens_q"]),
    _p("dpa-thd-no-cu-seqlens", _dpa(qkv_layout="thd"), None, (_x(12, 2, 16),) * 3, {}, None,
       ValueError, ["fused_attn", "cu_seqlens_q"]),
    _p("dpa-query-rank", _dpa("causal"), None, (_x(8, 2, 16),) * 3, {}, None, ValueError,
       ["DotProductAttention", "query", "rank"]),
    _p("dpa-head-dim", _dpa("causal"), None, (_x(2, 8, 2, 8),) * 3, {}, None, ValueError,
       ["DotProductAttention", "head dim", "16"]),
    _p("dpa-heads", _dpa("causal"), None, (_x(2, 8, 4, 16),) * 3, {}, None, ValueError,
       ["DotProductAttention", "heads", "4"]),
    _p("dpa-int-inputs", _dpa("causal"), None, (_x(2, 8, 2, 16, dtype=jnp.int32),) * 3, {},
       None, TypeError, ["fused_attn", "int32"]),
    _p("dpa-dtype-mismatch", _dpa("causal"), None,
       (QKV[0], _x(2, 8, 2, 16, dtype=jnp.bfloat16), QKV[2]), {}, None, TypeError,
       ["fused_attn", "bfloat16"]),
    # MultiHeadAttention
    _p("mha-float-mask", _mha(attn_mask_type="padding"), PADDED_SEQ,
       (SEQ, SEQ, _x(2, 1, 8, 8)), {}, None, TypeError,
       ["MultiHeadAttention", "mask", "float32"]),
    _p("mha-sb-mask", _mha(attn_mask_type="padding"), PADDED_SEQ, (SEQ, SEQ, _mask(8, 2)), {},
       None, ValueError, ["MultiHeadAttention", "mask", "[8, 2]", "[2, 1, 8, 8]"]),
    _p("mha-mask-batch", _mha(attn_mask_type="padding_causal"), PADDED_SEQ,
       (SEQ, SEQ, _mask(1, 1, 8, 8)), {}, None, ValueError,
       ["MultiHeadAttention", "mask", "[1, 1, 8, 8]"]),
    _p("mha-rank", _mha(), (SEQ, SEQ), (SEQ[0], SEQ[0]), {}, None, ValueError,
       ["MultiHeadAttention", "inputs_q", "rank"]),
    _p("mha-dtype-mismatch", _mha(), (SEQ, SEQ), (SEQ, SEQ.astype(jnp.bfloat16)), {}, None,
       TypeError, ["MultiHeadAttention", "inputs_kv", "bfloat16"]),
    _p("mha-wrong-hidden", _mha(), (SEQ, SEQ), (NARROW, NARROW), {}, None,
       ValueError, ["LayerNormDenseGeneral", "inputs", "[2, 8, 16]"]),
    _p("mha-bias-without-type", _mha(attn_bias_type="no_bias"), (SEQ, SEQ),
       (SEQ, SEQ, None, _x(1, 2, 8, 8)), {}, None, ValueError,
       ["MultiHeadAttention", "bias", "no_bias"]),
    # TransformerLayer
    _p("tl-float-mask", _tl(self_attn_mask_type="padding"), (SEQ, None, _mask(2, 1, 8, 8)), (SEQ,),
       {"attention_mask": _x(2, 1, 8, 8)}, None, TypeError,
       ["TransformerLayer", "attention_mask", "float32"]),
    _p("tl-sb-mask", _tl(self_attn_mask_type="padding"), (SEQ, None, _mask(2, 1, 8, 8)), (SEQ,),
       {"attention_mask": _mask(8, 2)}, None, ValueError,
       ["TransformerLayer", "attention_mask", "[8, 2]", "[2, 1, 8, 8]"]),
    _p("tl-wrong-hidden", _tl(), (SEQ,), (_x(2, 8, 16),), {}, None, ValueError,
       ["TransformerLayer", "inputs", "(2, 8, 16)"]),
    _p("tl-rank", _tl(), (SEQ,), (_x(8, 32),), {}, None, ValueError,
       ["TransformerLayer", "inputs", "(8, 32)"]),
    _p("tl-encoder-decoder-mask", _tl(layer_type=TransformerLayerType.DECODER),
       (SEQ, _x(2, 6, 32)), (SEQ, _x(2, 6, 32)),
       {"encoder_decoder_mask": _mask(2, 1, 8, 8)}, None, ValueError,
       ["TransformerLayer", "encoder_decoder_mask", "[2, 1, 8, 6]"]),
    _p("tl-mxfp8", _tl(), (_x(2, 16, 32),), (_x(2, 16, 32),), {}, MXFP8, NotImplementedError,
       ["fp8_recipe", "MXFP8BlockScaling"]),
]


def _host(tree):
    return jax.tree_util.tree_map(np.array, tree)


@pytest.mark.parametrize("module, init_inputs, inputs, kwargs, fp8_recipe, exc, words", CALLS)
def test_apply_rejects(module, init_inputs, inputs, kwargs, fp8_recipe, exc, words):
    # An unsupported recipe has no state to make: the variables come from a run without it.
    init_recipe = fp8_recipe if fp8_recipe is DELAYED else None

    def autocast(r):
        return (te.fp8_autocast(enabled=True, fp8_recipe=r) if r is not None
                else contextlib.nullcontext())

    variables = {}  # None: a module without variables (DotProductAttention)
    if init_inputs is not None:
        with autocast(init_recipe):
            variables = module.init(KEY, *init_inputs, **kwargs_of(module))
    before = _host(variables)
    with pytest.raises(exc) as info:
        with autocast(fp8_recipe):
            module.apply(variables, *inputs, **kwargs, **kwargs_of(module),
                         mutable=["fp8_metas"] if init_recipe is not None else False)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    after = _host(variables)
    assert jax.tree_util.tree_structure(after) == jax.tree_util.tree_structure(before)
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(before),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def kwargs_of(module) -> dict:
    """The keywords every call of ``module`` needs (no dropout rng in these tests)."""
    if isinstance(module, (MultiHeadAttention, TransformerLayer, LayerNormMLP)):
        return {"deterministic": True}
    return {}


def test_tables_cover_every_module():
    ids = [p.id for p in SETTINGS + CALLS]
    for prefix in ("dense-", "layernorm-", "lndense-", "mlp-", "dpa-", "mha-", "tl-"):
        assert any(i.startswith(prefix) for i in ids), prefix
    assert len(ids) >= 60


def test_integer_padding_mask_is_read_as_one_masked():
    """The accepted conventions, for contrast with the rejected rows: bool or 0/1 integers,
    True / 1 = masked out, both giving the cu_seqlens result."""
    attn = DotProductAttention(16, 2, attn_mask_type="padding")
    q = jax.random.normal(KEY, (2, 8, 2, 16))
    mask = np.zeros((2, 1, 8, 8), np.int32)
    mask[1, :, 5:, :] = 1
    mask[1, :, :, 5:] = 1
    got_int = attn.apply({}, q, q, q, jnp.asarray(mask))
    got_bool = attn.apply({}, q, q, q, jnp.asarray(mask, bool))
    cu = jnp.array([0, 8, 13], jnp.int32)
    want = attn.apply({}, q, q, q, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    np.testing.assert_array_equal(np.asarray(got_int), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_bool), np.asarray(want))
