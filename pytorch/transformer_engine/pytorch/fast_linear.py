"""The compiled eager path of te.Linear's FP8 forward under delayed and current scaling.

A small layer's forward is bound by host time, and in Python most of it is spent around the
kernels (autograd.Function, the op wrappers). ``_linear_fast`` (``pytorch/csrc/linear_fast.cpp``)
does the forward as one C++ autograd function over the core's C API: the same casts and GEMM
with the same arguments as :class:`~transformer_engine.pytorch.linear_fn.Fp8LinearFunction`,
so the same bits, and a backward that comes back here to share that function's backward.
te.Linear's full forward reaches it after its own checks (``forward``); once it has, the
module's later forwards under the same recipe go to it first (``steady_forward``), and the C++
checks the input itself, declining what the Python path must handle.

The extension is built with the package when torch and transformer-engine-common are present
at build time, for that torch release (``_compiled.py``); without it te.Linear takes its Python
path, which is also the one torch.compile traces. ``TE_FAST_LINEAR=0`` in the environment
turns it off, and so does ``enabled = False`` here (te.Linear's forward only).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _compiled, first_step, fp8
from ._compiled import ext as _ext
from .linear_fn import linear_backward
from .ops._backend import dtype_code, workspace_for
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
    the scale update in the core and amaxes recorded) or current scaling, plain tensors
    (the compiled function declines a bias of another dtype), and not in an activation
    checkpoint: neither its first run nor
    its recompute (torch's checkpoint demands that both runs save tensors of the same shapes,
    and the compiled forward saves one buffer where the Python path saves four); nor a first
    step, whose empty history the Python path scales from the tensors' own amaxes
    (first_step.py)."""
    if _ext is None:
        if inp.is_cuda and not torch.compiler.is_compiling():
            _compiled.warn_if_missing()  # (once)
        return False
    kind = plan.kind
    return (_eager_outside_checkpoint()
            and ((kind == "delayed" and not general_update and history is not None
                  and not first_step.has_empty(history))
                 or (kind == "current" and plan.input_mode == "tensor"))
            and type(inp) in _PLAIN and type(weight) in _PLAIN
            and (bias is None or type(bias) in _PLAIN))


def _eager_outside_checkpoint() -> bool:
    """Switched on, not traced by torch.compile, and no activation checkpoint recording or
    replaying. (The rest the compiled function checks itself: the input's shape, dtype and
    device, the bias's dtype, torch.autocast, an active dispatch mode.)"""
    r = fp8.RECOMPUTE
    return (enabled and r.recording is None and r.replay is None
            and not torch.compiler.is_compiling())


_SCALING = {"delayed": 0, "current": 1}  # linear_fast.cpp's Scaling


def forward(module: torch.nn.Module, inp: torch.Tensor, weight: torch.Tensor,
            bias: Optional[torch.Tensor], plan: Plan, scales: torch.Tensor,
            history: Optional[torch.Tensor], bwd_meta: tuple) -> Optional[torch.Tensor]:
    """``inp @ weight^T (+ bias)`` with FP8 operands, as Fp8LinearFunction computes it, for
    te.Linear's full forward once ``usable`` said yes; None where the compiled function
    declines the input (linear_fast.cpp, ``takes``). (Current scaling reads neither ``scales``
    nor ``history``.)

    Once it has served a forward, the module keeps the plan's arguments, so that its later
    forwards under the same recipe start at :func:`steady_forward`."""
    args = (_SCALING[plan.kind], plan.force_pow2_scales, plan.amax_epsilon,
            dtype_code(plan.fwd_dtype), dtype_code(plan.bwd_dtype), plan.margin, plan.algo)
    out = run(inp, weight, bias, scales, scales if history is None else history, bwd_meta, args)
    if out is not None and weight is module._parameters.get("weight"):  # not split or derived
        module._fast_linear = (module._fp8_recipe, args)
    return out


def steady_forward(module: torch.nn.Module, inp: torch.Tensor) -> Optional[torch.Tensor]:
    """te.Linear's forward under the recipe its last compiled forward ran under, straight to
    the compiled function; None (the full forward then runs) where anything differs from that
    forward's conditions or the compiled function declines the input.

    What ``usable`` checks for the full forward holds here: the module has met this recipe
    (``_fp8_recipe``, reset when its state is reloaded or recalibrated), whose plan the
    arguments come from; the checks that can change between calls are made again (plain
    tensors, no checkpoint, no amax group under delayed scaling, not traced), and those on the
    input are the compiled function's own. A small layer's forward is bound by host time, and
    the full forward's checks and lookups cost as much as the compiled call itself."""
    state = fp8.STATE
    recipe, fast = state.recipe, module._fast_linear
    if (fast is None or fast[0] is not recipe or recipe is not module._fp8_recipe
            or type(inp) is not torch.Tensor or module._weight_caches
            or not _eager_outside_checkpoint()):
        return None
    args = fast[1]
    delayed = args[0] == 0
    if delayed and state.group is not None:  # the backward update takes the general path
        return None
    params, buffers = module._parameters, module._buffers
    weight, bias = params.get("weight"), params.get("bias")
    # (A weight or bias that is no longer a parameter, e.g. parametrized since, is computed
    # by the full forward.)
    if (type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN)
            or "bias" not in params):
        return None
    if module.return_bias:
        bias = None
    out = run(inp, weight, bias, buffers["scale_fwd"], buffers["amax_history_fwd"],
              (buffers["amax_history_bwd"], buffers["scale_bwd"], buffers["scale_inv_bwd"]),
              args)
    if out is not None and delayed:
        state.pending[id(module)] = (module, recipe, None)  # fp8.register_forward_amaxes
    return out


def run(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
        scales: torch.Tensor, history: torch.Tensor, bwd_meta: tuple,
        args: tuple) -> Optional[torch.Tensor]:
    """The compiled function (``args``: scaling, pow2, epsilon, the FP8 formats' codes,
    margin, algo), or None where it declines the input."""
    ws = workspace_for(inp)
    return _ext.linear_fp8(inp, weight, bias, scales, history, bwd_meta,
                           _empty if ws is None else ws, *args)


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
