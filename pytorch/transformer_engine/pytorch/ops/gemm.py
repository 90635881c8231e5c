"""The FP8 GEMM as a custom op: ``D = A @ B^T`` with both operands K-major ("TN")."""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import (
    check_mode,
    core,
    custom_op,
    raw,
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
