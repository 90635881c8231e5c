"""Attention and the unfused path's scaled masked softmax as custom ops.

``attention_forward`` / ``attention_backward`` are the core's attention entry points (cuDNN,
the CUDA math path, or the CPU reference: ``attention.h``); ``attention_forward_fp8`` takes
E4M3 q, k, v (uint8 bytes) with their descales, and ``attention_backward_fp8`` takes those, the
E4M3 o and an FP8 d_o (E5M2 under the HYBRID recipe) and writes the gradients in FP8 or in a
high-precision dtype.
``scaled_softmax_forward`` / ``scaled_softmax_backward`` are the softmax of the unfused path.
Layouts: ``"bshd"``, ``"sbhd"``, ``"thd"``; masks: ``MASKS``. Like the other ops they are
functional (fresh outputs) with fake implementations for tracing; optional tensors the
custom-op schema cannot take as None travel as empty tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import FP8_DTYPES, core, custom_op, raw, raw_element, raw_view, stream_of

_NS = "transformer_engine"
LAYOUTS = ("bshd", "sbhd", "thd")
MASKS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
         "padding_causal_bottom_right")
CORE_BACKENDS = ("cudnn", "cuda_math", "cpu")
SOFTMAX_MASKS = ("none", "causal", "causal_bottom_right", "arbitrary")


def operand_strides_of(shape, stride, element_size: int) -> Optional[tuple[int, int]]:
    """(row, head) element strides of q, k or v of ``shape`` [s0, s1, heads, dim] (bshd or
    sbhd) and ``stride`` read in place: its tokens (rows s0 * s1 in order) and heads at
    regular strides, each head's elements adjacent, the strides 16-byte multiples (what cuDNN
    takes). None when it must be copied."""
    if len(shape) != 4 or stride[3] != 1 or shape[3] == 0:
        return None
    n0, n1, heads, dim = shape
    head = stride[2] if heads > 1 else dim
    row = stride[1] if n1 > 1 else stride[0] if n0 > 1 else heads * head
    if n0 > 1 and n1 > 1 and stride[0] != n1 * row:
        return None
    if (head < dim or row < (heads - 1) * head + dim or (row * element_size) % 16
            or (head * element_size) % 16):
        return None
    return row, head


def qkv_strides(layout: str, mask: str, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> Optional[list[int]]:
    """The config's strides for q, k, v as they are: [] when all three are contiguous, the six
    strides when the core can read them in place (bshd/sbhd without padding), else None."""
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        return []
    # (each at its address in elements: an offset from address 0, which is aligned)
    size = q.element_size()
    return _in_place_strides(layout, mask, tuple((t.shape, t.stride(), t.data_ptr() // size)
                                                 for t in (q, k, v)), size)


def qkv_strides_of(layout: str, mask: str, views: tuple, element_size: int
                   ) -> Optional[list[int]]:
    """qkv_strides of q, k, v given as (shape, stride, offset) views of one buffer whose first
    element is 16-byte aligned (a fresh allocation): what a traced step, which cannot look at
    tensors, knows of them."""
    if all(_is_contiguous(shape, stride) for shape, stride, _ in views):
        return []
    return _in_place_strides(layout, mask, views, element_size)


def _in_place_strides(layout: str, mask: str, views: tuple, element_size: int
                      ) -> Optional[list[int]]:
    """The six strides of (shape, stride, offset from a 16-byte boundary) views the core reads
    in place, or None: each 16-byte aligned and operand_strides_of's form, bshd/sbhd without
    padding."""
    if layout == "thd" or mask.startswith("padding"):
        return None
    out = []
    for shape, stride, offset in views:
        st = None if (offset * element_size) % 16 else operand_strides_of(shape, stride,
                                                                           element_size)
        if st is None:
            return None
        out += st
    return out


def _is_contiguous(shape, stride) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def config(layout: str, mask: str, window_left: int, window_right: int, softmax_scale: float,
           dropout: float, max_seqlen_q: int, max_seqlen_kv: int, deterministic: bool = False,
           backend: str = "auto", inference: bool = False, strides: Optional[list] = None):
    """The core's AttentionConfig (about a microsecond to build; not cached, since cached
    binding objects would outlive the module at interpreter exit)."""
    if layout not in LAYOUTS:
        raise ValueError(f"attention: qkv_format must be one of {LAYOUTS}, got {layout!r}")
    if mask not in MASKS:
        raise ValueError(f"attention: attn_mask_type must be one of {MASKS}, got {mask!r}")
    if backend not in ("auto",) + CORE_BACKENDS:
        raise ValueError(f"attention: backend must be 'auto' or one of {CORE_BACKENDS}, got "
                         f"{backend!r}")
    c = core()
    return c.AttentionConfig(getattr(c.AttnLayout, layout), getattr(c.AttnMask, mask),
                             window_left=window_left, window_right=window_right,
                             softmax_scale=softmax_scale, dropout=dropout,
                             max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                             deterministic=deterministic, backend=getattr(c.AttnBackend, backend),
                             inference=inference, strides=strides or [])


def _opt(t: torch.Tensor):
    """An optional tensor argument: empty means absent. t must be contiguous (raw() holds a
    bare pointer, so a temporary copy would die before the call)."""
    return None if t.numel() == 0 else raw(t)


def _device_id(t: torch.Tensor) -> int:
    return t.device.index if t.is_cuda else -1


def lse_shape(q: torch.Tensor, layout: str, heads: int, cu_seqlens_q: torch.Tensor,
              max_seqlen_q: int) -> tuple[int, int, int]:
    if layout == "thd":
        return (cu_seqlens_q.shape[0] - 1, heads, max_seqlen_q)
    b, s = (q.shape[0], q.shape[1]) if layout == "bshd" else (q.shape[1], q.shape[0])
    return (b, heads, s)


def _o_like(q: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=dtype)


@custom_op(f"{_NS}::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_kv: torch.Tensor, rng_state: torch.Tensor, layout: str, mask: str,
                      window_left: int, window_right: int, softmax_scale: float, dropout: float,
                      max_seqlen_q: int, max_seqlen_kv: int, backend: str,
                      inference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o in q's layout with v's head dim, softmax_lse [batch, heads_q, max_seqlen_q]
    fp32, empty with ``inference``: a forward that no backward follows). cu_seqlens_* (int32
    [batch + 1]) and rng_state (int64 [2]) may be empty."""
    # q, k, v are read in place where the core can (views of one projection's output); else
    # made dense
    strides = qkv_strides(layout, mask, q, k, v)
    if strides is None:
        strides = []
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = config(layout, mask, window_left, window_right, softmax_scale, dropout, max_seqlen_q,
                 max_seqlen_kv, False, backend, inference, strides)
    o = _o_like(q, v, q.dtype)
    lse = _lse_like(q, layout, cu_seqlens_q, max_seqlen_q, inference)
    cu_seqlens_q, cu_seqlens_kv = cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous()
    rng_state = rng_state.contiguous()
    ws = _workspace_for(cfg, (layout, mask, window_left, window_right, softmax_scale, dropout,
                              False, backend, inference, tuple(strides)), q, k, v,
                        _TE_NAMES[q.dtype], _TE_NAMES[q.dtype], cu_seqlens_q, max_seqlen_q,
                        max_seqlen_kv, False)
    core().attention_forward(cfg, raw_view(q), raw_view(k), raw_view(v), raw(o),
                             None if inference else raw(lse),
                             cu_seqlens_q=_opt(cu_seqlens_q), cu_seqlens_kv=_opt(cu_seqlens_kv),
                             rng_state=_opt(rng_state), workspace=_raw_or_none(ws),
                             stream=stream_of(q))
    return o, lse


