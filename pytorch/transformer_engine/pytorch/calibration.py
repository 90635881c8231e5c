"""Post-training calibration metadata: what a calibrating forward keeps for an FP8 deployment.

NVIDIA's ``QuantizationCalibrationConfig``. In an autocast that calibrates (FP8 off, and
``calibrating=True`` or a ``calibration_config``), te.Linear, te.LayerNormLinear,
te.LayerNormMLP and te.GroupedLinear keep, per GEMM operand, the per-tensor value an FP8
deployment quantizes it with, as a buffer (not saved in the state dict) named
``<operand>_tensor_<metadata>_<recipe>_te_ptq_calibrated``:

- delayed scaling: the operand's amax (``..._tensor_amax_fp8_delayed_scaling_...``);
- current scaling: the scale_inv its scale would have
  (``..._tensor_scale_inv_fp8_current_scaling_...``, the core's rule, the recipe's
  format, power-of-2 scales and epsilon);
- the block recipes have no per-tensor value and keep nothing.

Operands are ``input`` and ``weight`` (LayerNormMLP: ``fc1_input``, ``fc1_weight``,
``fc2_input``, ``fc2_weight``; GroupedLinear: ``input_gemm<i>``, ``weight_gemm<i>``). An
activation keeps max(this forward's value, decay x the value it kept), with the config's
``transformer_engine_calibration_decay`` (0: this forward's alone); a weight keeps this
forward's. A forward recomputed inside a backward (activation checkpointing) keeps nothing
new. The FP8 forwards (``enabled=True``) do not record it: there a ``calibration_config`` is
refused (fp8.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import ops
from .float8_tensor import Float8Tensor
from .quantization import kind_of, plan_of

SUFFIX = "_te_ptq_calibrated"

# recipe kind -> (what is kept, the recipe's name in the buffer names)
_KEPT = {"delayed": ("amax", "fp8_delayed_scaling"),
         "current": ("scale_inv", "fp8_current_scaling")}


@dataclasses.dataclass
class QuantizationCalibrationConfig:
    """How a calibrating forward keeps its calibration metadata (module docstring).

    Attributes:
        transformer_engine_calibration_decay: an activation's kept value decays by this
            factor per calibrating forward before the max with the new one (>= 0; 0 keeps
            the last forward's value alone).
    """

    transformer_engine_calibration_decay: float = 0.0

    def __post_init__(self) -> None:
        decay = self.transformer_engine_calibration_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise TypeError("QuantizationCalibrationConfig: transformer_engine_calibration_decay "
                            f"must be a number, got {type(decay).__name__}")
        if not math.isfinite(decay) or decay < 0:
            raise ValueError("QuantizationCalibrationConfig: transformer_engine_calibration_decay "
                             f"must be non-negative and finite, got {decay}")


def rows(t: torch.Tensor) -> torch.Tensor:
    """A GEMM operand as the high-precision [rows, features] matrix a calibration reads."""
    if isinstance(t, Float8Tensor):
        t = t.dequantize()  # (an FP8 weight)
    return t.detach().reshape(-1, t.shape[-1])


def record(module: torch.nn.Module, operands, recipe, config: QuantizationCalibrationConfig,
           gemm: int = -1, amaxes=None) -> None:
    """Keeps the calibration metadata of ``operands`` ((name, tensor, is_activation), ...) on
    ``module`` under ``recipe`` (module docstring); ``gemm`` >= 0: a GroupedLinear's group,
    whose names carry ``_gemm<i>``; ``amaxes``: the operands' amaxes where the caller has them
    (delayed scaling records them in its history too)."""
    if torch._C._current_graph_task_id() != -1:
        return  # (a forward recomputed inside a backward)
    kind = kind_of(recipe)
    if kind not in _KEPT:
        return
    metadata, recipe_name = _KEPT[kind]
    if kind == "delayed":
        values = amaxes if amaxes is not None else [ops.amax(rows(t)) for _, t, _ in operands]
    else:
        plan = plan_of(recipe)
        values = [torch.reciprocal(ops.current_scale(rows(t).contiguous(), plan.fwd_dtype,
                                                     plan.force_pow2_scales,
                                                     plan.amax_epsilon)[0])
                  for _, t, _ in operands]
    decay = float(config.transformer_engine_calibration_decay)
    group = f"_gemm{gemm}" if gemm >= 0 else ""
    for (operand, _, activation), value in zip(operands, values, strict=True):
        name = f"{operand}{group}_tensor_{metadata}_{recipe_name}{SUFFIX}"
        last = module._buffers.get(name)
        if activation and decay > 0 and last is not None:
            value = torch.maximum(value, last * decay)
        module.register_buffer(name, value, persistent=False)
