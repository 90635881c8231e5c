"""Attention through the core's C API on its CPU reference (attention.h) against float64 numpy:
outputs, softmax_lse and gradients for every mask, layout, GQA ratio and window; THD against
padded BSHD; dropout's reproducibility; the backend query's reasons; the validation messages;
strided q, k, v read in place from one buffer (the dense call's bits); and the scaled masked
softmax of the unfused path.

Tolerance: fp32 math over at most 129 keys of dot products of 8-16 terms of N(0, 1) values;
each fp32 sum errs by ~n * 2^-24 of its magnitude, so 2e-5 absolute plus 1e-4 relative
(outputs and gradients are O(1)) leaves ample room while catching any wrong mask entry
(which moves results by O(1 / seqlen) at least).
"""

from __future__ import annotations

import numpy as np
import pytest
from te_common_tests import _attention_reference as ref
from te_common_tests import _reference as fp8_ref
from te_common_tests import _tolerances as tol

from transformer_engine.common import _core as core

ATOL, RTOL = 2e-5, 1e-4
MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
         "padding_causal_bottom_right"]


def _rng(*key) -> np.random.Generator:
    # Seeded from the key's characters: Python's str hash is salted per process.
    return np.random.default_rng([ord(c) for c in str(key)])


def make(b, sq, skv, h, hk, d, dv, *key):
    rng = _rng(b, sq, skv, h, hk, d, dv, *key)
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, skv, hk, d)).astype(np.float32)
    v = rng.standard_normal((b, skv, hk, dv)).astype(np.float32)
    d_o = rng.standard_normal((b, sq, h, dv)).astype(np.float32)
    return q, k, v, d_o


def run(layout, mask, q, k, v, d_o, *, window=None, scale=0.3, lq=None, lk=None, dropout=0.0,
        rng_state=None, backend="auto"):
    """Forward and backward through the core; returns (o, lse, dq, dk, dv) in BSHD."""
    b, sq, h, _ = q.shape
    skv = k.shape[1]
    padding = layout == "thd" or mask.startswith("padding")
    lq = lq if lq is not None else [sq] * b
    lk = lk if lk is not None else [skv] * b
    left, right = window if window is not None else (-1, -1)
    cfg = core.AttentionConfig(getattr(core.AttnLayout, layout), getattr(core.AttnMask, mask),
                               window_left=left, window_right=right, softmax_scale=scale,
                               dropout=dropout, max_seqlen_q=sq, max_seqlen_kv=skv,
                               backend=getattr(core.AttnBackend, backend))
    tq, tdo = (ref.to_layout(x, layout, lq) for x in (q, d_o))
    tk, tv = (ref.to_layout(x, layout, lk) for x in (k, v))
    o = np.zeros_like(tdo)
    lse = np.zeros((b, h, sq), np.float32)
    cu = dict(cu_seqlens_q=ref.cu_seqlens(lq), cu_seqlens_kv=ref.cu_seqlens(lk)) if padding else {}
    rng = dict(rng_state=np.asarray(rng_state, np.int64)) if rng_state is not None else {}
    core.attention_forward(cfg, tq, tk, tv, o, lse, **cu, **rng)
    dq, dk, dv = np.zeros_like(tq), np.zeros_like(tk), np.zeros_like(tv)
    core.attention_backward(cfg, tq, tk, tv, o, tdo, lse, dq=dq, dk=dk, dv=dv, **cu, **rng)
    o, dq = (ref.from_layout(x, layout, lq, sq) for x in (o, dq))
    dk, dv = (ref.from_layout(x, layout, lk, skv) for x in (dk, dv))
    return o, lse, dq, dk, dv


def check_against_fp64(layout, mask, q, k, v, d_o, window=None, scale=0.3, lq=None, lk=None):
    b, sq = q.shape[:2]
    skv = k.shape[1]
    o, lse, dq, dk, dv = run(layout, mask, q, k, v, d_o, window=window, scale=scale, lq=lq, lk=lk)
    padding = layout == "thd" or mask.startswith("padding")
    lq_ = lq if padding and lq is not None else [sq] * b
    lk_ = lk if padding and lk is not None else [skv] * b
    allowed = ref.allowed_keys(mask, window, sq, skv, lq_, lk_)
    o64, lse64, p = ref.forward(q, k, v, allowed, scale)
    dq64, dk64, dv64 = ref.backward(q, k, v, p, d_o, scale)
    valid_q = np.arange(sq)[None, :] < np.asarray(lq_)[:, None]
    np.testing.assert_allclose(o, o64, atol=ATOL, rtol=RTOL)
    # lse only means something on valid query rows; -inf where a row has no allowed key.
    lse_valid = lse.transpose(0, 2, 1)[valid_q]
    np.testing.assert_allclose(lse_valid, lse64.transpose(0, 2, 1)[valid_q], atol=ATOL, rtol=RTOL)
    for got, want in ((dq, dq64), (dk, dk64), (dv, dv64)):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("mask", MASKS)
