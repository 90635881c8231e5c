"""Rotary position embedding of the attention modules: NVIDIA's timescale windows and group
methods, mapped onto :func:`transformer_engine.jax.rope.apply_rotary_pos_emb`.

Group methods: ``"consecutive"`` pairs features (2i, 2i + 1) (the interleaved layout);
``"alternate"`` pairs i with i + D / 2 (rotate-half). Pair i turns by position / timescale_i
with timescale_i = min * (max / min) ** (2i / D) for ``windows = (min, max)``: (1, 10000)
gives the usual RoPE frequencies with base 10000.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
from transformer_engine.jax.rope import apply_rotary_pos_emb

__all__ = ["rotary_pos_emb", "rotary_angles", "GROUP_METHODS"]

GROUP_METHODS = ("consecutive", "alternate")


def canonical_group_method(method: str) -> str:
    """NVIDIA's spelling rules: case, spaces, '-' and '_' do not matter."""
    canon = str(method).lower().strip().replace("-", "").replace("_", "")
    if canon not in GROUP_METHODS:
        raise ValueError(f"rotary_pos_emb: rotary_pos_emb_group_method must be one of "
                         f"{GROUP_METHODS}, got {method!r}")
    return canon


def rotary_angles(positions: jax.Array, dim: int, windows: Tuple[float, float],
                  interleaved: bool) -> jax.Array:
    """float32 [len(positions), dim]: the angle of each feature at each position, laid out as
    the features pair ([a_0, a_0, a_1, a_1, ..] interleaved, else [a_0 .. a_{D/2-1}] twice)."""
    lo, hi = float(windows[0]), float(windows[1])
    if lo <= 0 or hi <= 0:
        raise ValueError(f"rotary_pos_emb: rotary_pos_emb_windows must be two positive "
                         f"timescales, got {windows}")
    fraction = 2.0 * jnp.arange(dim // 2, dtype=jnp.float32) / dim
    inv_timescale = 1.0 / (lo * (hi / lo) ** fraction)
    half = jnp.asarray(positions, jnp.float32)[:, None] * inv_timescale[None, :]
    if interleaved:
        return jnp.repeat(half, 2, axis=-1)
    return jnp.concatenate([half, half], axis=-1)


def rotary_pos_emb(x: jax.Array, *, windows: Tuple[float, float], group_method: str,
                   transpose_batch_sequence: bool, offset=0) -> jax.Array:
    """x [batch, seq, heads, D] (or [seq, batch, ...]) rotated at positions offset + t
    (``offset`` a scalar, possibly traced: a decoding step's first position)."""
    method = canonical_group_method(group_method)
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"rotary_pos_emb: the head dim must be even, got {dim}")
    interleaved = method == "consecutive"
    seq = x.shape[0 if transpose_batch_sequence else 1]
    # The angles of exactly this call's positions: no table of a maximum length is needed.
    freqs = rotary_angles(offset + jnp.arange(seq), dim, windows, interleaved)
    return apply_rotary_pos_emb(x, freqs, tensor_format="sbhd" if transpose_batch_sequence
                                else "bshd", interleaved=interleaved)
