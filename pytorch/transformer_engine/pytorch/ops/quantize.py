"""Quantization custom ops (``transformer_engine::*``): per-tensor with a given scale (delayed
scaling), per-tensor from the tensor's own amax (current scaling), block-scaled, and back.

Every op returns fresh outputs (quantize_delayed also raises its amax history slot in place,
a declared mutation), so torch.compile traces it as one node and a CUDA graph captures it; the
``register_fake`` beside each gives the output shapes from the input shapes alone. Inputs are
matrices [M, K] (callers flatten leading dimensions). An output that was not asked for comes
back as an empty uint8 tensor. The batches of a grouped layer's casts (eager mode only) are
plain functions beside them.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import (
    block_grid,
    check_fp8_dtype,
    check_mode,
    core,
    custom_op,
    history_slot,
    placeholder,
    raw,
    raw_element,
    stream_of,
    te_dtype,
    te_mode,
)

_NS = "transformer_engine"


def _fp8_outputs(x: torch.Tensor, rowwise: bool, columnwise: bool):
    m, k = x.shape
    data = x.new_empty((m, k), dtype=torch.uint8) if rowwise else placeholder(x)
    col = x.new_empty((k, m), dtype=torch.uint8) if columnwise else placeholder(x)
    return data, col


def _check_matrix(op: str, x: torch.Tensor, rowwise: bool, columnwise: bool) -> None:
    if x.dim() != 2:
        raise ValueError(f"{op}: input must be a matrix [M, K], got shape {list(x.shape)}")
    if not (rowwise or columnwise):
        raise ValueError(f"{op}: rowwise or columnwise must be True, got both False")


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, dtype=torch.float32)


_ROW = 4  # floats per tensor in _scalar_rows: 16 bytes, the alignment cuBLASLt reads scales at


def _scalar_rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One fp32 buffer of n rows of _ROW floats for n tensors' scalars (element 0 of row i its
    scale_inv, the others free), and the [1] scale_inv views: one allocation where n would
    cost n (host time on the GPU)."""
    rows = x.new_empty(n * _ROW, dtype=torch.float32)
    return rows, [rows[_ROW * i:_ROW * i + 1] for i in range(n)]


# ------------------------------------------------------------ per-tensor, given scale


@custom_op(f"{_NS}::quantize", mutates_args=())
def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: str, rowwise: bool,
             columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 data of ``x * scale`` (row-wise [M, K] and/or column-wise [K, M], written in one
    pass), ``scale_inv = 1/scale`` and ``amax = max|x|``; ``scale`` is [1] fp32."""
    _check_matrix("quantize", x, rowwise, columnwise)
    check_fp8_dtype("quantize", fp8_dtype)
    c = core()
    x = x.contiguous()  # kept alive across the call: raw() holds only its pointer
    data, col = _fp8_outputs(x, rowwise, columnwise)
    scale_inv, amax = _scalar(x), _scalar(x)
    out = c.Tensor(raw(data) if rowwise else None, dtype=te_dtype(fp8_dtype), scale=raw(scale),
                   scale_inv=raw(scale_inv), amax=raw(amax),
                   columnwise_data=raw(col) if columnwise else None)
    c.quantize(raw(x), out, stream=stream_of(x))
    return data, col, scale_inv, amax


@quantize.register_fake
def _(x, scale, fp8_dtype, rowwise, columnwise):
    _check_matrix("quantize", x, rowwise, columnwise)
    return (*_fp8_outputs(x, rowwise, columnwise), _scalar(x), _scalar(x))


# ------------------------------------------------------------ delayed scaling, amax recorded


@custom_op(f"{_NS}::quantize_delayed", mutates_args=("amax_history",))
def quantize_delayed(x: torch.Tensor, scales: torch.Tensor, index: int,
                     amax_history: Optional[torch.Tensor], fp8_dtype: str, rowwise: bool,
                     columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delayed scaling: FP8 data of ``x * scales[index]`` (row-wise and/or column-wise) and its
    ``scale_inv``; ``max|x|`` is recorded in place as ``amax_history[0, index] = max(itself,
    max|x|)`` (several forwards of one step keep the largest; the scale update zeroes the slot
    when the history rolls). ``amax_history`` None records nothing (a checkpoint's recompute).

    One core call with no views and no separate amax: the scale and the history slot are
    passed by position, the amax raised by the cast itself (quantize.h, accumulate_amax).
    Returns (data, columnwise_data, scale_inv)."""
    _check_matrix("quantize_delayed", x, rowwise, columnwise)
    check_fp8_dtype("quantize_delayed", fp8_dtype)
    c = core()
    x = x.contiguous()  # kept alive across the call: raw() holds only its pointer
    data, col = _fp8_outputs(x, rowwise, columnwise)
    scale_inv = _scalar(x)
    amax = None
    if amax_history is not None:
        amax = history_slot("quantize_delayed", amax_history, index)
    out = c.Tensor(raw(data) if rowwise else None, dtype=te_dtype(fp8_dtype),
                   scale=raw_element(scales, index), scale_inv=raw(scale_inv), amax=amax,
                   columnwise_data=raw(col) if columnwise else None)
    c.quantize(raw(x), out, accumulate_amax=True, stream=stream_of(x))
    return data, col, scale_inv