def test_masks_and_layouts_match_fp64(layout, mask):
    q, k, v, d_o = make(3, 17, 23, 4, 2, 8, 6, layout, mask)
    lq, lk = ([17, 5, 1], [23, 9, 4]) if mask.startswith("padding") else (None, None)
    check_against_fp64(layout, mask, q, k, v, d_o, lq=lq, lk=lk)


@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_thd_matches_fp64_and_padded_bshd(mask):
    q, k, v, d_o = make(3, 17, 20, 4, 1, 8, 8, "thd", mask)
    lq, lk = [17, 4, 0], [20, 2, 7]
    check_against_fp64("thd", mask, q, k, v, d_o, lq=lq, lk=lk)
    thd = run("thd", mask, q, k, v, d_o, lq=lq, lk=lk)
    bshd = run("bshd", mask, q, k, v, d_o, lq=lq, lk=lk)
    valid_q = np.arange(17)[None, :] < np.asarray(lq)[:, None]
    valid_k = np.arange(20)[None, :] < np.asarray(lk)[:, None]
    for i, valid in enumerate([valid_q, None, valid_q, valid_k, valid_k]):
        if valid is None:
            np.testing.assert_array_equal(thd[1], bshd[1])
        else:
            np.testing.assert_array_equal(thd[i][valid], bshd[i][valid])


@pytest.mark.parametrize("seqlen", [1, 17, 129])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_odd_sequence_lengths(seqlen, mask):
    q, k, v, d_o = make(1, seqlen, seqlen, 2, 2, 8, 8, mask)
    check_against_fp64("bshd", mask, q, k, v, d_o, scale=1 / np.sqrt(8))


@pytest.mark.parametrize("heads_kv", [4, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_gqa_ratios(heads_kv):
    q, k, v, d_o = make(2, 9, 9, 4, heads_kv, 16, 8, "gqa")
    check_against_fp64("sbhd", "causal", q, k, v, d_o)


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (0, 0), (-1, 4), (5, -1)])
@pytest.mark.parametrize("mask", ["no_mask", "causal_bottom_right", "padding_causal"])
def test_sliding_windows(window, mask):
    q, k, v, d_o = make(2, 11, 15, 2, 1, 8, 8, "window", window, mask)
    lq, lk = ([11, 6], [15, 3]) if mask.startswith("padding") else (None, None)
    check_against_fp64("bshd", mask, q, k, v, d_o, window=window, lq=lq, lk=lk)


def test_fully_masked_rows_give_zero_and_minus_inf():
    # Bottom-right causal with more queries than keys: the first sq - skv queries see nothing.
    q, k, v, d_o = make(1, 6, 2, 1, 1, 4, 4, "empty")
    o, lse, dq, _, _ = run("bshd", "causal_bottom_right", q, k, v, d_o)
    assert np.all(o[0, :4] == 0) and np.all(dq[0, :4] == 0)
    assert np.all(np.isneginf(lse[0, 0, :4])) and np.all(np.isfinite(lse[0, 0, 4:]))


def test_dropout_reproducible_and_consistent():
    q, k, v, d_o = make(2, 16, 16, 2, 2, 8, 8, "dropout")
    first = run("bshd", "causal", q, k, v, d_o, dropout=0.25, rng_state=[1234, 7])
    again = run("bshd", "causal", q, k, v, d_o, dropout=0.25, rng_state=[1234, 7])
    other = run("bshd", "causal", q, k, v, d_o, dropout=0.25, rng_state=[1235, 7])
    plain = run("bshd", "causal", q, k, v, d_o)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[0], other[0])
    assert not np.allclose(first[0], plain[0], atol=1e-3)
    # o is linear in v under a fixed mask: the backward's dv must match the forward's mask
    # exactly, <d_o, o(v + dv_dir) - o(v)> = <dv, dv_dir>.
    direction = np.random.default_rng(5).standard_normal(v.shape).astype(np.float32)
    moved = run("bshd", "causal", q, k, v + direction, d_o, dropout=0.25, rng_state=[1234, 7])
    lhs = float(np.sum(d_o.astype(np.float64) * (moved[0] - first[0])))
    rhs = float(np.sum(first[4].astype(np.float64) * direction))
    assert lhs == pytest.approx(rhs, rel=1e-4, abs=1e-3)
    # Dropout keeps about 1 - p of the probabilities and rescales them: the mean output over
    # many independent masks approaches the undropped one.
    mean = np.mean([run("bshd", "no_mask", q, k, v, d_o, dropout=0.25, rng_state=[s, 0])[0]
                    for s in range(40)], axis=0)
    exact = run("bshd", "no_mask", q, k, v, d_o)[0]
    assert np.abs(mean - exact).mean() < 0.1 * np.abs(exact).mean()


