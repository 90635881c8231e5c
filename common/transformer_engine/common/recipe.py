"""FP8 recipes: how tensors are scaled into FP8, shared by the PyTorch and JAX packages.

A recipe only describes numerics; the framework packages read it and run the matching
kernels, so one object serves both. Recipes are frozen, hashable, picklable dataclasses (one
holding a user callable pickles only if the callable does). Framework code branches on the
predicates of :class:`Recipe` instead of isinstance chains.

* :class:`DelayedScaling`: one scale per tensor, from a history of past amaxes.
* :class:`Float8CurrentScaling`: one scale per tensor, from the tensor's own amax.
* :class:`Float8BlockScaling`: FP32 scales per 1x128 or 128x128 block.
* :class:`MXFP8BlockScaling`: power-of-two (E8M0) scales per 32 elements.
* :class:`NVFP4BlockScaling`, :class:`CustomRecipe`: NVIDIA Transformer Engine's FP4 and
  user-quantizer recipes. They are built and compared like the others, so that programs
  written for NVIDIA's package import and configure unchanged, but no module runs them: the
  plan (:mod:`transformer_engine.common.plan`) refuses them with the reason.

NVIDIA's keyword names are accepted next to ours: ``use_power_2_scales``
(:class:`Float8CurrentScaling`) and ``use_f32_scales`` (:class:`Float8BlockScaling`) set
``power_2_scale``; they are not stored (reading them back gives None; read ``power_2_scale``
or ``fp8_quant_fwd_inp.power_2_scale``). ``fp8_gemm_fprop``/``fp8_gemm_dgrad``/
``fp8_gemm_wgrad`` (:class:`MMParams`) and ``backward_override`` are fields; values the
modules do not run are refused by the plan, not dropped. NVIDIA's ``NVTE_*`` environment
defaults are not read.

Fields are keyword-only and checked when a recipe is built: a wrong type raises
``TypeError``, a bad value ``ValueError``. ``fp8_format`` takes a :class:`Format` member,
not its name, so that a recipe has one spelling (and one hash); convert a name read from a
config file with ``Format[name]``. Integer fields accept any integer type (e.g. a NumPy
integer) and store a plain ``int``, but not ``bool``.

Example:

>>> from transformer_engine.common.recipe import DelayedScaling, Format
>>> recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16)
>>> recipe.fp8_format.max_fwd, recipe.fp8_format.max_bwd
(448.0, 57344.0)
>>> recipe.delayed(), recipe.mxfp8()
(True, False)
>>> DelayedScaling(margin=-1)
Traceback (most recent call last):
    ...
ValueError: DelayedScaling: margin must be a non-negative int, got -1
"""

import dataclasses
import enum
import math
import numbers
import operator
from typing import Any, Callable, ClassVar, NoReturn, Optional, Union