@attention_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, rng_state, layout, mask, window_left, window_right,
      softmax_scale, dropout, max_seqlen_q, max_seqlen_kv, backend, inference=False):
    return _o_like(q, v, q.dtype), _lse_like(q, layout, cu_seqlens_q, max_seqlen_q, inference)


def _lse_like(q, layout: str, cu_seqlens_q, max_seqlen_q: int, inference: bool):
    """The softmax_lse output of a forward: empty for an inference one (the core writes none)."""
    if inference:
        return q.new_empty((0,), dtype=torch.float32)
    return q.new_empty(lse_shape(q, layout, q.shape[-2], cu_seqlens_q, max_seqlen_q),
                       dtype=torch.float32)


@custom_op(f"{_NS}::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       d_o: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_kv: torch.Tensor, rng_state: torch.Tensor, layout: str, mask: str,
                       window_left: int, window_right: int, softmax_scale: float, dropout: float,
                       max_seqlen_q: int, max_seqlen_kv: int, deterministic: bool, backend: str,
                       grad_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv) in grad_dtype, the shapes of q, k, v."""
    cfg = config(layout, mask, window_left, window_right, softmax_scale, dropout, max_seqlen_q,
                 max_seqlen_kv, deterministic, backend)
    dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))
    q, k, v, o, d_o, lse = (t.contiguous() for t in (q, k, v, o, d_o, lse))
    cu_seqlens_q, cu_seqlens_kv = cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous()
    rng_state = rng_state.contiguous()
    ws = _workspace_for(cfg, (layout, mask, window_left, window_right, softmax_scale, dropout,
                              deterministic, backend, False), q, k, v, _TE_NAMES[o.dtype],
                        _TE_NAMES[grad_dtype], cu_seqlens_q, max_seqlen_q, max_seqlen_kv, True)
    core().attention_backward(cfg, raw(q), raw(k), raw(v), raw(o), raw(d_o), raw(lse),
                              dq=raw(dq), dk=raw(dk), dv=raw(dv), cu_seqlens_q=_opt(cu_seqlens_q),
                              cu_seqlens_kv=_opt(cu_seqlens_kv), rng_state=_opt(rng_state),
                              workspace=_raw_or_none(ws), stream=stream_of(q))
    return dq, dk, dv


@attention_backward.register_fake
def _(q, k, v, o, d_o, lse, cu_seqlens_q, cu_seqlens_kv, rng_state, layout, mask, window_left,
      window_right, softmax_scale, dropout, max_seqlen_q, max_seqlen_kv, deterministic, backend,
      grad_dtype):
    return tuple(torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))


@custom_op(f"{_NS}::attention_backward_packed", mutates_args=())
def attention_backward_packed(qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, o: torch.Tensor, d_o: torch.Tensor,
                              lse: torch.Tensor, rng_state: torch.Tensor, layout: str, mask: str,
                              window_left: int, window_right: int, softmax_scale: float,
                              dropout: float, deterministic: bool, backend: str) -> torch.Tensor:
    """The gradient of qkv, a contiguous tensor that the views q, k, v tile exactly (each
    element in one of them, as a projection's output holds the heads of q, k and v; see
    attention_fn.packed_qkv), with dq, dk, dv written by the core in place, where q, k, v sit
    in qkv: no copies and no concatenation. bshd/sbhd without padding."""
    strides = qkv_strides(layout, mask, q, k, v)
    if not strides:
        raise ValueError("attention_backward_packed: q, k and v must be strided views the core "
                         f"reads in place (bshd/sbhd, no padding mask), got strides "
                         f"{q.stride()}, {k.stride()}, {v.stride()} for layout {layout!r} and "
                         f"mask {mask!r}")
    # The gradients are written where q, k, v sit in qkv: they must be views of it (a
    # compiler that handed the op copies of them would otherwise get gradients misplaced).
    begin, size = qkv.data_ptr(), qkv.numel() * qkv.element_size()
    if not qkv.is_contiguous() or any(not begin <= t.data_ptr() < begin + size
                                      for t in (q, k, v)):
        raise ValueError("attention_backward_packed: q, k and v must be views of the "
                         "contiguous qkv, got tensors outside it")
    cfg = config(layout, mask, window_left, window_right, softmax_scale, dropout, 0, 0,
                 deterministic, backend, False, strides)
    d_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    start = d_qkv.storage_offset() - qkv.storage_offset()
    dq, dk, dv = (d_qkv.as_strided(t.shape, t.stride(), t.storage_offset() + start)
                  for t in (q, k, v))
    o, d_o, lse, rng_state = (t.contiguous() for t in (o, d_o, lse, rng_state))
    empty = q.new_empty((0,), dtype=torch.int32)
    ws = _workspace_for(cfg, (layout, mask, window_left, window_right, softmax_scale, dropout,
                              deterministic, backend, False, tuple(strides)), q, k, v,
                        _TE_NAMES[o.dtype], _TE_NAMES[q.dtype], empty, 0, 0, True)
    core().attention_backward(cfg, raw_view(q), raw_view(k), raw_view(v), raw(o), raw(d_o),
                              raw(lse), dq=raw_view(dq), dk=raw_view(dk), dv=raw_view(dv),
                              rng_state=_opt(rng_state), workspace=_raw_or_none(ws),
                              stream=stream_of(q))
    return d_qkv


@attention_backward_packed.register_fake
def _(qkv, q, k, v, o, d_o, lse, rng_state, layout, mask, window_left, window_right,
      softmax_scale, dropout, deterministic, backend):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _fp8(data: torch.Tensor, scale_inv: torch.Tensor):
    """An E4M3 Tensor of contiguous uint8 data and its [1] scale_inv (both kept alive by the
    caller)."""
    return _fp8_raw(data, raw(scale_inv))


def _fp8_raw(data: torch.Tensor, scale_inv: tuple):
    """_fp8 with the scale_inv in raw form already."""
    return core().Tensor(raw(data), dtype=core().DType.float8_e4m3, scale_inv=scale_inv)


@custom_op(f"{_NS}::attention_forward_fp8", mutates_args=())
def attention_forward_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          descales: torch.Tensor, s_scales: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                          rng_state: torch.Tensor, layout: str, mask: str, window_left: int,
                          window_right: int, softmax_scale: float, dropout: float,
                          max_seqlen_q: int, max_seqlen_kv: int, backend: str,
                          o_scale: torch.Tensor, o_dtype: torch.dtype, inference: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 attention: q, k, v E4M3 bytes (uint8) with descales [3] fp32 (of q, k, v); s_scales
    [2] fp32 = (scale, scale_inv) of the probabilities. o_dtype torch.uint8 writes o as E4M3
    bytes of ``o * o_scale`` (o_scale [1] fp32; the only FP8 output sm_90 takes), a float dtype
    writes it in that dtype (o_scale empty). Returns (o, softmax_lse, amax of the probabilities
    [1] fp32, amax of o [1] fp32 when o is FP8 (cuDNN requires it), else empty); softmax_lse is
    empty with ``inference`` (cuDNN's FP8 forward is faster without it: gpu_checks.md)."""
    fp8_out = o_dtype == torch.uint8
    if fp8_out != (o_scale.numel() == 1):
        raise ValueError("attention_forward_fp8: o_scale must be a [1] tensor exactly when o is "
                         f"FP8 (o_dtype torch.uint8), got {o_scale.numel()} elements for "
                         f"o_dtype {o_dtype}")
    cfg = config(layout, mask, window_left, window_right, softmax_scale, dropout, max_seqlen_q,
                 max_seqlen_kv, False, backend, inference)
    o = _o_like(q, v, o_dtype)
    lse = _lse_like(q, layout, cu_seqlens_q, max_seqlen_q, inference)
    amax_s = q.new_zeros((1,), dtype=torch.float32)
    q, k, v, descales = q.contiguous(), k.contiguous(), v.contiguous(), descales.contiguous()
    cu_seqlens_q, cu_seqlens_kv = cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous()
    rng_state = rng_state.contiguous()
    d = [descales[i:i + 1] for i in range(3)]
    sc = [s_scales[0:1].contiguous(), s_scales[1:2].contiguous()]
    c = core()
    softmax = c.Tensor(None, scale=raw(sc[0]), scale_inv=raw(sc[1]), amax=raw(amax_s))
    o_scale = o_scale.contiguous()
    amax_o = _amax_o(q, fp8_out)
    out = c.Tensor(raw(o), dtype=c.DType.float8_e4m3, scale=raw(o_scale),
                   amax=raw(amax_o)) if fp8_out else raw(o)
    ws = _workspace_for(cfg, (layout, mask, window_left, window_right, softmax_scale, dropout,
                              False, backend, inference), q, k, v, _o_name(o_dtype),
                        _o_name(o_dtype), cu_seqlens_q, max_seqlen_q, max_seqlen_kv, False)
    c.attention_forward(cfg, _fp8(q, d[0]), _fp8(k, d[1]), _fp8(v, d[2]), out,
                        None if inference else raw(lse),
                        cu_seqlens_q=_opt(cu_seqlens_q), cu_seqlens_kv=_opt(cu_seqlens_kv),
                        rng_state=_opt(rng_state), softmax_fp8=softmax, workspace=_raw_or_none(ws),
                        stream=stream_of(q))
    return o, lse, amax_s, amax_o


