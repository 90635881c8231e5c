"""LayerNormLinear's and LayerNormMLP's FP8 step as whole blocks: one autograd node whose
forward and backward are each one compiled operator call, in eager mode and in the graphs
torch.compile traces.

A small block's step is bound by host time: its Python steps (layernorm_linear_fn,
layernorm_mlp_fn) make six to twelve op calls, each with its wrapper, its allocations and its
bookkeeping. ``torch.ops.te_eager``'s ``layernorm_linear_fp8_forward`` / ``_backward`` and
``layernorm_mlp_fp8_forward`` / ``_backward`` (``pytorch/csrc/eager/blocks.cpp``, on the
LibTorch stable ABI) make the same core calls with the same arguments from the weights' casts
to the output and from grad_output to every gradient, so the same bits
(``tests/pytorch/test_compiled_blocks.py``).

The modules take them where ``usable`` says so: per-tensor delayed or current scaling outside
activation checkpoints (traced: current scaling, and delayed scaling once no history column is
empty; a first step's graph keeps the Python steps' first-step rule), plain high-precision
weights cast for this forward alone
(no first-microbatch cache, no FP8 parameters), no norm output returned, no FP8 output, and,
for the MLP, an FC1 output small enough that the Python steps' memory-lean backward order
would not be taken (layernorm_mlp_fn.LEAN_BYTES). Everything else takes the Python steps.
``enabled = False`` turns them off (for comparisons).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from transformer_engine.common.plan import GEMM_GRANULE

from . import _compiled, fp8, layernorm_mlp_fn, ops
from ._autograd import eager_apply
from .fp8 import COMPILED_ALGOS
from .ops._backend import algo_code, custom_op, dtype_code, enum_code, stream_of, workspace_for
from .quantization import Plan

enabled = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Codes(NamedTuple):
    """What a block's operators take of its plan and norm, as their arguments (the core's
    codes), made once per forward and kept for the backward."""

    current: bool
    fwd_dtype: int
    bwd_dtype: int
    pow2: bool
    epsilon: float
    algo: int
    margin: int
    norm: int
    eps: float
    zero_centered_gamma: bool


def _codes(plan: Plan, cfg) -> Codes:
    current = plan.kind == "current"
    return Codes(current, dtype_code(plan.fwd_dtype), dtype_code(plan.bwd_dtype),
                 plan.force_pow2_scales, plan.amax_epsilon, 0 if current else algo_code(plan.algo),
                 plan.margin, enum_code("Norm", cfg.norm), cfg.eps, cfg.zero_centered_gamma)


def usable(plan: Plan, bwd_recipe: Any, history: Optional[torch.Tensor], inp: torch.Tensor,
           weights: tuple, biases: tuple, norm_params: tuple, cfg,
           is_first_microbatch: Optional[bool], module) -> bool:
    """Whether a block's FP8 forward (its input checked by the module) can run whole: the
    rule of every compiled operator (_compiled.serves: a per-tensor delayed or current plan,
    a delayed history that a step has written, plain tensors, not traced), eager and outside
    an activation checkpoint (whose two runs must save tensors of the same shapes), no
    deferred weight gradients (delay_wgrad_compute's backward keeps them apart), a token
    count the GEMMs take unpadded, the core's scale update under delayed scaling (no user
    callable, no amax group), plain weights cast for this forward alone, and no norm output
    to return. Traced by torch.compile, the graph takes the
    blocks' custom ops under current scaling and, under delayed scaling, once no history
    column is empty."""
    if not enabled or cfg.return_ln_out or is_first_microbatch is not None:
        return False
    if _compiled.ops is None:
        if inp.is_cuda and not torch.compiler.is_compiling():
            _compiled.warn_if_missing()  # (once)
        return False
    if module._weight_caches or module._wgrad_store is not None:  # (delay_wgrad_compute)
        return False
    r = fp8.RECOMPUTE
    if r.recording is not None or r.replay is not None:
        return False
    tokens = inp.numel() // inp.shape[-1] if inp.dim() else 0
    if tokens == 0 or tokens % GEMM_GRANULE:
        return False
    if plan.kind == "delayed" and (bwd_recipe is not None or plan.algo not in COMPILED_ALGOS):
        return False
    for w in weights:
        if type(w) not in _PLAIN or w.dtype not in _FLOATS:
            return False
    for b in biases:
        if b is not None and b.dtype not in _FLOATS:
            return False
    if torch.compiler.is_compiling():  # a traced graph calls the blocks' custom ops
        return _compiled.serves_traced(plan, history)
    return _compiled.serves(plan, history, (inp, *weights, *biases, *norm_params))


def _workspace(x: torch.Tensor) -> torch.Tensor:
    ws = workspace_for(x)
    return _compiled.NO_TENSOR if ws is None else ws


# The blocks' operators as custom ops: an eager call with plain tensors runs the implementation
# directly (one te_eager call, its status raised); torch.compile traces them as one graph node
# each with the fake implementation's shapes, and its graph then calls them through the
# dispatcher, one call per block and direction where the Python steps make six to twelve.
# What a call does not compute comes back as an empty float32 tensor of its own (outputs must
# not alias), as the fakes give it.
_NS = "transformer_engine"


def _empty(like: torch.Tensor, *shape, dtype=torch.uint8) -> torch.Tensor:
    return like.new_empty(shape if shape else (0,), dtype=dtype)


def _norm_gemm_like(x: torch.Tensor, beta, n: int, need_dgrad: bool, need_wgrad: bool) -> tuple:
    """What the norm and the GEMM after it return (blocks.cpp), for the fakes: the output
    [M, n], the norm output's scale_inv and column-wise copy, mu (LayerNorm) and rsigma, the
    weight's scale_inv and column-wise copy."""
    m, k = x.shape
    f32 = torch.float32
    return (x.new_empty((m, n)), _empty(x, 1, dtype=f32),
            _empty(x, k, m) if need_wgrad else _empty(x),
            _empty(x, m if beta is not None else 0, dtype=f32), _empty(x, m, dtype=f32),
            _empty(x, 1, dtype=f32), _empty(x, k if need_dgrad else 0, n))


