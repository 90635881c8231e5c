"""The FP8 GEMM as custom ops: ``D = A @ B^T`` with both operands K-major ("TN"), D in high
precision (``gemm_fp8``) or in FP8 for an FP8 consumer (``gemm_fp8_to_fp8``)."""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import (
    check_fp8_dtype,
    check_mode,
    core,
    custom_op,
    raw,
    raw_element,
    raw_workspace_for,
    stream_of,
    te_dtype,
    te_mode,
)

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _operand(c, data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: str, mode: str):
    return c.Tensor(raw(data), dtype=te_dtype(fp8_dtype), scaling_mode=te_mode(mode),
                    scale_inv=raw(scale_inv))


def _check(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: a and b must be matrices, got shapes {list(a.shape)} and "
                         f"{list(b.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"gemm: a [M, K] and b [N, K] must share K, got shapes "
                         f"{list(a.shape)} and {list(b.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"gemm: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


@custom_op("transformer_engine::gemm_fp8", mutates_args=())
def gemm_fp8(
    a: torch.Tensor, a_scale_inv: torch.Tensor, a_fp8_dtype: str, a_scaling_mode: str,
    b: torch.Tensor, b_scale_inv: torch.Tensor, b_fp8_dtype: str, b_scaling_mode: str,
    out_dtype: torch.dtype, bias: Optional[torch.Tensor], use_split_accumulator: bool,
) -> torch.Tensor:
    """``D[M, N] = dequant(a)[M, K] @ dequant(b)[N, K]^T (+ bias)`` in ``out_dtype``, FP8
    operands (uint8 data with their scale_inv by scaling mode), fp32 accumulation."""
    _check(a, b, out_dtype)
    check_mode("gemm", a_scaling_mode)
    check_mode("gemm", b_scaling_mode)
    c = core()
    d = a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
    ws = raw_workspace_for(a)
    # Locals keep every tensor alive across the call: raw() holds bare pointers.
    a, b = a.contiguous(), b.contiguous()
    a_scale_inv, b_scale_inv = a_scale_inv.contiguous(), b_scale_inv.contiguous()
    bias = None if bias is None else bias.contiguous()
    c.gemm(_operand(c, a, a_scale_inv, a_fp8_dtype, a_scaling_mode),
           _operand(c, b, b_scale_inv, b_fp8_dtype, b_scaling_mode), raw(d),
           bias=None if bias is None else raw(bias), transpose_a=False, transpose_b=True,
           use_split_accumulator=use_split_accumulator,
           workspace=ws, stream=stream_of(a))
    return d


@gemm_fp8.register_fake
def _(a, a_scale_inv, a_fp8_dtype, a_scaling_mode, b, b_scale_inv, b_fp8_dtype,
      b_scaling_mode, out_dtype, bias, use_split_accumulator):
    _check(a, b, out_dtype)
    return torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device)