@attention_forward_fp8.register_fake
def _(q, k, v, descales, s_scales, cu_seqlens_q, cu_seqlens_kv, rng_state, layout, mask,
      window_left, window_right, softmax_scale, dropout, max_seqlen_q, max_seqlen_kv, backend,
      o_scale, o_dtype, inference=False):
    lse = _lse_like(q, layout, cu_seqlens_q, max_seqlen_q, inference)
    return (_o_like(q, v, o_dtype), lse, q.new_empty((1,), dtype=torch.float32),
            _amax_o(q, o_dtype == torch.uint8))


def _amax_o(q: torch.Tensor, fp8_out: bool) -> torch.Tensor:
    return q.new_zeros((1 if fp8_out else 0,), dtype=torch.float32)


def _check_fp8_backward(o, d_o, do_format, grad_scales, grad_dtype) -> None:
    op = "attention_backward_fp8"
    for name, t in (("o", o), ("d_o", d_o)):
        if t.dtype != torch.uint8:
            raise TypeError(f"{op}: {name} must be torch.uint8 (FP8 bytes), got {t.dtype}")
    if do_format not in FP8_DTYPES:
        raise ValueError(f"{op}: do_format must be one of {FP8_DTYPES}, got {do_format!r}")
    fp8_grads = grad_dtype == torch.uint8
    if grad_scales.numel() != (3 if fp8_grads else 0):
        raise ValueError(f"{op}: grad_scales must have 3 elements (of dq, dk, dv) exactly when "
                         f"the gradients are FP8 (grad_dtype torch.uint8), got "
                         f"{grad_scales.numel()} for grad_dtype {grad_dtype}")