__all__ = ["Format", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling",
           "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]

_E4M3, _E5M2, _E2M1 = "float8_e4m3", "float8_e5m2", "float4_e2m1"
_ELEMENT_MAX = {_E4M3: 448.0, _E5M2: 57344.0, _E2M1: 6.0}
_FWD_BWD = {"E4M3": (_E4M3, _E4M3), "E5M2": (_E5M2, _E5M2), "HYBRID": (_E4M3, _E5M2),
            "E2M1": (_E2M1, _E2M1)}
# NVIDIA's backward precision modes; None is the only one the modules run (plan.py).
_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


class Format(enum.Enum):
    """FP8 element formats of the forward tensors (``input``, ``weight``) and of the backward
    tensor (``grad_output``).

    * ``E4M3``: 4 exponent and 3 mantissa bits, finite max 448, no infinities; more precision.
    * ``E5M2``: 5 exponent and 2 mantissa bits, finite max 57344; more range.
    * ``HYBRID``: E4M3 forward, E5M2 for gradients, whose range is wider; the usual choice.
    * ``E2M1``: the 4-bit element format of :class:`NVFP4BlockScaling` (finite max 6); no
      FP8 recipe takes it.

    Each member has these properties:

    * ``max_fwd``: largest finite value of the forward format; the ``fp8_max`` of forward scales.
    * ``max_bwd``: largest finite value of the backward format; the ``fp8_max`` of gradient
      scales.
    * ``fwd_dtype_name``: ``"float8_e4m3"`` or ``"float8_e5m2"``, the forward element format.
      The names are framework-neutral; the framework packages map them to their dtypes
      (``torch.float8_e4m3fn``, ``jnp.float8_e4m3fn``, ...).
    * ``bwd_dtype_name``: the same for the backward element format.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    @property
    def fwd_dtype_name(self) -> str:
        return _FWD_BWD[self.value][0]

    @property
    def bwd_dtype_name(self) -> str:
        return _FWD_BWD[self.value][1]

    @property
    def max_fwd(self) -> float:
        return _ELEMENT_MAX[self.fwd_dtype_name]

    @property
    def max_bwd(self) -> float:
        return _ELEMENT_MAX[self.bwd_dtype_name]


def _fail(exc: type, recipe: Any, name: str, expected: str, value: Any, hint: str = ""
          ) -> NoReturn:
    got = repr(value) if exc is ValueError else f"{value!r} of type {type(value).__name__}"
    raise exc(f"{type(recipe).__name__}: {name} must be {expected}, got {got}{hint}")


def _check_int(recipe: Any, name: str, minimum: int, expected: str) -> None:
    value = getattr(recipe, name)
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        _fail(TypeError, recipe, name, expected, value)
    value = operator.index(value)
    if value < minimum:
        _fail(ValueError, recipe, name, expected, value)
    object.__setattr__(recipe, name, value)


def _check_bool(recipe: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(recipe, name), bool):
            _fail(TypeError, recipe, name, "a bool", getattr(recipe, name))


def _check_format(recipe: Any) -> None:
    value = recipe.fp8_format
    expected = "Format.E4M3 or Format.HYBRID"
    if not isinstance(value, Format):
        hint = f"; convert a name with Format[{value!r}]" if isinstance(value, str) else ""
        _fail(TypeError, recipe, "fp8_format", f"a Format member ({expected})", value, hint)
    if value is Format.E2M1:
        hint = "; E2M1 is a 4-bit format, the fp4_format of NVFP4BlockScaling"
        _fail(ValueError, recipe, "fp8_format", expected, value, hint)
    if value is Format.E5M2:
        hint = ("; an all-E5M2 format is rejected because E5M2 has too little precision for "
                "the forward pass, use Format.HYBRID (E4M3 forward, E5M2 for gradients)")
        _fail(ValueError, recipe, "fp8_format", expected, value, hint)


def _check_epsilon(recipe: Any) -> None:
    value = recipe.amax_epsilon
    expected = "a finite, non-negative float"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(TypeError, recipe, "amax_epsilon", expected, value)
    value = float(value)
    if not (math.isfinite(value) and value >= 0.0):
        _fail(ValueError, recipe, "amax_epsilon", expected, value)
    object.__setattr__(recipe, "amax_epsilon", value)


def _check_attention(recipe: Any, supported: bool = True) -> None:
    """``supported`` False: the recipe has NVIDIA's fields, but attention here runs in FP8
    only under delayed or current scaling, so True is refused rather than ignored."""
    _check_bool(recipe, "fp8_dpa", "fp8_mha")
    if not supported:
        for name in ("fp8_dpa", "fp8_mha"):
            if getattr(recipe, name):
                _fail(ValueError, recipe, name, "False", True,
                      "; FP8 attention runs under DelayedScaling and Float8CurrentScaling only")
    if recipe.fp8_mha and not recipe.fp8_dpa:
        _fail(ValueError, recipe, "fp8_dpa", "True when fp8_mha is True", recipe.fp8_dpa)


def _check_backward_override(recipe: Any) -> None:
    value = recipe.backward_override
    if value not in _BACKWARD_OVERRIDES:
        _fail(ValueError, recipe, "backward_override",
              "None, 'high_precision' or 'dequantized'", value)


def _take_alias(recipe: Any, name: str, value: Any, ours: str, ours_value: Any) -> None:
    """NVIDIA's keyword ``name`` (given as ``value``, None when not given) sets our field
    ``ours`` to ``ours_value``. Our field given too, with another value, is a contradiction;
    at its default it is taken as not given."""
    if value is None:
        return
    if not isinstance(value, bool):
        _fail(TypeError, recipe, name, "a bool", value)
    current = getattr(recipe, ours)
    if current != type(recipe).__dataclass_fields__[ours].default and current != ours_value:
        raise ValueError(f"{type(recipe).__name__}: {name}={value!r} contradicts "
                         f"{ours}={current!r}; give one of them")
    object.__setattr__(recipe, ours, ours_value)


def _check_mm(recipe: Any, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(recipe, name), MMParams):
            _fail(TypeError, recipe, name, "an MMParams", getattr(recipe, name))


@dataclasses.dataclass(frozen=True)
class MMParams:
    """NVIDIA's GEMM options of a recipe (``fp8_gemm_fprop``, ``fp8_gemm_dgrad``,
    ``fp8_gemm_wgrad``).

    Attributes:
        use_split_accumulator: promote the FP8 GEMM's partial sums to FP32 often (more
            accurate, a little slower); False is the tensor cores' fast accumulation. The
            modules run the forward GEMM with fast accumulation and the two backward GEMMs
            split under per-tensor scaling, and every block-scaled GEMM split; a recipe asking
            otherwise is refused, not run differently.
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "use_split_accumulator")


