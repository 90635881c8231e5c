"""Attention sinks (NVIDIA's AttnSoftmaxType) in the flax modules: values and gradients (the
sink's included) against a reference written from the definition (a softmax over the logits
and one more column, the head's sink, dropped after), GQA, both layouts and masks; the sink's
limits; the parameter; and the refusals of the fused attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.jax.attention import AttnSoftmaxType, fused_attn
from transformer_engine.jax.flax import DotProductAttention, MultiHeadAttention

B, S, HEADS, GROUPS, DIM = 2, 7, 4, 2, 16
SINK = jnp.array([0.5, -1.0, 2.0, 0.0], jnp.float32)
# fp32 throughout: the module's and the reference's sums of 7 terms in other orders.
TOL = dict(rtol=2e-5, atol=2e-6)


def _reference(q, k, v, sink, causal: bool):
    """q [b, s, h, d], k, v [b, s, g, d] (bshd); sink [h]."""
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(t, group, axis=2) for t in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((S, S), bool)), logits, -jnp.inf)
    column = jnp.broadcast_to(sink.reshape(1, -1, 1, 1), (*logits.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(kq, (B, S, HEADS, DIM)),
            jax.random.normal(kk, (B, S, GROUPS, DIM)),
            jax.random.normal(kv, (B, S, GROUPS, DIM)))


def _module(softmax_type, mask="causal", layout="bshd_bshd_bshd", **kw):
    return DotProductAttention(head_dim=DIM, num_attention_heads=HEADS, num_gqa_groups=GROUPS,
                               attn_mask_type=mask, qkv_layout=layout,
                               softmax_type=softmax_type, **kw)


@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("softmax_type", ["off-by-one", AttnSoftmaxType.LEARNABLE_SOFTMAX])
@pytest.mark.parametrize("seq_first", [False, True])
def test_values_and_gradients_match_the_definition(mask, softmax_type, seq_first):
    learnable = softmax_type == AttnSoftmaxType.LEARNABLE_SOFTMAX
    m = _module(softmax_type, mask, transpose_batch_sequence=seq_first)
    q, k, v = _inputs()
    flip = (lambda t: jnp.swapaxes(t, 0, 1)) if seq_first else (lambda t: t)
    params = m.init(jax.random.PRNGKey(1), flip(q), flip(k), flip(v)).get("params", {})
    if learnable:
        assert params["softmax_offset"].value.shape == (HEADS,)
        params = {"softmax_offset": SINK}
    sink = SINK if learnable else jnp.zeros(HEADS)

    def ours(q, k, v, sink):
        p = {"softmax_offset": sink} if learnable else {}
        return flip(m.apply({"params": p}, flip(q), flip(k), flip(v)))

    def ref(q, k, v, sink):
        return _reference(q, k, v, sink, mask == "causal")

    np.testing.assert_allclose(ours(q, k, v, sink), ref(q, k, v, sink), **TOL)
    cot = jax.random.normal(jax.random.PRNGKey(5), (B, S, HEADS, DIM))
    got = jax.vjp(ours, q, k, v, sink)[1](cot)
    want = jax.vjp(ref, q, k, v, sink)[1](cot)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want, strict=True):
        if name == "dsink" and not learnable:
            continue
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)


def test_the_sinks_limits_and_padding_rows():
    q, k, v = _inputs()
    vanilla = DotProductAttention(head_dim=DIM, num_attention_heads=HEADS, num_gqa_groups=GROUPS)
    want = vanilla.apply({}, q, k, v)
    m = _module("learnable")
    low = m.apply({"params": {"softmax_offset": jnp.full((HEADS,), -1e4)}}, q, k, v)
    np.testing.assert_allclose(low, want, rtol=2e-5, atol=2e-5)
    high = m.apply({"params": {"softmax_offset": jnp.full((HEADS,), 1e4)}}, q, k, v)
    assert not np.any(np.asarray(high))
    # A padding mask: the padded query rows have no key and give 0, with the sink too.
    mask = np.zeros((B, 1, S, S), bool)
    mask[1, :, 4:, :] = mask[1, :, :, 4:] = True
    padded = _module("off-by-one", "padding_causal").apply({}, q, k, v, jnp.asarray(mask))
    assert not np.any(np.asarray(padded[1, 4:]))
    np.testing.assert_allclose(padded[0], _reference(q, k, v, jnp.zeros(HEADS), True)[0], **TOL)


def test_multi_head_attention_has_the_sink_parameter():
    mha = MultiHeadAttention(head_dim=DIM, num_attention_heads=HEADS, num_gqa_groups=GROUPS,
                             softmax_type="learnable", transpose_batch_sequence=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (B, S, HEADS * DIM))
    variables = mha.init(jax.random.PRNGKey(1), x, x)
    assert variables["params"]["softmax_offset"].value.shape == (HEADS,)
    out, _ = mha.apply(variables, x, x)
    assert out.shape == x.shape and np.all(np.isfinite(np.asarray(out)))


def test_the_fused_attention_refuses_a_sink_and_names_are_checked():
    q, k, v = _inputs()
    out = fused_attn(q, k, v, softmax_type=AttnSoftmaxType.VANILLA_SOFTMAX)
    assert out.shape == (B, S, HEADS, DIM)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        fused_attn(q, k, v, softmax_type=AttnSoftmaxType.OFF_BY_ONE_SOFTMAX)
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        _module("sink").init(jax.random.PRNGKey(0), q, k, v)
    with pytest.raises(NotImplementedError, match="thd"):
        _module("off-by-one", layout="thd").apply(
            {}, q[0], k[0], v[0], cu_seqlens_q=jnp.array([0, S], jnp.int32),
            cu_seqlens_kv=jnp.array([0, S], jnp.int32), max_seqlen_q=S, max_seqlen_kv=S)