@custom_op(f"{_NS}::attention_backward_fp8", mutates_args=())
def attention_backward_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                           d_o: torch.Tensor, lse: torch.Tensor, descales: torch.Tensor,
                           s_scales: torch.Tensor, dp_scales: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                           rng_state: torch.Tensor, layout: str, mask: str, window_left: int,
                           window_right: int, softmax_scale: float, dropout: float,
                           max_seqlen_q: int, max_seqlen_kv: int, deterministic: bool,
                           backend: str, do_format: str, grad_scales: torch.Tensor,
                           grad_dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor]:
    """FP8 backward: q, k, v and o E4M3 bytes (uint8), d_o bytes in ``do_format``
    (``"float8_e4m3"`` or ``"float8_e5m2"``); descales [5] fp32 of q, k, v, o, d_o; s_scales
    [2] the forward's (scale, scale_inv) of the probabilities; dp_scales [2] (scale, scale_inv)
    of ds, the gradient of the logits, which FP8 kernels round to do_format. grad_dtype
    torch.uint8 writes dq, dk, dv as do_format bytes of ``grad * grad_scales[i]`` (grad_scales
    [3] fp32; the only gradients sm_90's cuDNN writes), a float dtype writes them in that dtype
    (grad_scales empty). Returns (dq, dk, dv, amax of ds [1], amaxes of dq, dk, dv [3] when
    they are FP8 (cuDNN requires them), else empty)."""
    _check_fp8_backward(o, d_o, do_format, grad_scales, grad_dtype)
    cfg = config(layout, mask, window_left, window_right, softmax_scale, dropout, max_seqlen_q,
                 max_seqlen_kv, deterministic, backend)
    fp8_grads = grad_dtype == torch.uint8
    dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))
    amax_dp = q.new_zeros((1,), dtype=torch.float32)
    amax_grads = _amax_grads(q, fp8_grads)
    q, k, v, o, d_o, lse = (t.contiguous() for t in (q, k, v, o, d_o, lse))
    cu_seqlens_q, cu_seqlens_kv = cu_seqlens_q.contiguous(), cu_seqlens_kv.contiguous()
    rng_state, descales = rng_state.contiguous(), descales.contiguous()
    s_scales, dp_scales = s_scales.contiguous(), dp_scales.contiguous()
    grad_scales = grad_scales.contiguous()
    d = [raw_element(descales, i) for i in range(5)]
    c = core()
    fmt = getattr(c.DType, do_format)
    softmax = c.Tensor(None, scale=raw_element(s_scales, 0), scale_inv=raw_element(s_scales, 1))
    dp = c.Tensor(None, scale=raw_element(dp_scales, 0), scale_inv=raw_element(dp_scales, 1),
                  amax=raw(amax_dp))
    grads = [c.Tensor(raw(g), dtype=fmt, scale=raw_element(grad_scales, i),
                      amax=raw_element(amax_grads, i)) if fp8_grads else raw(g)
             for i, g in enumerate((dq, dk, dv))]
    grad_name = do_format if fp8_grads else _TE_NAMES[grad_dtype]
    ws = _workspace_for(cfg, (layout, mask, window_left, window_right, softmax_scale, dropout,
                              deterministic, backend, False), q, k, v, "float8_e4m3", grad_name,
                        cu_seqlens_q, max_seqlen_q, max_seqlen_kv, True, do_format)
    c.attention_backward(cfg, _fp8_raw(q, d[0]), _fp8_raw(k, d[1]), _fp8_raw(v, d[2]),
                         _fp8_raw(o, d[3]), c.Tensor(raw(d_o), dtype=fmt, scale_inv=d[4]), raw(lse),
                         dq=grads[0], dk=grads[1], dv=grads[2],
                         cu_seqlens_q=_opt(cu_seqlens_q), cu_seqlens_kv=_opt(cu_seqlens_kv),
                         rng_state=_opt(rng_state), softmax_fp8=softmax, dp_fp8=dp,
                         workspace=_raw_or_none(ws), stream=stream_of(q))
    return dq, dk, dv, amax_dp, amax_grads