@dataclasses.dataclass(frozen=True)
class QParams:
    """NVIDIA's per-role quantization options, as a recipe's ``fp8_quant_fwd_inp``,
    ``fp8_quant_fwd_weight`` and ``fp8_quant_bwd_grad`` report them (read-only views of the
    recipe's own fields). The last three are FP4 options; FP8 recipes report False."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


class _QParamsViews:
    """``fp8_quant_fwd_inp`` / ``fp8_quant_fwd_weight`` / ``fp8_quant_bwd_grad`` of a recipe
    whose ``power_2_scale`` and ``amax_epsilon`` serve all three roles."""

    @property
    def fp8_quant_fwd_inp(self) -> QParams:
        return QParams(power_2_scale=self.power_2_scale, amax_epsilon=self.amax_epsilon)

    fp8_quant_fwd_weight = fp8_quant_fwd_inp
    fp8_quant_bwd_grad = fp8_quant_fwd_inp


class Recipe:
    """Base class of the recipes. Each recipe answers True to exactly one predicate:
    ``delayed()`` for :class:`DelayedScaling`, ``float8_current_scaling()`` for
    :class:`Float8CurrentScaling`, ``float8_block_scaling()`` for :class:`Float8BlockScaling`,
    ``mxfp8()`` for :class:`MXFP8BlockScaling`, ``nvfp4()`` for :class:`NVFP4BlockScaling`
    and ``custom()`` for :class:`CustomRecipe`; ``float8_per_tensor_scaling()`` is True for
    the first two. They are class methods (as in NVIDIA's package), so a class can be asked
    as well as an instance."""

    @classmethod
    def delayed(cls) -> bool:
        return False

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return False

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return False

    @classmethod
    def mxfp8(cls) -> bool:
        return False

    @classmethod
    def nvfp4(cls) -> bool:
        return False

    @classmethod
    def custom(cls) -> bool:
        return False

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return cls.delayed() or cls.float8_current_scaling()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling(Recipe):
    """Per-tensor scaling whose scale comes from the amaxes of previous steps.

    The scale used at a step was computed at the end of the previous one, so quantization
    never waits for the amax of the tensor it quantizes; the amax of this step is recorded
    in the history and used from the next step on. Update rule, per tensor, where
    ``fp8_max`` is ``fp8_format.max_fwd`` for ``input``/``weight`` and ``max_bwd`` for
    ``grad_output``::

        amax = max(history)              # "max"; history[0] for "most_recent"
        if amax is finite and amax > 0:
            scale = (fp8_max / amax) / 2**margin   # an infinite result becomes FLT_MAX
        # otherwise (amax 0, NaN or Inf) scale keeps its previous value
        scale_inv = 1 / scale
        history = roll(history, -1); history[0] = 0   # slot 0 takes the next amax

    Attributes:
        margin: the scale is divided by ``2**margin``, leaving headroom for values that grow
            between the step that measured the amax and the step that uses the scale.
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``; ``Format.E5M2`` is
            rejected, its 2 mantissa bits are too coarse for the forward pass.
        amax_history_len: number of steps of amax kept per tensor. A longer window resists
            a single spike but reacts later to a lasting change in range.
        amax_compute_algo: how the history becomes one amax: ``"max"`` (the safest, never
            saturates on values seen in the window), ``"most_recent"`` (``history[0]``, the
            fastest to follow the data), or a callable mapping the history (newest amax in
            slot 0 along the first axis) to the amax, written with the framework's array ops.
        scaling_factor_compute_algo: ``None`` for the rule above, or a callable
            ``(amax, scale, fp8_max, recipe) -> new scale`` that replaces it (it may read
            ``recipe.margin``), written with the framework's array ops (traceable for jit).
        reduce_amax: all-reduce the amax over the ranks that share a tensor (data- and
            tensor-parallel) before the update, so every rank uses the same scales, which
            keeps replicated weights identical; turning it off saves a collective per step.
        fp8_dpa: run the two batched GEMMs of dot-product attention in FP8 (fused attention).
        fp8_mha: also keep the attention block's inputs and output in FP8 between the QKV
            projection, attention and the output projection, saving casts; needs ``fp8_dpa``.
        backward_override: None only (NVIDIA's field; delayed scaling has no other mode).
        override_linear_precision: NVIDIA's keyword (not stored): ``(False, False, False)``
            or None only; running some of the GEMMs in high precision under the recipe is not
            built here, and other values raise ValueError.
        params_dtype, device: accepted and ignored, as NVIDIA's recipe ignores them
            (Megatron-LM passes its module keywords to it); not stored.
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable[[Any], Any]] = "max"
    scaling_factor_compute_algo: Optional[Callable[[Any, Any, float, "DelayedScaling"], Any]] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    override_linear_precision: dataclasses.InitVar[Optional[tuple]] = None
    params_dtype: dataclasses.InitVar[Any] = None
    device: dataclasses.InitVar[Any] = None

    def __post_init__(self, override_linear_precision: Optional[tuple], params_dtype: Any,
                      device: Any) -> None:
        del params_dtype, device  # (NVIDIA's recipe ignores them too)
        if (override_linear_precision is not None
                and tuple(override_linear_precision) != (False, False, False)):
            _fail(ValueError, self, "override_linear_precision", "(False, False, False)",
                  override_linear_precision, "; GEMMs in high precision under an FP8 recipe "
                  "are not built here")
        _check_int(self, "margin", 0, "a non-negative int")
        _check_format(self)
        _check_int(self, "amax_history_len", 1, "a positive int")
        algo = self.amax_compute_algo
        expected = "'max', 'most_recent' or a callable"
        if isinstance(algo, str):
            if algo not in ("max", "most_recent"):
                _fail(ValueError, self, "amax_compute_algo", expected, algo)
        elif not callable(algo):
            _fail(TypeError, self, "amax_compute_algo", expected, algo)
        algo = self.scaling_factor_compute_algo
        if algo is not None and not callable(algo):
            _fail(TypeError, self, "scaling_factor_compute_algo", "None or a callable", algo)
        _check_bool(self, "reduce_amax")
        _check_attention(self)
        if self.backward_override is not None:
            _fail(ValueError, self, "backward_override", "None", self.backward_override,
                  "; delayed scaling has no other backward mode")

    @classmethod
    def delayed(cls) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(_QParamsViews, Recipe):
    """Per-tensor scaling whose scale comes from the amax of the tensor being quantized.

    Tracks the data with no lag, at the cost of an amax reduction before each cast.
    With ``fp8_max`` chosen per role as in :class:`DelayedScaling`::

        a = max(amax, amax_epsilon)
        scale = fp8_max / a       # an infinite result becomes FLT_MAX; a = 0, NaN or Inf gives 1
        if power_2_scale: scale = 2**floor(log2(scale))
        scale_inv = 1 / scale

    Attributes:
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``; ``Format.E5M2`` is rejected.
        power_2_scale: round the scale down to a power of two, so that multiplying by
            ``scale`` and ``scale_inv`` is exact and the FP8 rounding is the only error, at
            the cost of up to one bit of range.
        amax_epsilon: floor on the amax, so a nearly all-zero tensor does not get a huge scale.
        fp8_dpa: run dot-product attention in FP8 (see :class:`DelayedScaling`).
        fp8_mha: keep the attention block's inputs and output in FP8; needs ``fp8_dpa``.
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: NVIDIA's GEMM options; the defaults
            (fast accumulation forward, split backward) are what the modules run, the plan
            refuses others.
        backward_override: NVIDIA's backward precision mode: None (the backward uses the
            FP8 operands), ``"high_precision"`` or ``"dequantized"``. Only None runs here; the
            plan refuses the others.
        use_power_2_scales: NVIDIA's name for ``power_2_scale`` (keyword only, not stored).
    """

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    backward_override: Optional[str] = None
    use_power_2_scales: dataclasses.InitVar[Optional[bool]] = None

    def __post_init__(self, use_power_2_scales: Optional[bool]) -> None:
        _check_format(self)
        _check_bool(self, "power_2_scale")
        _take_alias(self, "use_power_2_scales", use_power_2_scales, "power_2_scale",
                    use_power_2_scales)
        _check_epsilon(self)
        _check_attention(self)
        _check_mm(self, "fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")
        _check_backward_override(self)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(_QParamsViews, Recipe):
    """FP8 with one FP32 scale per block of ``block_size`` elements or ``block_size``
    squared, each block's scale computed as in :class:`Float8CurrentScaling`.

    A block dim of 1 means 1x128 blocks (128 consecutive elements of a row share a scale);
    2 means 128x128 tiles. Small blocks confine an outlier's damage to its own block. A
    128x128 tile has the same elements in a matrix and in its transpose, so a weight
    quantized once serves both the forward GEMM and the transposed backward (dgrad) GEMM.

    Attributes:
        fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID``. E4M3 is the default for
            gradients too: per-block scales already follow their local range.
        x_block_scaling_dim: block dim (1 or 2) of the ``input`` (activations); 1 by default.
        w_block_scaling_dim: block dim (1 or 2) of the ``weight``; 2 by default.
        grad_block_scaling_dim: block dim (1 or 2) of the ``grad_output``; 1 by default.
        power_2_scale: round each block's scale down to a power of two (the default); see
            :class:`Float8CurrentScaling`.
        amax_epsilon: floor on each block's amax (see :class:`Float8CurrentScaling`).
        fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: NVIDIA's GEMM options; block-scaled
            GEMMs always accumulate split, so ``use_split_accumulator`` must be True.
        fp8_dpa, fp8_mha: False only (FP8 attention does not take block scales).
        backward_override: NVIDIA's backward precision mode: None (the backward uses the
            FP8 operands), ``"high_precision"`` or ``"dequantized"``. Only None runs here; the
            plan refuses the others.
        use_f32_scales: NVIDIA's keyword; True means ``power_2_scale=False`` (not stored).
    """

    block_size: ClassVar[int] = 128

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None
    use_f32_scales: dataclasses.InitVar[Optional[bool]] = None

    def __post_init__(self, use_f32_scales: Optional[bool]) -> None:
        _check_format(self)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_int(self, name, 1, "1 or 2")
            if getattr(self, name) > 2:
                _fail(ValueError, self, name, "1 or 2", getattr(self, name))
        _check_bool(self, "power_2_scale")
        _take_alias(self, "use_f32_scales", use_f32_scales, "power_2_scale",
                    None if use_f32_scales is None else not use_f32_scales)
        _check_epsilon(self)
        names = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")
        _check_mm(self, *names)
        for name in names:
            if not getattr(self, name).use_split_accumulator:
                _fail(ValueError, self, name, "MMParams(use_split_accumulator=True)",
                      getattr(self, name), "; block-scaled GEMMs always accumulate split")
        _check_attention(self, supported=False)
        _check_backward_override(self)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: every ``block_size`` (32) consecutive elements along the GEMM's reduction
    dimension share one E8M0 scale, an 8-bit power of two. The blocks follow the reduction
    dimension, so the row-wise and column-wise copies of a tensor each carry their own
    scales. MXFP8 GEMMs need Blackwell (sm_100) or later; quantization and dequantization
    run everywhere.

    Attributes:
        fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID``; ``Format.E5M2`` is rejected.
        margin: NVIDIA's field (a non-negative int); E8M0 scales come from the block's own
            amax, so it changes nothing.
        fp8_dpa, fp8_mha: False only (FP8 attention does not take MXFP8 scales here).
        backward_override: NVIDIA's backward precision mode: None (the backward uses the
            FP8 operands), ``"high_precision"`` or ``"dequantized"``. Only None runs here; the
            plan refuses the others.
    """

    block_size: ClassVar[int] = 32

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_int(self, "margin", 0, "a non-negative int")
        _check_format(self)
        _check_attention(self, supported=False)
        _check_backward_override(self)

    @classmethod
    def mxfp8(cls) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVIDIA's NVFP4 recipe: E2M1 (4-bit) values, an E4M3 scale per 16 elements and an FP32
    scale per tensor. It is built and checked so that NVIDIA programs configure unchanged,
    but this package has no FP4 GEMM: the plan refuses it when a module would run it.

    Attributes:
        disable_rht: no random Hadamard transform of inputs and gradients.
        disable_stochastic_rounding: round gradients to nearest instead.
        disable_2d_quantization: 1x16 blocks for weights too (instead of 16x16).
        fp4_format: ``Format.E2M1`` only.
        fp8_format: ``Format.E4M3`` only (the format of the block scales).
        fp8_dpa, fp8_mha: False only.
        backward_override: NVIDIA's backward precision mode: None (the backward uses the
            FP8 operands), ``"high_precision"`` or ``"dequantized"``. Only None runs here; the
            plan refuses the others.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        _check_bool(self, "disable_rht", "disable_stochastic_rounding", "disable_2d_quantization")
        for name, only in (("fp4_format", Format.E2M1), ("fp8_format", Format.E4M3)):
            value = getattr(self, name)
            if not isinstance(value, Format):
                _fail(TypeError, self, name, f"a Format member ({only!r})", value)
            if value is not only:
                _fail(ValueError, self, name, repr(only), value)
        _check_attention(self, supported=False)
        _check_backward_override(self)

    @classmethod
    def nvfp4(cls) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomRecipe(Recipe):
    """NVIDIA's recipe of user quantizer factories: ``qfactory(role)`` returns the quantizer
    of each tensor role. It is built and checked so that NVIDIA programs configure unchanged,
    but the modules here quantize through the plan, not through quantizer objects: the plan
    refuses it when a module would run it.

    Attributes:
        qfactory: a callable (required).
        fp8_format: ``Format.HYBRID`` (default) or ``Format.E4M3``.
        fp8_dpa, fp8_mha: False only.
        backward_override: NVIDIA's backward precision mode: None (the backward uses the
            FP8 operands), ``"high_precision"`` or ``"dequantized"``. Only None runs here; the
            plan refuses the others.
    """

    qfactory: Callable[..., Any]
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = None

    def __post_init__(self) -> None:
        if not callable(self.qfactory):
            _fail(TypeError, self, "qfactory", "a callable", self.qfactory)
        _check_format(self)
        _check_attention(self, supported=False)
        _check_backward_override(self)

    @classmethod
    def custom(cls) -> bool:
        return True
