"""A Transformer layer from plain flax.linen modules (nn.LayerNorm / nn.RMSNorm,
nn.DenseGeneral) and an explicit softmax attention, reading the parameter tree of the
modules under test: the reference of test_transformer.

RoPE is written as a complex rotation (a feature pair is one complex number, multiplied by
e^{i angle}, angles in float64), T5's buckets as a scalar loop, the masks as explicit index
comparisons.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

ACTIVATIONS = {
    ("relu",): jax.nn.relu,
    ("gelu",): jax.nn.gelu,
    ("gelu", "linear"): lambda a, b: jax.nn.gelu(a) * b,
    ("silu", "linear"): lambda a, b: jax.nn.silu(a) * b,
}


def norm(p, x, kind, eps, zero_centered):
    scale = p["scale"] + (1.0 if zero_centered else 0.0)
    if kind == "layernorm":
        return nn.LayerNorm(epsilon=eps).apply({"params": {"scale": scale,
                                                           "bias": p["ln_bias"]}}, x)
    return nn.RMSNorm(epsilon=eps).apply({"params": {"scale": scale}}, x)


def dense(p, x, features, prefix=""):
    params = {"kernel": p[prefix + "kernel"]}
    if prefix + "bias" in p:
        params["bias"] = p[prefix + "bias"]
    return nn.DenseGeneral(features, use_bias=len(params) == 2).apply({"params": params}, x)


def rope(x, windows, method, offset=0):
    """x [b, s, h, d] rotated at positions offset .. offset + s - 1 (float64 angles)."""
    d = x.shape[-1]
    lo, hi = windows
    timescale = np.array([lo * (hi / lo) ** (2 * i / d) for i in range(d // 2)])
    angle = (np.arange(x.shape[1]) + offset)[:, None] / timescale[None, :]
    cos = jnp.asarray(np.cos(angle)[None, :, None, :], jnp.float32)
    sin = jnp.asarray(np.sin(angle)[None, :, None, :], jnp.float32)
    x = x.astype(jnp.float32)
    if method == "consecutive":  # pairs (2i, 2i + 1) = re, im
        re, im = x[..., 0::2], x[..., 1::2]
    else:  # "alternate": pairs (i, i + d / 2)
        re, im = x[..., : d // 2], x[..., d // 2:]
    # (re + i im) * (cos + i sin)
    re, im = re * cos - im * sin, re * sin + im * cos
    if method == "consecutive":
        return jnp.stack([re, im], axis=-1).reshape(x.shape)
    return jnp.concatenate([re, im], axis=-1)


def allowed(mask_type, sq, skv, mask=None, window=None):
    """bool [b, 1, sq, skv]: as attention.h, the bottom-right diagonal of a padded sequence
    ends at its own last query and key."""
    pad = np.zeros((1, 1, sq, skv), bool) if mask is None else np.asarray(mask, bool)
    left, right = window if window is not None else (-1, -1)
    ok = np.ones((pad.shape[0], 1, sq, skv), bool)
    for b in range(pad.shape[0]):
        lq, lk = sq, skv
        if mask_type.startswith("padding"):
            lq = int((~pad[b, 0]).any(axis=1).sum())
            lk = int((~pad[b, 0]).any(axis=0).sum())
        off = lk - lq if mask_type.endswith("bottom_right") else 0
        for i in range(sq):
            for j in range(skv):
                if "causal" in mask_type and j > i + off:
                    ok[b, 0, i, j] = False
                if left >= 0 and j < i + off - left:
                    ok[b, 0, i, j] = False
                if right >= 0 and "causal" not in mask_type and j > i + off + right:
                    ok[b, 0, i, j] = False
    if mask_type.startswith("padding"):
        ok = ok & ~pad
    return jnp.asarray(ok)


def attention(q, k, v, ok, scale, bias=None, bias_type="post_scale_bias"):
    h, g = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    if bias is not None and bias_type == "pre_scale_bias":
        logits = (logits + bias) * scale
    else:
        logits = logits * scale + (0.0 if bias is None else bias)
    logits = jnp.where(ok, logits, -1e30)  # finite: exp never overflows (no NaN gradient)
    e = jnp.exp(logits - jnp.max(logits, -1, keepdims=True)) * ok
    total = e.sum(-1, keepdims=True)
    p = jnp.where(total > 0, e / jnp.where(total > 0, total, 1.0), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))


def mha(cfg, p, xq, xkv, mask=None, bias=None, self_attention=True):
    """(out, normed input) of MultiHeadAttention in [b, s, hidden], from its parameters."""
    h, g, d = cfg["heads"], cfg["groups"], cfg["head_dim"]
    dt = xq.dtype
    xq, xkv = xq.astype(jnp.float32), xkv.astype(jnp.float32)
    first = p["qkv"] if "qkv" in p else p["query"]
    ln = xq
    if cfg.get("input_layernorm", True):
        ln = norm(first, xq, cfg["layernorm_type"], cfg["eps"], cfg["zero_centered_gamma"])
    if "qkv" in p:
        qkv = dense(p["qkv"], ln, (3, h * d))
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    else:
        q = dense(p["query"], ln, h * d)
        src = ln if self_attention else xkv
        if "kv" in p:
            kv = dense(p["kv"], src, (2, g * d))
            k, v = kv[..., 0, :], kv[..., 1, :]
        else:
            k, v = dense(p["key"], src, g * d), dense(p["value"], src, g * d)
    b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
    q, k, v = q.reshape(b, sq, h, d), k.reshape(b, skv, g, d), v.reshape(b, skv, g, d)
    if cfg.get("rope") is not None:
        q, k = rope(q, *cfg["rope"]), rope(k, *cfg["rope"])
    scale = 1.0 / math.sqrt(d) if cfg.get("scale_attn_logits") else 1.0
    ok = allowed(cfg["mask_type"], sq, skv, mask, cfg.get("window"))
    x = attention(q, k, v, ok, scale, bias, cfg.get("bias_type", "post_scale_bias"))
    out = dense(p["out"], x.reshape(b, sq, h * d), xq.shape[-1])
    return out.astype(dt), ln.astype(dt)


def t5_bucket(offset, num_buckets, max_distance, bidirectional):
    """T5's bucket of one key offset (key position - query position)."""
    n, bucket, dist = num_buckets, 0, -offset
    if bidirectional:
        n //= 2
        if dist < 0:
            bucket = n
        dist = abs(dist)
    else:
        dist = max(dist, 0)
    exact = n // 2
    if dist < exact:
        return bucket + dist
    far = exact + int(np.float32(math.log(dist / exact + float(np.finfo(np.float32).eps))
                                 / math.log(max_distance / exact) * (n - exact)))
    return bucket + min(far, n - 1)


