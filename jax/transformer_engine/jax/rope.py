"""Rotary position embedding (RoPE) as a ``jax.custom_vjp`` over the core's fused kernels (one
custom call forward, one backward).

``rotary_freqs`` makes the angles of every position, ``apply_rotary_pos_emb`` rotates the
first ``rot_dim`` features of each head of a query or key tensor by them and passes the rest
through (partial rotary). Feature pairs and angle layout follow ``transformer_engine.pytorch``:
``(i, i + rot_dim/2)`` with angles ``[f_0 .. f_{n-1}, f_0 .. f_{n-1}]`` ("rotate half"), or
``(2i, 2i + 1)`` with ``[f_0, f_0, f_1, f_1, ...]`` when ``interleaved``. The arithmetic is
fp32 whatever the input dtype, with the core's own cos and sin (the same bits on the CPU and
on CUDA); semantics and the checks of positions: ``rope.h`` of the core.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp
from transformer_engine.jax._native import TARGETS, load

__all__ = ["apply_rotary_pos_emb", "rotary_freqs"]

_FORMATS = {"sbhd": 0, "bshd": 1}  # te_rope_format
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
_VMAP = "sequential"


def rotary_freqs(seq_len: int, rot_dim: int, base: float = 10000.0,
                 interleaved: bool = False) -> jax.Array:
    """The angles float32 [seq_len, rot_dim] of positions 0 .. seq_len - 1:
    ``p * base ** (-2i / rot_dim)`` for frequency i, laid out for ``interleaved`` or not.

    Example:
        >>> from transformer_engine.jax.rope import rotary_freqs
        >>> rotary_freqs(3, 4, base=100.0)[2].tolist()
        [2.0, 0.20000000298023224, 2.0, 0.20000000298023224]
    """
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rotary_freqs: rot_dim must be even and positive, got {rot_dim}")
    exponent = jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim
    inv_freq = 1.0 / (jnp.float32(base) ** exponent)
    half = jnp.outer(jnp.arange(seq_len, dtype=jnp.float32), inv_freq)
    if interleaved:
        return jnp.repeat(half, 2, axis=1)
    return jnp.concatenate((half, half), axis=1)


def apply_rotary_pos_emb(x: jax.Array, freqs: jax.Array, tensor_format: str = "bshd",
                         interleaved: bool = False,
                         start_positions: Optional[jax.Array] = None) -> jax.Array:
    """Rotates the first ``rot_dim = freqs.shape[-1]`` features of each head of ``x``.

    Args:
        x: [b, s, h, d] (``"bshd"``) or [s, b, h, d] (``"sbhd"``); float32, float16 or
            bfloat16.
        freqs: float32 angles [s_max, rot_dim] (or [s_max, 1, 1, rot_dim]), row p for
            position p (``rotary_freqs``); rot_dim even and at most d.
        tensor_format: the layout of ``x``.
        interleaved: pairs ``(2i, 2i + 1)`` rather than ``(i, i + rot_dim/2)``; ``freqs``
            must be laid out the same way.
        start_positions: optional integer [b]: token i of sequence b takes position
            ``start_positions[b] + i`` (decoding with a KV cache); otherwise i.

    Returns:
        An array of x's shape and dtype. The gradient flows to ``x`` only: ``freqs`` and
        ``start_positions`` are treated as constants. On the CPU a position past the rows of
        ``freqs`` fails the call; on CUDA it gives NaN in that token's rotated features.

    Example:
        >>> import jax.numpy as jnp
        >>> from transformer_engine.jax.rope import apply_rotary_pos_emb, rotary_freqs
        >>> x = jnp.ones((2, 8, 4, 64), jnp.bfloat16)        # [b, s, h, d]
        >>> apply_rotary_pos_emb(x, rotary_freqs(16, 64)).shape
        (2, 8, 4, 64)
    """
    op = "apply_rotary_pos_emb"
    if tensor_format not in _FORMATS:
        raise ValueError(f"{op}: tensor_format must be one of {tuple(_FORMATS)}, got "
                         f"{tensor_format!r}")
    x, freqs = jnp.asarray(x), jnp.asarray(freqs)
    if x.ndim != 4:
        raise ValueError(f"{op}: x must have rank 4 ({tensor_format}), got shape {x.shape}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16, got {x.dtype}")
    if freqs.dtype != jnp.float32:
        raise TypeError(f"{op}: freqs must be float32, got {freqs.dtype}")
    if freqs.ndim == 4 and freqs.shape[1:3] == (1, 1):
        freqs = freqs.reshape(freqs.shape[0], freqs.shape[3])
    if freqs.ndim != 2:
        raise ValueError(f"{op}: freqs must have shape [s_max, rot_dim] or "
                         f"[s_max, 1, 1, rot_dim], got {freqs.shape}")
    rot_dim, head_dim = freqs.shape[1], x.shape[3]
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"{op}: freqs' last dimension (rot_dim) must be even, positive and at "
                         f"most x's head dimension {head_dim}, got {rot_dim}")
    seq, batch = (x.shape[0], x.shape[1]) if tensor_format == "sbhd" else (x.shape[1],
                                                                           x.shape[0])
    if start_positions is None:
        if seq > freqs.shape[0]:
            raise ValueError(f"{op}: freqs must have at least the sequence length {seq} rows, "
                             f"got {freqs.shape[0]}")
    else:
        start_positions = jnp.asarray(start_positions)
        if start_positions.shape != (batch,) or not jnp.issubdtype(start_positions.dtype,
                                                                    jnp.integer):
            raise ValueError(f"{op}: start_positions must be an integer vector [{batch}], got "
                             f"{start_positions.dtype} of shape {start_positions.shape}")
        start_positions = start_positions.astype(jnp.int32)
    return _rope(x, freqs, start_positions, _FORMATS[tensor_format], bool(interleaved))


def _call(target: str, x, freqs, start_positions, fmt: int, interleaved: bool):
    load()
    no_index = jnp.zeros((0,), jnp.int32)
    call = jax.ffi.ffi_call(TARGETS[target], jax.ShapeDtypeStruct(x.shape, x.dtype),
                            vmap_method=_VMAP)
    return call(x, freqs, no_index, no_index if start_positions is None else start_positions,
                format=np.int32(fmt), interleaved=interleaved, with_cu_seqlens=False,
                with_start_positions=start_positions is not None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rope(x, freqs, start_positions, fmt, interleaved):
    return _call("rope_forward", x, freqs, start_positions, fmt, interleaved)


def _rope_fwd(x, freqs, start_positions, fmt, interleaved):
    y = _call("rope_forward", x, freqs, start_positions, fmt, interleaved)
    return y, (freqs, start_positions)


def _rope_bwd(fmt, interleaved, residuals, dy):
    freqs, start_positions = residuals
    dx = _call("rope_backward", dy, freqs, start_positions, fmt, interleaved)
    # freqs and start_positions are constants here (None: a zero cotangent).
    return dx, None, None


_rope.defvjp(_rope_fwd, _rope_bwd)
