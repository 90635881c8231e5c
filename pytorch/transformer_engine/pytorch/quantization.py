"""How a recipe quantizes each role (``input``, ``weight``, ``grad_output``) of a GEMM.

A recipe is turned once per forward into a :class:`Plan` of plain values (strings, numbers),
which is what the autograd function carries into the backward: torch.compile treats it as a
constant. :func:`quantize` then maps (plan, role, matrix) to an :class:`Operand`, the FP8
data of the matrix row-wise and/or column-wise with the scale_inv of each.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_engine.common.recipe import Recipe

from . import ops

ROLES = ("input", "weight", "grad_output")


class Plan(NamedTuple):
    """The numerics of one FP8 linear layer, decided from the recipe."""

    kind: str  # "delayed", "current" or "block"
    fwd_dtype: str  # FP8 format of input and weight
    bwd_dtype: str  # FP8 format of grad_output
    input_mode: str  # scaling mode per role
    weight_mode: str
    grad_mode: str
    force_pow2_scales: bool
    amax_epsilon: float
    algo: str  # delayed scaling: "max" / "most_recent" / "callable"
    margin: int

    def dtype_of(self, role: str) -> str:
        return self.bwd_dtype if role == "grad_output" else self.fwd_dtype

    def mode_of(self, role: str) -> str:
        if role == "input":
            return self.input_mode
        return self.weight_mode if role == "weight" else self.grad_mode


class Operand(NamedTuple):
    """FP8 data of a matrix [rows, K]: row-wise [rows, K] and column-wise [K, rows] copies
    (an empty tensor where one was not made) with their scale_inv, format and mode."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    columnwise: torch.Tensor
    columnwise_scale_inv: torch.Tensor
    fp8_dtype: str
    mode: str


_BLOCK_MODES = {1: "block_1x128", 2: "block_128x128"}


def make_plan(recipe: Recipe) -> Plan:
    """The plan of ``recipe`` for a linear layer; a recipe te.Linear cannot run raises."""
    fmt = recipe.fp8_format
    if recipe.delayed():
        # Either user callable takes the scale update out of the core ("callable": the update
        # of the backward then runs fp8.update_backward_scales, as the exit update does).
        algo = recipe.amax_compute_algo
        python = not isinstance(algo, str) or recipe.scaling_factor_compute_algo is not None
        return Plan("delayed", fmt.fwd_dtype_name, fmt.bwd_dtype_name, "tensor", "tensor",
                    "tensor", False, 0.0, "callable" if python else algo, recipe.margin)
    if recipe.float8_current_scaling():
        return Plan("current", fmt.fwd_dtype_name, fmt.bwd_dtype_name, "tensor", "tensor",
                    "tensor", recipe.power_2_scale, recipe.amax_epsilon, "", 0)
    if recipe.float8_block_scaling():
        # The block-scaled GEMM takes A in 1x128 blocks (B in 1x128 or 128x128): A is the
        # input in the forward and grad_output in both backward GEMMs.
        for name in ("x_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(recipe, name) != 1:
                raise NotImplementedError(
                    f"te.Linear: Float8BlockScaling.{name} must be 1, got "
                    f"{getattr(recipe, name)}: the block-scaled GEMM reads its first "
                    "operand in 1x128 blocks")
        return Plan("block", fmt.fwd_dtype_name, fmt.bwd_dtype_name, "block_1x128",
                    _BLOCK_MODES[recipe.w_block_scaling_dim], "block_1x128",
                    recipe.power_2_scale, recipe.amax_epsilon, "", 0)
    raise NotImplementedError(
        f"te.Linear: {type(recipe).__name__} is not supported: its GEMM (MXFP8) needs a "
        "Blackwell GPU; use DelayedScaling, Float8CurrentScaling or Float8BlockScaling")


_PLANS: dict = {}


def plan_of(recipe: Recipe) -> Plan:
    """The plan of ``recipe``, made once per recipe (forwards ask for it every call)."""
    plan = _PLANS.get(recipe)
    if plan is None:
        plan = _PLANS[recipe] = make_plan(recipe)
    return plan


def quantize(plan: Plan, role: str, x: torch.Tensor, rowwise: bool, columnwise: bool,
             scales: Optional[torch.Tensor] = None, column: int = 0,
             history: Optional[torch.Tensor] = None) -> Operand:
    """FP8 copies of the matrix ``x`` for ``role``.

    Delayed scaling quantizes with ``scales[column]`` and records the amax of x in place in
    ``history[0, column]`` (the max with what that slot holds: several forwards of one step
    keep the largest); ``history`` None records nothing (a checkpoint's recompute). The
    other recipes compute their scales from x and take neither.
    """
    dtype, mode = plan.dtype_of(role), plan.mode_of(role)
    kind = plan.kind
    if kind == "delayed":
        data, col, sinv = ops.quantize_delayed(x, scales, column, history, dtype, rowwise,
                                               columnwise)
        return Operand(data, sinv, col, sinv, dtype, mode)
    if kind == "current":
        data, col, _, sinv, _ = ops.quantize_current(
            x, dtype, rowwise, columnwise, plan.force_pow2_scales, plan.amax_epsilon)
        return Operand(data, sinv, col, sinv, dtype, mode)
    data, sinv, col, col_sinv = ops.quantize_block(
        x, dtype, mode, rowwise, columnwise, plan.force_pow2_scales, plan.amax_epsilon)
    return Operand(data, sinv, col, col_sinv, dtype, mode)


def record_amax(history: torch.Tensor, column: int, amax: torch.Tensor) -> None:
    """Writes ``amax`` into slot 0 of one history column, keeping the larger value when the
    column was already written this step (several forwards in one autocast). For calibration
    (amaxes of high-precision compute); the FP8 ops raise the history's slot themselves
    (:func:`quantize`, and the norm and activation ops' ``amax_history``)."""
    slot = history[0, column:column + 1]
    slot.copy_(torch.maximum(slot, amax))
