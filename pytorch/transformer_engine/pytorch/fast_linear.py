"""The compiled eager path of te.Linear's FP8 step under delayed and current scaling.

A small layer's step is bound by host time, and in Python most of it is spent around the
kernels (the op wrappers, their tensor bookkeeping). Here the forward is one autograd.Function
whose forward and backward are each one call of a compiled operator
(``torch.ops.te_eager.linear_fp8_forward`` and ``linear_fp8_backward``,
``pytorch/csrc/eager/``, on the LibTorch stable ABI): the same casts and GEMMs with the
same arguments as :class:`~transformer_engine.pytorch.linear_fn.Fp8LinearFunction` and
``linear_fn.linear_backward``, so the same bits. (The backward is ``linear_backward``, which
takes the compiled operator where ``compiled_grads.usable`` says so.) te.Linear's full forward
reaches it after its own checks (``forward``); once it has, the module's later forwards under
the same recipe go to it first (``steady_forward``), which checks the input (``takes``).

The operator is built with the package when torch and transformer-engine-common are present
at build time (``_compiled.py``); without it te.Linear takes its Python path, which is also
the one torch.compile traces. ``TE_FAST_LINEAR=0`` in the environment turns it off, and so does
``enabled = False`` here (te.Linear's forward only).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _compiled, fp8
from .linear_fn import linear_backward
from .ops._backend import dtype_code, stream_of, workspace_for
from .quantization import Plan

enabled = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_GRANULE = 16  # FP8 tensor cores work on 16x16 granules: M, N and K must be multiples


def available() -> bool:
    """Whether te.Linear's FP8 forward can take the compiled path in this process."""
    return _compiled.ops is not None and enabled


def usable(plan: Plan, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
           history: Optional[torch.Tensor], general_update: bool) -> bool:
    """Whether this forward (of an input te.Linear has checked) is one the compiled path
    computes exactly as the Python path: an eager call under per-tensor delayed scaling (with
    the scale update in the core and amaxes recorded) or current scaling, plain tensors, and
    not in an activation checkpoint: neither its first run nor its recompute (torch's
    checkpoint demands that both runs save tensors of the same shapes, and the two paths save
    different ones); nor a first step, whose empty history the Python path scales from the
    tensors' own amaxes (first_step.py). The input itself is checked by ``takes``."""
    if _compiled.ops is None:
        if inp.is_cuda and not torch.compiler.is_compiling():
            _compiled.warn_if_missing()  # (once)
        return False
    return (_eager_outside_checkpoint()
            and not (plan.kind == "delayed" and general_update)
            and _compiled.serves(plan, history, (inp, weight, bias)))


def _eager_outside_checkpoint() -> bool:
    """Switched on, not traced by torch.compile, and no activation checkpoint recording or
    replaying."""
    r = fp8.RECOMPUTE
    return (enabled and r.recording is None and r.replay is None
            and not torch.compiler.is_compiling())


