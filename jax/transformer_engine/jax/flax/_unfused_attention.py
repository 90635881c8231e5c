"""Dot-product attention written in jnp, for what :func:`~transformer_engine.jax.fused_attn`
does not take: an additive bias on the logits (relative position biases) and decoding over a
key/value cache (any number of new queries at an offset, a partly filled cache).

The masks mean what they mean in the core's ``attention.h``: a query row with no allowed key
gives 0; causal masks set the window's right side to 0.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["allowed_keys", "query_positions", "unfused_attention"]

# Logits of masked keys: finite, so a fully masked row gives no NaN before it is zeroed.
_MASKED = -1e30


def allowed_keys(mask_type: str, q_pos: jax.Array, k_pos: jax.Array,
                 window: Optional[tuple[int, int]], mask: Optional[jax.Array] = None,
                 k_valid: Optional[jax.Array] = None) -> jax.Array:
    """bool [b or 1, 1, sq, skv]: which keys each query may attend to.

    ``q_pos`` [sq] or [b, sq] and ``k_pos`` [skv] are the tokens' positions (on the same
    axis: the causal diagonal is ``k_pos <= q_pos``); ``mask`` [b, 1, sq, skv] (True =
    masked) applies for the padding masks; ``k_valid`` [skv] marks the keys that exist (a
    decoding cache).
    """
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask_type:
        right = 0
    q = jnp.reshape(q_pos, (-1, 1, q_pos.shape[-1], 1))
    k = jnp.reshape(k_pos, (1, 1, 1, -1))
    ok = jnp.ones((q.shape[0], 1, q.shape[2], k.shape[3]), bool)
    if left >= 0:
        ok &= k >= q - left
    if right >= 0:
        ok &= k <= q + right
    if k_valid is not None:
        ok &= jnp.reshape(k_valid, (1, 1, 1, -1))
    if mask_type.startswith("padding") and mask is not None:
        ok = ok & ~mask.astype(bool)
    return ok


def query_positions(mask_type: str, sq: int, skv: int,
                    mask: Optional[jax.Array] = None) -> jax.Array:
    """The query positions on the keys' axis outside decoding: [sq], or [b, sq] for
    ``padding_causal_bottom_right``, whose diagonal ends at each sequence's last valid key
    and query (their counts are the rows and columns of ``mask`` not fully masked)."""
    q_pos = jnp.arange(sq)
    if not mask_type.endswith("bottom_right"):
        return q_pos
    if mask_type.startswith("padding") and mask is not None:
        valid = ~jnp.asarray(mask).astype(bool)[:, 0]
        lq = valid.any(axis=-1).sum(axis=-1)
        lk = valid.any(axis=-2).sum(axis=-1)
        return q_pos[None, :] + (lk - lq)[:, None]
    return q_pos + (skv - sq)


def unfused_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *,
                      scale: float, bias: Optional[jax.Array] = None,
                      bias_type: str = "post_scale_bias", dropout_rate: float = 0.0,
                      dropout_rng: Optional[jax.Array] = None, float32_logits: bool = False,
                      seq_first: bool = False, sink: Optional[jax.Array] = None) -> jax.Array:
    """softmax(scale * q k^T (+ bias) | allowed) v per head; q [b, sq, h, d], k and v
    [b, skv, g, d] (g divides h: GQA), or seq-first ([s, b, ...]) with ``seq_first``.

    ``bias`` [b or 1, h, sq, skv] is added after the scale (``post_scale_bias``) or before it
    (``pre_scale_bias``). The logits accumulate in fp32 (fp32 inputs to the products with
    ``float32_logits``); the softmax runs in fp32; the weights meet v in v's dtype. ``sink``
    [h] (attention sinks): each row's denominator gets ``exp(sink[head])`` more, a weight
    with no value (a row with no allowed key gives 0 still).
    """
    if seq_first:
        q, k, v = (jnp.swapaxes(t, 0, 1) for t in (q, k, v))
    b, sq, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    kk = k
    if float32_logits:
        qg, kk = qg.astype(jnp.float32), kk.astype(jnp.float32)
    logits = jnp.einsum("bqgrd,bkgd->bgrqk", qg, kk, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, h, sq, k.shape[1])
    if bias is not None and bias_type == "pre_scale_bias":
        logits = (logits + bias.astype(jnp.float32)) * scale
    else:
        logits = logits * scale
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
    logits = jnp.where(allowed, logits, _MASKED)
    top = jnp.max(logits, axis=-1, keepdims=True)
    if sink is not None:
        column = jnp.reshape(sink.astype(jnp.float32), (1, h, 1, 1))
        top = jnp.maximum(top, column)
    e = jnp.exp(logits - top) * allowed
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(column - top)
    probs = e / jnp.where(total > 0, total, 1.0)
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    probs = probs.astype(v.dtype).reshape(b, g, h // g, sq, k.shape[1])
    out = jnp.einsum("bgrqk,bkgd->bqgrd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(b, sq, h, v.shape[-1]).astype(v.dtype)
    return jnp.swapaxes(out, 0, 1) if seq_first else out
