"""te.DotProductAttention against a float64 torch reference (autograd through plain ops), on both
paths (the core's entry point and the unfused matmul + softmax path), every mask, layout, GQA
ratio and window; THD against padded BSHD; dropout under torch.manual_seed; backend choice and
its reasons; input errors; tracing of the custom ops; FP8 attention (forward and backward)
against the bf16 module. The CUDA runs use bf16 inputs.
Tolerances and their reasons: _tolerances.py (ATTENTION_*).
"""

from __future__ import annotations

import math

import pytest
import torch
from te_torch_tests._tolerances import (
    ATTENTION_FP8_RMSE_OF_RANGE,
    ATTENTION_FP8_TOL,
    ATTENTION_TOL,
    E5M2_GRAD_RTOL,
)

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

TOL = ATTENTION_TOL
MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
         "padding_causal_bottom_right"]


def reference(q, k, v, mask, window, scale, lq, lk, attention_mask=None):
    """float64 attention of BSHD tensors, o [b, sq, h, dv]; padded query rows give 0."""
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, h, _ = q.shape
    skv, hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if attention_mask is not None:
        allowed = ~attention_mask.bool()
    else:
        left, right = window if window is not None else (-1, -1)
        right = 0 if "causal" in mask else right
        i = torch.arange(sq).view(1, sq, 1)
        j = torch.arange(skv).view(1, 1, skv)
        lq_, lk_ = torch.tensor(lq).view(-1, 1, 1), torch.tensor(lk).view(-1, 1, 1)
        diag = i + (lk_ - lq_ if mask.endswith("bottom_right") else 0)
        allowed = (i < lq_) & (j < lk_)
        if left >= 0:
            allowed = allowed & (j >= diag - left)
        if right >= 0:
            allowed = allowed & (j <= diag + right)
        allowed = allowed.unsqueeze(1)
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhij,bjhd->bihd", p, v)


def _data(b, sq, skv, h, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    return make(b, sq, h, d), make(b, skv, hk, d), make(b, skv, hk, d)


def _to(x, layout, lengths=None):
    if layout == "bshd":
        return x
    if layout == "sbhd":
        return x.transpose(0, 1).contiguous()
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])


def _from(o, layout, b, s, lengths=None):
    if layout == "bshd":
        return o
    if layout == "sbhd":
        return o.transpose(0, 1)
    out = o.new_zeros((b, s, *o.shape[1:]))
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = o[start:start + n]
        start += n
    return out


def _cu(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                        device=device)


def check(layout, mask, backend, device, dtype=torch.float32, b=2, sq=9, skv=13, h=4, hk=2,
          d=8, window=None, lq=None, lk=None, seed=0):
    q, k, v = _data(b, sq, skv, h, hk, d, dtype, device, seed)
    padding = layout == "thd" or mask.startswith("padding")
    lq = lq or [sq] * b
    lk = lk or [skv] * b
    attn = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format=layout, attn_mask_type=mask,
                                  window_size=window, attention_backend=backend)
    kw = {}
    if padding:
        kw = dict(cu_seqlens_q=_cu(lq, device), cu_seqlens_kv=_cu(lk, device), max_seqlen_q=sq,
                  max_seqlen_kv=skv)
    out = attn(_to(q, layout, lq), _to(k, layout, lk), _to(v, layout, lk), **kw)
    o = _from(out.view(*out.shape[:-1], h, d), layout, b, sq, lq)
    want = reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), mask, window,
                     1 / math.sqrt(d), lq if padding else [sq] * b, lk if padding else [skv] * b)
    valid = (torch.arange(sq).view(1, sq) < torch.tensor(lq).view(-1, 1)).to(device)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(o.double()[valid], want.to(device)[valid], atol=atol, rtol=rtol)
    grad = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    (o * grad * valid.view(b, sq, 1, 1)).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, mask, window, 1 / math.sqrt(d), lq if padding else [sq] * b,
                    lk if padding else [skv] * b)
    (ref * grad.cpu().double() * valid.cpu().view(b, sq, 1, 1)).sum().backward()
    for got, t in zip(grads, (q64, k64, v64), strict=True):
        torch.testing.assert_close(got.double(), t.grad.to(device), atol=atol * 2, rtol=rtol * 2)


