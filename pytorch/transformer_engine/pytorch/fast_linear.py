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

Traced by torch.compile, the same two operators are the graph's nodes for te.Linear's step
(custom ops: ``transformer_engine::linear_block_forward`` here, whose outputs have storage of
their own, and ``linear_block_backward`` in compiled_grads.py) under current scaling, and under
delayed scaling in the graph of the steps after the first (``_compiled.serves_traced``): two
calls per layer where the Python path's graph makes six or seven.

The operator is built with the package when torch and transformer-engine-common are present
at build time (``_compiled.py``); without it te.Linear takes its Python path.
``TE_FAST_LINEAR=0`` in the environment turns it off, and so does ``enabled = False`` here
(te.Linear's forward only).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _compiled, compiled_grads, fp8
from ._autograd import eager_apply
from .fp8 import COMPILED_ALGOS
from .linear_fn import linear_backward
from .ops._backend import algo_code, custom_op, dtype_code, enum_code, stream_of, workspace_for
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
    if torch.compiler.is_compiling():
        # The traced graph's backward is the compiled one too (its scale update in the core).
        # Plain tensors only: an FP8 input (fp8_mha's attention output) or FP8 weight takes
        # the Python path, which uses its bytes.
        return (_outside_checkpoint() and type(inp) in _PLAIN and type(weight) in _PLAIN
                and (bias is None or type(bias) in _PLAIN)
                and _compiled.serves_traced(plan, history)
                and (plan.kind == "current" or (not general_update
                                                and plan.algo in COMPILED_ALGOS)))
    return (_eager_outside_checkpoint()
            and not (plan.kind == "delayed" and general_update)
            and _compiled.serves(plan, history, (inp, weight, bias)))


def _outside_checkpoint() -> bool:
    """Switched on, and no activation checkpoint recording or replaying."""
    r = fp8.RECOMPUTE
    return enabled and r.recording is None and r.replay is None


def _eager_outside_checkpoint() -> bool:
    """_outside_checkpoint, and not traced by torch.compile."""
    return _outside_checkpoint() and not torch.compiler.is_compiling()


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
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is None


class Codes(NamedTuple):
    """What the compiled forward and backward need of a plan, as their operators take it (kept
    on the module after its first compiled forward, with the plan for the backward). Made
    before the autograd function runs: a traced function may not fill the codes' cache."""

    plan: Plan
    current: bool  # current scaling (else delayed)
    fp8_dtype: int  # the core's te_dtype code of the forward format
    pow2: bool
    epsilon: float
    bwd_dtype: int
    algo: int  # delayed scaling's amax algorithm (0 under current scaling)
    identity: int  # the core's code of the identity activation


def codes_of(plan: Plan) -> Codes:
    current = plan.kind == "current"
    return Codes(plan, current, dtype_code(plan.fwd_dtype), plan.force_pow2_scales,
                 plan.amax_epsilon, dtype_code(plan.bwd_dtype),
                 0 if current else algo_code(plan.algo), enum_code("Activation", "identity"))


class _Backward(NamedTuple):
    """What the backward of one compiled forward needs besides its saved tensors."""

    codes: Codes
    bwd_meta: tuple  # (history, scale, scale_inv) of grad_output, updated in place (delayed)
    need: tuple  # (dgrad, wgrad, bias)
    dtypes: tuple  # of input, weight and bias
    input_shape: torch.Size


def _operator(inp, weight, bias, scales, history, current: bool, fp8_dtype: int, pow2: bool,
              epsilon: float, need_dgrad: bool, need_wgrad: bool, own_buffers: bool) -> list:
    """The compiled operator's call: [output, input scale_inv, weight scale_inv, column-wise
    input, column-wise weight]."""
    ws = workspace_for(inp)
    status, *outs = _compiled.ops.linear_fp8_forward.default(
        inp, weight, bias, scales, history, _compiled.NO_TENSOR if ws is None else ws, current,
        fp8_dtype, pow2, epsilon, need_dgrad, need_wgrad, own_buffers, stream_of(inp))
    _compiled.raise_if_failed(status)
    return outs


@custom_op("transformer_engine::linear_block_forward", mutates_args=("history",))
def linear_block_forward(
        inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
        scales: torch.Tensor, history: torch.Tensor, current: bool, fp8_dtype: int, pow2: bool,
        epsilon: float, need_dgrad: bool, need_wgrad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operator as a traced graph's node: its outputs in allocations of their own (a
    custom op's outputs may not share storage)."""
    return tuple(_operator(inp, weight, bias, scales, history, current, fp8_dtype, pow2, epsilon,
                           need_dgrad, need_wgrad, True))


@linear_block_forward.register_fake
def _(inp, weight, bias, scales, history, current, fp8_dtype, pow2, epsilon, need_dgrad,
      need_wgrad):
    n, k = weight.shape
    m = inp.numel() // k
    f32, u8 = torch.float32, torch.uint8
    return (inp.new_empty((*inp.shape[:-1], n)), inp.new_empty((1,), dtype=f32),
            inp.new_empty((1,), dtype=f32), inp.new_empty((k if need_wgrad else 0, m), dtype=u8),
            inp.new_empty((k if need_dgrad else 0, n), dtype=u8))


def _forward(inp, weight, bias, scales, history, codes: Codes, need_dgrad: bool,
             need_wgrad: bool) -> list:
    """The operator, in eager mode straight away, traced as linear_block_forward."""
    args = (inp, weight, bias, scales, history, codes.current, codes.fp8_dtype, codes.pow2,
            codes.epsilon, need_dgrad, need_wgrad)
    if _compiled.tracing():
        return linear_block_forward(*args)
    return _operator(*args, False)


class _Fp8Linear(torch.autograd.Function):
    """``inp @ weight^T (+ bias)`` through the compiled forward, saving the FP8 column-wise
    input and weight (what Fp8LinearFunction saves) for linear_backward."""

    @staticmethod
    def forward(ctx, inp, weight, bias, scales, history, codes: Codes, bwd_meta: tuple,
                need_dgrad: bool, need_wgrad: bool):
        out, x_sinv, w_sinv, x_col, w_col = _forward(inp, weight, bias, scales, history, codes,
                                                     need_dgrad, need_wgrad)
        ctx.save_for_backward(x_sinv, w_sinv, x_col, w_col)
        ctx.info = _Backward(codes, bwd_meta, (need_dgrad, need_wgrad, bias is not None),
                             (inp.dtype, weight.dtype, None if bias is None else bias.dtype),
                             inp.shape)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x_sinv, w_sinv, x_col, w_col = ctx.saved_tensors
        b = ctx.info
        need_dgrad, need_wgrad, _ = b.need
        if torch.compiler.is_compiling():  # (usable() has taken the compiled backward's rule)
            return (*_traced_backward(grad_output, ctx.saved_tensors, b), None, None, None,
                    None, None, None)
        saved = (x_col if need_wgrad else None, x_sinv, w_col if need_dgrad else None, w_sinv)
        # (one compiled operator call where compiled_grads.usable says so)
        grads = linear_backward(grad_output, saved, b.codes.plan, b.bwd_meta, None, None, b.need,
                                b.dtypes, b.input_shape)
        return (*grads, None, None, None, None, None, None)


_apply_fp8_linear = eager_apply(_Fp8Linear)


def _traced_backward(grad_output, saved, b: _Backward) -> tuple:
    """(grad_input, grad_weight, grad_bias), None where not needed, as one node of a traced
    graph: compiled_grads.linear_grads' operator call with the codes made in the forward."""
    x_sinv, w_sinv, x_col, w_col = saved
    c = b.codes
    need_dgrad, need_wgrad, has_bias = b.need
    in_dtype, w_dtype, b_dtype = b.dtypes
    history, scale, scale_inv = b.bwd_meta
    g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
    gi, gw, gb = compiled_grads.linear_block_backward(
        g, None, c.identity, x_sinv, w_sinv, x_col, w_col, history, scale, scale_inv, 0, True,
        c.current, c.fp8_dtype, c.bwd_dtype, c.pow2, c.epsilon, c.algo, c.plan.margin,
        need_dgrad, need_wgrad, in_dtype, w_dtype, b_dtype if has_bias else None)
    return (gi.view(b.input_shape) if need_dgrad else None, gw if need_wgrad else None,
            gb if has_bias else None)




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
    if (out is not None and weight is module._parameters.get("weight")  # not split or derived
            and not torch.compiler.is_compiling()):
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
    return _apply_fp8_linear(inp, weight, bias, scales, history, codes, bwd_meta, need_dgrad,
                             need_wgrad)
