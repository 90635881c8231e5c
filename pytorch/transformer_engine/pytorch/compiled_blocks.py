"""LayerNormLinear's and LayerNormMLP's FP8 step as whole blocks: one autograd node whose
forward and backward are each one compiled operator call, in eager mode.

A small block's step is bound by host time: its Python steps (layernorm_linear_fn,
layernorm_mlp_fn) make six to twelve op calls, each with its wrapper, its allocations and its
bookkeeping. ``torch.ops.te_eager``'s ``layernorm_linear_fp8_forward`` / ``_backward`` and
``layernorm_mlp_fp8_forward`` / ``_backward`` (``pytorch/csrc/eager/blocks.cpp``, on the
LibTorch stable ABI) make the same core calls with the same arguments from the weights' casts
to the output and from grad_output to every gradient, so the same bits
(``tests/pytorch/test_compiled_blocks.py``).

The modules take them where ``usable`` says so: per-tensor delayed or current scaling in eager
mode outside activation checkpoints, plain high-precision weights cast for this forward alone
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
from .fp8 import COMPILED_ALGOS
from .ops._backend import algo_code, dtype_code, enum_code, stream_of, workspace_for
from .quantization import Plan

enabled = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)


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
    an activation checkpoint (whose two runs must save tensors of the same shapes), a token
    count the GEMMs take unpadded, the core's scale update under delayed scaling (no user
    callable, no amax group), plain weights cast for this forward alone, biases in the
    input's dtype, and no norm output to return."""
    if not enabled or cfg.return_ln_out or is_first_microbatch is not None:
        return False
    if _compiled.ops is None:
        if inp.is_cuda and not torch.compiler.is_compiling():
            _compiled.warn_if_missing()  # (once)
        return False
    if module._weight_caches:
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
        if type(w) not in _PLAIN or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    for b in biases:
        if b is not None and b.dtype != inp.dtype:
            return False
    return _compiled.serves(plan, history, (inp, *weights, *biases, *norm_params))


def _workspace(x: torch.Tensor) -> torch.Tensor:
    ws = workspace_for(x)
    return _compiled.NO_TENSOR if ws is None else ws


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
        status, out, *saved = _compiled.ops.layernorm_linear_fp8_forward.default(
            x, gamma, beta, codes.norm, codes.eps, codes.zero_centered_gamma, weight, bias,
            scales, history, _workspace(x), codes.current, codes.fwd_dtype, codes.pow2,
            codes.epsilon, need_dgrad, need_wgrad, stream_of(x))
        _compiled.raise_if_failed(status)
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
        status, dx, dgamma, dbeta, gw, gb = _compiled.ops.layernorm_linear_fp8_backward.default(
            g, x, mu, rsigma, gamma, has_beta, c.norm, c.zero_centered_gamma, ln_sinv, ln_col,
            w_sinv, w_col, history, scale, scale_inv, _workspace(g), c.current, c.fwd_dtype,
            c.bwd_dtype, c.pow2, c.epsilon, c.algo, c.margin, need_dgrad, need_wgrad, w_dtype,
            b_dtype, stream_of(g))
        _compiled.raise_if_failed(status)
        if not need_dgrad:
            dx = dgamma = dbeta = None
        else:
            dx = dx.view(b.input_shape)
            dbeta = dbeta if has_beta else None
        return (dx, dgamma, dbeta, gw if need_wgrad else None,
                gb if b_dtype is not None else None, None, None, None, None, None, None)


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
        status, out, *_ = _compiled.ops.layernorm_linear_fp8_forward.default(
            x, gamma, beta, codes.norm, codes.eps, codes.zero_centered_gamma,
            weight.contiguous(), bias, scales, history, _workspace(x), codes.current,
            codes.fwd_dtype, codes.pow2, codes.epsilon, False, False, stream_of(x))
        _compiled.raise_if_failed(status)
        return out
    return LayerNormLinearBlock.apply(inp.contiguous(), gamma, beta, weight.contiguous(), bias,
                                      scales, history, bwd_meta, codes, need_dgrad, need_wgrad)


class LayerNormMlpBlock(torch.autograd.Function):
    """norm -> FC1 -> activation -> FC2: Fp8LayerNormMLPFunction's numbers in two operator
    calls. ``need`` = (FC1's dgrad, FC1's wgrad, FC2's wgrad, anything before FC2)."""

    @staticmethod
    def forward(ctx, inp, gamma, beta, w1, b1, w2, b2, scales, history, bwd_meta, codes: Codes,
                act: int, need: tuple):
        need_dgrad, need_wgrad1, need_wgrad2, need_fc1 = need
        x = inp.reshape(-1, inp.shape[-1])
        status, out, *saved = _compiled.ops.layernorm_mlp_fp8_forward.default(
            x, gamma, beta, codes.norm, codes.eps, codes.zero_centered_gamma, w1, b1, act, w2,
            b2, scales, history, _workspace(x), codes.current, codes.fwd_dtype, codes.pow2,
            codes.epsilon, need_dgrad, need_wgrad1, need_fc1, need_wgrad2, stream_of(x))
        _compiled.raise_if_failed(status)
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
        status, dx, dgamma, dbeta, gw1, gb1, gw2, gb2 = \
            _compiled.ops.layernorm_mlp_fp8_backward.default(
                g, x, mu, rsigma, gamma, has_beta, c.norm, c.zero_centered_gamma, ln_sinv, ln_col,
                w1_sinv, w1_col, h, b.act, a_sinv, a_col, w2_sinv, w2_col, history, scale,
                scale_inv, _workspace(g), c.current, c.fwd_dtype, c.bwd_dtype, c.pow2, c.epsilon,
                c.algo, c.margin, need_dgrad, need_wgrad1, need_fc1, need_wgrad2, w1_dtype,
                b1_dtype, w2_dtype, b2_dtype, stream_of(g))
        _compiled.raise_if_failed(status)
        if need_fc1 and need_dgrad:
            dx = dx.view(b.input_shape)
            dbeta = dbeta if has_beta else None
        else:
            dx = dgamma = dbeta = None
        fc1 = need_fc1 and b1_dtype is not None
        return (dx, dgamma, dbeta, gw1 if need_fc1 and need_wgrad1 else None,
                gb1 if fc1 else None, gw2 if need_wgrad2 else None,
                gb2 if b2_dtype is not None else None, None, None, None, None, None, None)


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
    if tokens * w1.shape[0] * inp.element_size() >= layernorm_mlp_fn.LEAN_BYTES:
        return None
    codes = _codes(plan, cfg)
    act_code = enum_code("Activation", act)
    w1, w2 = w1.contiguous(), w2.contiguous()
    grad = torch.is_grad_enabled()
    if not (need_fc1 or need_wgrad2):
        if grad and b2 is not None and b2.requires_grad:
            return None
        x = inp.reshape(-1, inp.shape[-1]).contiguous()
        status, out, *_ = _compiled.ops.layernorm_mlp_fp8_forward.default(
            x, gamma, beta, codes.norm, codes.eps, codes.zero_centered_gamma, w1, b1, act_code,
            w2, b2, scales, history, _workspace(x), codes.current, codes.fwd_dtype, codes.pow2,
            codes.epsilon, False, False, False, False, stream_of(x))
        _compiled.raise_if_failed(status)
        return out
    if need_fc1 and not (need_dgrad or need_wgrad1):
        return None
    return LayerNormMlpBlock.apply(inp.contiguous(), gamma, beta, w1, b1, w2, b2, scales,
                                   history, bwd_meta, codes, act_code, need)