def _state(scales: torch.Tensor, history: Optional[torch.Tensor]) -> torch.Tensor:
    """The history the operators take (current scaling reads none: the scales stand in)."""
    return scales if history is None or history.numel() == 0 else history


@custom_op(f"{_NS}::layernorm_linear_block_forward", mutates_args=("history",))
def layernorm_linear_block_forward(
        x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
        weight: torch.Tensor, bias: Optional[torch.Tensor], scales: torch.Tensor,
        history: Optional[torch.Tensor], norm: int, eps: float, zero_centered_gamma: bool,
        current: bool, fp8_dtype: int, pow2: bool, epsilon: float, need_dgrad: bool,
        need_wgrad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks.cpp's layernorm_linear_fp8_forward: (output [M, N], the norm output's
    scale_inv and column-wise copy, mu, rsigma, the weight's scale_inv and column-wise copy)."""
    status, *outs = _compiled.ops.layernorm_linear_fp8_forward.default(
        x, gamma, beta, norm, eps, zero_centered_gamma, weight, bias, scales,
        _state(scales, history), _workspace(x), current, fp8_dtype, pow2, epsilon, need_dgrad,
        need_wgrad, stream_of(x))
    _compiled.raise_if_failed(status)
    return tuple(outs)


@layernorm_linear_block_forward.register_fake
def _(x, gamma, beta, weight, bias, scales, history, norm, eps, zero_centered_gamma, current,
      fp8_dtype, pow2, epsilon, need_dgrad, need_wgrad):
    return _norm_gemm_like(x, beta, weight.shape[0], need_dgrad, need_wgrad)


@custom_op(f"{_NS}::layernorm_linear_block_backward",
           mutates_args=("grad_history", "grad_scale", "grad_scale_inv"))
def layernorm_linear_block_backward(
        g: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
        gamma: torch.Tensor, has_beta: bool, ln_sinv: torch.Tensor, ln_col: torch.Tensor,
        w_sinv: torch.Tensor, w_col: torch.Tensor, grad_history: torch.Tensor,
        grad_scale: torch.Tensor, grad_scale_inv: torch.Tensor, norm: int,
        zero_centered_gamma: bool, current: bool, fwd_dtype: int, bwd_dtype: int, pow2: bool,
        epsilon: float, algo: int, margin: int, need_dgrad: bool, need_wgrad: bool,
        weight_dtype: torch.dtype, bias_dtype: Optional[torch.dtype],
        grad_input_add: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks.cpp's layernorm_linear_fp8_backward: (grad_input, grad_gamma, grad_beta,
    grad_weight, grad_bias), empty where not computed. ``grad_input_add`` (x's shape and
    dtype, with need_dgrad): a residual gradient added into grad_input by the norm's backward,
    with the bits of adding it in a step of its own."""
    status, *grads = _compiled.ops.layernorm_linear_fp8_backward.default(
        g, x, mu, rsigma, gamma, has_beta, norm, zero_centered_gamma, ln_sinv, ln_col, w_sinv,
        w_col, grad_history, grad_scale, grad_scale_inv, _workspace(g), current, fwd_dtype,
        bwd_dtype, pow2, epsilon, algo, margin, need_dgrad, need_wgrad, weight_dtype,
        bias_dtype, grad_input_add, stream_of(g))
    _compiled.raise_if_failed(status)
    return tuple(grads)


@layernorm_linear_block_backward.register_fake
def _(g, x, mu, rsigma, gamma, has_beta, ln_sinv, ln_col, w_sinv, w_col, grad_history,
      grad_scale, grad_scale_inv, norm, zero_centered_gamma, current, fwd_dtype, bwd_dtype, pow2,
      epsilon, algo, margin, need_dgrad, need_wgrad, weight_dtype, bias_dtype,
      grad_input_add=None):
    m, k = x.shape
    n = g.shape[1]
    f32 = torch.float32
    dx = ((x.new_empty((m, k)), gamma.new_empty((k,)), gamma.new_empty((k if has_beta else 0,)))
          if need_dgrad else (_empty(x, dtype=f32),) * 3)
    return (*dx, x.new_empty((n, k), dtype=weight_dtype) if need_wgrad else _empty(x, dtype=f32),
            x.new_empty((n,), dtype=bias_dtype) if bias_dtype is not None
            else _empty(x, dtype=f32))


@custom_op(f"{_NS}::layernorm_mlp_block_forward", mutates_args=("history",))
def layernorm_mlp_block_forward(
        x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], w1: torch.Tensor,
        b1: Optional[torch.Tensor], w2: torch.Tensor, b2: Optional[torch.Tensor],
        scales: torch.Tensor, history: Optional[torch.Tensor], norm: int, eps: float,
        zero_centered_gamma: bool, act: int, current: bool, fp8_dtype: int, pow2: bool,
        epsilon: float, need_dgrad: bool, need_wgrad1: bool, need_fc1: bool, need_wgrad2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks.cpp's layernorm_mlp_fp8_forward: (output, then what the backward reads)."""
    status, *outs = _compiled.ops.layernorm_mlp_fp8_forward.default(
        x, gamma, beta, norm, eps, zero_centered_gamma, w1, b1, act, w2, b2, scales,
        _state(scales, history), _workspace(x), current, fp8_dtype, pow2, epsilon, need_dgrad,
        need_wgrad1, need_fc1, need_wgrad2, stream_of(x))
    _compiled.raise_if_failed(status)
    return tuple(outs)


@layernorm_mlp_block_forward.register_fake
def _(x, gamma, beta, w1, b1, w2, b2, scales, history, norm, eps, zero_centered_gamma, act,
      current, fp8_dtype, pow2, epsilon, need_dgrad, need_wgrad1, need_fc1, need_wgrad2):
    m = x.shape[0]
    n, f = w2.shape
    h, *fc1 = _norm_gemm_like(x, beta, w1.shape[0], need_dgrad, need_wgrad1)
    f32 = torch.float32
    return (x.new_empty((m, n)), *fc1, h, _empty(x, 1, dtype=f32),
            _empty(x, f, m) if need_wgrad2 else _empty(x),
            _empty(x, 1, dtype=f32), _empty(x, f if need_fc1 else 0, n))


@custom_op(f"{_NS}::layernorm_mlp_block_backward",
           mutates_args=("grad_history", "grad_scale", "grad_scale_inv"))
def layernorm_mlp_block_backward(
        g: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
        gamma: torch.Tensor, has_beta: bool, ln_sinv: torch.Tensor, ln_col: torch.Tensor,
        w1_sinv: torch.Tensor, w1_col: torch.Tensor, h: torch.Tensor, act: int,
        a_sinv: torch.Tensor, a_col: torch.Tensor, w2_sinv: torch.Tensor, w2_col: torch.Tensor,
        grad_history: torch.Tensor, grad_scale: torch.Tensor, grad_scale_inv: torch.Tensor,
        norm: int, zero_centered_gamma: bool, current: bool, fwd_dtype: int, bwd_dtype: int,
        pow2: bool, epsilon: float, algo: int, margin: int, need_dgrad: bool,
        need_wgrad1: bool, need_fc1: bool, need_wgrad2: bool, w1_dtype: torch.dtype,
        b1_dtype: Optional[torch.dtype], w2_dtype: torch.dtype, b2_dtype: Optional[torch.dtype],
        grad_input_add: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """blocks.cpp's layernorm_mlp_fp8_backward: (grad_input, grad_gamma, grad_beta, FC1's
    grad_weight and grad_bias, FC2's), empty where not computed; ``grad_input_add`` as in
    layernorm_linear_block_backward (with need_fc1 and need_dgrad)."""
    status, *grads = _compiled.ops.layernorm_mlp_fp8_backward.default(
        g, x, mu, rsigma, gamma, has_beta, norm, zero_centered_gamma, ln_sinv, ln_col, w1_sinv,
        w1_col, h, act, a_sinv, a_col, w2_sinv, w2_col, grad_history, grad_scale,
        grad_scale_inv, _workspace(g), current, fwd_dtype, bwd_dtype, pow2, epsilon, algo,
        margin, need_dgrad, need_wgrad1, need_fc1, need_wgrad2, w1_dtype, b1_dtype, w2_dtype,
        b2_dtype, grad_input_add, stream_of(g))
    _compiled.raise_if_failed(status)
    return tuple(grads)


@layernorm_mlp_block_backward.register_fake
def _(g, x, mu, rsigma, gamma, has_beta, ln_sinv, ln_col, w1_sinv, w1_col, h, act, a_sinv,
      a_col, w2_sinv, w2_col, grad_history, grad_scale, grad_scale_inv, norm,
      zero_centered_gamma, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin,
      need_dgrad, need_wgrad1, need_fc1, need_wgrad2, w1_dtype, b1_dtype, w2_dtype, b2_dtype,
      grad_input_add=None):
    m, k = x.shape
    n, f_rows = g.shape[1], h.shape[1]
    f = a_col.shape[0] if need_wgrad2 else w2_col.shape[0]
    f32 = torch.float32
    fc1 = need_fc1 and need_dgrad
    dx = ((x.new_empty((m, k)), gamma.new_empty((k,)), gamma.new_empty((k if has_beta else 0,)))
          if fc1 else (_empty(x, dtype=f32),) * 3)
    gw1 = (x.new_empty((f_rows, k), dtype=w1_dtype) if need_fc1 and need_wgrad1
           else _empty(x, dtype=f32))
    gb1 = (x.new_empty((f_rows,), dtype=b1_dtype) if need_fc1 and b1_dtype is not None
           else _empty(x, dtype=f32))
    gw2 = x.new_empty((n, f), dtype=w2_dtype) if need_wgrad2 else _empty(x, dtype=f32)
    gb2 = x.new_empty((n,), dtype=b2_dtype) if b2_dtype is not None else _empty(x, dtype=f32)
    return (*dx, gw1, gb1, gw2, gb2)


def _in_dtype(bias: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    """A bias as the GEMM's epilogue adds it: in the output's (the input's) dtype, as
    linear_fn._fp8_gemm casts it (an fp32 bias beside bf16 activations: torch.autocast over
    fp32 parameters). Its gradient keeps the bias's own dtype."""
    return bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)


def _linear_forward(x, gamma, beta, weight, bias, scales, history, codes: Codes,
                    need_dgrad: bool, need_wgrad: bool) -> tuple:
    """LayerNormLinear's forward operator on x [M, K]: (output, then what the backward reads)."""
    return _compiled.call(layernorm_linear_block_forward, x, gamma, beta, weight,
                          _in_dtype(bias, x), scales, history, codes.norm, codes.eps,
                          codes.zero_centered_gamma, codes.current, codes.fwd_dtype, codes.pow2,
                          codes.epsilon, need_dgrad, need_wgrad)


def _mlp_forward(x, gamma, beta, w1, b1, w2, b2, scales, history, codes: Codes, act: int,
                 need: tuple) -> tuple:
    """LayerNormMLP's forward operator on x [M, K]: (output, then what the backward reads).
    ``need`` as LayerNormMlpBlock's."""
    need_dgrad, need_wgrad1, need_wgrad2, need_fc1 = need
    return _compiled.call(layernorm_mlp_block_forward, x, gamma, beta, w1, _in_dtype(b1, x), w2,
                          _in_dtype(b2, x), scales, history, codes.norm, codes.eps,
                          codes.zero_centered_gamma, act, codes.current, codes.fwd_dtype,
                          codes.pow2, codes.epsilon, need_dgrad, need_wgrad1, need_fc1,
                          need_wgrad2)


class _Backward(NamedTuple):
    """What a block's backward needs besides its saved tensors."""

    codes: Codes
    bwd_meta: tuple  # (history, scale, scale_inv) of grad_output, updated in place (delayed)
    need: tuple
    dtypes: tuple  # of the weights and biases (None: no bias)
    input_shape: torch.Size
    act: int  # LayerNormMLP's activation code


class LayerNormLinearBlock(torch.autograd.Function):
    """``norm(inp) @ weight^T (+ bias)``: Fp8LayerNormLinearFunction's numbers in two operator
    calls."""

    @staticmethod
    def forward(ctx, inp, gamma, beta, weight, bias, scales, history, bwd_meta, codes: Codes,
                need_dgrad: bool, need_wgrad: bool):
        x = inp.reshape(-1, inp.shape[-1])
        out, *saved = _linear_forward(x, gamma, beta, weight, bias, scales, history, codes,
                                      need_dgrad, need_wgrad)
        ctx.save_for_backward(x, gamma, *saved)
        ctx.info = _Backward(codes, bwd_meta, (need_dgrad, need_wgrad, beta is not None),
                             (weight.dtype, None if bias is None else bias.dtype), inp.shape, 0)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, gamma, ln_sinv, ln_col, mu, rsigma, w_sinv, w_col = ctx.saved_tensors
        b = ctx.info
        c = b.codes
        need_dgrad, need_wgrad, has_beta = b.need
        w_dtype, b_dtype = b.dtypes
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        history, scale, scale_inv = b.bwd_meta
        dx, dgamma, dbeta, gw, gb = _compiled.call(
            layernorm_linear_block_backward,
            g, x, mu, rsigma, gamma, has_beta, ln_sinv, ln_col, w_sinv, w_col, history, scale,
            scale_inv, c.norm, c.zero_centered_gamma, c.current, c.fwd_dtype, c.bwd_dtype,
            c.pow2, c.epsilon, c.algo, c.margin, need_dgrad, need_wgrad, w_dtype, b_dtype)
        if not need_dgrad:
            dx = dgamma = dbeta = None
        else:
            dx = dx.view(b.input_shape)
            dbeta = dbeta if has_beta else None
        return (dx, dgamma, dbeta, gw if need_wgrad else None,
                gb if b_dtype is not None else None, None, None, None, None, None, None)


_apply_linear_block = eager_apply(LayerNormLinearBlock)


def layernorm_linear(inp, gamma, beta, weight, bias, plan: Plan, cfg, scales, history,
                     bwd_meta: tuple, need_dgrad: bool, need_wgrad: bool
                     ) -> Optional[torch.Tensor]:
    """The [M, N] output of a LayerNormLinear forward ``usable`` accepted, or None where its
    backward would need only the bias gradient (the Python steps compute that alone)."""
    grad = torch.is_grad_enabled()
    need_bias = grad and bias is not None and bias.requires_grad
    codes = _codes(plan, cfg)
    if not (need_dgrad or need_wgrad):
        if need_bias:
            return None
        x = inp.reshape(-1, inp.shape[-1]).contiguous()
        return _linear_forward(x, gamma, beta, weight.contiguous(), bias, scales, history, codes,
                               False, False)[0]
    return _apply_linear_block(inp.contiguous(), gamma, beta, weight.contiguous(), bias,
                                      scales, history, bwd_meta, codes, need_dgrad, need_wgrad)


class LayerNormMlpBlock(torch.autograd.Function):
    """norm -> FC1 -> activation -> FC2: Fp8LayerNormMLPFunction's numbers in two operator
    calls. ``need`` = (FC1's dgrad, FC1's wgrad, FC2's wgrad, anything before FC2)."""

    @staticmethod
    def forward(ctx, inp, gamma, beta, w1, b1, w2, b2, scales, history, bwd_meta, codes: Codes,
                act: int, need: tuple):
        x = inp.reshape(-1, inp.shape[-1])
        out, *saved = _mlp_forward(x, gamma, beta, w1, b1, w2, b2, scales, history, codes, act,
                                   need)
        ctx.save_for_backward(x, gamma, *saved)
        ctx.info = _Backward(codes, bwd_meta, (*need, beta is not None),
                             (w1.dtype, None if b1 is None else b1.dtype, w2.dtype,
                              None if b2 is None else b2.dtype), inp.shape, act)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (x, gamma, ln_sinv, ln_col, mu, rsigma, w1_sinv, w1_col, h, a_sinv, a_col, w2_sinv,
         w2_col) = ctx.saved_tensors
        b = ctx.info
        c = b.codes
        need_dgrad, need_wgrad1, need_wgrad2, need_fc1, has_beta = b.need
        w1_dtype, b1_dtype, w2_dtype, b2_dtype = b.dtypes
        g = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        history, scale, scale_inv = b.bwd_meta
        dx, dgamma, dbeta, gw1, gb1, gw2, gb2 = _compiled.call(
            layernorm_mlp_block_backward,
            g, x, mu, rsigma, gamma, has_beta, ln_sinv, ln_col, w1_sinv, w1_col, h, b.act,
            a_sinv, a_col, w2_sinv, w2_col, history, scale, scale_inv, c.norm,
            c.zero_centered_gamma, c.current, c.fwd_dtype, c.bwd_dtype, c.pow2, c.epsilon, c.algo,
            c.margin, need_dgrad, need_wgrad1, need_fc1, need_wgrad2, w1_dtype, b1_dtype,
            w2_dtype, b2_dtype)
        if need_fc1 and need_dgrad:
            dx = dx.view(b.input_shape)
            dbeta = dbeta if has_beta else None
        else:
            dx = dgamma = dbeta = None
        fc1 = need_fc1 and b1_dtype is not None
        return (dx, dgamma, dbeta, gw1 if need_fc1 and need_wgrad1 else None,
                gb1 if fc1 else None, gw2 if need_wgrad2 else None,
                gb2 if b2_dtype is not None else None, None, None, None, None, None, None)


_apply_mlp_block = eager_apply(LayerNormMlpBlock)


def layernorm_mlp(inp, gamma, beta, w1, b1, w2, b2, act: str, plan: Plan, cfg, scales,
                  history, bwd_meta: tuple, need: tuple) -> Optional[torch.Tensor]:
    """The [M, N] output of a LayerNormMLP forward ``usable`` accepted, or None where its
    Python steps must run: an activation the operator does not take by code (one with
    parameters), FC1's output at or above layernorm_mlp_fn.LEAN_BYTES (whose backward takes
    the memory-lean order), or gradients the two calls do not cover (FC1's backward needed
    for its bias alone; FC2's for its bias alone)."""
    if ops.activation.has_params(act):
        return None
    need_dgrad, need_wgrad1, need_wgrad2, need_fc1 = need
    tokens = inp.numel() // inp.shape[-1]
    if layernorm_mlp_fn.large_block(tokens, w1.shape[0], inp.dtype):
        return None
    codes = _codes(plan, cfg)
    act_code = enum_code("Activation", act)
    w1, w2 = w1.contiguous(), w2.contiguous()
    grad = torch.is_grad_enabled()
    if not (need_fc1 or need_wgrad2):
        if grad and b2 is not None and b2.requires_grad:
            return None
        x = inp.reshape(-1, inp.shape[-1]).contiguous()
        return _mlp_forward(x, gamma, beta, w1, b1, w2, b2, scales, history, codes, act_code,
                            (False,) * 4)[0]
    if need_fc1 and not (need_dgrad or need_wgrad1):
        return None
    return _apply_mlp_block(inp.contiguous(), gamma, beta, w1, b1, w2, b2, scales,
                                   history, bwd_meta, codes, act_code, need)