@attention_backward_fp8.register_fake
def _(q, k, v, o, d_o, lse, descales, s_scales, dp_scales, cu_seqlens_q, cu_seqlens_kv,
      rng_state, layout, mask, window_left, window_right, softmax_scale, dropout, max_seqlen_q,
      max_seqlen_kv, deterministic, backend, do_format, grad_scales, grad_dtype):
    dq, dk, dv = (torch.empty(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))
    return (dq, dk, dv, q.new_empty((1,), dtype=torch.float32),
            _amax_grads(q, grad_dtype == torch.uint8))


def _amax_grads(q: torch.Tensor, fp8_grads: bool) -> torch.Tensor:
    return q.new_zeros((3 if fp8_grads else 0,), dtype=torch.float32)


_TE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
             torch.uint8: "float8_e4m3"}


def _o_name(dtype: torch.dtype) -> str:
    """The core's name of an o dtype (uint8: E4M3 bytes)."""
    return _TE_NAMES[dtype]


# The workspace size of each kind of call: the core's query (which plans the call) costs tens
# of microseconds, a dict lookup one; a step asks it twice per attention layer.
_WORKSPACE_SIZES: dict = {}


def _workspace_for(cfg, key: tuple, q, k, v, o_name: str, grad_name: str, cu_q, max_sq, max_skv,
                   backward, do_name: Optional[str] = None):
    """CUDA workspace tensor of a call (None on the CPU); dtypes by the core's names. ``key``: the
    arguments cfg was built from (the binding object does not show them all)."""
    if not q.is_cuda:
        return None
    sizes = sizes_of(q, k, v, cfg.layout.name, cu_q, max_sq, max_skv)
    known = (key, tuple(sizes), q.dtype, o_name, grad_name, do_name, q.device.index, backward)
    size = _WORKSPACE_SIZES.get(known)
    if size is None:
        c = core()
        size = int(c.attention_workspace_size(
            cfg, sizes, getattr(c.DType, _TE_NAMES[q.dtype]), getattr(c.DType, o_name),
            getattr(c.DType, grad_name), do_dtype=getattr(c.DType, do_name or o_name),
            device_id=_device_id(q), backward=backward))
        if len(_WORKSPACE_SIZES) >= 1024:  # (shapes that keep changing: no unbounded growth)
            _WORKSPACE_SIZES.clear()
        _WORKSPACE_SIZES[known] = size
    # the tensor, not its raw form: the caller keeps it alive until the core call returns
    return torch.empty((max(size, 1),), dtype=torch.uint8, device=q.device)


