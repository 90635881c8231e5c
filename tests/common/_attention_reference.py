"""Float64 numpy attention (forward and backward) in the words of the core's attention.h, and
the layout conversions the attention tests share. Arrays are [batch, seqlen, heads, dim]."""

from __future__ import annotations

import numpy as np


def allowed_keys(mask: str, window, sq: int, skv: int, lq, lk) -> np.ndarray:
    """bool [batch, sq, skv]: key j allowed for query i (padding from the lengths lq, lk)."""
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask:
        right = 0
    lq = np.asarray(lq).reshape(-1, 1, 1)
    lk = np.asarray(lk).reshape(-1, 1, 1)
    i = np.arange(sq).reshape(1, sq, 1)
    j = np.arange(skv).reshape(1, 1, skv)
    diag = i + (lk - lq if mask.endswith("bottom_right") else 0)
    ok = (i < lq) & (j < lk)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def _expand(k: np.ndarray, heads: int) -> np.ndarray:
    return np.repeat(k, heads // k.shape[2], axis=2)


def forward(q, k, v, allowed, scale):
    """(o [b, sq, h, dv], lse [b, h, sq], p [b, h, sq, skv]) in float64."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    heads = q.shape[2]
    s = np.einsum("bihd,bjhd->bhij", q, _expand(k, heads)) * scale
    s = np.where(allowed[:, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    p = np.where(total > 0, e / safe, 0.0)
    lse = np.where(total[..., 0] > 0, (m + np.log(safe))[..., 0], -np.inf)
    o = np.einsum("bhij,bjhd->bihd", p, _expand(v, heads))
    return o, lse, p


def backward(q, k, v, p, d_o, scale):
    """(dq, dk, dv) in float64 from the forward's p; GQA sums over each group's query heads."""
    q, k, v, d_o = (np.asarray(t, np.float64) for t in (q, k, v, d_o))
    b, skv, hk, _ = k.shape
    heads = q.shape[2]
    dp = np.einsum("bihd,bjhd->bhij", d_o, _expand(v, heads))
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhij,bjhd->bihd", ds, _expand(k, heads)) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    dv = np.einsum("bhij,bihd->bjhd", p, d_o)
    g = heads // hk
    return dq, dk.reshape(b, skv, hk, g, -1).sum(3), dv.reshape(b, skv, hk, g, -1).sum(3)


def pack(x: np.ndarray, lengths) -> np.ndarray:
    """[b, s, h, d] -> THD [sum(lengths), h, d]."""
    return np.concatenate([x[i, :n] for i, n in enumerate(lengths)], axis=0)


def unpack(x: np.ndarray, lengths, seqlen: int) -> np.ndarray:
    """THD -> [b, seqlen, h, d] with zeros past each length."""
    out = np.zeros((len(lengths), seqlen, *x.shape[1:]), x.dtype)
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = x[start:start + n]
        start += n
    return out


def cu_seqlens(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def to_layout(x: np.ndarray, layout: str, lengths=None) -> np.ndarray:
    if layout == "bshd":
        return np.ascontiguousarray(x)
    if layout == "sbhd":
        return np.ascontiguousarray(x.transpose(1, 0, 2, 3))
    return np.ascontiguousarray(pack(x, lengths))


def from_layout(x: np.ndarray, layout: str, lengths=None, seqlen=None) -> np.ndarray:
    if layout == "bshd":
        return x
    if layout == "sbhd":
        return x.transpose(1, 0, 2, 3)
    return unpack(x, lengths, seqlen)
