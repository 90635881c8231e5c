"""MultiHeadAttention reads q, k and v in place from its fused QKV projection's output, or k and
v from its fused KV projection's (GQA, cross-attention) beside q (attention.packed_attention):
the same bits as the fused attention on the copies, forward and backward, under FP8 and not,
with dropout; no copy, slice or transpose left around the attention in the compiled program;
and the copies where the packed call does not apply (a padding mask, RoPE)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_engine.common.recipe import DelayedScaling
from transformer_engine.jax import fp8_autocast
from transformer_engine.jax.flax import MultiHeadAttention
from transformer_engine.jax.flax import multi_head_attention as mha_module

HIDDEN, HEADS, HEAD_DIM, BATCH, SEQ = 64, 4, 16, 2, 32


@pytest.fixture(autouse=True)
def _restore():
    yield
    mha_module.packed_enabled = True


def _run(on: bool, *, seq_first=False, mask="causal", dropout=0.0, recipe=None, rope=False,
         attention_mask=None, groups=None, cross=False):
    """(output, gradients of the parameters and the inputs, the compiled program's text).
    ``groups``: GQA's key/value heads; ``cross``: keys and values from another sequence (24
    tokens), which the KV projection makes."""
    mha_module.packed_enabled = on
    m = MultiHeadAttention(head_dim=HEAD_DIM, num_attention_heads=HEADS, num_gqa_groups=groups,
                           input_layernorm=True, attn_mask_type=mask,
                           transpose_batch_sequence=seq_first, attention_dropout=dropout,
                           enable_rotary_pos_emb=rope)

    def tokens(key, seq):
        shape = (seq, BATCH, HIDDEN) if seq_first else (BATCH, seq, HIDDEN)
        return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.bfloat16)

    x = tokens(0, SEQ)
    y = tokens(4, 24) if cross else None
    rngs = {"dropout": jax.random.PRNGKey(3)}
    with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        variables = m.init({"params": jax.random.PRNGKey(1), "dropout": jax.random.PRNGKey(2)},
                           x, x if y is None else y, attention_mask, deterministic=False)

    def loss(params, x, y):
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out, _ = m.apply({**variables, "params": params}, x, x if y is None else y,
                             attention_mask, deterministic=False, rngs=rngs)
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = step(variables["params"], x, y)
    text = step.lower(variables["params"], x, y).compile().as_text()
    return out, grads, text


def _assert_same_bits(a, b):
    for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(p.astype(jnp.float32)),
                                      np.asarray(q.astype(jnp.float32)))


@pytest.mark.parametrize("seq_first, mask, dropout, fp8", [
    (False, "causal", 0.0, False), (True, "causal", 0.1, False),
    (False, "no_mask", 0.1, True), (True, "no_mask", 0.0, True)])
def test_packed_attention_gives_the_bits_of_the_copies(seq_first, mask, dropout, fp8):
    kw = dict(seq_first=seq_first, mask=mask, dropout=dropout,
              recipe=DelayedScaling() if fp8 else None)
    out0, grads0, text0 = _run(False, **kw)
    out1, grads1, text1 = _run(True, **kw)
    assert "te_attention_forward_packed_ffi" not in text0
    assert "te_attention_forward_packed_ffi" in text1
    assert "te_attention_backward_packed_ffi" in text1
    _assert_same_bits((out0, grads0), (out1, grads1))


def _moves(text: str) -> int:
    """Copies, slices, transposes and concatenations in a compiled program."""
    return len(re.findall(r"= \S+ (?:copy|slice|transpose|concatenate)\(", text))


@pytest.mark.parametrize("groups, cross", [(None, False), (2, False), (None, True)])
def test_packed_attention_leaves_no_copy_around_the_attention(groups, cross):
    _, _, text0 = _run(False, groups=groups, cross=cross, mask="no_mask")
    _, _, text1 = _run(True, groups=groups, cross=cross, mask="no_mask")
    assert _moves(text0) > 0  # (the parts copied out, their gradients joined)
    assert _moves(text1) == 0


@pytest.mark.parametrize("seq_first, groups, cross, fp8", [
    (False, 2, False, False), (True, 1, False, True), (False, None, True, False),
    (True, 2, True, True)])
def test_kv_packed_attention_gives_the_bits_of_the_copies(seq_first, groups, cross, fp8):
    """GQA (2 groups, or 1: MQA) and cross-attention: q dense, k and v read from the KV
    projection's output."""
    kw = dict(seq_first=seq_first, groups=groups, cross=cross, dropout=0.1,
              mask="no_mask" if cross else "causal", recipe=DelayedScaling() if fp8 else None)
    out0, grads0, text0 = _run(False, **kw)
    out1, grads1, text1 = _run(True, **kw)
    assert "te_attention_forward_packed_ffi" not in text0
    assert "te_attention_forward_packed_ffi" in text1
    _assert_same_bits((out0, grads0), (out1, grads1))


@pytest.mark.parametrize("case", ["padding", "rope"])
def test_copies_where_the_packed_call_does_not_apply(case):
    mask = None
    if case == "padding":
        keep = np.ones((BATCH, 1, SEQ, SEQ), bool)
        keep[1, :, :, SEQ - 4:] = False
        keep[1, :, SEQ - 4:, :] = False
        mask = jnp.asarray(~keep)
    kw = dict(mask="padding" if case == "padding" else "causal", rope=case == "rope",
              attention_mask=mask)
    out, grads, text = _run(True, **kw)
    assert "te_attention_forward_packed_ffi" not in text
    out0, grads0, _ = _run(False, **kw)
    _assert_same_bits((out0, grads0), (out, grads))


@pytest.mark.cuda
@pytest.mark.parametrize("seq_first, dropout, fp8, groups, cross", [
    (False, 0.0, False, None, False), (True, 0.0, True, None, False),
    (False, 0.1, True, None, False), (False, 0.0, False, 2, False), (True, 0.1, True, 2, True)])
def test_packed_attention_gives_the_bits_of_the_copies_on_cuda(seq_first, dropout, fp8, groups,
                                                               cross):
    """cuDNN reading q, k, v through strides, against its reading of the copies."""
    kw = dict(seq_first=seq_first, dropout=dropout, recipe=DelayedScaling() if fp8 else None,
              groups=groups, cross=cross, mask="no_mask" if cross else "causal")
    out0, grads0, _ = _run(False, **kw)
    out1, grads1, text1 = _run(True, **kw)
    assert "te_attention_forward_packed_ffi" in text1
    _assert_same_bits((out0, grads0), (out1, grads1))