@custom_op("transformer_engine::gemm_fp8_to_fp8", mutates_args=())
def gemm_fp8_to_fp8(
    a: torch.Tensor, a_scale_inv: torch.Tensor, a_fp8_dtype: str,
    b: torch.Tensor, b_scale_inv: torch.Tensor, b_fp8_dtype: str,
    out_fp8_dtype: str, out_scales: torch.Tensor, out_index: int,
    bias: Optional[torch.Tensor], use_split_accumulator: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``D = dequant(a) @ dequant(b)^T (+ bias)`` written in FP8 with the scale
    ``out_scales[out_index]`` (per-tensor operands only; the epilogue casts the fp32 result,
    so D never exists in high precision). Returns (D as uint8 [M, N], its scale_inv [1], the
    amax [1] of the fp32 result before the cast). A bias must be bf16 (cuBLASLt's rule)."""
    _check(a, b, torch.float32)
    check_fp8_dtype("gemm", out_fp8_dtype)
    if not 0 <= out_index < out_scales.numel():
        raise IndexError(f"gemm: out_index must be in [0, {out_scales.numel()}), got {out_index}")
    if bias is not None and bias.dtype != torch.bfloat16:
        raise TypeError(f"gemm: the bias of an FP8 output must be bfloat16, got {bias.dtype}")
    c = core()
    d = a.new_empty((a.shape[0], b.shape[0]), dtype=torch.uint8)
    scale_inv, amax = a.new_empty(1, dtype=torch.float32), a.new_empty(1, dtype=torch.float32)
    ws = raw_workspace_for(a)
    a, b = a.contiguous(), b.contiguous()
    a_scale_inv, b_scale_inv = a_scale_inv.contiguous(), b_scale_inv.contiguous()
    out_scales = out_scales.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = c.Tensor(raw(d), dtype=te_dtype(out_fp8_dtype), scale=raw_element(out_scales, out_index),
                   scale_inv=raw(scale_inv), amax=raw(amax))
    c.gemm(_operand(c, a, a_scale_inv, a_fp8_dtype, "tensor"),
           _operand(c, b, b_scale_inv, b_fp8_dtype, "tensor"), out,
           bias=None if bias is None else raw(bias), transpose_a=False, transpose_b=True,
           use_split_accumulator=use_split_accumulator, workspace=ws, stream=stream_of(a))
    return d, scale_inv, amax


@gemm_fp8_to_fp8.register_fake
def _(a, a_scale_inv, a_fp8_dtype, b, b_scale_inv, b_fp8_dtype, out_fp8_dtype, out_scales,
      out_index, bias, use_split_accumulator):
    _check(a, b, torch.float32)
    return (a.new_empty((a.shape[0], b.shape[0]), dtype=torch.uint8),
            a.new_empty(1, dtype=torch.float32), a.new_empty(1, dtype=torch.float32))


def _check_grouped(a: list, b: list, out_dtype: torch.dtype) -> int:
    """The common N of the groups' ``a_g [M_g, K_g] @ b_g [N, K_g]^T``."""
    if len(a) != len(b) or not a:
        raise ValueError(f"grouped_gemm: a and b must be non-empty lists of one matrix per group, "
                         f"got {len(a)} and {len(b)}")
    n = b[0].shape[0] if b[0].dim() == 2 else -1
    for i, (x, w) in enumerate(zip(a, b, strict=True)):
        if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.shape[0] != n:
            raise ValueError(f"grouped_gemm: group {i}: a [M, K] and b [N, K] must share K, and "
                             f"every b must have group 0's N = {n}, got shapes "
                             f"{list(x.shape)} and {list(w.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"grouped_gemm: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    return n


@custom_op("transformer_engine::grouped_gemm_fp8", mutates_args=())
def grouped_gemm_fp8(
    a: list[torch.Tensor], a_scale_inv: list[torch.Tensor], a_fp8_dtype: str,
    a_scaling_mode: str, b: list[torch.Tensor], b_scale_inv: list[torch.Tensor],
    b_fp8_dtype: str, b_scaling_mode: str, out_dtype: torch.dtype,
    bias: list[Optional[torch.Tensor]], use_split_accumulator: bool,
) -> torch.Tensor:
    """The groups' ``D_g = dequant(a_g) @ dequant(b_g)^T (+ bias_g)`` (FP8, each group with
    its own scale_inv in the scaling mode given) in one core call, stacked by rows:
    D [sum M_g, N]. ``bias``: [] for none, else one entry per group (None: that group has
    none)."""
    n = _check_grouped(a, b, out_dtype)
    check_mode("grouped_gemm", a_scaling_mode)
    check_mode("grouped_gemm", b_scaling_mode)
    c = core()
    rows = [x.shape[0] for x in a]
    d = a[0].new_empty((sum(rows), n), dtype=out_dtype)
    ws = raw_workspace_for(d)
    a = [x.contiguous() for x in a]
    b = [w.contiguous() for w in b]
    a_scale_inv = [s.contiguous() for s in a_scale_inv]
    b_scale_inv = [s.contiguous() for s in b_scale_inv]
    bias = [None if x is None else x.contiguous() for x in bias] or None
    outs = list(torch.split(d, rows))  # views: the core writes each group's rows in place
    c.grouped_gemm(
        [_operand(c, x, s, a_fp8_dtype, a_scaling_mode)
         for x, s in zip(a, a_scale_inv, strict=True)],
        [_operand(c, w, s, b_fp8_dtype, b_scaling_mode)
         for w, s in zip(b, b_scale_inv, strict=True)],
        [raw(o) for o in outs],
        bias=None if bias is None else [None if x is None else raw(x) for x in bias],
        transpose_a=False, transpose_b=True, use_split_accumulator=use_split_accumulator,
        workspace=ws, stream=stream_of(d))
    return d


@grouped_gemm_fp8.register_fake
def _(a, a_scale_inv, a_fp8_dtype, a_scaling_mode, b, b_scale_inv, b_fp8_dtype, b_scaling_mode,
      out_dtype, bias, use_split_accumulator):
    n = _check_grouped(a, b, out_dtype)
    return a[0].new_empty((sum(x.shape[0] for x in a), n), dtype=out_dtype)


def _grouped_hp_shapes(a: list, b: list, transpose_a: bool, transpose_b: bool) -> list:
    """(rows, cols) of each group's D = op(a_g) @ op(b_g), checked."""
    if len(a) != len(b) or not a:
        raise ValueError(f"grouped_gemm: a and b must be non-empty lists of one matrix per group, "
                         f"got {len(a)} and {len(b)}")
    shapes = []
    for i, (x, w) in enumerate(zip(a, b, strict=True)):
        if x.dim() != 2 or w.dim() != 2:
            raise ValueError(f"grouped_gemm: group {i}: a and b must be matrices, got shapes "
                             f"{list(x.shape)} and {list(w.shape)}")
        m, k = (x.shape[1], x.shape[0]) if transpose_a else (x.shape[0], x.shape[1])
        kb, n = (w.shape[1], w.shape[0]) if transpose_b else (w.shape[0], w.shape[1])
        if k != kb:
            raise ValueError(f"grouped_gemm: group {i}: the contraction of op(a) ({k}) and op(b) "
                             f"({kb}) must match (shapes {list(x.shape)}, {list(w.shape)})")
        shapes.append((m, n))
    if len({n for _, n in shapes}) != 1:
        raise ValueError(f"grouped_gemm: every group's D must have group 0's columns, got "
                         f"{[n for _, n in shapes]}")
    return shapes


@custom_op("transformer_engine::grouped_gemm", mutates_args=())
def grouped_gemm(a: list[torch.Tensor], b: list[torch.Tensor], transpose_a: bool,
                 transpose_b: bool, bias: list[Optional[torch.Tensor]]) -> torch.Tensor:
    """The groups' ``D_g = op(a_g) @ op(b_g) (+ bias_g)`` in high precision (fp32, fp16 or bf16,
    D in the operands' dtype), one core call, stacked by rows: D [sum rows_g, N]."""
    shapes = _grouped_hp_shapes(a, b, transpose_a, transpose_b)
    c = core()
    d = a[0].new_empty((sum(m for m, _ in shapes), shapes[0][1]))
    ws = raw_workspace_for(d)
    a = [x.contiguous() for x in a]
    b = [w.contiguous() for w in b]
    bias = [None if x is None else x.contiguous() for x in bias] or None
    outs = list(torch.split(d, [m for m, _ in shapes]))
    c.grouped_gemm([raw(x) for x in a], [raw(w) for w in b], [raw(o) for o in outs],
                   bias=None if bias is None else [None if x is None else raw(x) for x in bias],
                   transpose_a=transpose_a, transpose_b=transpose_b, workspace=ws,
                   stream=stream_of(d))
    return d


@grouped_gemm.register_fake
def _(a, b, transpose_a, transpose_b, bias):
    shapes = _grouped_hp_shapes(a, b, transpose_a, transpose_b)
    return a[0].new_empty((sum(m for m, _ in shapes), shapes[0][1]))
