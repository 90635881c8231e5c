"""How a recipe quantizes each tensor role of a GEMM, decided once for both frameworks.

A :class:`Plan` is the recipe read per role (``input``, ``weight``, ``grad_output``): FP8
format, scaling mode, power-of-two scales and amax epsilon, and, under delayed scaling, the
amax algorithm and margin. It holds only strings, numbers and bools, so a framework can carry
it as a compile-time constant (torch.compile, a jax static argument). The frameworks map the
format names to their own dtypes and branch on ``plan.kind``, never on the recipe class.

The recipes a framework cannot run are refused here, in the words of the caller (the op or
module name passed in), so both frameworks refuse the same recipes with the same message.

Example:

>>> from transformer_engine.common.recipe import Float8BlockScaling
>>> plan = plan_of(Float8BlockScaling(), "te.Linear")
>>> plan.kind, plan.mode_of("input"), plan.mode_of("weight"), plan.fp8_max_of("grad_output")
('block', 'block_1x128', 'block_128x128', 448.0)
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .recipe import Format, Recipe

__all__ = ["ROLES", "GEMM_GRANULE", "FP8_MAX", "BLOCK_SHAPES", "Plan", "make_plan", "plan_of"]

# The tensors of a GEMM that a recipe quantizes: the activation, the weight, and the gradient
# of the output (the backward's operand).
ROLES = ("input", "weight", "grad_output")

# FP8 tensor cores work on 16x16 granules: every dimension of an FP8 GEMM must be a multiple.
GEMM_GRANULE = 16

# Largest finite value per FP8 format name, taken from the recipe's Format so that there is
# one source for it (E2M1, NVFP4's 4-bit format, is no FP8 format: no plan uses it).
FP8_MAX = {}
for _fmt in Format:
    if _fmt is not Format.E2M1:
        FP8_MAX[_fmt.fwd_dtype_name] = _fmt.max_fwd
        FP8_MAX[_fmt.bwd_dtype_name] = _fmt.max_bwd
del _fmt

# The accumulation the modules run per GEMM under per-tensor scaling: fast in the forward,
# split (FP32 partial sums) in both backward GEMMs (block-scaled GEMMs always split; their
# recipe refuses anything else itself).
_PER_TENSOR_SPLIT = {"fp8_gemm_fprop": False, "fp8_gemm_dgrad": True, "fp8_gemm_wgrad": True}

# Elements that share one scale, per scaling mode (rows, columns); None: the whole tensor.
BLOCK_SHAPES = {"tensor": None, "block_1x128": (1, 128), "block_128x128": (128, 128),
                "mxfp8": (1, 32)}

_BLOCK_MODES = {1: "block_1x128", 2: "block_128x128"}


class Plan(NamedTuple):
    """The numerics of the GEMMs of one layer, decided from the recipe. (Compiled code never
    sees it whole: the torch operators take the fields they need as named arguments.)"""

    kind: str  # "delayed", "current" or "block"
    fwd_dtype: str  # FP8 format name of input and weight
    bwd_dtype: str  # FP8 format name of grad_output
    input_mode: str  # scaling mode per role
    weight_mode: str
    grad_mode: str
    force_pow2_scales: bool
    amax_epsilon: float
    algo: str  # delayed scaling: "max" / "most_recent" / "callable" (a user callable); else ""
    margin: int

    def dtype_of(self, role: str) -> str:
        return self.bwd_dtype if role == "grad_output" else self.fwd_dtype

    def mode_of(self, role: str) -> str:
        if role == "input":
            return self.input_mode
        return self.weight_mode if role == "weight" else self.grad_mode

    def fp8_max_of(self, role: str) -> float:
        return FP8_MAX[self.dtype_of(role)]

    def block_shape_of(self, role: str) -> Optional[tuple]:
        return BLOCK_SHAPES[self.mode_of(role)]


def make_plan(recipe: Recipe, caller: str) -> Plan:
    """The plan of ``recipe``; a recipe the core's GEMM cannot run raises NotImplementedError
    whose message starts with ``caller`` (the op or module that asked)."""
    _refuse_unrunnable(recipe, caller)
    fmt = recipe.fp8_format
    if recipe.delayed():
        # Either user callable takes the scale update out of the core: the frameworks then run
        # the update in their own array ops.
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
                    f"{caller}: Float8BlockScaling.{name} must be 1, got "
                    f"{getattr(recipe, name)}: the block-scaled GEMM reads its first "
                    "operand in 1x128 blocks")
        return Plan("block", fmt.fwd_dtype_name, fmt.bwd_dtype_name, "block_1x128",
                    _BLOCK_MODES[recipe.w_block_scaling_dim], "block_1x128",
                    recipe.power_2_scale, recipe.amax_epsilon, "", 0)
    raise NotImplementedError(
        f"{caller}: {type(recipe).__name__} is not supported: its GEMM (MXFP8) needs a "
        "Blackwell GPU; use DelayedScaling, Float8CurrentScaling or Float8BlockScaling")


def _refuse_unrunnable(recipe: Recipe, caller: str) -> None:
    """Refuses NVIDIA's recipes and options that no GEMM here runs, naming the recipe and why
    (never a silent change of numerics)."""
    name = type(recipe).__name__
    if recipe.nvfp4():
        raise NotImplementedError(
            f"{caller}: {name} is not supported: this package has no FP4 (E2M1) GEMM; use "
            "DelayedScaling, Float8CurrentScaling or Float8BlockScaling")
    if recipe.custom():
        raise NotImplementedError(
            f"{caller}: {name} is not supported: custom quantizer factories (qfactory) are "
            "not supported, the modules quantize as the built-in recipes describe; use "
            "DelayedScaling, Float8CurrentScaling or Float8BlockScaling")
    override = getattr(recipe, "backward_override", None)
    if override is not None:
        raise NotImplementedError(
            f"{caller}: {name}(backward_override={override!r}) is not supported: the backward "
            "GEMMs here always take the FP8 operands; use backward_override=None")
    if recipe.float8_current_scaling():
        for field, split in _PER_TENSOR_SPLIT.items():
            if getattr(recipe, field).use_split_accumulator != split:
                raise NotImplementedError(
                    f"{caller}: {name}({field}=MMParams(use_split_accumulator="
                    f"{not split})) is not supported: the modules run this GEMM with "
                    f"use_split_accumulator={split}; leave {field} at its default")


_PLANS: dict = {}


def plan_of(recipe: Recipe, caller: str) -> Plan:
    """The plan of ``recipe``, made once per recipe (equal recipes share it): forwards ask for
    it at every call. ``caller`` names the asker in the error of a refused recipe."""
    plan = _PLANS.get(recipe)
    if plan is None:
        plan = _PLANS[recipe] = make_plan(recipe, caller)
    return plan
