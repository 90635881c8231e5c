"""DotProductAttention's softmax_type (attention sinks, NVIDIA TE's "off-by-one" and
"learnable"): values and gradients (the sink's included) against a float64 reference written
from the definition, in every layout and mask; the sink's limits; its parameter in the
modules' state; decoding through a KV cache; and the refusals."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

CPU = torch.device("cpu")
B, S, HEADS, GROUPS, DIM = 2, 7, 4, 2, 16
# fp32 against float64: the module's matmuls and softmax round each product and sum once in
# fp32 (relative 2^-24 per operation, sums of 7-16 terms of order 1): 1e-5 leaves room for
# the orders of the reductions and is far below any real difference (a sink's share here is
# 0.05-0.5 of a row's weight).
TOL = dict(atol=1e-5, rtol=1e-5)


def _reference(q, k, v, sink, causal: bool, lengths=None):
    """Attention with a sink, in float64 from the definition: q, k, v [b, s, h(kv), d] (bshd),
    sink [h] or None; ``lengths`` [b] masks each sequence's keys and queries past its length
    (those query rows give 0)."""
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    x = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    allowed = torch.ones(b, 1, sq, k.shape[1], dtype=torch.bool)
    if causal:
        allowed &= torch.ones(sq, k.shape[1], dtype=torch.bool).tril()
    if lengths is not None:
        pos = torch.arange(sq)
        valid = pos.view(1, -1) < lengths.view(-1, 1)
        allowed &= valid.view(b, 1, sq, 1) & valid.view(b, 1, 1, sq)
    x = x.masked_fill(~allowed, float("-inf"))
    e = torch.exp(x - x.amax(-1, keepdim=True).clamp(min=-1e300))
    e = torch.where(allowed, e, torch.zeros_like(e))
    m = x.amax(-1, keepdim=True).clamp(min=-1e300)
    denominator = e.sum(-1, keepdim=True)
    if sink is not None:
        denominator = denominator + torch.exp(sink.double().view(1, -1, 1, 1) - m)
    p = e / denominator.clamp(min=1e-300)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if lengths is not None:
        o = o * valid.view(b, sq, 1, 1)
    return o.reshape(b, sq, h * d)


def _inputs(seed=0, kv_heads=GROUPS):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, HEADS, DIM, generator=g)
    k, v = (torch.randn(B, S, kv_heads, DIM, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _dpa(softmax_type, mask="causal", fmt="bshd", sink=None):
    m = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format=fmt,
                               attn_mask_type=mask, softmax_type=softmax_type, device=CPU)
    if sink is not None:
        with torch.no_grad():
            m.softmax_offset.copy_(sink)
    return m


def _to(fmt, t):
    return t.transpose(0, 1) if fmt == "sbhd" else t


def _from(fmt, o):
    return o.transpose(0, 1) if fmt == "sbhd" else o


SINK = torch.tensor([0.5, -1.0, 2.0, 0.0])


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_values_and_gradients_match_the_definition(fmt, mask, softmax_type):
    sink = SINK if softmax_type == "learnable" else None
    m = _dpa(softmax_type, mask, fmt, sink)
    q, k, v = _inputs()
    out = _from(fmt, m(*(_to(fmt, t) for t in (q, k, v))))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_sink = (SINK if sink is not None else torch.zeros(HEADS)).double().requires_grad_()
    ref = _reference(*ref_in, ref_sink, mask == "causal")
    torch.testing.assert_close(out.double(), ref, **TOL)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad)
    ref.backward(grad.double())
    for got, want in zip((q.grad, k.grad, v.grad), ref_in, strict=True):
        torch.testing.assert_close(got.double(), want.grad, **TOL)
    if softmax_type == "learnable":
        assert m.softmax_offset.grad is not None
        torch.testing.assert_close(m.softmax_offset.grad.double(), ref_sink.grad, **TOL)


def test_packed_thd_and_padding_take_the_sink_per_sequence():
    """thd (packed) and bshd with a padding mask: each sequence's rows as the reference
    masks them; the padded query rows give 0."""
    lengths = torch.tensor([7, 4])
    cu = torch.tensor([0, 7, 11], dtype=torch.int32)
    q, k, v = _inputs()
    ref = _reference(q.detach(), k.detach(), v.detach(), SINK, True, lengths)
    padded = _dpa("learnable", "padding_causal", "bshd", SINK)
    out = padded(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    torch.testing.assert_close(out.double(), ref, **TOL)
    packed = _dpa("learnable", "padding_causal", "thd", SINK)
    rows = [t[i, :n] for t in (q, k, v) for i, n in enumerate(lengths.tolist())]
    tq, tk, tv = (torch.cat(rows[j * B:(j + 1) * B]) for j in range(3))
    out = packed(tq, tk, tv, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S, max_seqlen_kv=S)
    want = torch.cat([ref[i, :n] for i, n in enumerate(lengths.tolist())])
    torch.testing.assert_close(out.double(), want, **TOL)


def test_the_sinks_limits():
    """A sink far below every logit takes nothing (the vanilla softmax's output); one far
    above takes everything (output 0)."""
    q, k, v = _inputs()
    vanilla = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd",
                                     attention_backend="unfused", device=CPU)
    low = _dpa("learnable", sink=torch.full((HEADS,), -1e4))
    torch.testing.assert_close(low(q, k, v), vanilla(q, k, v), **TOL)
    high = _dpa("learnable", sink=torch.full((HEADS,), 1e4))
    assert torch.equal(high(q, k, v), torch.zeros(B, S, HEADS * DIM))


def test_the_sink_in_the_modules_state():
    learnable = _dpa("learnable")
    assert isinstance(learnable.softmax_offset, torch.nn.Parameter)
    assert learnable.softmax_offset.dtype == torch.float32
    assert torch.equal(learnable.softmax_offset.detach(), torch.zeros(HEADS))
    assert "softmax_offset" in learnable.state_dict()
    fixed = _dpa("off-by-one")
    assert "softmax_offset" not in fixed.state_dict()
    assert "softmax_offset" in dict(fixed.named_buffers())
    assert _dpa("vanilla").softmax_offset is None
    layer = te.TransformerLayer(64, 128, HEADS, num_gqa_groups=GROUPS, softmax_type="learnable",
                                hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    names = [n for n, _ in layer.named_parameters()]
    assert "self_attention.core_attention.softmax_offset" in names
    x = torch.randn(5, 2, 64)
    layer(x).sum().backward()
    assert layer.self_attention.core_attention.softmax_offset.grad.abs().sum() > 0
    deferred = te.DotProductAttention(HEADS, DIM, softmax_type="learnable", device="meta")
    deferred = deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    assert torch.equal(deferred.softmax_offset.detach(), torch.zeros(HEADS))


def test_kv_cache_decoding_with_sinks_equals_the_full_forward():
    torch.manual_seed(0)
    mha = te.MultiheadAttention(64, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                qkv_format="bshd", softmax_type="learnable", device="cpu")
    with torch.no_grad():
        mha.core_attention.softmax_offset.copy_(SINK)
    x = torch.randn(2, 9, 64)
    full = mha(x, attn_mask_type="causal")
    params = te.InferenceParams(2, 16)
    params.pre_step(OrderedDict((i, 4) for i in range(2)))
    outs = [mha(x[:, :4], inference_params=params)]
    for t in range(4, 9):
        params.pre_step(OrderedDict((i, 1) for i in range(2)))
        outs.append(mha(x[:, t:t + 1], inference_params=params))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=2e-5, rtol=2e-5)


def test_refusals_name_the_sink():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        te.DotProductAttention(HEADS, DIM, softmax_type="off_by_one", device=CPU)
    fused = te.DotProductAttention(HEADS, DIM, num_gqa_groups=GROUPS, qkv_format="bshd",
                                   softmax_type="off-by-one", attention_backend="cpu",
                                   device=CPU)
    with pytest.raises(NotImplementedError, match="attention sinks.*unfused path only"):
        fused(q, k, v)
    m = _dpa("off-by-one")
    with pytest.raises(NotImplementedError, match="fp8_dpa=True.*attention sinks"):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            m(q, k, v)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_the_device_gives_the_cpu_results(device, softmax_type):
    """On every device the same torch ops: CUDA's values and gradients against the CPU's (fp32;
    cuBLAS may sum in another order, hence the tolerance, not bits)."""
    results = []
    for where in (CPU, device):
        m = _dpa(softmax_type, sink=SINK if softmax_type == "learnable" else None).to(where)
        q, k, v = (t.detach().to(where).requires_grad_() for t in _inputs())
        out = m(q, k, v)
        out.square().sum().backward()
        sink_grad = m.softmax_offset.grad if softmax_type == "learnable" else None
        results.append([out, q.grad, k.grad, v.grad]
                       + ([sink_grad] if sink_grad is not None else []))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
