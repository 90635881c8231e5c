"""Bad arguments to every public module, one row each: the constructor or forward raises the
expected exception type, its message names the module (or op) and the argument, and nothing
changed on the way (the module's parameters and FP8 state buffers; for a constructor, torch's
random state, which an initializer that ran before the check would have advanced)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

CPU = "cpu"
DELAYED = recipe.DelayedScaling()
MXFP8 = recipe.MXFP8BlockScaling()


def _p(case_id, *values):
    return pytest.param(*values, id=case_id)


# ------------------------------------------------------------------------------ constructors

CONSTRUCTORS = [
    _p("linear-negative-in", lambda: te.Linear(-1, 16, device=CPU), ValueError,
       ["te.Linear", "in_features", "-1"]),
    _p("linear-zero-out", lambda: te.Linear(16, 0, device=CPU), ValueError,
       ["te.Linear", "out_features", "0"]),
    _p("linear-float-size", lambda: te.Linear(16.5, 16, device=CPU), ValueError,
       ["te.Linear", "in_features", "16.5"]),
    _p("linear-int8-params", lambda: te.Linear(16, 16, params_dtype=torch.int8, device=CPU),
       TypeError, ["te.Linear", "params_dtype", "int8"]),
    _p("linear-bool-params", lambda: te.Linear(16, 16, params_dtype=torch.bool, device=CPU),
       TypeError, ["te.Linear", "params_dtype", "bool"]),
    _p("linear-parallel-mode", lambda: te.Linear(16, 16, parallel_mode="diag", device=CPU),
       ValueError, ["te.Linear", "parallel_mode", "diag"]),
    _p("linear-tp-size", lambda: te.Linear(16, 16, tp_size=0, device=CPU),
       ValueError, ["te.Linear", "tp_size"]),
    _p("linear-uneven-split",
       lambda: te.Linear(16, 16, parameters_split=["a", "b", "c"], device=CPU), ValueError,
       ["te.Linear", "parameters_split"]),
    _p("lnlinear-zero-in", lambda: te.LayerNormLinear(0, 16, device=CPU), ValueError,
       ["te.LayerNormLinear", "in_features"]),
    _p("lnlinear-negative-out", lambda: te.LayerNormLinear(16, -2, device=CPU), ValueError,
       ["te.LayerNormLinear", "out_features", "-2"]),
    _p("lnlinear-int32-params",
       lambda: te.LayerNormLinear(16, 16, params_dtype=torch.int32, device=CPU), TypeError,
       ["te.LayerNormLinear", "params_dtype", "int32"]),
    _p("lnlinear-normalization",
       lambda: te.LayerNormLinear(16, 16, normalization="BatchNorm", device=CPU), ValueError,
       ["te.LayerNormLinear", "normalization", "BatchNorm"]),
    _p("lnlinear-negative-eps", lambda: te.LayerNormLinear(16, 16, eps=-1.0, device=CPU),
       ValueError, ["te.LayerNormLinear", "eps"]),
    _p("mlp-zero-hidden", lambda: te.LayerNormMLP(0, 16, device=CPU), ValueError,
       ["te.LayerNormMLP", "hidden_size", "0"]),
    _p("mlp-zero-ffn", lambda: te.LayerNormMLP(16, 0, device=CPU), ValueError,
       ["te.LayerNormMLP", "ffn_hidden_size", "0"]),
    _p("mlp-int8-params", lambda: te.LayerNormMLP(16, 16, params_dtype=torch.int8, device=CPU),
       TypeError, ["te.LayerNormMLP", "params_dtype", "int8"]),
    _p("mlp-activation", lambda: te.LayerNormMLP(16, 16, activation="tanh", device=CPU),
       ValueError, ["te.LayerNormMLP", "activation", "tanh"]),
    _p("layernorm-zero", lambda: te.LayerNorm(0, device=CPU), ValueError,
       ["te.LayerNorm", "hidden_size"]),
    _p("layernorm-negative-eps", lambda: te.LayerNorm(16, eps=-1.0, device=CPU), ValueError,
       ["te.LayerNorm", "eps"]),
    _p("rmsnorm-negative", lambda: te.RMSNorm(-3, device=CPU), ValueError,
       ["te.RMSNorm", "hidden_size", "-3"]),
    _p("rmsnorm-int8-params", lambda: te.RMSNorm(16, params_dtype=torch.int8, device=CPU),
       TypeError, ["te.RMSNorm", "params_dtype", "int8"]),
    _p("dpa-zero-heads", lambda: te.DotProductAttention(0, 16, device=CPU), ValueError,
       ["DotProductAttention", "num_attention_heads"]),
    _p("dpa-zero-kv-channels", lambda: te.DotProductAttention(2, 0, device=CPU), ValueError,
       ["DotProductAttention", "kv_channels"]),
    _p("dpa-zero-head-dim-v", lambda: te.DotProductAttention(2, (16, 0), device=CPU),
       ValueError, ["DotProductAttention", "kv_channels"]),
    _p("dpa-gqa-groups", lambda: te.DotProductAttention(4, 16, num_gqa_groups=3, device=CPU),
       ValueError, ["DotProductAttention", "num_gqa_groups"]),
    _p("dpa-dropout", lambda: te.DotProductAttention(2, 16, attention_dropout=1.5, device=CPU),
       ValueError, ["DotProductAttention", "attention_dropout"]),
    _p("dpa-qkv-format", lambda: te.DotProductAttention(2, 16, qkv_format="hsbd", device=CPU),
       ValueError, ["DotProductAttention", "qkv_format", "hsbd"]),
    _p("dpa-mask-type",
       lambda: te.DotProductAttention(2, 16, attn_mask_type="sliding", device=CPU), ValueError,
       ["DotProductAttention", "attn_mask_type", "sliding"]),
    _p("dpa-backend",
       lambda: te.DotProductAttention(2, 16, attention_backend="flash9", device=CPU),
       ValueError, ["DotProductAttention", "attention_backend", "flash9"]),
    _p("mha-zero-hidden", lambda: te.MultiheadAttention(0, 2, device=CPU), ValueError,
       ["te.MultiheadAttention", "hidden_size"]),
    _p("mha-zero-heads", lambda: te.MultiheadAttention(32, 0, device=CPU), ValueError,
       ["te.MultiheadAttention", "num_attention_heads"]),
    _p("mha-indivisible", lambda: te.MultiheadAttention(30, 4, device=CPU), ValueError,
       ["te.MultiheadAttention", "hidden_size", "num_attention_heads"]),
    _p("mha-int8-params",
       lambda: te.MultiheadAttention(32, 4, params_dtype=torch.int8, device=CPU), TypeError,
       ["te.MultiheadAttention", "params_dtype", "int8"]),
    _p("mha-attention-type",
       lambda: te.MultiheadAttention(32, 4, attention_type="both", device=CPU), ValueError,
       ["te.MultiheadAttention", "attention_type", "both"]),
    _p("mha-gqa-groups", lambda: te.MultiheadAttention(32, 4, num_gqa_groups=3, device=CPU),
       ValueError, ["te.MultiheadAttention", "num_gqa_groups"]),
    _p("tl-zero-hidden", lambda: te.TransformerLayer(0, 64, 2, device=CPU), ValueError,
       ["te.TransformerLayer", "hidden_size"]),
    _p("tl-zero-ffn", lambda: te.TransformerLayer(32, 0, 2, device=CPU), ValueError,
       ["te.TransformerLayer", "ffn_hidden_size"]),
    _p("tl-zero-heads", lambda: te.TransformerLayer(32, 64, 0, device=CPU), ValueError,
       ["te.TransformerLayer", "num_attention_heads"]),
    _p("tl-int8-params",
       lambda: te.TransformerLayer(32, 64, 2, params_dtype=torch.int8, device=CPU), TypeError,
       ["te.TransformerLayer", "params_dtype", "int8"]),
    _p("tl-layer-type", lambda: te.TransformerLayer(32, 64, 2, layer_type="middle", device=CPU),
       ValueError, ["te.TransformerLayer", "layer_type", "middle"]),
    _p("tl-hidden-dropout",
       lambda: te.TransformerLayer(32, 64, 2, hidden_dropout=2.0, device=CPU), ValueError,
       ["te.TransformerLayer", "hidden_dropout"]),
]


@pytest.mark.parametrize("make, exc, words", CONSTRUCTORS)
def test_constructor_rejects(make, exc, words):
    rng = torch.get_rng_state()
    with pytest.raises(exc) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    # The check runs before any parameter is initialized.
    assert torch.equal(torch.get_rng_state(), rng)


# ------------------------------------------------------------------------------ forwards

def _x(*shape, dtype=torch.float32, device=CPU):
    if dtype.is_floating_point:
        return torch.randn(*shape, device=device).to(dtype)
    return torch.ones(*shape, dtype=dtype, device=device)


def _qkv(q_shape=(2, 8, 2, 16), kv_shape=None, dtype=torch.float32, device=CPU, **over):
    q = _x(*q_shape, dtype=dtype, device=device)
    kv = q if kv_shape is None else _x(*kv_shape, dtype=dtype, device=device)
    out = {"query": q, "key": kv, "value": kv}
    out.update(over)
    return out


def _bool(*shape):
    return torch.zeros(*shape, dtype=torch.bool)


def _dpa(mask="padding", fmt="bshd", **kw):
    return lambda: te.DotProductAttention(2, 16, qkv_format=fmt, attn_mask_type=mask,
                                          device=CPU, **kw)


def _linear(k=16, n=16):
    return lambda: te.Linear(k, n, device=CPU)


def _lnlinear(k=16, n=16):
    return lambda: te.LayerNormLinear(k, n, device=CPU)


def _mlp(k=16, f=16):
    return lambda: te.LayerNormMLP(k, f, device=CPU)


def _mha(mask="padding", **kw):
    return lambda: te.MultiheadAttention(32, 2, attention_dropout=0.0, attn_mask_type=mask,
                                         qkv_format="bshd", device=CPU, **kw)


def _tl(mask="padding", **kw):
    return lambda: te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                       self_attn_mask_type=mask, attn_input_format="bshd",
                                       device=CPU, **kw)


def _cu(*lengths):
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


FORWARDS = [
    # te.Linear
    _p("linear-wrong-features", _linear(), lambda m: m(_x(4, 8)), None, ValueError,
       ["te.Linear", "input", "in_features=16", "[4, 8]"]),
    _p("linear-scalar", _linear(), lambda m: m(torch.tensor(1.0)), None, ValueError,
       ["te.Linear", "input", "in_features"]),
    _p("linear-empty-features", _linear(), lambda m: m(_x(4, 0)), None, ValueError,
       ["te.Linear", "input", "[4, 0]"]),
    _p("linear-int-input", _linear(), lambda m: m(_x(4, 16, dtype=torch.int32)), None,
       TypeError, ["te.Linear", "input", "int32"]),
    _p("linear-meta-input", _linear(), lambda m: m(_x(4, 16, device="meta")), None,
       RuntimeError, ["te.Linear", "input", "meta"]),
    _p("linear-meta-input-fp8", _linear(32, 32), lambda m: m(_x(32, 32, device="meta")),
       DELAYED, RuntimeError, ["te.Linear", "input", "meta"]),
    _p("linear-fp8-features", _linear(24, 32), lambda m: m(_x(32, 24)), DELAYED, ValueError,
       ["te.Linear", "in_features", "24"]),
    # (any token count is taken in FP8; the feature dimensions keep the rule of 16)
    _p("linear-fp8-out-features", _linear(32, 24), lambda m: m(_x(5, 32)), DELAYED,
       ValueError, ["te.Linear", "out_features", "24"]),
    _p("linear-fp8-float64", _linear(32, 32), lambda m: m(_x(32, 32, dtype=torch.float64)),
       DELAYED, TypeError, ["te.Linear", "input", "float64"]),
    _p("linear-mxfp8", _linear(32, 32), lambda m: m(_x(32, 32)), MXFP8, NotImplementedError,
       ["te.Linear", "fp8_recipe", "MXFP8BlockScaling"]),
    # te.LayerNormLinear
    _p("lnlinear-wrong-features", _lnlinear(), lambda m: m(_x(4, 8)), None, ValueError,
       ["te.LayerNormLinear", "input", "16", "[4, 8]"]),
    _p("lnlinear-scalar", _lnlinear(), lambda m: m(torch.tensor(1.0)), None, ValueError,
       ["te.LayerNormLinear", "input"]),
    _p("lnlinear-int-input", _lnlinear(), lambda m: m(_x(4, 16, dtype=torch.int64)), None,
       TypeError, ["te.LayerNormLinear", "input", "int64"]),
    _p("lnlinear-float64", _lnlinear(), lambda m: m(_x(4, 16, dtype=torch.float64)), None,
       TypeError, ["te.LayerNormLinear", "input", "float64"]),
    _p("lnlinear-meta-input", _lnlinear(), lambda m: m(_x(4, 16, device="meta")), None,
       RuntimeError, ["te.LayerNormLinear", "input", "meta"]),
    _p("lnlinear-fp8-out-features", _lnlinear(32, 24), lambda m: m(_x(5, 32)), DELAYED,
       ValueError, ["te.LayerNormLinear", "out_features", "24"]),
    _p("lnlinear-mxfp8", _lnlinear(32, 32), lambda m: m(_x(32, 32)), MXFP8,
       NotImplementedError, ["te.LayerNormLinear", "fp8_recipe", "MXFP8BlockScaling"]),
    # te.LayerNormMLP
    _p("mlp-wrong-features", _mlp(), lambda m: m(_x(4, 8)), None, ValueError,
       ["te.LayerNormMLP", "input", "[4, 8]"]),
    _p("mlp-empty-features", _mlp(), lambda m: m(_x(4, 0)), None, ValueError,
       ["te.LayerNormMLP", "input", "[4, 0]"]),
    _p("mlp-int-input", _mlp(), lambda m: m(_x(4, 16, dtype=torch.int32)), None, TypeError,
       ["te.LayerNormMLP", "input", "int32"]),
    _p("mlp-meta-input", _mlp(), lambda m: m(_x(4, 16, device="meta")), None, RuntimeError,
       ["te.LayerNormMLP", "input", "meta"]),
    _p("mlp-fp8-hidden", _mlp(24, 32), lambda m: m(_x(5, 24)), DELAYED, ValueError,
       ["te.LayerNormMLP", "in_features", "24"]),
    _p("mlp-fp8-ffn", _mlp(32, 24), lambda m: m(_x(32, 32)), DELAYED, ValueError,
       ["te.LayerNormMLP", "24"]),
    _p("mlp-mxfp8", _mlp(32, 32), lambda m: m(_x(32, 32)), MXFP8, NotImplementedError,
       ["te.LayerNormMLP", "fp8_recipe", "MXFP8BlockScaling"]),
    # te.LayerNorm / te.RMSNorm
    _p("layernorm-wrong-features", lambda: te.LayerNorm(16, device=CPU),
       lambda m: m(_x(4, 8)), None, ValueError, ["te.LayerNorm", "input", "[4, 8]"]),
    _p("layernorm-int-input", lambda: te.LayerNorm(16, device=CPU),
       lambda m: m(_x(4, 16, dtype=torch.int32)), None, TypeError,
       ["te.LayerNorm", "input", "int32"]),
    _p("layernorm-meta-input", lambda: te.LayerNorm(16, device=CPU),
       lambda m: m(_x(4, 16, device="meta")), None, RuntimeError,
       ["te.LayerNorm", "input", "meta"]),
    _p("rmsnorm-scalar", lambda: te.RMSNorm(16, device=CPU), lambda m: m(torch.tensor(1.0)),
       None, ValueError, ["te.RMSNorm", "input", "hidden_size"]),
    _p("rmsnorm-float64", lambda: te.RMSNorm(16, device=CPU),
       lambda m: m(_x(2, 16, dtype=torch.float64)), None, TypeError,
       ["te.RMSNorm", "input", "float64"]),
    _p("rmsnorm-meta-input", lambda: te.RMSNorm(16, device=CPU),
       lambda m: m(_x(4, 16, device="meta")), None, RuntimeError,
       ["te.RMSNorm", "input", "meta"]),
    # DotProductAttention: inputs
    _p("dpa-query-rank", _dpa("causal"), lambda m: m(**_qkv((2, 8, 32))), None, ValueError,
       ["DotProductAttention", "query", "[2, 8, 32]"]),
    _p("dpa-key-head-dim", _dpa("causal"),
       lambda m: m(**_qkv(key=_x(2, 8, 2, 8), value=_x(2, 8, 2, 8))), None, ValueError,
       ["DotProductAttention", "key", "head dim"]),
    _p("dpa-query-heads", _dpa("causal"), lambda m: m(**_qkv((2, 8, 4, 16), (2, 8, 2, 16))),
       None, ValueError, ["DotProductAttention", "query", "heads"]),
    _p("dpa-key-dtype", _dpa("causal"),
       lambda m: m(**_qkv(key=_x(2, 8, 2, 16, dtype=torch.float64))), None, TypeError,
       ["DotProductAttention", "key", "float64"]),
    _p("dpa-int-query", _dpa("causal"), lambda m: m(**_qkv(dtype=torch.int32)), None,
       TypeError, ["DotProductAttention", "query", "int32"]),
    _p("dpa-meta-inputs", _dpa("causal"), lambda m: m(**_qkv(device="meta")), None,
       RuntimeError, ["DotProductAttention", "query", "meta"]),
    _p("dpa-window", _dpa("no_mask"), lambda m: m(**_qkv(), window_size=(-2, 0)), None,
       ValueError, ["DotProductAttention", "window_size"]),
    _p("dpa-qkv-format-call", _dpa("causal"), lambda m: m(**_qkv(), qkv_format="bsdh"), None,
       ValueError, ["DotProductAttention", "qkv_format", "bsdh"]),
    # DotProductAttention: masks (bool, True = masked out)
    _p("dpa-padding-float-mask", _dpa(), lambda m: m(**_qkv(), attention_mask=_x(2, 1, 1, 8)),
       None, TypeError, ["DotProductAttention", "attention_mask", "float32", "bool"]),
    _p("dpa-padding-keep-convention-mask", _dpa(),
       lambda m: m(**_qkv(), attention_mask=torch.ones(2, 1, 1, 8)), None, TypeError,
       ["DotProductAttention", "attention_mask", "float32", "bool"]),
    _p("dpa-padding-uint8-mask", _dpa(),
       lambda m: m(**_qkv(), attention_mask=torch.zeros(2, 1, 1, 8, dtype=torch.uint8)), None,
       TypeError, ["DotProductAttention", "attention_mask", "uint8", "bool"]),
    _p("dpa-padding-sb-mask", _dpa(), lambda m: m(**_qkv(), attention_mask=_bool(8, 2)), None,
       ValueError, ["DotProductAttention", "attention_mask", "[8, 2]", "[2, 1, 1, 8]"]),
    _p("dpa-padding-bs-mask", _dpa(), lambda m: m(**_qkv(), attention_mask=_bool(2, 8)), None,
       ValueError, ["DotProductAttention", "attention_mask", "[2, 8]", "[2, 1, 1, 8]"]),
    _p("dpa-padding-sbhd-mask-layout", _dpa(fmt="sbhd"),
       lambda m: m(**_qkv((8, 2, 2, 16)), attention_mask=_bool(8, 1, 1, 2)), None, ValueError,
       ["DotProductAttention", "attention_mask", "[8, 1, 1, 2]", "[2, 1, 1, 8]"]),
    _p("dpa-padding-batch", _dpa(), lambda m: m(**_qkv(), attention_mask=_bool(3, 1, 1, 8)),
       None, ValueError, ["DotProductAttention", "attention_mask", "[3, 1, 1, 8]"]),
    _p("dpa-padding-cross-one-mask", _dpa(),
       lambda m: m(**_qkv((2, 8, 2, 16), (2, 6, 2, 16)), attention_mask=_bool(2, 1, 1, 8)),
       None, ValueError, ["DotProductAttention", "attention_mask", "kv_mask"]),
    _p("dpa-padding-cross-kv-shape", _dpa(),
       lambda m: m(**_qkv((2, 8, 2, 16), (2, 6, 2, 16)),
                   attention_mask=(_bool(2, 1, 1, 8), _bool(2, 1, 1, 8))),
       None, ValueError, ["DotProductAttention", "attention_mask", "kv_mask", "[2, 1, 1, 6]"]),
    _p("dpa-padding-triple", _dpa(),
       lambda m: m(**_qkv(), attention_mask=(_bool(2, 1, 1, 8),) * 3), None, ValueError,
       ["DotProductAttention", "attention_mask", "pair"]),
    _p("dpa-padding-list-mask", _dpa(),
       lambda m: m(**_qkv(), attention_mask=[[False] * 8] * 2), None, TypeError,
       ["DotProductAttention", "attention_mask", "list"]),
    _p("dpa-padding-no-mask", _dpa(), lambda m: m(**_qkv()), None, ValueError,
       ["DotProductAttention", "cu_seqlens_q", "attention_mask"]),
    _p("dpa-arbitrary-float-mask", _dpa("arbitrary"),
       lambda m: m(**_qkv(), attention_mask=torch.zeros(2, 1, 8, 8)), None, TypeError,
       ["DotProductAttention", "attention_mask", "float32", "bool"]),
    _p("dpa-arbitrary-shape", _dpa("arbitrary"),
       lambda m: m(**_qkv(), attention_mask=_bool(3, 1, 8, 8)), None, ValueError,
       ["DotProductAttention", "attention_mask", "[3, 1, 8, 8]"]),
    _p("dpa-arbitrary-missing", _dpa("arbitrary"), lambda m: m(**_qkv()), None, ValueError,
       ["DotProductAttention", "arbitrary", "attention_mask"]),
    _p("dpa-arbitrary-pair", _dpa("arbitrary"),
       lambda m: m(**_qkv(), attention_mask=(_bool(2, 1, 8, 8), _bool(2, 1, 8, 8))), None,
       TypeError, ["DotProductAttention", "attention_mask", "tuple"]),
    _p("dpa-cu-seqlens-decreasing", _dpa(),
       lambda m: m(**_qkv(), cu_seqlens_q=torch.tensor([0, 8, 4], dtype=torch.int32),
                   cu_seqlens_kv=_cu(8, 8)), None, ValueError,
       ["DotProductAttention", "cu_seqlens_q", "[0, 8, 4]"]),
    _p("dpa-cu-seqlens-shape", _dpa(),
       lambda m: m(**_qkv(), cu_seqlens_q=torch.zeros(2, 3, dtype=torch.int32),
                   cu_seqlens_kv=_cu(8, 8)), None, ValueError,
       ["DotProductAttention", "cu_seqlens_q", "[2, 3]"]),
    _p("dpa-thd-no-max-seqlen", _dpa("padding", "thd"),
       lambda m: m(**_qkv((12, 2, 16)), cu_seqlens_q=_cu(8, 4), cu_seqlens_kv=_cu(8, 4)), None,
       ValueError, ["DotProductAttention", "max_seqlen_q"]),
    # te.MultiheadAttention
    _p("mha-wrong-hidden", _mha(), lambda m: m(_x(2, 8, 16)), None, ValueError,
       ["te.MultiheadAttention", "hidden_states", "[2, 8, 16]"]),
    _p("mha-meta-input", _mha("causal"), lambda m: m(_x(2, 8, 32, device="meta")), None,
       RuntimeError, ["te.MultiheadAttention", "hidden_states", "meta"]),
    _p("mha-float-mask", _mha(), lambda m: m(_x(2, 8, 32), attention_mask=torch.ones(2, 1, 1, 8)),
       None, TypeError, ["DotProductAttention", "attention_mask", "float32"]),
    _p("mha-sb-mask", _mha(), lambda m: m(_x(2, 8, 32), attention_mask=_bool(8, 2)), None,
       ValueError, ["DotProductAttention", "attention_mask", "[8, 2]"]),
    _p("mha-cross-no-encoder", _mha("no_mask", attention_type="cross"),
       lambda m: m(_x(2, 8, 32)), None, ValueError, ["te.MultiheadAttention", "encoder_output"]),
    # te.TransformerLayer
    _p("tl-wrong-hidden", _tl(), lambda m: m(_x(2, 8, 16)), None, ValueError,
       ["te.TransformerLayer", "hidden_states", "[2, 8, 16]"]),
    _p("tl-scalar", _tl(), lambda m: m(torch.tensor(1.0)), None, ValueError,
       ["te.TransformerLayer", "hidden_states"]),
    _p("tl-meta-input", _tl("causal"), lambda m: m(_x(2, 8, 32, device="meta")), None,
       RuntimeError, ["te.TransformerLayer", "hidden_states", "meta"]),
    _p("tl-float-mask", _tl(), lambda m: m(_x(2, 8, 32), attention_mask=torch.ones(2, 1, 1, 8)),
       None, TypeError, ["DotProductAttention", "attention_mask", "float32", "bool"]),
    _p("tl-sb-mask", _tl(), lambda m: m(_x(2, 8, 32), attention_mask=_bool(8, 2)), None,
       ValueError, ["DotProductAttention", "attention_mask", "[8, 2]", "[2, 1, 1, 8]"]),
    _p("tl-mxfp8", _tl("causal"), lambda m: m(_x(2, 16, 32)), MXFP8, NotImplementedError,
       ["te.LayerNormLinear", "fp8_recipe", "MXFP8BlockScaling"]),
]


def _state(module: torch.nn.Module) -> dict:
    """Copies of the parameters and buffers (the FP8 scaling state among them)."""
    return {name: t.detach().clone() for name, t in
            list(module.named_parameters()) + list(module.named_buffers())}


@pytest.mark.parametrize("make, call, fp8_recipe, exc, words", FORWARDS)
def test_forward_rejects(make, call, fp8_recipe, exc, words):
    module = make()
    before = _state(module)
    autocast = (te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe) if fp8_recipe is not None
                else contextlib.nullcontext())
    with pytest.raises(exc) as info:
        with autocast:
            call(module)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    after = _state(module)
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(after[name], t), f"{name} changed"


def test_tables_cover_every_public_module():
    """Each public module appears in both tables' ids (a new module needs its rows)."""
    ids = [p.id for p in CONSTRUCTORS + FORWARDS]
    for prefix in ("linear-", "lnlinear-", "mlp-", "layernorm-", "rmsnorm-", "dpa-", "mha-",
                   "tl-"):
        assert any(i.startswith(prefix) for i in ids), prefix
    assert len(ids) >= 60


def test_bool_padding_mask_gives_the_cu_seqlens_result():
    """The accepted convention, for contrast with the rejected rows: True = padded."""
    attn = te.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="padding",
                                  device=CPU)
    qkv = _qkv()
    mask = _bool(2, 1, 1, 8)
    mask[1, ..., 5:] = True
    got = attn(**qkv, attention_mask=mask)
    want = attn(**qkv, cu_seqlens_q=_cu(8, 5), cu_seqlens_kv=_cu(8, 5))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