@quantize_delayed.register_fake
def _(x, scales, index, amax_history, fp8_dtype, rowwise, columnwise):
    _check_matrix("quantize_delayed", x, rowwise, columnwise)
    return (*_fp8_outputs(x, rowwise, columnwise), _scalar(x))


# ------------------------------------------------------------ per-tensor, current scaling


def _current_cast(c, rx, rdata, rcol, fmt, rscale, rsinv, ramax, pow2: bool, epsilon: float,
                  stream: int):
    """Current scaling's first two core calls on x (fast forms): its amax, then the scale and
    scale_inv from it; returns the output the cast then writes (without the amax: it is known,
    the cast need not reduce it again)."""
    c.compute_amax(rx, c.Tensor(amax=ramax), stream=stream)
    c.compute_scale_from_amax(c.Tensor(rdata, dtype=fmt, scale=rscale, scale_inv=rsinv,
                                       amax=ramax, columnwise_data=rcol),
                              force_pow2_scales=pow2, amax_epsilon=epsilon, stream=stream)
    return c.Tensor(rdata, dtype=fmt, scale=rscale, scale_inv=rsinv, columnwise_data=rcol)


@custom_op(f"{_NS}::quantize_current", mutates_args=())
def quantize_current(
    x: torch.Tensor, fp8_dtype: str, rowwise: bool, columnwise: bool, force_pow2_scales: bool,
    amax_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: amax of ``x``, the scale from it (``compute_scale_from_amax``) and the
    FP8 data with that scale. Returns (data, columnwise_data, scale, scale_inv, amax)."""
    _check_matrix("quantize_current", x, rowwise, columnwise)
    check_fp8_dtype("quantize_current", fp8_dtype)
    c = core()
    x = x.contiguous()
    stream = stream_of(x)
    data, col = _fp8_outputs(x, rowwise, columnwise)
    scale, scale_inv, amax = _scalar(x), _scalar(x), _scalar(x)
    # Each fast form once: the three calls share them.
    rx, rscale, rsinv, ramax = raw(x), raw(scale), raw(scale_inv), raw(amax)
    rdata, rcol = (raw(data) if rowwise else None), (raw(col) if columnwise else None)
    cast = _current_cast(c, rx, rdata, rcol, te_dtype(fp8_dtype), rscale, rsinv, ramax,
                         force_pow2_scales, amax_epsilon, stream)
    c.quantize(rx, cast, stream=stream)
    return data, col, scale, scale_inv, amax


@quantize_current.register_fake
def _(x, fp8_dtype, rowwise, columnwise, force_pow2_scales, amax_epsilon):
    _check_matrix("quantize_current", x, rowwise, columnwise)
    return (*_fp8_outputs(x, rowwise, columnwise), _scalar(x), _scalar(x), _scalar(x))


@custom_op(f"{_NS}::current_scale", mutates_args=())
def current_scale(x: torch.Tensor, fp8_dtype: str, force_pow2_scales: bool,
                  amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling's scale of ``x`` without the cast: (scale, amax), each [1] fp32, from
    the same two core calls as quantize_current. For a kernel that casts with a given scale
    and computes something else in the same pass (the fused bias gradient + cast)."""
    check_fp8_dtype("current_scale", fp8_dtype)
    c = core()
    x = x.contiguous()
    stream = stream_of(x)
    scale, scale_inv, amax = _scalar(x), _scalar(x), _scalar(x)
    ramax = raw(amax)
    c.compute_amax(raw(x), c.Tensor(amax=ramax), stream=stream)
    # The core reads the FP8 format from the data slot: an empty buffer of that format.
    fmt = placeholder(x)
    out = c.Tensor(raw(fmt), dtype=te_dtype(fp8_dtype), scale=raw(scale),
                   scale_inv=raw(scale_inv), amax=ramax)
    c.compute_scale_from_amax(out, force_pow2_scales=force_pow2_scales,
                              amax_epsilon=amax_epsilon, stream=stream)
    return scale, amax


@current_scale.register_fake
def _(x, fp8_dtype, force_pow2_scales, amax_epsilon):
    return _scalar(x), _scalar(x)


# ------------------------------------------------------------ batches (eager mode only)
#
# The casts of a grouped layer's groups, each with its own scale, in one core call: one kernel
# launch on the GPU where every cast has a column-wise copy, where one op per group costs each
# group its host time. Plain functions, not custom ops: their scale_invs are rows of one buffer
# (a custom op's outputs must not alias), and a graph torch.compile traces calls the ops above
# group by group, paying no host time per call of its own.


def quantize_delayed_many(xs: list[torch.Tensor], scales: list[torch.Tensor], index: int,
                          amax_histories: list[torch.Tensor], fp8_dtype: str, rowwise: bool,
                          columnwise: bool) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                     list[torch.Tensor]]:
    """:func:`quantize_delayed` of each ``xs[i]`` with ``scales[i][index]``, raising
    ``amax_histories[i][0, index]``, in one core call: the same bits as the calls one by one.
    Returns (datas, columnwise datas, scale_invs)."""
    n = len(xs)
    if len(scales) != n or len(amax_histories) != n:
        raise ValueError(f"quantize_delayed_many: xs, scales and amax_histories must be as many, "
                         f"got {n}, {len(scales)} and {len(amax_histories)}")
    check_fp8_dtype("quantize_delayed_many", fp8_dtype)
    if n == 0:
        return [], [], []
    c = core()
    fmt = te_dtype(fp8_dtype)
    xs = [x.contiguous() for x in xs]  # kept alive across the call: raw() holds pointers
    rows, sinvs = _scalar_rows(xs[0], n)
    datas, cols, ins, outs = [], [], [], []
    for i, (x, scale, history) in enumerate(zip(xs, scales, amax_histories, strict=True)):
        _check_matrix("quantize_delayed_many", x, rowwise, columnwise)
        data, col = _fp8_outputs(x, rowwise, columnwise)
        ins.append(raw(x))
        outs.append(c.Tensor(raw(data) if rowwise else None, dtype=fmt,
                             scale=raw_element(scale, index),
                             scale_inv=raw_element(rows, _ROW * i),
                             amax=history_slot("quantize_delayed_many", history, index),
                             columnwise_data=raw(col) if columnwise else None))
        datas.append(data)
        cols.append(col)
    c.quantize_many(ins, outs, accumulate_amax=True, stream=stream_of(xs[0]))
    return datas, cols, sinvs


