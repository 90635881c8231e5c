"""The forward steps of the fused FP8 blocks as compiled operator calls, in eager mode.

LayerNormLinear's forward is the norm writing the GEMM's FP8 input
(layernorm_linear_fn.norm_to_fp8) and the GEMM (linear_fn.fp8_gemm); LayerNormMLP's is that,
then the activation writing FC2's FP8 input (layernorm_mlp_fn.act_to_fp8) and FC2. In Python
each step is an op call with its wrapper's host time. ``torch.ops.te_eager``'s
``norm_linear_fp8_forward`` and ``act_linear_fp8_forward`` (``pytorch/csrc/eager/``, on
the LibTorch stable ABI) make the same core calls with the same arguments, a pair of steps per
call, so the same bits (``tests/pytorch/test_compiled_forward.py``). The autograd functions
take them where ``usable`` says so, and their Python steps otherwise; ``enabled = False`` turns
them off (for comparisons).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from transformer_engine.common.plan import GEMM_GRANULE

from . import _compiled
from .ops._backend import dtype_code, enum_code, stream_of, workspace_for
from .quantization import Operand, Plan

if TYPE_CHECKING:  # (layernorm_linear_fn imports this module)
    from .layernorm_linear_fn import NormConfig

enabled = True


def usable(plan: Plan, x: torch.Tensor, tensors: tuple, bias,
           history: Optional[torch.Tensor]) -> bool:
    """Whether a step pair on x [M, K] (norm or activation, then the GEMM) can run through a
    compiled operator: the rule of every compiled operator (_compiled.serves; ``history`` None
    in a checkpoint's recompute, which records no amax), a token count the GEMM takes unpadded
    (a multiple of 16) and a bias in x's dtype."""
    return (enabled and x.shape[0] % GEMM_GRANULE == 0
            and (bias is None or bias.dtype == x.dtype)
            and _compiled.serves(plan, history, (x, bias, *tensors)))


def norm_linear(plan: Plan, cfg: NormConfig, x: torch.Tensor, gamma, beta, w_data, w_sinv, bias,
                scales: torch.Tensor, history: Optional[torch.Tensor], columnwise: bool
                ) -> tuple[torch.Tensor, Operand, torch.Tensor, torch.Tensor]:
    """norm(x) @ w^T (+ bias): (output [M, N], the norm output's FP8 operand (its row-wise
    copy is the operator's own: only its column-wise copy and scale_inv come back), mu,
    rsigma), for a forward ``usable`` accepted (and no ln_out to return). ``x`` [M, K]
    contiguous; the scale is ``scales[0]``."""
    ws = workspace_for(x)
    none = _compiled.NO_TENSOR
    status, out, sinv, col, mu, rsigma = _compiled.ops.norm_linear_fp8_forward.default(
        x, gamma, beta, enum_code("Norm", cfg.norm), cfg.eps, cfg.zero_centered_gamma, w_data,
        w_sinv, bias, scales, scales if history is None else history, none if ws is None else ws,
        plan.kind == "current", dtype_code(plan.fwd_dtype), plan.force_pow2_scales,
        plan.amax_epsilon, columnwise, stream_of(x))
    _compiled.raise_if_failed(status)
    return out, Operand(none, sinv, col, sinv, plan.fwd_dtype, plan.input_mode), mu, rsigma


def act_linear(plan: Plan, act: str, h: torch.Tensor, w_data, w_sinv, bias,
               scales: torch.Tensor, history: Optional[torch.Tensor], columnwise: bool
               ) -> tuple[torch.Tensor, Operand]:
    """act(h) @ w^T (+ bias): (output [M, N], the activation output's FP8 operand (row-wise
    copy the operator's own, as in norm_linear)), for a forward ``usable`` accepted. ``h``
    [M, K] contiguous (gated: [M, 2K]); the scale is ``scales[2]`` (FC2's input column)."""
    ws = workspace_for(h)
    none = _compiled.NO_TENSOR
    status, out, sinv, col = _compiled.ops.act_linear_fp8_forward.default(
        h, enum_code("Activation", act), w_data, w_sinv, bias, scales,
        scales if history is None else history, none if ws is None else ws,
        plan.kind == "current", dtype_code(plan.fwd_dtype), plan.force_pow2_scales,
        plan.amax_epsilon, columnwise, stream_of(h))
    _compiled.raise_if_failed(status)
    return out, Operand(none, sinv, col, sinv, plan.fwd_dtype, plan.input_mode)
