"""Rotary position embedding (RoPE, https://arxiv.org/abs/2104.09864).

``RotaryPositionEmbedding`` makes the rotation angles of every position, and
``apply_rotary_pos_emb`` rotates the leading ``rot_dim`` features of each head of a query or
key tensor by them, passing the remaining features through (partial rotary).

Feature pairs: in the default "rotate half" convention feature ``i`` pairs with feature
``i + rot_dim / 2`` and both use frequency ``f_i``, so the angles are laid out as
``[f_0 .. f_{n-1}, f_0 .. f_{n-1}]``; with ``interleaved=True`` features ``2i`` and ``2i + 1``
pair and the angles read ``[f_0, f_0, f_1, f_1, ...]``. A pair ``(x1, x2)`` at angle ``a``
becomes ``(x1 cos a - x2 sin a, x2 cos a + x1 sin a)``.

Example:

>>> import torch
>>> import transformer_engine.pytorch as te
>>> rope = te.RotaryPositionEmbedding(64)
>>> freqs = rope(128)                       # [128, 1, 1, 64] float32
>>> q = torch.randn(16, 2, 4, 64)           # [s, b, h, d]
>>> te.apply_rotary_pos_emb(q, freqs).shape
torch.Size([16, 2, 4, 64])
"""

from __future__ import annotations

from typing import Optional

import torch

from . import context_parallel_thd
from .ops import rope as rope_ops

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]

TENSOR_FORMATS = ("sbhd", "bshd", "thd")


