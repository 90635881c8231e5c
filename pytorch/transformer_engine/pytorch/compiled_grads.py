"""The backward of an FP8 linear layer as one compiled operator call, in eager mode.

The backward of every per-tensor FP8 linear layer is the same few steps: its grad_output
(through an activation's derivative in LayerNormMLP's first GEMM) cast to FP8 with the bias
gradient in the same pass, delayed scaling's scale update, the dgrad and wgrad GEMMs. In
Python that is five to ten op calls, each with its wrapper's host time; here it is one call of
``torch.ops.te_eager.linear_fp8_backward`` (``pytorch/csrc/eager/``, on the LibTorch
stable ABI), which makes the same core calls with the same arguments, so the same bits
(``tests/pytorch/test_compiled_grads.py``). te.Linear (both of its forward paths),
LayerNormLinear and LayerNormMLP's second GEMM take it where ``usable`` says so, and their
Python steps otherwise. (The operator can run LayerNormMLP's first GEMM too, through the
activation's derivative, but the Python steps free FC1's output and its gradient as soon as
the activation's backward has read them, which keeps that backward's peak memory lower than
one call could.) It is also the custom op ``transformer_engine::linear_block_backward``, the
node of te.Linear's backward in the graphs torch.compile traces (fast_linear.py).
``enabled = False`` turns it off (for comparisons).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from transformer_engine.common.plan import GEMM_GRANULE

from . import _compiled
from .fp8 import COMPILED_ALGOS
from .ops._backend import algo_code, custom_op, dtype_code, enum_code, stream_of, workspace_for
from .quantization import Plan

enabled = True


def usable(plan: Plan, recipe: Any, history: torch.Tensor, tokens: int,
           *tensors: Optional[torch.Tensor]) -> bool:
    """Whether the backward under ``plan`` can run through the compiled operator: the rule of
    every compiled operator (_compiled.serves), a token count the GEMMs take unpadded (a
    multiple of 16; linear_fn pads other counts), and under delayed scaling the core's scale
    update (``recipe`` None: no user callable, no amax group)."""
    return (enabled and tokens % GEMM_GRANULE == 0
            and (plan.kind == "current" or (recipe is None and plan.algo in COMPILED_ALGOS))
            and _compiled.serves(plan, history, tensors))


def _opt(t: Optional[torch.Tensor]) -> torch.Tensor:
    return _compiled.NO_TENSOR if t is None else t


@custom_op("transformer_engine::linear_block_backward",
           mutates_args=("grad_history", "grad_scale", "grad_scale_inv"))
def linear_block_backward(
        g: torch.Tensor, h: Optional[torch.Tensor], act: int, x_sinv: torch.Tensor,
        w_sinv: torch.Tensor, x_col: Optional[torch.Tensor], w_col: Optional[torch.Tensor],
        grad_history: torch.Tensor, grad_scale: torch.Tensor, grad_scale_inv: torch.Tensor,
        column: int, update: bool, current: bool, fwd_dtype: int, bwd_dtype: int, pow2: bool,
        epsilon: float, algo: int, margin: int, need_dgrad: bool, need_wgrad: bool,
        grad_dtype: torch.dtype, weight_dtype: torch.dtype, bias_dtype: Optional[torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear.cpp's linear_fp8_backward: (grad_input, grad_weight, grad_bias), each an empty
    float32 tensor of its own where not computed."""
    ws = workspace_for(g)
    status, *grads = _compiled.ops.linear_fp8_backward.default(
        g, h, act, x_sinv, w_sinv, _opt(x_col), _opt(w_col), grad_history, grad_scale,
        grad_scale_inv, column, update, _opt(ws), current, fwd_dtype, bwd_dtype, pow2, epsilon,
        algo, margin, need_dgrad, need_wgrad, grad_dtype, weight_dtype, bias_dtype, stream_of(g))
    _compiled.raise_if_failed(status)
    return tuple(grads)


@linear_block_backward.register_fake
def _(g, h, act, x_sinv, w_sinv, x_col, w_col, grad_history, grad_scale, grad_scale_inv, column,
      update, current, fwd_dtype, bwd_dtype, pow2, epsilon, algo, margin, need_dgrad, need_wgrad,
      grad_dtype, weight_dtype, bias_dtype):
    m = g.shape[0]
    n = g.shape[1] if h is None else h.shape[1]
    k = w_col.shape[0] if need_dgrad else x_col.shape[0]
    def shaped(shape, dtype, needed: bool):
        return g.new_empty(shape if needed else (0,), dtype=dtype if needed else torch.float32)

    return (shaped((m, k), grad_dtype, need_dgrad), shaped((n, k), weight_dtype, need_wgrad),
            shaped((n,), bias_dtype, bias_dtype is not None))


def linear_grads(g: torch.Tensor, h: Optional[torch.Tensor], act: str, saved: tuple,
                 plan: Plan, bwd_meta: tuple, column: int, update: bool, need: tuple,
                 dtypes: tuple) -> tuple:
    """(grad_input [M, K], grad_weight [N, K], grad_bias [N]) of one FP8 linear layer, each
    None where ``need`` = (dgrad, wgrad, bias) says so (dgrad or wgrad must be needed), for a
    backward ``usable`` accepted.

    ``g`` [M, N'] is the grad_output reaching the layer's activation ``act`` (``"identity"``:
    none, ``h`` None), whose forward input was ``h`` [M, N]; ``saved`` = (column-wise input
    [K, M], its scale_inv, column-wise weight [K, N], its scale_inv), None where the GEMM that
    reads it is not needed; ``bwd_meta`` = (history, scale, scale_inv) of grad_output, whose
    ``column`` this layer's amax goes into, updated (all columns) when ``update``;
    ``dtypes`` = of grad_input, weight and bias."""
    in_col, in_sinv, w_col, w_sinv = saved
    need_dgrad, need_wgrad, has_bias = need
    history, scale, scale_inv = bwd_meta
    grad_dtype, w_dtype, b_dtype = dtypes
    current = plan.kind == "current"
    gi, gw, gb = _compiled.call(
        linear_block_backward, g, h, enum_code("Activation", act), in_sinv, w_sinv, in_col,
        w_col, history, scale, scale_inv, column, update, current, dtype_code(plan.fwd_dtype),
        dtype_code(plan.bwd_dtype), plan.force_pow2_scales, plan.amax_epsilon,
        0 if current else algo_code(plan.algo), plan.margin, need_dgrad, need_wgrad,
        grad_dtype, w_dtype, b_dtype if has_bias else None)
    return (gi if need_dgrad else None, gw if need_wgrad else None, gb if has_bias else None)