def relative_bias(table, sq, skv, bidirectional, num_buckets=32, max_distance=128):
    idx = np.array([[t5_bucket(j - i, num_buckets, max_distance, bidirectional)
                     for j in range(skv)] for i in range(sq)])
    return jnp.asarray(table)[:, idx][None]


def layer_config(layer):
    """The attention settings of a TransformerLayer, for :func:`mha`."""
    h = layer.num_attention_heads
    return dict(heads=h, groups=layer.num_gqa_groups or h, head_dim=layer.hidden_size // h,
                layernorm_type=layer.layernorm_type, eps=layer.layernorm_epsilon,
                zero_centered_gamma=layer.zero_centered_gamma,
                rope=((layer.rotary_pos_emb_windows, layer.rotary_pos_emb_group_method)
                      if layer.enable_rotary_pos_emb else None),
                scale_attn_logits=layer.scale_attn_logits, window=layer.window_size)


def transformer_layer(layer, params, x, encoded=None, attention_mask=None,
                      encoder_decoder_mask=None):
    """TransformerLayer's forward (no dropout) from its parameters."""
    dt = x.dtype
    if layer.transpose_batch_sequence:
        x = jnp.swapaxes(x, 0, 1)
        encoded = None if encoded is None else jnp.swapaxes(encoded, 0, 1)
    x = x.astype(jnp.float32)
    cfg = layer_config(layer)
    decoder = layer.layer_type.value == "decoder"
    post_ln = layer.apply_residual_connection_post_layernorm
    bias = None
    if layer.enable_relative_embedding:
        s = x.shape[1]
        bias = relative_bias(params["relpos_bias"]["rel_embedding"], s, s, not decoder)
    self_cfg = dict(cfg, mask_type=_canon(layer.self_attn_mask_type),
                    input_layernorm=not layer.output_layernorm)
    a, ln = mha(self_cfg, params["self_attention" if decoder else "attention"], x, x,
                attention_mask, bias)
    x = a + (ln if post_ln else x)
    if decoder:
        mask = encoder_decoder_mask
        if mask is None:
            mask = np.zeros((x.shape[0], 1, x.shape[1], encoded.shape[1]), bool)
        cross_cfg = dict(cfg, mask_type="padding")
        y, ln = mha(cross_cfg, params["encoder_decoder_attention"], x,
                    encoded.astype(jnp.float32), mask, self_attention=False)
        x = y + (ln if post_ln else x)
    p = params["mlp"]
    ln = norm(p, x, layer.layernorm_type, layer.layernorm_epsilon, layer.zero_centered_gamma)
    acts = tuple(layer.mlp_activations)
    hid = dense(p, ln, p["wi_kernel"].shape[1:], prefix="wi_")
    hid = ACTIVATIONS[acts](*(hid[..., i, :] for i in range(len(acts))))
    z = dense(p, hid, x.shape[-1], prefix="wo_") + (ln if post_ln else x)
    if layer.output_layernorm:
        z = norm(params["output_layernorm"], z, layer.layernorm_type, layer.layernorm_epsilon,
                 layer.zero_centered_gamma)
    if layer.transpose_batch_sequence:
        z = jnp.swapaxes(z, 0, 1)
    return z.astype(dt)


def _canon(mask_type):
    return "padding_causal" if mask_type == "causal_padding" else mask_type