def test_dropout_zero_equals_no_dropout():
    q, k, v, d_o = make(1, 8, 8, 2, 2, 8, 8, "zero")
    with_state = run("bshd", "causal", q, k, v, d_o, dropout=0.0, rng_state=[3, 4])
    without = run("bshd", "causal", q, k, v, d_o)
    for a, b in zip(with_state, without, strict=True):
        np.testing.assert_array_equal(a, b)


def _query(device_id=-1, backend="auto", backward=False, qkv=core.DType.float32):
    cfg = core.AttentionConfig(core.AttnLayout.bshd, core.AttnMask.causal, softmax_scale=0.125,
                               backend=getattr(core.AttnBackend, backend))
    return core.attention_backend(cfg, [2, 8, 8, 64, 64, 64, 64, 128, 128], qkv, qkv, qkv,
                                  device_id=device_id, backward=backward)


def test_backend_query_reasons():
    chosen, reasons, message = _query()
    assert chosen == core.AttnBackend.cpu and message == ""
    assert reasons[core.AttnBackend.cpu.value] == ""
    assert "CUDA tensors" in reasons[core.AttnBackend.cudnn.value]
    assert "CUDA tensors" in reasons[core.AttnBackend.cuda_math.value]
    chosen, reasons, message = _query(backend="cudnn", backward=True)
    assert chosen is None and "config.backend cudnn cannot run this backward" in message
    if not core.built_with_cuda():
        chosen, reasons, message = _query(device_id=0)
        assert chosen is None
        assert reasons[core.AttnBackend.cudnn.value] == "this build has no cuDNN"
        assert "no CUDA kernels" in reasons[core.AttnBackend.cuda_math.value]
        assert "needs CPU tensors" in reasons[core.AttnBackend.cpu.value]


def _forward(layout="bshd", mask="causal", q_shape=(1, 4, 2, 8), k_shape=(1, 4, 2, 8),
             v_shape=(1, 4, 2, 8), cu=None, **cfg_kw):
    cfg = core.AttentionConfig(getattr(core.AttnLayout, layout), getattr(core.AttnMask, mask),
                               softmax_scale=0.5, **cfg_kw)
    q, k, v = (np.zeros(s, np.float32) for s in (q_shape, k_shape, v_shape))
    o = np.zeros((*q_shape[:-1], v_shape[-1]), np.float32)
    b = q_shape[0] if layout != "thd" else len(cu) - 1
    sq = q_shape[1] if layout == "bshd" else cfg_kw.get("max_seqlen_q", q_shape[0])
    lse = np.zeros((b, q_shape[-2], sq), np.float32)
    kw = {} if cu is None else dict(cu_seqlens_q=np.asarray(cu, np.int32),
                                    cu_seqlens_kv=np.asarray(cu, np.int32))
    core.attention_forward(cfg, q, k, v, o, lse, **kw)


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="k.data must have q's head dim 8"):
        _forward(k_shape=(1, 4, 2, 16), v_shape=(1, 4, 2, 16))
    with pytest.raises(ValueError, match="heads_q must be a multiple of heads_kv"):
        _forward(q_shape=(1, 4, 3, 8))
    with pytest.raises(ValueError, match=r"4 dimensions \[batch, seqlen, heads, head_dim\]"):
        _forward(q_shape=(4, 2, 8))
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        _forward("thd", "padding", (6, 2, 8), (6, 2, 8), (6, 2, 8), cu=[0, 4, 2, 6],
                 max_seqlen_q=4, max_seqlen_kv=4)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        _forward("bshd", "padding", cu=[1, 3])
    with pytest.raises(ValueError, match="must be NULL without a padding mask"):
        _forward(cu=[0, 4])
    with pytest.raises(ValueError, match="config.dropout must be in"):
        _forward(dropout=1.0)
    with pytest.raises(ValueError, match="rng_state must be a tensor handle"):
        _forward(dropout=0.1)
    with pytest.raises(ValueError, match="window_left and window_right must be >= -1"):
        _forward(window_left=-2)


# The scaled masked softmax of the unfused path.
def _softmax_ref(x, scale, masked):
    s = np.where(masked, -np.inf, x.astype(np.float64) * scale)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = e.sum(axis=-1, keepdims=True)
    return np.where(total > 0, e / np.where(total > 0, total, 1), 0)


