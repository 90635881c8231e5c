"""A norm and the FP8 GEMM after it as one compiled operator call, in eager mode.

LayerNormLinear's forward, and the first half of LayerNormMLP's, is the norm writing the GEMM's
FP8 input (layernorm_linear_fn.norm_to_fp8) and the GEMM (linear_fn.fp8_gemm): two op calls in
Python, each with its wrapper's host time. ``torch.ops.te_eager.norm_linear_fp8_forward``
(``pytorch/csrc/eager_ops.cpp``, on the LibTorch stable ABI) makes the same core calls with the
same arguments in one call, so the same bits (``tests/pytorch/test_compiled_norm_linear.py``).
The autograd functions take it where ``usable`` says so, and their Python steps otherwise;
``enabled = False`` turns it off (for comparisons).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from transformer_engine.common.plan import GEMM_GRANULE

from . import _compiled, first_step
from .ops._backend import core, dtype_code, stream_of, workspace_for
from .quantization import Operand, Plan

if TYPE_CHECKING:  # (layernorm_linear_fn imports this module)
    from .layernorm_linear_fn import NormConfig

enabled = True
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NORM_CODES: dict[str, int] = {}


def usable(plan: Plan, cfg: NormConfig, x: torch.Tensor, gamma, beta, w_data, w_sinv, bias,
           history: Optional[torch.Tensor]) -> bool:
    """Whether the forward of norm(x) @ w^T (+ bias) can run through the compiled operator:
    it is built and on; per-tensor delayed scaling recording its amax (``history``, None in a
    checkpoint's recompute) into a history some step has written (a first step's rule is
    first_step.py's), or per-tensor current scaling; no ln_out returned; a token count the
    GEMM takes unpadded (a multiple of 16); a bias in x's dtype; eager, plain tensors."""
    if _compiled.ops is None or not enabled or cfg.return_ln_out or x.shape[0] % GEMM_GRANULE:
        return False
    if plan.kind == "delayed":
        if history is None or first_step.has_empty(history):
            return False
    elif plan.kind != "current" or plan.input_mode != "tensor":
        return False
    if plan.weight_mode != "tensor" or (bias is not None and bias.dtype != x.dtype):
        return False
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in _PLAIN for t in (x, gamma, beta, w_data, w_sinv, bias))


def _norm_code(norm: str) -> int:
    code = _NORM_CODES.get(norm)
    if code is None:
        code = _NORM_CODES[norm] = int(getattr(core().Norm, norm).value)
    return code


def forward(plan: Plan, cfg: NormConfig, x: torch.Tensor, gamma, beta, w_data, w_sinv, bias,
            scales: torch.Tensor, history: Optional[torch.Tensor], columnwise: bool
            ) -> tuple[torch.Tensor, Operand, torch.Tensor, torch.Tensor]:
    """(output [M, N], the norm output's FP8 operand (its row-wise copy is the operator's
    own: only its column-wise copy and scale_inv come back), mu, rsigma), for a forward
    ``usable`` accepted. ``x`` [M, K] contiguous; the scale is ``scales[0]``."""
    ws = workspace_for(x)
    none = _compiled.NO_TENSOR
    status, out, sinv, col, mu, rsigma = _compiled.ops.norm_linear_fp8_forward.default(
        x, gamma, beta, _norm_code(cfg.norm), cfg.eps, cfg.zero_centered_gamma, w_data, w_sinv,
        bias, scales, scales if history is None else history, none if ws is None else ws,
        plan.kind == "current", dtype_code(plan.fwd_dtype), plan.force_pow2_scales,
        plan.amax_epsilon, columnwise, stream_of(x))
    _compiled.raise_if_failed(status)
    return out, Operand(none, sinv, col, sinv, plan.fwd_dtype, plan.input_mode), mu, rsigma
