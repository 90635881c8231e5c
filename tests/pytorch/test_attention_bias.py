"""Attention biases by NVIDIA's names (attention_bias.py): DotProductAttention's
``core_attention_bias_type`` with ``core_attention_bias`` or ``alibi_slopes``, against a
float64 reference, with gradients, through MultiheadAttention and TransformerLayer, and the
refusals."""

from __future__ import annotations

import math

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

B, SQ, SKV, H, D = 2, 8, 12, 4, 16


def _reference(q, k, v, bias, pre_scale: bool, causal: bool):
    """softmax(scale * (q k^T + bias)) v or softmax(scale * q k^T + bias) v in float64, bshd;
    "causal" is NVIDIA's top-left causal mask (key j > query i masked)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    scale = 1 / math.sqrt(D)
    s = q @ k.transpose(-1, -2)
    s = (s + bias.double()) * scale if pre_scale else s * scale + bias.double()
    if causal:
        sq, skv = s.shape[-2:]
        s = s.masked_fill(torch.arange(skv).view(1, skv) > torch.arange(sq).view(sq, 1),
                          float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, -1, H * D)


def _alibi(slopes, sq, skv, bottom_right: bool):
    i = torch.arange(sq).view(sq, 1) + (skv - sq if bottom_right else 0)
    distance = (torch.arange(skv).view(1, skv) - i).abs().double()
    return -slopes.double().reshape(-1, H, 1, 1) * distance


def _qkv(dtype=torch.float32, sq=SQ, skv=SKV, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, s, H, D, generator=g).to(device, dtype).requires_grad_(True)
            for s in (sq, skv, skv)]


def _dpa(mask="no_mask", layout="bshd", device="cpu"):
    return te.DotProductAttention(H, D, attention_dropout=0.0, qkv_format=layout,
                                  attn_mask_type=mask, device=device)


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
@pytest.mark.parametrize("shape", [(B, H), (1, H), (B, 1), (1, 1)], ids=str)
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_bias_equals_the_reference_with_gradients(device, bias_type, shape, mask):
    q, k, v = _qkv(device=device)
    bias = (torch.randn(*shape, SQ, SKV, generator=torch.Generator().manual_seed(1)) * 2
            ).to(device).requires_grad_(True)
    out = _dpa(mask, device=device)(q, k, v, core_attention_bias_type=bias_type,
                                    core_attention_bias=bias)
    qr, kr, vr = (t.detach().cpu().requires_grad_(True) for t in (q, k, v))
    br = bias.detach().cpu().requires_grad_(True)
    ref = _reference(qr, kr, vr, br, bias_type == "pre_scale_bias", mask == "causal")
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double().cpu())
    for ours, want in zip((q, k, v, bias), (qr, kr, vr, br), strict=True):
        torch.testing.assert_close(ours.grad.double().cpu(), want.grad.double(), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("slopes_shape", [(H,), (B, H)], ids=["h", "bh"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_alibi_equals_the_reference(device, slopes_shape, mask):
    q, k, v = _qkv(device=device)
    slopes = torch.rand(*slopes_shape, generator=torch.Generator().manual_seed(2))
    out = _dpa(mask, device=device)(q, k, v, core_attention_bias_type="alibi",
                                    alibi_slopes=slopes.to(device))
    # NVIDIA's alignment: top-left under the top-left causal mask, else bottom-right
    ref = _reference(*(t.detach().cpu() for t in (q, k, v)),
                     _alibi(slopes, SQ, SKV, mask != "causal"), False, mask == "causal")
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)


def test_sbhd_and_bf16():
    """sbhd gives bshd's rows; bf16 inputs give a bf16 output within bf16's rounding."""
    q, k, v = _qkv(torch.bfloat16)
    bias = torch.randn(1, H, SQ, SKV)
    bshd = _dpa()(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    sbhd = _dpa(layout="sbhd")(*(t.transpose(0, 1) for t in (q, k, v)),
                               core_attention_bias_type="post_scale_bias",
                               core_attention_bias=bias)
    assert bshd.dtype == sbhd.dtype == torch.bfloat16
    assert torch.equal(bshd, sbhd.transpose(0, 1))
    ref = _reference(q, k, v, bias, False, False)
    torch.testing.assert_close(bshd.double(), ref, rtol=2e-2, atol=2e-2)


def test_through_transformer_layer():
    """TransformerLayer hands the bias to its attention: a zero bias gives the output without
    one (within the two paths' rounding), another bias changes it, and its gradient flows."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(H * D, 128, H, hidden_dropout=0.0, attention_dropout=0.0,
                                attn_input_format="bshd", self_attn_mask_type="causal")
    x = torch.randn(B, SQ, H * D)
    plain = layer(x)
    zero = layer(x, core_attention_bias_type="post_scale_bias",
                 core_attention_bias=torch.zeros(1, H, SQ, SQ))
    torch.testing.assert_close(zero, plain, rtol=1e-5, atol=1e-5)
    bias = torch.randn(1, H, SQ, SQ, requires_grad=True)
    biased = layer(x, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    assert not torch.allclose(biased, plain, atol=1e-3)
    biased.sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    alibi = layer(x, core_attention_bias_type="alibi", alibi_slopes=torch.full((H,), 0.5))
    assert alibi.shape == plain.shape and not torch.allclose(alibi, plain, atol=1e-3)


@pytest.mark.parametrize("kwargs, call, error, words", [
    (dict(core_attention_bias=torch.zeros(1, H, SQ, SKV + 1)), {}, ValueError,
     ["core_attention_bias must be a float tensor", f"{SQ}, {SKV}]", "[1, 4, 8, 13]"]),
    (dict(core_attention_bias=torch.zeros(3, H, SQ, SKV)), {}, ValueError,
     ["[2 or 1, 4 or 1, 8, 12]"]),
    (dict(core_attention_bias=torch.zeros(1, H, SQ, SKV, dtype=torch.int32)), {}, ValueError,
     ["torch.int32"]),
    (dict(core_attention_bias_type="alibi", alibi_slopes=torch.ones(H + 1)), {}, ValueError,
     ["alibi_slopes must be a float tensor [4] or [2, 4]", "[5]"]),
    (dict(core_attention_bias=torch.zeros(1, H, SQ, SKV)), dict(attention_backend="cudnn"),
     NotImplementedError, ["unfused path only", "'cudnn'"]),
])
def test_bad_biases_are_refused(kwargs, call, error, words):
    kwargs.setdefault("core_attention_bias_type", "post_scale_bias")
    with pytest.raises(error) as info:
        _dpa()(*_qkv(), **kwargs, **call)
    message = str(info.value)
    assert message.startswith("DotProductAttention: ")
    for word in words:
        assert word in message, (word, message)


def test_fp8_attention_with_a_bias_is_refused():
    q, k, v = _qkv()
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="fp8_dpa=True"):
            _dpa()(q, k, v, core_attention_bias_type="alibi", alibi_slopes=torch.ones(H))


def test_mha_refuses_a_bias_where_it_attends_otherwise():
    mha = te.MultiheadAttention(H * D, H, attention_dropout=0.0, attn_mask_type="causal")
    cache = te.InferenceParams(B, 16)
    with pytest.raises(NotImplementedError, match="KV cache"):
        mha(torch.randn(SQ, B, H * D), inference_params=cache,
            core_attention_bias_type="alibi", alibi_slopes=torch.ones(H))
