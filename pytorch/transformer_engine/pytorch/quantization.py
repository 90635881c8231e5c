"""How a recipe quantizes each role (``input``, ``weight``, ``grad_output``) of a GEMM.

A recipe is turned once (per recipe, cached) into a :class:`Plan` of plain values (strings,
numbers), which is what the autograd function carries into the backward: torch.compile treats
it as a constant. The plan and the recipes it refuses are defined once for both frameworks, in
:mod:`transformer_engine.common.plan`. :func:`quantize` then maps (plan, role, matrix) to an
:class:`Operand`, the FP8 data of the matrix row-wise and/or column-wise with the scale_inv
of each.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from transformer_engine.common import plan as _plan
from transformer_engine.common.plan import ROLES, Plan
from transformer_engine.common.recipe import Recipe

from . import ops
from .first_step import step_scales

__all__ = ["ROLES", "Plan", "Operand", "make_plan", "plan_of", "kind_of", "quantize",
           "record_amax"]

# The plan is transformer_engine.common.plan's (one definition for both frameworks); the
# modules report a refused recipe in their own names by replacing this prefix.
_CALLER = "te.Linear"


class Operand(NamedTuple):
    """FP8 data of a matrix [rows, K]: row-wise [rows, K] and column-wise [K, rows] copies
    (an empty tensor where one was not made) with their scale_inv, format and mode."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    columnwise: torch.Tensor
    columnwise_scale_inv: torch.Tensor
    fp8_dtype: str
    mode: str


def make_plan(recipe: Recipe) -> Plan:
    """The plan of ``recipe`` for a linear layer; a recipe te.Linear cannot run raises."""
    return _plan.make_plan(recipe, _CALLER)


def plan_of(recipe: Recipe) -> Plan:
    """The plan of ``recipe``, made once per recipe (forwards ask for it every call)."""
    return _plan.plan_of(recipe, _CALLER)


def kind_of(recipe: Recipe) -> Optional[str]:
    """``plan_of(recipe).kind``, or None for a recipe that has no plan (MXFP8): for checks
    that only ask which kind a recipe is, where a recipe no GEMM can run is no error (e.g.
    calibration, which records nothing under it)."""
    try:
        return plan_of(recipe).kind
    except NotImplementedError:
        return None


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
        scales = step_scales(scales, column, history, column, dtype, plan.margin,
                             lambda gate: ops.amax(x, gate))
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


def quantize_many(plan: Plan, role: str, xs, rowwise: bool, columnwise: bool,
                    states: list, column: int) -> list:
    """:func:`quantize` of each ``xs[i]`` with its own state ``states[i] = (scales,
    history)``: the operands of a grouped layer's groups, each as its own layer makes them, so
    the same bits. In eager mode under delayed scaling (every history given: not a
    checkpoint's recompute) and current scaling the casts are one core call
    (ops.quantize_delayed_many, ops.quantize_current_many: one kernel launch on the GPU), where
    one op per group costs each group its host time; traced, the ops one by one."""
    kind = plan.kind
    batched = (len(xs) > 1 and not torch.compiler.is_compiling()
               and (kind == "current"
                    or (kind == "delayed" and all(h is not None for _, h in states))))
    if not batched:
        return [quantize(plan, role, x, rowwise, columnwise, scales, column, history)
                for x, (scales, history) in zip(xs, states, strict=True)]
    dtype, mode = plan.dtype_of(role), plan.mode_of(role)
    if kind == "current":
        datas, cols, sinvs = ops.quantize_current_many(list(xs), dtype, rowwise, columnwise,
                                                       plan.force_pow2_scales, plan.amax_epsilon)
    else:
        # (a first step's empty history: the group's scale from its own amax, as quantize does)
        scales = [step_scales(s, column, h, column, dtype, plan.margin,
                              lambda gate, x=x: ops.amax(x, gate))
                  for x, (s, h) in zip(xs, states, strict=True)]
        datas, cols, sinvs = ops.quantize_delayed_many(list(xs), scales, column,
                                                       [h for _, h in states], dtype, rowwise,
                                                       columnwise)
    return [Operand(d, si, c, si, dtype, mode) for d, c, si in zip(datas, cols, sinvs,
                                                                  strict=True)]


def record_amax(history: torch.Tensor, column: int, amax: torch.Tensor) -> None:
    """Writes ``amax`` into slot 0 of one history column, keeping the larger value when the
    column was already written this step (several forwards in one autocast). For calibration
    (amaxes of high-precision compute); the FP8 ops raise the history's slot themselves
    (:func:`quantize`, and the norm and activation ops' ``amax_history``)."""
    slot = history[0, column:column + 1]
    slot.copy_(torch.maximum(slot, amax))


# NVIDIA's programs import the autocast API from ``transformer_engine.pytorch.quantization``
# (its newer home of what this package keeps in fp8.py, model_init.py and availability.py);
# those modules import this one, so the names are looked up on first use.
_NVIDIA_NAMES = {
    "FP8GlobalStateManager": "fp8_global_state", "autocast": "fp8", "fp8_autocast": "fp8",
    "fp8_model_init": "fp8", "quantized_model_init": "model_init",
    "is_fp8_available": "availability", "is_fp8_block_scaling_available": "availability",
    "is_mxfp8_available": "availability", "is_nvfp4_available": "availability",
    "get_default_recipe": "availability",
    "QuantizationCalibrationConfig": "calibration",
}


def __getattr__(name: str):
    if name in _NVIDIA_NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__package__}.{_NVIDIA_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