def _raw_or_none(t: Optional[torch.Tensor]):
    return None if t is None else raw(t)


def sizes_of(q, k, v, layout: str, cu_q: Optional[torch.Tensor], max_sq: int,
             max_skv: int) -> list[int]:
    """The core's problem sizes: (batch, heads_q, heads_kv, seqlen_q, seqlen_kv, head_dim_qk,
    head_dim_v, total_q, total_kv)."""
    if layout == "thd":
        return [cu_q.shape[0] - 1, q.shape[1], k.shape[1], max_sq, max_skv, q.shape[2],
                v.shape[2], q.shape[0], k.shape[0]]
    bshd = layout == "bshd"
    b, sq = (q.shape[0], q.shape[1]) if bshd else (q.shape[1], q.shape[0])
    skv = k.shape[1] if bshd else k.shape[0]
    return [b, q.shape[2], k.shape[2], sq, skv, q.shape[3], v.shape[3], b * sq, b * skv]


@custom_op(f"{_NS}::scaled_softmax_forward", mutates_args=())
def scaled_softmax_forward(x: torch.Tensor, mask: torch.Tensor, mask_type: str,
                           scale: float) -> torch.Tensor:
    """softmax(scale * x) over the last dim of x [b, h, sq, sk]; mask (uint8/bool, nonzero =
    masked, [b or 1, h or 1, sq, sk]) for mask_type "arbitrary", else empty."""
    if mask_type not in SOFTMAX_MASKS:
        raise ValueError(f"scaled_softmax_forward: mask_type must be one of {SOFTMAX_MASKS}, got "
                         f"{mask_type!r}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    x = x.contiguous()
    m = mask.to(torch.uint8).contiguous() if mask_type == "arbitrary" else None
    core().scaled_softmax_forward(getattr(core().SoftmaxMask, mask_type), scale, raw(x),
                                  None if m is None else raw(m), raw(y), stream=stream_of(x))
    return y


@scaled_softmax_forward.register_fake
def _(x, mask, mask_type, scale):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op(f"{_NS}::scaled_softmax_backward", mutates_args=())
def scaled_softmax_backward(dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) over the last dim."""
    dx = torch.empty_like(y, memory_format=torch.contiguous_format)
    dy, y = dy.contiguous(), y.contiguous()
    core().scaled_softmax_backward(scale, raw(dy), raw(y), raw(dx), stream=stream_of(y))
    return dx


@scaled_softmax_backward.register_fake
def _(dy, y, scale):
    return torch.empty_like(y, memory_format=torch.contiguous_format)
