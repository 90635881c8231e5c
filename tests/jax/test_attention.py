"""fused_attn and the flax DotProductAttention against a float64 numpy reference: values and the
gradients of q, k, v (jax.vjp) for every mask and layout, GQA and windows, under jit; dropout
keyed by the PRNG key; input errors. The CUDA tests compare bf16 runs on the GPU with the same
reference within 1.5e-2 and check that the compiled program calls the attention targets.

fp32 tolerance as the core's tests: 2e-5 absolute, 1e-4 relative (O(1) values, sums of < 64
terms). bf16: 1.5e-2 absolute and relative (bf16 inputs, fp32 accumulation in the kernels).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax import hlo
from transformer_engine.jax._native import TARGETS
from transformer_engine.jax.attention import QKVLayout, fused_attn
from transformer_engine.jax.flax import DotProductAttention

MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
         "padding_causal_bottom_right"]


def _allowed(mask, window, sq, skv, lq, lk):
    left, right = window if window is not None else (-1, -1)
    right = 0 if "causal" in mask else right
    lq, lk = np.asarray(lq).reshape(-1, 1, 1), np.asarray(lk).reshape(-1, 1, 1)
    i, j = np.arange(sq).reshape(1, sq, 1), np.arange(skv).reshape(1, 1, skv)
    diag = i + (lk - lq if mask.endswith("bottom_right") else 0)
    ok = (i < lq) & (j < lk)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def reference(q, k, v, d_o, allowed, scale):
    """(o, dq, dk, dv) in float64, BSHD."""
    q, k, v, d_o = (np.asarray(t, np.float64) for t in (q, k, v, d_o))
    h, hk = q.shape[2], k.shape[2]
    kk, vv = np.repeat(k, h // hk, axis=2), np.repeat(v, h // hk, axis=2)
    s = np.where(allowed[:, None], np.einsum("bihd,bjhd->bhij", q, kk) * scale, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    tot = e.sum(-1, keepdims=True)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0)
    o = np.einsum("bhij,bjhd->bihd", p, vv)
    dp = np.einsum("bihd,bjhd->bhij", d_o, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = np.einsum("bhij,bjhd->bihd", ds, kk) * scale
    dk = np.einsum("bhij,bihd->bjhd", ds, q) * scale
    dv = np.einsum("bhij,bihd->bjhd", p, d_o)
    b, skv = k.shape[:2]
    dk, dv = (x.reshape(b, skv, hk, h // hk, -1).sum(3) for x in (dk, dv))
    return o, dq, dk, dv


def _to(x, layout, lengths):
    if layout == "bshd":
        return x
    if layout == "sbhd":
        return jnp.swapaxes(x, 0, 1)
    return jnp.concatenate([x[i, :n] for i, n in enumerate(lengths)])


def _from(x, layout, lengths, seqlen):
    x = np.asarray(x, np.float64)
    if layout == "bshd":
        return x
    if layout == "sbhd":
        return x.swapaxes(0, 1)
    out = np.zeros((len(lengths), seqlen, *x.shape[1:]))
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = x[start:start + n]
        start += n
    return out


def _cu(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def check(layout, mask, dtype=jnp.float32, b=2, sq=7, skv=11, h=4, hk=2, d=8, window=None,
          lq=None, lk=None, atol=2e-5, rtol=1e-4, device=None):
    keys = jax.random.split(jax.random.PRNGKey(sq * 100 + skv), 4)
    q = jax.random.normal(keys[0], (b, sq, h, d)).astype(dtype)
    k = jax.random.normal(keys[1], (b, skv, hk, d)).astype(dtype)
    v = jax.random.normal(keys[2], (b, skv, hk, d)).astype(dtype)
    d_o = jax.random.normal(keys[3], (b, sq, h, d)).astype(dtype)
    padding = layout == "thd" or mask.startswith("padding")
    lq, lk = (lq or [sq] * b), (lk or [skv] * b)
    kw = dict(qkv_layout=layout, attn_mask_type=mask, window_size=window)
    if padding:
        kw.update(cu_seqlens_q=_cu(lq), cu_seqlens_kv=_cu(lk), max_seqlen_q=sq,
                  max_seqlen_kv=skv)
    args = (_to(q, layout, lq), _to(k, layout, lk), _to(v, layout, lk))
    if device is not None:
        args = jax.device_put(args, device)
    o, vjp = jax.vjp(jax.jit(lambda q_, k_, v_: fused_attn(q_, k_, v_, **kw)), *args)
    dq, dk, dv = vjp(_to(d_o, layout, lq).astype(o.dtype))
    allowed = _allowed(mask, window, sq, skv, lq if padding else [sq] * b,
                       lk if padding else [skv] * b)
    want = reference(q, k, v, d_o, allowed, 1 / math.sqrt(d))
    valid_q = np.arange(sq)[None] < np.asarray(lq)[:, None]
    valid_k = np.arange(skv)[None] < np.asarray(lk)[:, None]
    got = (_from(o, layout, lq, sq), _from(dq, layout, lq, sq), _from(dk, layout, lk, skv),
           _from(dv, layout, lk, skv))
    for g, w, valid in zip(got, want, (valid_q, valid_q, valid_k, valid_k), strict=True):
        np.testing.assert_allclose(g[valid], w[valid], atol=atol, rtol=rtol)


# Every mask in bshd; sbhd only re-indexes the same core call (the core's tests cover it all).
@pytest.mark.parametrize(("mask", "layout"), [(m, "bshd") for m in MASKS] +
                         [("causal", "sbhd"), ("padding_causal", "sbhd")])
def test_masks_and_layouts(mask, layout):
    pad = mask.startswith("padding")
    check(layout, mask, lq=[7, 3] if pad else None, lk=[11, 2] if pad else None)


@pytest.mark.parametrize("mask", ["padding", "padding_causal_bottom_right"])
def test_thd(mask):
    check("thd", mask, b=3, lq=[7, 2, 1], lk=[11, 4, 3])


@pytest.mark.parametrize("window", [(2, 0), (1, 2)])
def test_window_mqa(window):
    check("bshd", "no_mask", hk=1, window=window)


def test_dropout_keyed_by_rng():
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 8, 2, 8))

    def run(key, p=0.2):
        return fused_attn(q, q, q, dropout_probability=p, dropout_rng=key)

    a, b = run(jax.random.PRNGKey(1)), run(jax.random.PRNGKey(1))
    c = run(jax.random.PRNGKey(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(run(jax.random.PRNGKey(1), 0.0), fused_attn(q, q, q))


def test_flax_module_padding_mask_equals_cu_seqlens():
    q = jax.random.normal(jax.random.PRNGKey(0), (2, 6, 2, 8))
    mask = np.zeros((2, 1, 6, 6), bool)
    mask[1, :, 4:, :] = True
    mask[1, :, :, 4:] = True
    attn = DotProductAttention(head_dim=8, num_attention_heads=2, attn_mask_type="padding")
    out = attn.apply({}, q, q, q, jnp.asarray(mask))
    cu = jnp.asarray([0, 6, 10], jnp.int32)
    want = fused_attn(q, q, q, attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert out.shape == (2, 6, 2, 8)  # [b, s, h, d] as NVIDIA's module returns it
    np.testing.assert_array_equal(out, want)
    seq_first = DotProductAttention(head_dim=8, num_attention_heads=2, attn_mask_type="padding",
                                    transpose_batch_sequence=True)
    qs = jnp.swapaxes(q, 0, 1)
    np.testing.assert_array_equal(seq_first.apply({}, qs, qs, qs, jnp.asarray(mask)),
                                  jnp.swapaxes(want, 0, 1))
    dropped = DotProductAttention(head_dim=8, num_attention_heads=2, attention_dropout=0.5)
    y = dropped.apply({}, q, q, q, rngs={"dropout": jax.random.PRNGKey(3)})
    assert not np.allclose(y, dropped.apply({}, q, q, q, deterministic=True))


def test_errors():
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(ValueError, match="same head dim"):
        fused_attn(q, q[..., :4], q)
    with pytest.raises(ValueError, match="qkv_layout must be one of"):
        fused_attn(q, q, q, qkv_layout="bhsd")
    with pytest.raises(ValueError, match="needs cu_seqlens_q"):
        fused_attn(q, q, q, attn_mask_type="padding")
    with pytest.raises(ValueError, match="needs dropout_rng"):
        fused_attn(q, q, q, dropout_probability=0.1)


def test_hlo_calls_the_attention_targets():
    q = jnp.ones((1, 4, 2, 8))
    text = jax.jit(jax.grad(lambda x: fused_attn(x, x, x).sum())).lower(q).compile().as_text()
    counts = hlo.target_counts(text)
    assert counts[TARGETS["attention_forward"]] == 1
    assert counts[TARGETS["attention_backward"]] == 1


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("mask", MASKS)
def test_cuda_bf16(mask, layout):
    if layout == "thd" and not mask.startswith("padding"):
        pytest.skip("thd takes the padding masks")
    pad = layout == "thd" or mask.startswith("padding")
    check(layout, mask, jnp.bfloat16, sq=129, skv=129, d=64, lq=[129, 17] if pad else None,
          lk=[129, 40] if pad else None, atol=1.5e-2, rtol=1.5e-2, device=jax.devices("gpu")[0])


@pytest.mark.parametrize("seq_first", [False, True], ids=["bshd", "sbhd"])
def test_flax_module_takes_nvidia_layout_names_and_packed_inputs(seq_first):
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    q, k, v = (jax.random.normal(kk, (2, 6, 2, 8)) for kk in ks)
    if seq_first:
        q, k, v = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))

    def attn(layout, mask_type="causal"):
        return DotProductAttention(head_dim=8, num_attention_heads=2, qkv_layout=layout,
                                   attn_mask_type=mask_type,
                                   transpose_batch_sequence=seq_first)

    want = attn("bshd").apply({}, q, k, v)
    np.testing.assert_array_equal(attn("bshd_bshd_bshd").apply({}, q, k, v), want)
    np.testing.assert_array_equal(attn(QKVLayout.BSHD_BSHD_BSHD).apply({}, q, k, v), want)
    qkv = jnp.stack([q, k, v], axis=-3)  # [b, s, 3, h, d]
    np.testing.assert_array_equal(attn("bs3hd").apply({}, qkv, None, None), want)
    np.testing.assert_array_equal(attn(QKVLayout.BS3HD).apply({}, qkv), want)
    kv = jnp.stack([k, v], axis=-3)  # [b, s, 2, h, d]
    np.testing.assert_array_equal(attn("bshd_bs2hd").apply({}, q, kv, None), want)
    # The packed parts are taken apart, not read whole: another order gives another output.
    swapped = jnp.stack([v, k], axis=-3)
    assert not np.array_equal(attn("bshd_bs2hd").apply({}, q, swapped, None), want)
    with pytest.raises(ValueError, match=r"packed query must have shape \[b, s, 3"):
        attn("bs3hd").apply({}, kv)
    with pytest.raises(ValueError, match="needs query, key and value"):
        attn("bshd_bshd_bshd").apply({}, q)
    # NVIDIA's "causal_padding" is our "padding_causal".
    mask = np.zeros((2, 1, 6, 6), bool)
    mask[1, :, 4:, :] = True
    mask[1, :, :, 4:] = True
    want_pc = attn("bshd", "padding_causal").apply({}, q, k, v, jnp.asarray(mask))
    got_pc = attn("bshd_bshd_bshd", "causal_padding").apply({}, q, k, v, jnp.asarray(mask))
    np.testing.assert_array_equal(got_pc, want_pc)
    assert not np.array_equal(got_pc, want)  # the mask took effect


def test_flax_module_takes_nvidia_thd_names():
    ks = jax.random.split(jax.random.PRNGKey(6), 3)
    q, k, v = (jax.random.normal(kk, (10, 2, 8)) for kk in ks)
    cu = jnp.asarray([0, 6, 10], jnp.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)

    def attn(layout):
        return DotProductAttention(head_dim=8, num_attention_heads=2, qkv_layout=layout,
                                   attn_mask_type="padding_causal")

    want = attn("thd").apply({}, q, k, v, **kw)
    assert want.shape == (10, 2, 8)
    np.testing.assert_array_equal(attn("thd_thd_thd").apply({}, q, k, v, **kw), want)
    np.testing.assert_array_equal(attn("t3hd").apply({}, jnp.stack([q, k, v], -3), **kw), want)
    np.testing.assert_array_equal(
        attn("thd_t2hd").apply({}, q, jnp.stack([k, v], -3), None, **kw), want)