BACKENDS = ["cpu", "unfused"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", MASKS)
def test_masks_layouts_cpu(mask, layout, backend):
    pad = mask.startswith("padding")
    check(layout, mask, backend, "cpu", lq=[9, 4] if pad else None, lk=[13, 2] if pad else None)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_cpu(mask, backend):
    check("thd", mask, backend, "cpu", lq=[9, 3, 1], lk=[13, 5, 2], b=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [(2, 0), (1, 3)])
@pytest.mark.parametrize("hk", [4, 1], ids=["mha", "mqa"])
def test_windows_and_gqa_cpu(window, hk, backend):
    check("bshd", "no_mask", backend, "cpu", window=window, hk=hk)


@pytest.mark.parametrize("seqlen", [1, 17, 129])
def test_odd_lengths_cpu(seqlen):
    check("sbhd", "causal", "cpu", "cpu", b=1, sq=seqlen, skv=seqlen, h=2, hk=1)


def test_unfused_arbitrary_mask():
    q, k, v = _data(2, 5, 7, 2, 2, 8, torch.float32, "cpu")
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(3)) < 0.3
    attn = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="arbitrary")
    o = attn(q, k, v, attention_mask=mask).view(2, 5, 2, 8)
    want = reference(q.detach(), k.detach(), v.detach(), "", None, 1 / math.sqrt(8), None, None,
                     attention_mask=mask)
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=1e-4)


def test_padding_from_attention_mask():
    q, k, v = _data(2, 6, 6, 2, 2, 8, torch.float32, "cpu")
    pad = torch.zeros(2, 1, 1, 6, dtype=torch.bool)
    pad[1, ..., 4:] = True
    attn = te.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="padding_causal")
    o = attn(q, k, v, attention_mask=pad)
    o2 = attn(q, k, v, cu_seqlens_q=_cu([6, 4], "cpu"), cu_seqlens_kv=_cu([6, 4], "cpu"))
    torch.testing.assert_close(o, o2, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_follows_manual_seed(backend):
    q, k, v = _data(2, 8, 8, 2, 2, 8, torch.float32, "cpu")
    attn = te.DotProductAttention(2, 8, attention_dropout=0.3, qkv_format="bshd",
                                  attention_backend=backend)
    torch.manual_seed(7)
    a = attn(q, k, v)
    torch.manual_seed(7)
    b = attn(q, k, v)
    c = attn(q, k, v)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(a, c)
    attn.eval()  # no dropout in eval, and dropout 0 is the plain attention
    plain = te.DotProductAttention(2, 8, qkv_format="bshd", attention_backend=backend)
    torch.testing.assert_close(attn(q, k, v), plain(q, k, v), atol=0, rtol=0)


def test_backend_choice_and_reasons(monkeypatch):
    q, k, v = _data(1, 4, 4, 2, 2, 8, torch.float32, "cpu")
    info = te.get_attention_backend(q, k, v, qkv_format="bshd")
    assert info.name == "cpu" and info.reasons["unfused"] == ""
    assert "CUDA tensors" in info.reasons["cudnn"]
    q16, k16, v16 = (t.bfloat16() for t in (q, k, v))
    fp8 = te.get_attention_backend(q16, k16, v16, qkv_format="bshd", fp8=True)
    assert fp8.name == "cpu" and fp8.reasons["unfused"] == "the unfused path has no FP8"
    monkeypatch.setenv("TE_ATTENTION_BACKEND", "unfused")
    assert te.get_attention_backend(q, k, v, qkv_format="bshd").name == "unfused"
    info = te.get_attention_backend(q, k, v, qkv_format="bshd", attention_backend="cudnn")
    assert info.name is None
    attn = te.DotProductAttention(2, 8, qkv_format="bshd", attention_backend="cudnn")
    with pytest.raises(RuntimeError, match="no backend can run this call"):
        attn(q, k, v)


def test_bad_inputs():
    q, k, v = _data(1, 4, 4, 2, 2, 8, torch.float32, "cpu")
    attn = te.DotProductAttention(2, 8, qkv_format="bshd")
    with pytest.raises(ValueError, match="same head dim"):
        attn(q, k[..., :4], v)
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        attn(q, k, v, qkv_format="bhsd")
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        te.DotProductAttention(2, 8, attn_mask_type="triangle")
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        attn(q, k, v, attn_mask_type="padding")
    thd = te.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding")
    bad_cu = torch.tensor([0, 3, 2], dtype=torch.int32)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="cu_seqlens_q must start at 0 and be non-decreasing"):
            thd(q[0], k[0], v[0], cu_seqlens_q=bad_cu, cu_seqlens_kv=bad_cu, max_seqlen_q=4,
                max_seqlen_kv=4, attention_backend=backend)