@pytest.mark.parametrize("kind", ["none", "causal", "causal_bottom_right", "arbitrary"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 2, 17, 17), (1, 1, 3, 129)])
def test_scaled_softmax_forward_backward(kind, shape):
    rng = _rng("softmax", kind, shape)
    b, h, sq, sk = shape
    x = rng.standard_normal(shape).astype(np.float32) * 3
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    mask = None
    masked = np.zeros(shape, bool)
    if kind == "causal":
        masked |= j > i
    elif kind == "causal_bottom_right":
        masked |= j > i + sk - sq
    elif kind == "arbitrary":
        mask = (rng.uniform(size=(b, 1, sq, sk)) < 0.4).astype(np.uint8)
        mask[0, 0, 0, :] = 1  # a fully masked row
        masked = np.broadcast_to(mask.astype(bool), shape)
    y = np.zeros_like(x)
    core.scaled_softmax_forward(getattr(core.SoftmaxMask, kind), 0.7, x, mask, y)
    want = _softmax_ref(x, 0.7, masked)
    np.testing.assert_allclose(y, want, atol=1e-6, rtol=1e-5)
    dy = rng.standard_normal(shape).astype(np.float32)
    dx = np.zeros_like(x)
    core.scaled_softmax_backward(0.7, dy, y, dx)
    want_dx = 0.7 * want * (dy - (dy * want).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(dx, want_dx, atol=1e-5, rtol=1e-4)


def test_scaled_softmax_errors():
    x = np.zeros((1, 1, 2, 3), np.float32)
    with pytest.raises(ValueError, match=r"mask.data must have shape \[1 or 1, 1 or 1, 2, 3\]"):
        core.scaled_softmax_forward(core.SoftmaxMask.arbitrary, 1.0, x,
                                    np.zeros((1, 1, 3, 3), np.uint8), np.zeros_like(x))
    with pytest.raises(ValueError, match="4 dimensions"):
        core.scaled_softmax_forward(core.SoftmaxMask.none, 1.0, x[0], None, np.zeros_like(x[0]))


# FP8 attention backward: E4M3 q, k, v and o, d_o in E5M2 (the HYBRID recipe) or E4M3, against
# float64 attention of the dequantized inputs; bounds: _tolerances.attention_fp8_backward_bound.
FP8_NAMES = {"e4m3": core.DType.float8_e4m3, "e5m2": core.DType.float8_e5m2}


class Fp8Input:
    """x quantized with the scale from its amax: bytes, descale and the dequantized float64."""

    def __init__(self, x: np.ndarray, fmt: str):
        f = fp8_ref.FORMATS[fmt]
        self.fmt, self.dtype = fmt, FP8_NAMES[fmt]
        self.scale_inv = np.float32(np.abs(x).max() / f.max)
        self.data = fp8_ref.cast_to_fp8(x / self.scale_inv, f)
        self.value = fp8_ref.fp8_to_float32(self.data, f).astype(np.float64) * self.scale_inv

    def on(self, device):
        return core.Tensor(device.put(self.data), dtype=self.dtype,
                           scale_inv=device.put(np.array([self.scale_inv], np.float32)))


def _scalars(device, *values):
    return [device.put(np.array([v], np.float32)) for v in values]


def _fp8_workspace(device, cfg, q, k, grad_dtype, do_dtype):
    if not device.is_cuda:
        return None
    b, sq, h, d = q.shape
    sizes = [b, h, k.shape[2], sq, k.shape[1], d, d, b * sq, b * k.shape[1]]
    e4m3 = core.DType.float8_e4m3
    size = core.attention_workspace_size(cfg, sizes, e4m3, e4m3, grad_dtype, do_dtype=do_dtype,
                                         device_id=0, backward=True)
    size = max(size, core.attention_workspace_size(cfg, sizes, e4m3, e4m3, grad_dtype,
                                                   device_id=0))
    return device.put(np.zeros(max(size, 1), np.uint8))


def fp8_forward(device, cfg, q8, k8, v8):
    """The FP8 forward as the PyTorch layer runs it: (o bytes, o's descale, lse, p's factors)."""
    b, sq, h, _ = q8.data.shape
    o_scale = np.float32(0.5) / v8.scale_inv  # |o| <= max |v|, with room for p's rounding
    o = device.put(np.zeros((*q8.data.shape[:-1], v8.data.shape[-1]), np.uint8))
    lse = device.put(np.zeros((b, h, sq), np.float32))
    s_scale, s_inv, o_sc = _scalars(device, 448.0, 1.0 / 448.0, o_scale)
    # cuDNN's FP8 forward writes the amaxes of p and o whether or not they are wanted.
    s_amax, o_amax = _scalars(device, 0.0, 0.0)
    softmax = core.Tensor(scale=s_scale, scale_inv=s_inv, amax=s_amax)
    ws = _fp8_workspace(device, cfg, q8.data, k8.data, core.DType.float8_e5m2,
                        core.DType.float8_e5m2)
    core.attention_forward(cfg, q8.on(device), k8.on(device), v8.on(device),
                           core.Tensor(o, dtype=core.DType.float8_e4m3, scale=o_sc,
                                       amax=o_amax), lse,
                           softmax_fp8=softmax, workspace=ws, stream=device.stream)
    return device.get(o), np.float32(1) / o_scale, device.get(lse)


def dp_scale_of(d8, v8, scale, fmt):
    """The dp factor PyTorch's FP8 backward takes (attention_fn._backward_scales): |ds| <=
    scale max|d_o_i| max|v_j| / 2, with a factor 2 of room."""
    norms = [np.linalg.norm(t.value, axis=-1).max() for t in (d8, v8)]
    bound = scale * norms[0] * norms[1]
    return np.float32(fp8_ref.FORMATS[fmt].max / bound)


def fp8_backward(device, cfg, q8, k8, v8, o, descale_o, lse, d8, dp_scale, grad, grad_scales=None,
                 **kw):
    """dq, dk, dv (float32, or FP8 bytes of ``grad`` with grad_scales) and the amax of ds."""
    fp8_grads = grad in FP8_NAMES
    out_dtype = np.uint8 if fp8_grads else np.float32
    grads = [device.put(np.zeros(t.data.shape, out_dtype)) for t in (q8, k8, v8)]
    amax_dp, s_scale, s_inv, dp_sc, dp_inv, o_inv = _scalars(
        device, -1.0, 448.0, 1.0 / 448.0, dp_scale, np.float32(1) / dp_scale, descale_o)
    handles = grads
    if fp8_grads:
        scales = _scalars(device, *grad_scales)
        # cuDNN's FP8 backward writes the gradients' amaxes whether or not they are wanted.
        amaxes = _scalars(device, 0.0, 0.0, 0.0)
        handles = [core.Tensor(g, dtype=FP8_NAMES[grad], scale=s, amax=a)
                   for g, s, a in zip(grads, scales, amaxes, strict=True)]
    grad_dtype = FP8_NAMES[grad] if fp8_grads else core.DType.float32
    ws = _fp8_workspace(device, cfg, q8.data, k8.data, grad_dtype, d8.dtype)
    core.attention_backward(
        cfg, q8.on(device), k8.on(device), v8.on(device),
        core.Tensor(device.put(o), dtype=core.DType.float8_e4m3, scale_inv=o_inv),
        d8.on(device), device.put(lse), dq=handles[0], dk=handles[1], dv=handles[2],
        softmax_fp8=core.Tensor(scale=s_scale, scale_inv=s_inv),
        dp_fp8=core.Tensor(scale=dp_sc, scale_inv=dp_inv, amax=amax_dp), workspace=ws,
        stream=device.stream, **kw)
    out = [device.get(g) for g in grads]
    if fp8_grads:
        f = fp8_ref.FORMATS[grad]
        out = [fp8_ref.fp8_to_float32(g, f).astype(np.float64) / s
               for g, s in zip(out, grad_scales, strict=True)]
    return out, float(device.get(amax_dp)[0])


def _fp8_case(b, sq, skv, h, hk, d, do_fmt, *key):
    q, k, v, d_o = make(b, sq, skv, h, hk, d, d, "fp8", *key)
    return Fp8Input(q, "e4m3"), Fp8Input(k, "e4m3"), Fp8Input(v, "e4m3"), Fp8Input(d_o, do_fmt)


def check_fp8_backward(device, mask, do_fmt, grad, b=2, sq=11, skv=13, h=4, hk=2, d=16,
                       backend="auto"):
    scale = 1 / np.sqrt(d)
    q8, k8, v8, d8 = _fp8_case(b, sq, skv, h, hk, d, do_fmt, mask, grad)
    cfg = core.AttentionConfig(core.AttnLayout.bshd, getattr(core.AttnMask, mask),
                               softmax_scale=scale, backend=getattr(core.AttnBackend, backend))
    o, descale_o, lse = fp8_forward(device, cfg, q8, k8, v8)
    allowed = ref.allowed_keys(mask, None, sq, skv, [sq] * b, [skv] * b)
    _, _, p = ref.forward(q8.value, k8.value, v8.value, allowed, scale)
    want = ref.backward(q8.value, k8.value, v8.value, p, d8.value, scale)
    dp_scale = dp_scale_of(d8, v8, scale, do_fmt)
    grad_scales = None
    if grad in FP8_NAMES:  # scales from the answer's amax, with a factor 2 of room
        grad_scales = [np.float32(fp8_ref.FORMATS[grad].max / (2 * np.abs(w).max())) for w in want]
    got, amax_dp = fp8_backward(device, cfg, q8, k8, v8, o, descale_o, lse, d8, dp_scale, grad,
                                grad_scales)
    bound = tol.attention_fp8_backward_bound(
        q8.value, k8.value, v8.value, d8.value, allowed, scale, want, descale_o=descale_o,
        do_fmt=do_fmt, descale_dp=1 / dp_scale, grad_fmt=grad if grad_scales else None,
        grad_descales=[1 / s for s in grad_scales] if grad_scales else (1, 1, 1),
        cuda_fp8_gemm=backend == "cudnn")
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        err = np.abs(g - w)
        worst = float((err / (bound[name] + 1e-30)).max())
        assert worst <= 1.0, f"{name}: error {worst:.3g}x its bound"
    ds_max = np.abs(bound["ds_want"]).max()
    assert abs(amax_dp - ds_max) <= bound["ds"].max() + ds_max * tol.ATTENTION_FP32_REL
    return got, (o, descale_o, lse)


@pytest.mark.parametrize("grad", ["float32", "e5m2"])
@pytest.mark.parametrize("do_fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_fp8_backward_matches_fp64(device, mask, do_fmt, grad):
    # On CUDA the math path by name: cuDNN (FP8 tensor cores) has its own test below.
    backend = "cuda_math" if device.is_cuda else "auto"
    got, _ = check_fp8_backward(device, mask, do_fmt, grad, backend=backend)
    # It did run in FP8: ds is rounded to d_o's format, so dq is no fp32 answer.
    q8, k8, v8, d8 = _fp8_case(2, 11, 13, 4, 2, 16, do_fmt, mask, grad)
    allowed = ref.allowed_keys(mask, None, 11, 13, [11, 11], [13, 13])
    _, _, p = ref.forward(q8.value, k8.value, v8.value, allowed, 0.25)
    exact = ref.backward(q8.value, k8.value, v8.value, p, d8.value, 0.25)[0]
    assert np.abs(got[0] - exact).max() > 1e-4 * np.abs(exact).max()


@pytest.mark.cuda
@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_cudnn_fp8_backward_matches_cpu(cuda_device, mask):
    # cuDNN's FP8 backward on sm_90 takes head dim 128 and writes FP8 gradients; the CPU
    # reference gets the very FP8 inputs, o and softmax_lse of cuDNN's forward.
    cpu = cuda_device.cpu
    got, (o, descale_o, lse) = check_fp8_backward(cuda_device, mask, "e5m2", "e5m2", b=2,
                                                  sq=128, skv=128, h=4, hk=2, d=128,
                                                  backend="cudnn")
    q8, k8, v8, d8 = _fp8_case(2, 128, 128, 4, 2, 128, "e5m2", mask, "e5m2")
    scale = 1 / np.sqrt(128)
    cfg = core.AttentionConfig(core.AttnLayout.bshd, getattr(core.AttnMask, mask),
                               softmax_scale=scale)
    dp_scale = dp_scale_of(d8, v8, scale, "e5m2")
    want, _ = fp8_backward(cpu, cfg, q8, k8, v8, o, descale_o, lse, d8, dp_scale, "float32")
    allowed = ref.allowed_keys(mask, None, 128, 128, [128, 128], [128, 128])
    _, _, p = ref.forward(q8.value, k8.value, v8.value, allowed, scale)
    exact = ref.backward(q8.value, k8.value, v8.value, p, d8.value, scale)
    grad_scales = [np.float32(fp8_ref.FORMATS["e5m2"].max / (2 * np.abs(w).max())) for w in exact]
    cuda_bound = tol.attention_fp8_backward_bound(
        q8.value, k8.value, v8.value, d8.value, allowed, scale, exact, descale_o=descale_o,
        do_fmt="e5m2", descale_dp=1 / dp_scale, grad_fmt="e5m2",
        grad_descales=[1 / s for s in grad_scales], cuda_fp8_gemm=True)
    cpu_bound = tol.attention_fp8_backward_bound(
        q8.value, k8.value, v8.value, d8.value, allowed, scale, exact, descale_o=descale_o,
        do_fmt="e5m2", descale_dp=1 / dp_scale)
    # Both lie within their bounds of the float64 answer, so within the sum of each other.
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        worst = float((np.abs(g - w) / (cuda_bound[name] + cpu_bound[name] + 1e-30)).max())
        assert worst <= 1.0, f"{name}: cuDNN is {worst:.3g}x the bound away from the CPU"


def _fp8_call(cpu, mask="causal", do_fmt="e5m2", **kw):
    """An FP8 backward on the CPU with keywords of core.attention_backward replaced."""
    q8, k8, v8, d8 = _fp8_case(1, 4, 4, 2, 2, 8, do_fmt, "errors")
    cfg = core.AttentionConfig(core.AttnLayout.bshd, getattr(core.AttnMask, mask),
                               softmax_scale=0.5)
    o, descale_o, lse = fp8_forward(cpu, cfg, q8, k8, v8)
    grads = [np.full(t.data.shape, 7.0, np.float32) for t in (q8, k8, v8)]
    args = dict(dq=grads[0], dk=grads[1], dv=grads[2],
                softmax_fp8=core.Tensor(scale=np.array([448.0], np.float32),
                                        scale_inv=np.array([1 / 448.0], np.float32)),
                dp_fp8=core.Tensor(scale=np.ones(1, np.float32), scale_inv=np.ones(1, np.float32)))
    args.update(kw)
    o_t = core.Tensor(o, dtype=core.DType.float8_e4m3, scale_inv=np.array([descale_o], np.float32))
    d_o = args.pop("d_o", d8.on(cpu))
    core.attention_backward(cfg, q8.on(cpu), k8.on(cpu), v8.on(cpu), o_t, d_o, lse, **args)
    return grads


def test_fp8_backward_bad_inputs_give_clear_errors(cpu):
    assert all(np.all(np.isfinite(g)) and not np.all(g == 7.0) for g in _fp8_call(cpu))
    grads = [np.full((1, 4, 2, 8), 7.0, np.float32) for _ in range(3)]
    keep = dict(dq=grads[0], dk=grads[1], dv=grads[2])
    with pytest.raises(ValueError, match="attention_backward: softmax_fp8 must be a tensor handle"):
        _fp8_call(cpu, softmax_fp8=None, **keep)
    hp_d_o = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(TypeError, match=r"d_o must be float8_e4m3 or float8_e5m2 \(o is FP8\), "
                                        "got float32"):
        _fp8_call(cpu, d_o=hp_d_o, **keep)
    with pytest.raises(ValueError, match="dp_fp8 must be a tensor handle"):
        _fp8_call(cpu, dp_fp8=None, **keep)
    for g in grads:  # nothing written by any failed call
        assert np.all(g == 7.0)
    # High-precision attention takes no softmax factors.
    q, k, v, d_o = make(1, 4, 4, 2, 2, 8, 8, "hp")
    cfg = core.AttentionConfig(core.AttnLayout.bshd, core.AttnMask.causal, softmax_scale=0.5)
    o, lse = np.zeros_like(d_o), np.zeros((1, 2, 4), np.float32)
    core.attention_forward(cfg, q, k, v, o, lse)
    dq = np.full_like(q, 7.0)
    with pytest.raises(ValueError, match="softmax_fp8 must be NULL unless q, k and v are FP8"):
        core.attention_backward(cfg, q, k, v, o, d_o, lse, dq=dq, dk=np.zeros_like(k),
                                dv=np.zeros_like(v),
                                softmax_fp8=core.Tensor(scale=np.ones(1, np.float32),
                                                        scale_inv=np.ones(1, np.float32)))
    assert np.all(dq == 7.0)
    with pytest.raises(TypeError, match=r"d_o must be float32 \(o's dtype\), got float16"):
        core.attention_backward(cfg, q, k, v, o, d_o.astype(np.float16), lse, dq=dq,
                                dk=np.zeros_like(k), dv=np.zeros_like(v))
    assert np.all(dq == 7.0)


def test_fp8_backend_query_takes_d_o_dtype():
    cfg = core.AttentionConfig(core.AttnLayout.bshd, core.AttnMask.causal, softmax_scale=0.125)
    sizes = [2, 8, 8, 64, 64, 64, 64, 128, 128]
    e4m3, e5m2 = core.DType.float8_e4m3, core.DType.float8_e5m2
    chosen, _, message = core.attention_backend(cfg, sizes, e4m3, e4m3, core.DType.bfloat16,
                                                do_dtype=e5m2, backward=True)
    assert chosen == core.AttnBackend.cpu and message == ""
    with pytest.raises(TypeError, match=r"d_o must be float8_e4m3 or float8_e5m2 \(o is FP8\)"):
        core.attention_backend(cfg, sizes, e4m3, e4m3, e5m2, do_dtype=core.DType.bfloat16,
                               backward=True)


@pytest.mark.parametrize("mask", ["causal", "padding_causal"])
def test_inference_forward_writes_o_only(mask):
    """config.inference: the same o as a forward with softmax statistics, softmax_lse NULL;
    a softmax_lse with inference, or none without it, is an error that writes nothing."""
    q, k, v, d_o = make(2, 9, 9, 4, 2, 8, 8, "inference", mask)
    lens = [9, 5] if mask.startswith("padding") else [9, 9]
    cu = dict(cu_seqlens_q=ref.cu_seqlens(lens), cu_seqlens_kv=ref.cu_seqlens(lens)) \
        if mask.startswith("padding") else {}

    def cfg(inference):
        return core.AttentionConfig(core.AttnLayout.bshd, getattr(core.AttnMask, mask),
                                    softmax_scale=0.3, inference=inference)

    o_train, lse = np.zeros_like(d_o), np.zeros((2, 4, 9), np.float32)
    core.attention_forward(cfg(False), q, k, v, o_train, lse, **cu)
    o = np.full_like(d_o, 7.0)
    core.attention_forward(cfg(True), q, k, v, o, None, **cu)
    np.testing.assert_array_equal(o, o_train)  # the same arithmetic, bit for bit
    assert cfg(True).inference == 1
    o = np.full_like(d_o, 7.0)
    with pytest.raises(ValueError, match="softmax_lse must be NULL when config.inference is set"):
        core.attention_forward(cfg(True), q, k, v, o, lse, **cu)
    with pytest.raises(ValueError, match="softmax_lse"):
        core.attention_forward(cfg(False), q, k, v, o, None, **cu)
    assert np.all(o == 7.0)


# Strided q, k, v (attention.h's row_stride / head_stride): column slices of one projection
# output [tokens, (heads_q + 2 * heads_kv) * dim], read in place, and dq, dk, dv written into
# one buffer of that shape. The CPU reference must give the dense call's bits.
def _view(buf: np.ndarray, offset: int, shape) -> tuple:
    """The binding's raw form of a strided operand: (pointer, dtype, shape, device)."""
    return (buf.ctypes.data + offset * buf.itemsize, core.DType.float32, tuple(shape), -1)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_strided_qkv_equal_dense(layout, interleaved):
    b, s, h, hk, d = 2, 9, 4, 4 if interleaved else 2, 8
    q, k, v, d_o = make(b, s, s, h, hk, d, d, layout, interleaved)
    tq, tk, tv, tdo = (ref.to_layout(x, layout) for x in (q, k, v, d_o))
    lead = tq.shape[:2]
    width = (h + 2 * hk) * d
    packed = np.zeros((*lead, width), np.float32)
    if interleaved:  # per head: [q | k | v] (heads_q == heads_kv)
        grouped = packed.reshape(*lead, h, 3, d)
        grouped[..., 0, :], grouped[..., 1, :], grouped[..., 2, :] = tq, tk, tv
        offsets, head = (0, d, 2 * d), 3 * d
        strides = [width, head] * 3
    else:  # [q heads | k heads | v heads]
        packed[..., :h * d] = tq.reshape(*lead, -1)
        packed[..., h * d:(h + hk) * d] = tk.reshape(*lead, -1)
        packed[..., (h + hk) * d:] = tv.reshape(*lead, -1)
        offsets = (0, h * d, (h + hk) * d)
        strides = [width, d] * 3
    cfg = core.AttentionConfig(getattr(core.AttnLayout, layout), core.AttnMask.causal,
                               softmax_scale=0.3, strides=strides)
    shapes = (tq.shape, tk.shape, tv.shape)
    ops = [_view(packed, off, shape) for off, shape in zip(offsets, shapes, strict=True)]
    o = np.zeros_like(tdo)
    lse = np.zeros((b, h, s), np.float32)
    core.attention_forward(cfg, *ops, o, lse)
    grads = np.full_like(packed, np.nan)
    outs = [_view(grads, off, shape) for off, shape in zip(offsets, shapes, strict=True)]
    core.attention_backward(cfg, *ops, o, tdo, lse, dq=outs[0], dk=outs[1], dv=outs[2])
    dense = core.AttentionConfig(getattr(core.AttnLayout, layout), core.AttnMask.causal,
                                 softmax_scale=0.3)
    o_ref, lse_ref = np.zeros_like(tdo), np.zeros_like(lse)
    core.attention_forward(dense, tq, tk, tv, o_ref, lse_ref)
    g_ref = [np.zeros_like(t) for t in (tq, tk, tv)]
    core.attention_backward(dense, tq, tk, tv, o_ref, tdo, lse_ref, dq=g_ref[0], dk=g_ref[1],
                            dv=g_ref[2])
    assert np.array_equal(o, o_ref) and np.array_equal(lse, lse_ref)
    assert not np.isnan(grads).any()  # every element is one of dq, dk, dv
    if interleaved:
        got = [grads.reshape(*lead, h, 3, d)[..., i, :] for i in range(3)]
    else:
        flat = [grads[..., :h * d], grads[..., h * d:(h + hk) * d], grads[..., (h + hk) * d:]]
        got = [g.reshape(t.shape) for g, t in zip(flat, (tq, tk, tv), strict=True)]
    for g, r in zip(got, g_ref, strict=True):
        assert np.array_equal(g, r)
