"""The compiled eager path of te.Linear's FP8 forward under delayed and current scaling.

A small layer's forward is bound by host time, and in Python most of it is spent around the
kernels (autograd.Function, the op wrappers). ``_linear_fast`` (``pytorch/csrc/linear_fast.cpp``)
does the forward as one C++ autograd function over the core's C API: the same casts and GEMM
with the same arguments as :class:`~transformer_engine.pytorch.linear_fn.Fp8LinearFunction`,
so the same bits, and a backward that comes back here to share that function's backward.

The extension is built with the package when torch and transformer-engine-common are present
at build time, for that torch release (``_compiled.py``); without it te.Linear takes its Python
path, which is also the one torch.compile traces. ``TE_FAST_LINEAR=0`` in the environment
turns it off, and so does ``enabled = False`` here (te.Linear's forward only).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fp8
from ._compiled import ext as _ext
from .linear_fn import linear_backward
from .ops._backend import _plain_eager, dtype_code, workspace_for
from .quantization import Plan

enabled = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def available() -> bool:
    """Whether te.Linear's FP8 forward can take the compiled path in this process."""
    return _ext is not None and enabled


def usable(plan: Plan, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           history: Optional[torch.Tensor], general_update: bool) -> bool:
    """Whether this forward (of an input te.Linear has checked) is one the compiled path
    computes exactly as the Python path: an eager call under per-tensor delayed scaling (with
    the scale update in the core and amaxes recorded) or current scaling, plain tensors, a
    bias of the input's dtype, and not in an activation checkpoint: neither its first run nor
    its recompute (torch's checkpoint demands that both runs save tensors of the same shapes,
    and the compiled forward saves one buffer where the Python path saves four)."""
    kind, r = plan.kind, fp8.RECOMPUTE
    return (_ext is not None and enabled and r.recording is None and r.replay is None
            and ((kind == "delayed" and not general_update and history is not None)
                 or (kind == "current" and plan.input_mode == "tensor"))
            and type(inp) in _PLAIN and type(weight) in _PLAIN
            and (bias is None or (type(bias) in _PLAIN and bias.dtype == inp.dtype))
            and _plain_eager(()))


_SCALING = {"delayed": 0, "current": 1}  # linear_fast.cpp's Scaling


def forward(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
            plan: Plan, scales: torch.Tensor, history: Optional[torch.Tensor], bwd_meta: tuple,
            need_dgrad: bool, need_wgrad: bool) -> torch.Tensor:
    """``inp @ weight^T (+ bias)`` with FP8 operands, as Fp8LinearFunction computes it.
    (Current scaling reads neither ``scales`` nor ``history``.)"""
    ws = workspace_for(inp)
    return _ext.linear_fp8(
        inp, weight, bias, _SCALING[plan.kind], scales, scales if history is None else history,
        plan.force_pow2_scales, plan.amax_epsilon, _empty if ws is None else ws, list(bwd_meta),
        dtype_code(plan.fwd_dtype), dtype_code(plan.bwd_dtype), plan.margin, plan.algo,
        need_dgrad, need_wgrad)


_empty = torch.empty(0, dtype=torch.uint8)
_plans: dict = {}


def backward(grad_output, keep, layout, history, scale, scale_inv, plan_fields: tuple,
             need_dgrad: bool, need_wgrad: bool, has_bias: bool, in_carrier, w_carrier,
             b_carrier, input_shape):
    """The compiled forward's backward (called from C++): Fp8LinearFunction's, with the
    plan rebuilt from its fields (kind, formats, pow2, epsilon, algo, margin) and the dtypes
    carried by empty tensors.

    ``keep`` is the forward's one saved byte buffer: the input's scale_inv (fp32) at byte 0,
    the weight's at byte ``s_at``, the column-wise input [K, M] at byte ``x_at`` (when wgrad
    is needed) and the column-wise weight [K, N] at byte ``w_at`` (when dgrad is);
    ``layout`` = (M, N, K, s_at, x_at, w_at)."""
    plan = _plans.get(plan_fields)
    if plan is None:
        kind, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin = plan_fields
        plan = _plans[plan_fields] = Plan(kind, fwd_dtype, bwd_dtype, "tensor", "tensor",
                                          "tensor", pow2, epsilon, algo, margin)
    m, n, k, s_at, x_at, w_at = layout
    in_sinv, w_sinv = keep[:4].view(torch.float32), keep[s_at:s_at + 4].view(torch.float32)
    in_col = keep[x_at:x_at + k * m].view(k, m) if need_wgrad else None
    w_col = keep[w_at:w_at + k * n].view(k, n) if need_dgrad else None
    dtypes = (in_carrier.dtype, w_carrier.dtype, None if b_carrier is None else b_carrier.dtype)
    return linear_backward(grad_output, (in_col, in_sinv, w_col, w_sinv), plan,
                           (history, scale, scale_inv), None, None,
                           (need_dgrad, need_wgrad, has_bias), dtypes, input_shape)