def quantize_current_many(xs: list[torch.Tensor], fp8_dtype: str, rowwise: bool,
                          columnwise: bool, force_pow2_scales: bool, amax_epsilon: float
                          ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`quantize_current` of each ``xs[i]`` (a batch, see above): each amax and scale by
    its own core calls, the casts in one, the same bits as the calls one by one. Returns
    (datas, columnwise datas, scale_invs)."""
    check_fp8_dtype("quantize_current_many", fp8_dtype)
    n = len(xs)
    if n == 0:
        return [], [], []
    c = core()
    fmt = te_dtype(fp8_dtype)
    xs = [x.contiguous() for x in xs]  # kept alive across the calls: raw() holds pointers
    stream = stream_of(xs[0])
    rows, sinvs = _scalar_rows(xs[0], n)  # per row: scale_inv, scale, amax
    datas, cols, ins, outs = [], [], [], []
    for i, x in enumerate(xs):
        _check_matrix("quantize_current_many", x, rowwise, columnwise)
        data, col = _fp8_outputs(x, rowwise, columnwise)
        rx = raw(x)
        rsinv, rscale, ramax = (raw_element(rows, _ROW * i + j) for j in range(3))
        rdata, rcol = (raw(data) if rowwise else None), (raw(col) if columnwise else None)
        ins.append(rx)
        outs.append(_current_cast(c, rx, rdata, rcol, fmt, rscale, rsinv, ramax,
                                  force_pow2_scales, amax_epsilon, stream))
        datas.append(data)
        cols.append(col)
    c.quantize_many(ins, outs, stream=stream)
    return datas, cols, sinvs


# ------------------------------------------------------------ block scaling


def _block_outputs(x: torch.Tensor, mode: str, rowwise: bool, columnwise: bool):
    m, k = x.shape
    data, col = _fp8_outputs(x, rowwise, columnwise)
    f32 = torch.float32
    sinv = x.new_empty(block_grid(m, k, mode), dtype=f32) if rowwise else placeholder(x)
    col_sinv = x.new_empty(block_grid(k, m, mode), dtype=f32) if columnwise else placeholder(x)
    return data, sinv, col, col_sinv


@custom_op(f"{_NS}::quantize_block", mutates_args=())
def quantize_block(
    x: torch.Tensor, fp8_dtype: str, scaling_mode: str, rowwise: bool, columnwise: bool,
    force_pow2_scales: bool, amax_epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 (``block_1x128`` or ``block_128x128``): returns (data, scale_inv,
    columnwise_data, columnwise_scale_inv), the column-wise copy being the transpose [K, M]
    blocked like row-wise data (tensor.h)."""
    _check_matrix("quantize_block", x, rowwise, columnwise)
    check_fp8_dtype("quantize_block", fp8_dtype)
    if scaling_mode not in ("block_1x128", "block_128x128"):
        raise ValueError("quantize_block: scaling_mode must be 'block_1x128' or "
                         f"'block_128x128', got {scaling_mode!r}")
    c = core()
    x = x.contiguous()
    data, sinv, col, col_sinv = _block_outputs(x, scaling_mode, rowwise, columnwise)
    out = c.Tensor(raw(data) if rowwise else None, dtype=te_dtype(fp8_dtype),
                   scaling_mode=te_mode(scaling_mode), scale_inv=raw(sinv) if rowwise else None,
                   columnwise_data=raw(col) if columnwise else None,
                   columnwise_scale_inv=raw(col_sinv) if columnwise else None)
    c.quantize(raw(x), out, force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon,
               stream=stream_of(x))
    return data, sinv, col, col_sinv


@quantize_block.register_fake
def _(x, fp8_dtype, scaling_mode, rowwise, columnwise, force_pow2_scales, amax_epsilon):
    _check_matrix("quantize_block", x, rowwise, columnwise)
    return _block_outputs(x, scaling_mode, rowwise, columnwise)


# ------------------------------------------------------------ back to high precision


@custom_op(f"{_NS}::dequantize", mutates_args=())
def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, fp8_dtype: str, scaling_mode: str,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_value * scale_inv`` in ``out_dtype`` (fp32/fp16/bf16), data of any shape."""
    check_fp8_dtype("dequantize", fp8_dtype)
    check_mode("dequantize", scaling_mode)
    c = core()
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    data, scale_inv = data.contiguous(), scale_inv.contiguous()
    src = c.Tensor(raw(data), dtype=te_dtype(fp8_dtype), scaling_mode=te_mode(scaling_mode),
                   scale_inv=raw(scale_inv))
    c.dequantize(src, raw(out), stream=stream_of(data))
    return out


@dequantize.register_fake
def _(data, scale_inv, fp8_dtype, scaling_mode, out_dtype):
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


@custom_op(f"{_NS}::transpose", mutates_args=())
def transpose(data: torch.Tensor) -> torch.Tensor:
    """The transpose [K, M] of a [M, K] matrix of raw elements (FP8 bytes keep their scale)."""
    if data.dim() != 2:
        raise ValueError(f"transpose: data must be a matrix [M, K], got shape {list(data.shape)}")
    out = data.new_empty((data.shape[1], data.shape[0]))
    data = data.contiguous()
    core().transpose(raw(data), raw(out), stream=stream_of(data))
    return out


@transpose.register_fake
def _(data):
    return data.new_empty((data.shape[1], data.shape[0]))


@custom_op(f"{_NS}::amax", mutates_args=())
def amax(x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|x| as [1] fp32 (NaN when x holds a NaN). ``gate`` ([1] fp32, the core's gate,
    tensor.h): the call runs only while it holds 0, else gives 0 after one early return."""
    c = core()
    out = _scalar(x)
    x = x.contiguous()
    c.compute_amax(raw(x), c.Tensor(amax=raw(out), gate=None if gate is None else raw(gate)),
                   stream=stream_of(x))
    return out


@amax.register_fake
def _(x, gate=None):
    return _scalar(x)