class RotaryPositionEmbedding(torch.nn.Module):
    """The rotation angles of rotary position embedding.

    Args:
        dim: the head dimension the embedding is made for.
        rotary_percent: the fraction of ``dim`` that is rotated; ``rot_dim = int(dim *
            rotary_percent)`` must be even and positive.
        seq_len_interpolation_factor: positions are divided by it (position interpolation,
            https://arxiv.org/abs/2306.15595).
        pretrained_max_position_embeddings: the sequence length the model was trained at;
            with ``seq_len_interpolation_factor``, a ``max_seq_len`` beyond
            ``pretrained_max_position_embeddings * seq_len_interpolation_factor`` squeezes the
            positions into the pretrained range instead.
        rotary_base: the base of the geometric progression of frequencies.
        interleaved: lay the angles out for interleaved feature pairs (see the module's
            docstring).
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ):
        super().__init__()
        rot_dim = int(dim * rotary_percent)
        if rot_dim <= 0 or rot_dim % 2:
            raise ValueError(
                "RotaryPositionEmbedding: int(dim * rotary_percent) must be even and positive, "
                f"got {rot_dim} (dim={dim}, rotary_percent={rotary_percent})")
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor <= 0:
            raise ValueError("RotaryPositionEmbedding: seq_len_interpolation_factor must be "
                             f"positive, got {seq_len_interpolation_factor}")
        self.dim = dim
        self.rot_dim = rot_dim
        self.rotary_percent = rotary_percent
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        exponent = torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim
        # Not persistent: it follows from the constructor's arguments, so checkpoints need not
        # carry it (and a checkpoint cannot contradict them).
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** exponent), persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """Angles ``[max_seq_len, 1, 1, rot_dim]`` (float32) of positions
        ``offset .. offset + max_seq_len - 1``."""
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32)
        seq = seq + offset
        factor = self.seq_len_interpolation_factor
        if factor is not None:
            pretrained = self.pretrained_max_position_embeddings
            if pretrained is not None and max_seq_len > pretrained * factor:
                seq = seq * (pretrained / max_seq_len)
            else:
                seq = seq / factor
        half = torch.outer(seq, self.inv_freq.float())
        if self.interleaved:
            angles = torch.stack((half, half), dim=-1).reshape(max_seq_len, self.rot_dim)
        else:
            angles = torch.cat((half, half), dim=-1)
        return angles.reshape(max_seq_len, 1, 1, self.rot_dim)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, rot_dim={self.rot_dim}, rotary_base={self.rotary_base}, "
                f"interleaved={self.interleaved}")


def checked_angles(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str, cu_seqlens,
                   cp_size: int, start_positions) -> torch.Tensor:
    """The angles as a matrix [rows, rot_dim], after checking every argument."""
    op = "apply_rotary_pos_emb"
    if cp_size != 1 and (tensor_format == "thd" or start_positions is not None):
        raise NotImplementedError(f"{op}: context parallelism (cp_size={cp_size}) takes "
                                  "tensor_format 'sbhd' or 'bshd' without start_positions")
    if tensor_format not in TENSOR_FORMATS:
        raise ValueError(f"{op}: tensor_format must be one of {TENSOR_FORMATS}, "
                         f"got {tensor_format!r}")
    want = 3 if tensor_format == "thd" else 4
    if t.dim() != want:
        raise ValueError(f"{op}: t must have {want} dimensions ({tensor_format}), "
                         f"got shape {list(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: t must be a floating-point tensor, got {t.dtype}")
    if freqs.dtype != torch.float32:
        raise TypeError(f"{op}: freqs must be float32, got {freqs.dtype}")
    if freqs.dim() not in (2, 4) or (freqs.dim() == 4 and freqs.shape[1:3] != (1, 1)):
        raise ValueError(f"{op}: freqs must be [s, 1, 1, rot_dim] or [s, rot_dim], "
                         f"got shape {list(freqs.shape)}")
    rot_dim = freqs.shape[-1]
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > t.shape[-1]:
        raise ValueError(f"{op}: freqs' last dimension (rot_dim) must be even, positive and at "
                         f"most t's head dimension {t.shape[-1]}, got {rot_dim}")
    if freqs.device != t.device:
        raise ValueError(f"{op}: freqs must be on t's device {t.device}, got {freqs.device}")
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError(f"{op}: cu_seqlens must be given for tensor_format 'thd', got None")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"{op}: cu_seqlens must be an integer vector [batch + 1], got "
                             f"shape {list(cu_seqlens.shape)}, {cu_seqlens.dtype}")
        batch = cu_seqlens.numel() - 1
    else:
        batch = t.shape[1] if tensor_format == "sbhd" else t.shape[0]
        seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
        if start_positions is None and seq > freqs.shape[0]:
            raise ValueError(f"{op}: freqs must have at least the sequence length {seq} rows, "
                             f"got {freqs.shape[0]}")
    if start_positions is not None and (
            start_positions.dim() != 1 or start_positions.numel() != batch
            or start_positions.is_floating_point()):
        raise ValueError(f"{op}: start_positions must be an integer vector [{batch}], got "
                         f"shape {list(start_positions.shape)}, {start_positions.dtype}")
    return freqs.reshape(freqs.shape[0], rot_dim)


def _rotate(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x`` [..., rot_dim] (float32) rotated by ``angles`` broadcast against it."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        partner = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        partner = torch.cat((-x2, x1), dim=-1)
    return x * torch.cos(angles) + partner * torch.sin(angles)


def _token_angles(freqs2d: torch.Tensor, t: torch.Tensor, tensor_format: str, cu_seqlens,
                  start_positions) -> torch.Tensor:
    """The angle rows of every token, shaped to broadcast against ``t``'s [..., h, rot_dim]."""
    if tensor_format == "thd":
        tokens = torch.arange(t.shape[0], device=t.device)
        bounds = cu_seqlens.to(device=t.device, dtype=torch.long)
        # Sequence of each token without a data-dependent shape (torch.compile traces it).
        seq_id = torch.searchsorted(bounds[1:], tokens, right=True)
        pos = tokens - bounds[seq_id]
        if start_positions is not None:
            pos = pos + start_positions.to(device=t.device, dtype=torch.long)[seq_id]
        return freqs2d[pos].unsqueeze(1)                                   # [t, 1, r]
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    if start_positions is None:
        rows = freqs2d[:seq].unsqueeze(1)                                  # [s, 1, r]
        return rows.unsqueeze(1) if tensor_format == "sbhd" else rows      # sbhd: [s, 1, 1, r]
    pos = start_positions.to(device=t.device, dtype=torch.long)[:, None]
    pos = pos + torch.arange(seq, device=t.device)                         # [b, s]
    rows = freqs2d[pos].unsqueeze(2)                                       # [b, s, 1, r]
    return rows.transpose(0, 1) if tensor_format == "sbhd" else rows


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _FusedRotary(torch.autograd.Function):
    """The core's fused kernels: one op forward, one backward (the transposed rotation of the
    gradient). ``freqs`` gets no gradient on this path."""

    @staticmethod
    def forward(ctx, t, freqs2d, tensor_format, interleaved, cu_seqlens, start_positions):
        ctx.save_for_backward(freqs2d, cu_seqlens, start_positions)
        ctx.layout = (tensor_format, interleaved)
        return rope_ops.rope_forward(t, freqs2d, tensor_format, interleaved, cu_seqlens,
                                     start_positions)

    @staticmethod
    def backward(ctx, grad_output):
        freqs2d, cu_seqlens, start_positions = ctx.saved_tensors
        tensor_format, interleaved = ctx.layout
        grad_input = rope_ops.rope_backward(grad_output, freqs2d, tensor_format, interleaved,
                                            cu_seqlens, start_positions)
        return grad_input, None, None, None, None, None


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    start_positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Rotate the leading ``rot_dim = freqs.shape[-1]`` features of each head of ``t``.

    Args:
        t: [s, b, h, d] (``"sbhd"``), [b, s, h, d] (``"bshd"``) or [t, h, d] (``"thd"``:
            sequences packed one after another, bounded by ``cu_seqlens``).
        freqs: float32 angles [s_max, 1, 1, rot_dim] (``RotaryPositionEmbedding``'s output) or
            [s_max, rot_dim]; row ``p`` is position ``p``.
        tensor_format: the layout of ``t``.
        interleaved: the feature pairs are ``(2i, 2i + 1)`` rather than ``(i, i + rot_dim/2)``;
            ``freqs`` must be laid out the same way.
        fused: run the core's fused kernels (one op each way; float32, bfloat16 or float16
            ``t``; no gradient for ``freqs``) rather than the composition of torch operations,
            which is the reference the fused path is tested against.
        cu_seqlens: for ``"thd"``, the int32/int64 offsets [batch + 1] of the packed sequences;
            each sequence's tokens take positions 0, 1, ... Ignored for ``"sbhd"`` and
            ``"bshd"`` (as by NVIDIA's, whose programs pass their batch's offsets whatever the
            layout).
        cp_size, cp_rank: context parallelism: ``t`` holds this rank's chunks ``cp_rank``
            and ``2 * cp_size - 1 - cp_rank`` of the sequence (of every sequence for
            ``"thd"``, whose ``cu_seqlens`` are then the global padded offsets, each
            sequence's rows a multiple of ``2 * cp_size``), ``freqs`` the whole sequence's
            angles (as te.DotProductAttention's ``cp_group`` splits it).
        start_positions: optional integer [batch]: token ``i`` of sequence ``b`` takes
            position ``start_positions[b] + i`` (decoding with a KV cache). ``freqs`` must
            have a row for every position used.

    Returns:
        A tensor of ``t``'s shape and dtype; the arithmetic runs in float32.
    """
    if tensor_format in ("sbhd", "bshd"):
        cu_seqlens = None  # every sequence starts at row 0 of its batch entry
    if not isinstance(cp_size, int) or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"apply_rotary_pos_emb: cp_size must be a positive int and cp_rank in "
                         f"[0, cp_size), got cp_size={cp_size!r}, cp_rank={cp_rank!r}")
    if cp_size > 1 and tensor_format in ("sbhd", "bshd"):
        # t holds this rank's chunks cp_rank and 2*cp_size-1-cp_rank of the sequence
        # (context_parallel.py): their rows of the whole sequence's angles.
        seq = t.shape[0 if tensor_format == "sbhd" else 1]
        if seq % 2:
            raise ValueError(f"apply_rotary_pos_emb: under context parallelism t holds two "
                             f"equal chunks of the sequence, so an even length, got {seq}")
        c = seq // 2
        first, second = cp_rank, 2 * cp_size - 1 - cp_rank
        if freqs.shape[0] < (second + 1) * c:
            raise ValueError(f"apply_rotary_pos_emb: freqs must cover the whole sequence "
                             f"({2 * cp_size * c} positions) under context parallelism, got "
                             f"{freqs.shape[0]}")
        freqs = torch.cat([freqs[first * c:(first + 1) * c], freqs[second * c:(second + 1) * c]])
    elif cp_size > 1 and tensor_format == "thd" and cu_seqlens is not None:
        if start_positions is not None:
            raise NotImplementedError("apply_rotary_pos_emb: context parallelism of packed "
                                      "(thd) sequences takes no start_positions")
        # this rank's 2 * batch chunks (context_parallel_thd.py), each from its first position
        _, cu_seqlens, starts = context_parallel_thd.chunks(cu_seqlens, cp_size, cp_rank)
        start_positions, cp_size = starts.flatten(), 1
    freqs2d = checked_angles(t, freqs, tensor_format, cu_seqlens, cp_size, start_positions)
    if fused:
        if t.dtype not in _FUSED_DTYPES:
            raise TypeError("apply_rotary_pos_emb: t must be float32, bfloat16 or float16 with "
                            f"fused=True, got {t.dtype}")
        return _FusedRotary.apply(t, freqs2d, tensor_format, interleaved, cu_seqlens,
                                  start_positions)
    rot_dim = freqs2d.shape[-1]
    angles = _token_angles(freqs2d, t, tensor_format, cu_seqlens, start_positions)
    rotated = _rotate(t[..., :rot_dim].float(), angles, interleaved).to(t.dtype)
    if rot_dim == t.shape[-1]:
        return rotated
    return torch.cat((rotated, t[..., rot_dim:]), dim=-1)