def test_custom_ops_trace():
    q, k, v = (t.detach() for t in _data(1, 4, 4, 2, 2, 8, torch.float32, "cpu"))
    empty_i, empty_l = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
    args = (q, k, v, empty_i, empty_i, empty_l, "bshd", "causal", -1, 0, 0.35, 0.0, 0, 0, "auto")
    torch.library.opcheck(te.ops.attention_forward.op, args,
                          test_utils=("test_schema", "test_faketensor"))
    x = torch.randn(1, 2, 3, 5)
    torch.library.opcheck(te.ops.scaled_softmax_forward.op, (x, torch.empty(0), "causal", 0.5),
                          test_utils=("test_schema", "test_faketensor"))


# CUDA: the same checks in bf16 on the backend chosen automatically (cuDNN when it takes the
# call) and on the unfused path.
@pytest.mark.cuda
@pytest.mark.parametrize("backend", [None, "unfused", "cuda_math"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask", MASKS)
def test_cuda_bf16(mask, layout, backend):
    if layout == "thd" and not mask.startswith("padding"):
        pytest.skip("thd takes the padding masks")
    pad = layout == "thd" or mask.startswith("padding")
    check(layout, mask, backend, "cuda", torch.bfloat16, sq=129, skv=129, h=4, hk=2, d=64,
          lq=[129, 17] if pad else None, lk=[129, 40] if pad else None)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [(64, 0), (16, 16)])
def test_cuda_bf16_window(window):
    check("bshd", "no_mask", None, "cuda", torch.bfloat16, sq=257, skv=257, d=64, window=window)


@pytest.mark.cuda
def test_cuda_dropout_follows_manual_seed():
    q, k, v = _data(2, 128, 128, 4, 4, 64, torch.bfloat16, "cuda")
    attn = te.DotProductAttention(4, 64, attention_dropout=0.1, qkv_format="bshd")
    torch.manual_seed(11)
    a = attn(q, k, v)
    torch.manual_seed(11)
    torch.testing.assert_close(attn(q, k, v), a, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_cuda_fp8_forward_close_to_bf16(mask):
    q, k, v = _data(2, 256, 256, 8, 8, 128, torch.bfloat16, "cuda")
    attn = te.DotProductAttention(8, 128, qkv_format="bshd", attn_mask_type=mask)
    with torch.no_grad():
        ref = attn(q, k, v).float()
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            out = attn(q, k, v).float()
    torch.testing.assert_close(out, ref, atol=ATTENTION_FP8_TOL[0], rtol=ATTENTION_FP8_TOL[1])
    rmse = (out - ref).pow(2).mean().sqrt()
    assert rmse < ATTENTION_FP8_RMSE_OF_RANGE * (ref.max() - ref.min())


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_forward_close_to_bf16_cpu(mask):
    q, k, v = _data(1, 33, 33, 2, 2, 16, torch.bfloat16, "cpu")
    attn = te.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type=mask, device="cpu")
    ref = attn(q, k, v).float()
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        out = attn(q, k, v)
    out = out.float().detach()
    assert not torch.equal(out, ref)  # it did run in FP8
    ref = ref.detach()
    torch.testing.assert_close(out, ref, atol=ATTENTION_FP8_TOL[0], rtol=ATTENTION_FP8_TOL[1])
    rmse = (out - ref).pow(2).mean().sqrt()
    assert rmse < ATTENTION_FP8_RMSE_OF_RANGE * (ref.max() - ref.min())


def _fp8_forward_op(device, batch: int):
    """ops.attention_forward_fp8 on E4M3 q, k, v [batch, 64, 2, 64] (causal, E4M3 o written
    with half of v's scale), as a function of ``inference``; and o's scale."""
    from transformer_engine.pytorch import ops

    q, k, v = (t.detach() for t in _data(batch, 64, 64, 2, 2, 64, torch.bfloat16, device))
    quant = [ops.quantize_current(t.reshape(-1, 64), "float8_e4m3", True, False, False, 0.0)
             for t in (q, k, v)]
    qf, kf, vf = (d.view(t.shape) for (d, *_), t in zip(quant, (q, k, v), strict=True))
    descales = torch.cat([sinv for _, _, _, sinv, _ in quant])
    s_scales = torch.tensor([448.0, 1 / 448.0], device=device)
    cu = torch.empty(0, dtype=torch.int32, device=device)
    rng = torch.empty(0, dtype=torch.int64, device=device)
    o_scale = quant[2][2] * 0.5
    backend = "cudnn" if device.type == "cuda" else "auto"

    def forward(inference=False):
        return ops.attention_forward_fp8(
            qf, kf, vf, descales, s_scales, cu, cu, rng, "bshd", "causal", -1, 0, 0.125, 0.0,
            64, 64, backend, o_scale, torch.uint8, inference)

    return forward, o_scale


def test_fp8_forward_op_reports_amax_of_o(device):
    # An E4M3 o comes with the amax of o before scaling (cuDNN's FP8 forward requires the
    # slot; delayed scaling of o would read it).
    from transformer_engine.pytorch import ops

    forward, o_scale = _fp8_forward_op(device, 1)
    o8, _, _, amax_o = forward()
    o = ops.dequantize(o8, 1 / o_scale, "float8_e4m3", "tensor", torch.float32)
    assert amax_o.shape == (1,)
    # E4M3 keeps 3 mantissa bits: the largest |o| read back is within 2^-4 of the true amax.
    torch.testing.assert_close(amax_o[0], o.abs().max(), rtol=2**-4, atol=0)


def test_fp8_forward_op_in_inference(device):
    """inference=True: the same o (on the CPU, where both run the same arithmetic, bit for bit;
    cuDNN may pick another kernel: within FP8's rounding of o) and an empty softmax_lse."""
    from transformer_engine.pytorch import ops

    forward, o_scale = _fp8_forward_op(device, 2)
    o_train, lse, amax_s, _ = forward(False)
    o, lse_inf, amax_s_inf, _ = forward(True)
    assert lse.shape == (2, 2, 64) and lse_inf.numel() == 0
    if device.type == "cpu":
        assert torch.equal(o, o_train) and torch.equal(amax_s, amax_s_inf)
    else:
        widen = [ops.dequantize(t, 1 / o_scale, "float8_e4m3", "tensor", torch.float32)
                 for t in (o, o_train)]
        torch.testing.assert_close(widen[0], widen[1], rtol=2**-3, atol=1e-3)


def test_fp8_module_forward_without_grad_matches(monkeypatch):
    """DotProductAttention under fp8_dpa without grad runs the core's inference forward, also
    for inputs that require grad (under no_grad no backward can follow), and gives the o of
    its forward with grad (current scaling: no state changes between the two)."""
    from transformer_engine.pytorch import attention_fn

    asked = []
    op = attention_fn.ops.attention_forward_fp8

    def spy(*args):
        asked.append(args[-1])  # inference
        return op(*args)

    monkeypatch.setattr(attention_fn.ops, "attention_forward_fp8", spy)
    q, k, v = _data(1, 32, 32, 2, 2, 16, torch.bfloat16, "cpu")  # (requiring grad)
    attn = te.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal")
    fp8 = recipe.Float8CurrentScaling(fp8_dpa=True)
    with te.fp8_autocast(fp8_recipe=fp8):
        with_grad = attn(q, k, v)
        with torch.no_grad():
            without = attn(q, k, v)
        frozen = attn(*(t.detach() for t in (q, k, v)))
    assert asked == [False, True, True]
    assert with_grad.requires_grad and not without.requires_grad
    assert torch.equal(with_grad.detach(), without) and torch.equal(without, frozen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiles_without_graph_breaks(backend):
    # aot_eager traces forward and backward through the fake implementations (inductor's C++
    # compile would only add minutes); fullgraph=True raises on a graph break.
    torch._dynamo.reset()
    q, k, v = _data(1, 6, 6, 2, 1, 8, torch.float32, "cpu")
    attn = te.DotProductAttention(2, 8, num_gqa_groups=1, qkv_format="bshd",
                                  attention_backend=backend)

    def loss(q_, k_, v_):
        return attn(q_, k_, v_).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    got.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = loss(q, k, v)
    want.backward()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    for g, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(g, t.grad, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["none", "causal", "causal_bottom_right", "arbitrary"])
def test_cuda_scaled_softmax_matches_cpu(kind):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 17, 129, generator=g) * 3
    mask = (torch.rand(2, 1, 17, 129, generator=g) < 0.3).to(torch.uint8)
    mask[0, 0, 0] = 1  # a fully masked row
    m = mask if kind == "arbitrary" else torch.empty(0, dtype=torch.uint8)
    want = te.ops.scaled_softmax_forward(x, m, kind, 0.7)
    got = te.ops.scaled_softmax_forward(x.cuda(), m.cuda(), kind, 0.7).cpu()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    dy = torch.randn(x.shape, generator=g)
    torch.testing.assert_close(te.ops.scaled_softmax_backward(dy.cuda(), got.cuda(), 0.7).cpu(),
                               te.ops.scaled_softmax_backward(dy, want, 0.7),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_math_path_fp8_forward_matches_cpu():
    q, k, v = _data(1, 65, 65, 2, 2, 64, torch.bfloat16, "cpu")
    outs = []
    for device, backend in (("cpu", "cpu"), ("cuda", "cuda_math")):
        # A fresh module per device: the delayed-scaling state lives on one, and both runs
        # must quantize with the same (initial) scales.
        attn = te.DotProductAttention(2, 64, qkv_format="bshd", device=device)
        args = [t.detach().to(device) for t in (q, k, v)]
        with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            outs.append(attn(*args, attention_backend=backend).float().cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=1.5e-2, rtol=1.5e-2)


# FP8 backward: under fp8_dpa the backward runs in FP8 too (E4M3 q, k, v, o; d_o in the recipe's
# gradient format), and its gradients must stay within the FP8 bounds of the bf16 module's.
def _assert_fp8_close(got, want, what, against_bf16=True, e5m2_written=False):
    """FP8 attention's result against bf16; ``e5m2_written``: a gradient that cuDNN's FP8
    backward wrote in E5M2 (HYBRID on CUDA), one more rounding of 2^-3 relative."""
    got, want = got.float().detach().cpu(), want.float().detach().cpu()
    if against_bf16:
        assert not torch.equal(got, want), f"{what}: identical to bf16, so FP8 did not run"
    rtol = ATTENTION_FP8_TOL[1] + (E5M2_GRAD_RTOL if e5m2_written else 0.0)
    torch.testing.assert_close(got, want, atol=ATTENTION_FP8_TOL[0], rtol=rtol,
                               msg=lambda m: f"{what}: {m}")
    rmse = (got - want).pow(2).mean().sqrt()
    assert rmse < ATTENTION_FP8_RMSE_OF_RANGE * (want.max() - want.min()), f"{what}: RMSE {rmse}"


def check_fp8_grads(device, mask, fmt, b=1, s=33, h=2, hk=2, d=16, backend=None):
    q, k, v = _data(b, s, s, h, hk, d, torch.bfloat16, device, seed=5)
    attn = te.DotProductAttention(h, d, num_gqa_groups=hk, qkv_format="bshd",
                                  attn_mask_type=mask, attention_backend=backend, device=device)
    grad = torch.randn(b, s, h * d, generator=torch.Generator().manual_seed(6)).to(device)
    attn(q, k, v).float().mul(grad).sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    fp8_recipe = recipe.DelayedScaling(fp8_dpa=True, fp8_format=getattr(recipe.Format, fmt))
    with te.fp8_autocast(fp8_recipe=fp8_recipe):
        out = attn(q, k, v)
    out.float().mul(grad).sum().backward()
    e5m2 = fmt == "HYBRID" and torch.device(device).type == "cuda" and backend in (None, "cudnn")
    for name, t, w in zip("qkv", (q, k, v), want, strict=True):
        _assert_fp8_close(t.grad, w, f"d{name}", e5m2_written=e5m2)
    return [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_backward_close_to_bf16_cpu(mask, fmt):
    check_fp8_grads("cpu", mask, fmt)


def test_fp8_backward_gqa_and_thd_cpu():
    check_fp8_grads("cpu", "causal", "HYBRID", h=4, hk=2)
    q, k, v = _data(1, 20, 20, 2, 2, 16, torch.bfloat16, "cpu", seed=8)
    lengths = [13, 7]
    qt, kt, vt = (torch.cat([x[0, :n] for n in lengths]).detach().requires_grad_()
                  for x in (q, k, v))
    attn = te.DotProductAttention(2, 16, qkv_format="thd", attn_mask_type="padding_causal",
                                  device="cpu")
    kw = dict(cu_seqlens_q=_cu(lengths, "cpu"), cu_seqlens_kv=_cu(lengths, "cpu"),
              max_seqlen_q=13, max_seqlen_kv=13)
    attn(qt, kt, vt, **kw).float().sum().backward()
    want = [t.grad.clone() for t in (qt, kt, vt)]
    for t in (qt, kt, vt):
        t.grad = None
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        attn(qt, kt, vt, **kw).float().sum().backward()
    for name, t, w in zip("qkv", (qt, kt, vt), want, strict=True):
        _assert_fp8_close(t.grad, w, f"thd d{name}")


def _fp8_backward_args(device, o_dtype=torch.uint8, d_o_dtype=torch.uint8, grad_scales=0):
    g = torch.Generator().manual_seed(2)
    q, k, v, o, d_o = (torch.randint(0, 100, (1, 4, 2, 16), generator=g, dtype=torch.uint8)
                       .to(device) for _ in range(5))
    o, d_o = o.to(o_dtype), d_o.to(d_o_dtype)
    lse = torch.zeros(1, 2, 4, device=device)
    ones = torch.ones(5, device=device)
    empty_i = torch.empty(0, dtype=torch.int32, device=device)
    empty_l = torch.empty(0, dtype=torch.int64, device=device)
    return (q, k, v, o, d_o, lse, ones, ones[:2], ones[:2], empty_i, empty_i, empty_l, "bshd",
            "causal", -1, 0, 0.25, 0.0, 4, 4, False, "auto", "float8_e5m2",
            torch.ones(grad_scales, device=device), torch.bfloat16)


def test_fp8_backward_op_errors_and_trace():
    from transformer_engine.pytorch import ops

    with pytest.raises(TypeError, match="attention_backward_fp8: d_o must be torch.uint8"):
        ops.attention_backward_fp8(*_fp8_backward_args("cpu", d_o_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="grad_scales must have 3 elements"):
        ops.attention_backward_fp8(*_fp8_backward_args("cpu", grad_scales=3))
    torch.library.opcheck(te.ops.attention_backward_fp8.op, _fp8_backward_args("cpu"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.cuda
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_cuda_fp8_backward_close_to_bf16(mask):
    # Head dim 128: what cuDNN's FP8 backward takes on sm_90 (FP8 gradients, widened here).
    info = te.get_attention_backend(*_data(2, 256, 256, 8, 8, 128, torch.bfloat16, "cuda"),
                                    qkv_format="bshd", attn_mask_type=mask, fp8=True)
    assert info.name == "cudnn", info.reasons
    check_fp8_grads("cuda", mask, "HYBRID", b=2, s=256, h=8, hk=8, d=128)


@pytest.mark.cuda
def test_cuda_math_path_fp8_backward_matches_cpu():
    # The CUDA math path rounds p and ds as the CPU reference does; both write bf16 gradients
    # and differ only by fp32 summation order, which can move a rounding of ds by one E5M2 ulp.
    grads = [check_fp8_grads(dev, "causal", "HYBRID", s=65, d=64, backend=backend)
             for dev, backend in (("cpu", "cpu"), ("cuda", "cuda_math"))]
    for name, got, want in zip("qkv", grads[1], grads[0], strict=True):
        _assert_fp8_close(got.cpu(), want, f"cuda_math d{name} vs cpu", against_bf16=False)


@pytest.mark.cuda
def test_cuda_fp8_dropout_is_not_launched_on_cudnn_sm90():
    # cuDNN's FP8 forward with dropout faults on sm_90: the FP8 choice passes it over with the
    # reason, and the call runs cuDNN's high-precision attention, with a warning, instead of
    # ending the process.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the refusal is for sm_90")
    q, k, v = _data(2, 128, 128, 4, 4, 128, torch.bfloat16, "cuda")
    info = te.get_attention_backend(q, k, v, qkv_format="bshd", attn_mask_type="causal",
                                    attention_dropout=0.1, fp8=True)
    assert info.name != "cudnn" and "dropout" in info.reasons["cudnn"], info.reasons
    attn = te.DotProductAttention(4, 128, attention_dropout=0.1, qkv_format="bshd",
                                  attn_mask_type="causal")
    with pytest.warns(UserWarning, match="runs in high precision on cuDNN.*dropout"):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            o = attn(q, k, v)
    o.float().sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(q.grad).all()


def test_fp8_without_a_fused_kernel_runs_cudnn_in_high_precision(monkeypatch):
    # Where cuDNN has no FP8 kernel for a call but runs it in high precision, the automatic
    # choice takes that (with a warning) over the core's slow FP8 math path.
    from transformer_engine.pytorch.module import _attention_backend as mod

    def reasons(key, grad):
        fp8 = bool(key[-1])
        return {"cudnn": "FP8 attention backward on sm_90 needs head_dim 128, got 64" if fp8
                else "", "cpu": "cuDNN tensors only", "cuda_math": ""}

    monkeypatch.setattr(mod, "_core_reasons", reasons)
    monkeypatch.setattr(mod, "_CHOICES", {})
    monkeypatch.setattr(mod, "_FP8_FALLBACK_WARNED", set())
    key = ("bshd", "causal", -1, 0, 0.125, 0.0, (2, 128, 128, 4, 4, 64, 64), "bfloat16", 0,
           "float8_e5m2")
    with pytest.warns(UserWarning, match="runs in high precision on cuDNN.*head_dim 128"):
        assert mod._fp8_falls_back(key, True, "auto", True)
    assert mod._fp8_falls_back(key, True, "auto", True)  # warned once
    assert not mod._fp8_falls_back(key, True, "cuda_math", True)  # asked for explicitly
    assert not mod._fp8_falls_back(key, True, "auto", False)  # the CPU keeps its FP8 path
    hp_only = dict(reasons(key, True), cuda_math="")
    monkeypatch.setattr(mod, "_core_reasons", lambda k, g: dict(hp_only, cudnn="no GPU"))
    monkeypatch.setattr(mod, "_CHOICES", {})
    assert not mod._fp8_falls_back(key, True, "auto", True)  # cuDNN cannot run it at all
