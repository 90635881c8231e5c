"""FP8 recipes: how tensors are scaled into FP8, shared by the PyTorch and JAX packages.

A recipe only describes numerics; the framework packages read it and run the matching
kernels, so one object serves both. Recipes are frozen, hashable, picklable dataclasses (one
holding a user callable pickles only if the callable does). Framework code branches on the
predicates of :class:`Recipe` instead of isinstance chains.

* :class:`DelayedScaling`: one scale per tensor, from a history of past amaxes.
* :class:`Float8CurrentScaling`: one scale per tensor, from the tensor's own amax.
* :class:`Float8BlockScaling`: FP32 scales per 1x128 or 128x128 block.
* :class:`MXFP8BlockScaling`: power-of-two (E8M0) scales per 32 elements.

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

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling"]

_E4M3, _E5M2 = "float8_e4m3", "float8_e5m2"
_ELEMENT_MAX = {_E4M3: 448.0, _E5M2: 57344.0}
_FWD_BWD = {"E4M3": (_E4M3, _E4M3), "E5M2": (_E5M2, _E5M2), "HYBRID": (_E4M3, _E5M2)}


class Format(enum.Enum):
    """FP8 element formats of the forward tensors (``input``, ``weight``) and of the backward
    tensor (``grad_output``).

    * ``E4M3``: 4 exponent and 3 mantissa bits, finite max 448, no infinities; more precision.
    * ``E5M2``: 5 exponent and 2 mantissa bits, finite max 57344; more range.
    * ``HYBRID``: E4M3 forward, E5M2 for gradients, whose range is wider; the usual choice.

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


def _check_attention(recipe: Any) -> None:
    _check_bool(recipe, "fp8_dpa", "fp8_mha")
    if recipe.fp8_mha and not recipe.fp8_dpa:
        _fail(ValueError, recipe, "fp8_dpa", "True when fp8_mha is True", recipe.fp8_dpa)


class Recipe:
    """Base class of the recipes. Each recipe answers True to exactly one predicate:
    ``delayed()`` for :class:`DelayedScaling`, ``float8_current_scaling()`` for
    :class:`Float8CurrentScaling`, ``float8_block_scaling()`` for :class:`Float8BlockScaling`
    and ``mxfp8()`` for :class:`MXFP8BlockScaling`."""

    def delayed(self) -> bool:
        return False

    def float8_current_scaling(self) -> bool:
        return False

    def float8_block_scaling(self) -> bool:
        return False

    def mxfp8(self) -> bool:
        return False


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
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable[[Any], Any]] = "max"
    scaling_factor_compute_algo: Optional[Callable[[Any, Any, float, "DelayedScaling"], Any]] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
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

    def delayed(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(Recipe):
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
    """

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(self)
        _check_bool(self, "power_2_scale")
        _check_epsilon(self)
        _check_attention(self)

    def float8_current_scaling(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(Recipe):
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
    """

    block_size: ClassVar[int] = 128

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_format(self)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_int(self, name, 1, "1 or 2")
            if getattr(self, name) > 2:
                _fail(ValueError, self, name, "1 or 2", getattr(self, name))
        _check_bool(self, "power_2_scale")
        _check_epsilon(self)

    def float8_block_scaling(self) -> bool:
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
    """

    block_size: ClassVar[int] = 32

    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        _check_format(self)

    def mxfp8(self) -> bool:
        return True
