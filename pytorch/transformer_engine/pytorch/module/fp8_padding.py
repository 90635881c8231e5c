"""``te.Fp8Padding`` and ``te.Fp8Unpadding``: NVIDIA's pair around a grouped GEMM, which pads
each group's rows (tokens) to a multiple of the FP8 GEMM's alignment and takes the padding off
again.

Here the FP8 GEMMs accept any token count (they pad inside, linear_fn.pad_gemm_operands), so
the pair is not needed for correctness; it is provided for programs written for NVIDIA TE,
with the same contract: the padded rows are zeros, the output of ``Fp8Padding`` has
``padded_m_splits`` rows per group, and ``Fp8Unpadding`` with the original ``m_splits`` gives
back exactly the unpadded rows. Both are differentiable (the padding's gradient is dropped).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["Fp8Padding", "Fp8Unpadding"]

# The row alignment of the FP8 GEMMs' operands (NVIDIA's default for per-tensor and block
# scaling; MXFP8 asks for 32).
DEFAULT_ALIGN = 16


def _check(op: str, inp: torch.Tensor, m_splits: Sequence[int], num_gemms: int,
           rows: int) -> list[int]:
    splits = [int(m) for m in m_splits]
    if len(splits) != num_gemms or any(m < 0 for m in splits):
        raise ValueError(f"{op}: m_splits must hold num_gemms={num_gemms} sizes >= 0, got "
                         f"{list(m_splits)}")
    if inp.dim() != 2 or inp.shape[0] != rows:
        raise ValueError(f"{op}: inp must be [{rows} rows, features] for m_splits {splits}, "
                         f"got {list(inp.shape)}")
    return splits


def _check_module(op: str, num_gemms: int, align_size: Optional[int]) -> int:
    if not isinstance(num_gemms, int) or num_gemms < 1:
        raise ValueError(f"{op}: num_gemms must be an int >= 1, got {num_gemms!r}")
    align = DEFAULT_ALIGN if align_size is None else align_size
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"{op}: align_size must be an int >= 1 or None, got {align_size!r}")
    return align


class Fp8Padding(torch.nn.Module):
    """``forward(inp, m_splits) -> (padded, padded_m_splits)``: each of the ``num_gemms``
    row groups of ``inp`` padded with zero rows to a multiple of ``align_size`` (default 16)."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        self.align_size = _check_module("te.Fp8Padding", num_gemms, align_size)
        self.num_gemms = num_gemms

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]):
        splits = [int(m) for m in m_splits]
        splits = _check("te.Fp8Padding", inp, splits, self.num_gemms, sum(splits))
        a = self.align_size
        padded = [-(-m // a) * a for m in splits]
        if padded == splits:
            return inp, padded
        parts = []
        for chunk, m, p in zip(torch.split(inp, splits), splits, padded, strict=True):
            parts.append(chunk)
            if p > m:
                parts.append(inp.new_zeros((p - m, inp.shape[1])))
        return torch.cat(parts), padded


class Fp8Unpadding(torch.nn.Module):
    """``forward(inp, m_splits) -> unpadded``: the padding that :class:`Fp8Padding` added to
    the row groups of ``inp`` (``m_splits``: the sizes before padding) taken off again."""

    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        self.align_size = _check_module("te.Fp8Unpadding", num_gemms, align_size)
        self.num_gemms = num_gemms

    def forward(self, inp: torch.Tensor, m_splits: Sequence[int]) -> torch.Tensor:
        a = self.align_size
        splits = [int(m) for m in m_splits]
        padded = [-(-m // a) * a for m in splits]
        splits = _check("te.Fp8Unpadding", inp, splits, self.num_gemms, sum(padded))
        if padded == splits:
            return inp
        chunks = torch.split(inp, padded)
        return torch.cat([c[:m] for c, m in zip(chunks, splits, strict=True)])