def takes(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether the compiled forward computes this input as the Python path would; where not,
    the Python path takes the call (and raises the errors where the input is wrong): shapes
    the FP8 GEMM cannot take unpadded, tensors on different devices, dtypes other than
    fp32/bf16/fp16, a bias of another dtype than the input (added in fp32 there), an input
    torch.autocast would cast, an active dispatch mode (a tracer or fake tensors)."""
    if inp.dim() == 0 or weight.dim() != 2:
        return False
    n, k = weight.shape
    if inp.shape[-1] != k or k % _GRANULE or n % _GRANULE or (inp.numel() // k) % _GRANULE:
        return False
    dtype = inp.dtype
    if dtype not in _FLOATS or weight.dtype not in _FLOATS or inp.device != weight.device:
        return False
    if bias is not None and (bias.dtype != dtype or bias.shape != (n,)
                             or bias.device != inp.device):
        return False
    device_type = "cuda" if inp.is_cuda else inp.device.type
    if torch.is_autocast_enabled(device_type) and \
            torch.get_autocast_dtype(device_type) != dtype:
        return False
    return _get_current_dispatch_mode() is None


class Codes(NamedTuple):
    """What the compiled forward needs of a plan, as its operator takes it (kept on the module
    after its first compiled forward, with the plan for the backward)."""

    plan: Plan
    current: bool  # current scaling (else delayed)
    fp8_dtype: int  # the core's te_dtype code of the forward format
    pow2: bool
    epsilon: float


def codes_of(plan: Plan) -> Codes:
    return Codes(plan, plan.kind == "current", dtype_code(plan.fwd_dtype),
                 plan.force_pow2_scales, plan.amax_epsilon)


class _Backward(NamedTuple):
    """What the backward of one compiled forward needs besides its saved tensors."""

    plan: Plan
    bwd_meta: tuple  # (history, scale, scale_inv) of grad_output, updated in place (delayed)
    need: tuple  # (dgrad, wgrad, bias)
    dtypes: tuple  # of input, weight and bias
    input_shape: torch.Size


def _forward(inp, weight, bias, scales, history, codes: Codes, need_dgrad: bool,
             need_wgrad: bool) -> list:
    """The compiled operator's call: [output, input scale_inv, weight scale_inv, column-wise
    input, column-wise weight]."""
    ws = workspace_for(inp)
    status, *outs = _compiled.ops.linear_fp8_forward.default(
        inp, weight, bias, scales, history, _compiled.NO_TENSOR if ws is None else ws,
        codes.current, codes.fp8_dtype, codes.pow2, codes.epsilon, need_dgrad, need_wgrad,
        stream_of(inp))
    _compiled.raise_if_failed(status)
    return outs


class _Fp8Linear(torch.autograd.Function):
    """``inp @ weight^T (+ bias)`` through the compiled forward, saving the FP8 column-wise
    input and weight (what Fp8LinearFunction saves) for linear_backward."""

    @staticmethod
    def forward(ctx, inp, weight, bias, scales, history, codes: Codes, bwd_meta: tuple,
                need_dgrad: bool, need_wgrad: bool):
        out, x_sinv, w_sinv, x_col, w_col = _forward(inp, weight, bias, scales, history, codes,
                                                     need_dgrad, need_wgrad)
        ctx.save_for_backward(x_sinv, w_sinv, x_col, w_col)
        ctx.info = _Backward(codes.plan, bwd_meta, (need_dgrad, need_wgrad, bias is not None),
                             (inp.dtype, weight.dtype, None if bias is None else bias.dtype),
                             inp.shape)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x_sinv, w_sinv, x_col, w_col = ctx.saved_tensors
        b = ctx.info
        need_dgrad, need_wgrad, _ = b.need
        saved = (x_col if need_wgrad else None, x_sinv, w_col if need_dgrad else None, w_sinv)
        # (one compiled operator call where compiled_grads.usable says so)
        grads = linear_backward(grad_output, saved, b.plan, b.bwd_meta, None, None, b.need,
                                b.dtypes, b.input_shape)
        return (*grads, None, None, None, None, None, None)




def forward(module: torch.nn.Module, inp: torch.Tensor, weight: torch.Tensor,
            bias: Optional[torch.Tensor], plan: Plan, scales: torch.Tensor,
            history: Optional[torch.Tensor], bwd_meta: tuple) -> Optional[torch.Tensor]:
    """``inp @ weight^T (+ bias)`` with FP8 operands, as Fp8LinearFunction computes it, for
    te.Linear's full forward once ``usable`` said yes; None where ``takes`` declines the input.
    (Current scaling reads neither ``scales`` nor ``history``.)

    Once it has served a forward, the module keeps the plan's codes, so that its later
    forwards under the same recipe start at :func:`steady_forward`."""
    codes = codes_of(plan)
    out = run(inp, weight, bias, scales, scales if history is None else history, bwd_meta, codes)
    if out is not None and weight is module._parameters.get("weight"):  # not split or derived
        module._fast_linear = (module._fp8_recipe, codes)
    return out


def steady_forward(module: torch.nn.Module, inp: torch.Tensor) -> Optional[torch.Tensor]:
    """te.Linear's forward under the recipe its last compiled forward ran under, straight to
    the compiled function; None (the full forward then runs) where anything differs from that
    forward's conditions or ``takes`` declines the input.

    What ``usable`` checks for the full forward holds here: the module has met this recipe
    (``_fp8_recipe``, reset when its state is reloaded or recalibrated), whose plan the
    codes come from; the checks that can change between calls are made again (plain
    tensors, no checkpoint, no amax group under delayed scaling, not traced). A small layer's
    forward is bound by host time, and the full forward's checks and lookups cost as much as
    the compiled call itself."""
    state = fp8.STATE
    recipe, fast = state.recipe, module._fast_linear
    if (fast is None or fast[0] is not recipe or recipe is not module._fp8_recipe
            or type(inp) is not torch.Tensor or module._weight_caches
            or not _eager_outside_checkpoint()):
        return None
    codes = fast[1]
    delayed = not codes.current
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
              codes)
    if out is not None and delayed:
        state.pending[id(module)] = (module, recipe, None)  # fp8.register_forward_amaxes
    return out


def run(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
        scales: torch.Tensor, history: torch.Tensor, bwd_meta: tuple,
        codes: Codes) -> Optional[torch.Tensor]:
    """The compiled forward, or None where ``takes`` declines the input. Whether the backward
    needs dgrad and wgrad is read here, outside the autograd function (whose forward runs with
    grad mode off); where no gradient is needed at all (inference, evaluation) the operator is
    called without the autograd function, whose host time would buy nothing."""
    if not takes(inp, weight, bias):
        return None
    grad = torch.is_grad_enabled()
    need_dgrad, need_wgrad = grad and inp.requires_grad, grad and weight.requires_grad
    inp, weight = inp.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    if not (need_dgrad or need_wgrad or (grad and bias is not None and bias.requires_grad)):
        return _forward(inp, weight, bias, scales, history, codes, False, False)[0]
    return _Fp8Linear.apply(inp, weight, bias, scales, history, codes, bwd_meta, need_dgrad,
                            need_wgrad)
