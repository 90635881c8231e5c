"""Attention through the core's C API on its CPU reference (attention.h) against float64 numpy:
outputs, softmax_lse and gradients for every mask, layout, GQA ratio and window; THD against
padded BSHD; dropout's reproducibility; the backend query's reasons; the validation messages;
and the scaled masked softmax of the unfused path.

Tolerance: fp32 math over at most 129 keys of dot products of 8-16 terms of N(0, 1) values;
each fp32 sum errs by ~n * 2^-24 of its magnitude, so 2e-5 absolute plus 1e-4 relative
(outputs and gradients are O(1)) leaves ample room while catching any wrong mask entry
(which moves results by O(1 / seqlen) at least).
"""

from __future__ import annotations

import numpy as np
import pytest
from te_common_tests import _attention_reference as ref

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
