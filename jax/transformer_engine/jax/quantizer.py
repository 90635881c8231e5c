"""FP8 quantization of the three tensors of a dense layer by recipe, and the FP8 state.

The roles are ``x`` (the input), ``kernel`` (the weight) and ``grad`` (the gradient of the
output): the names under which the state is stored, mapped to the plan's roles (``input``,
``weight``, ``grad_output``) in ``_PLAN_ROLE``. What each role's FP8 data is (format, scaling
mode, ...) comes from the recipe's plan (:mod:`transformer_engine.common.plan`), shared with
the PyTorch package. Delayed scaling keeps, per role, a ``scale`` [1] and an
``amax_history`` [H] (float32) in the flax collection ``fp8_metas``; current and block
scaling keep nothing.

A :class:`QuantizerSet` carries the recipe (static) and that state (arrays) into
:func:`transformer_engine.jax.dense`, whose VJP returns the updated state as the cotangent
of the state: ``jax.grad`` with respect to the state *is* the next state.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
from transformer_engine.common import plan as _plan
from transformer_engine.common.recipe import Recipe
from transformer_engine.jax import ops
from transformer_engine.jax.autocast import get_fp8_recipe

__all__ = ["ROLES", "FP8_COLLECTION", "QuantizerSet", "new_fp8_state", "make_quantizer_set",
           "update_collections", "plan_kind"]

ROLES = ("x", "kernel", "grad")
FP8_COLLECTION = "fp8_metas"

# The stored names of the roles -> the plan's roles (the only place the two meet).
_PLAN_ROLE = {"x": "input", "kernel": "weight", "grad": "grad_output"}


def _plan_of(recipe: Recipe, caller: str = "make_quantizer_set") -> _plan.Plan:
    """The recipe's plan (made once per recipe); a recipe the GEMM cannot run raises in the
    words of ``caller``."""
    return _plan.plan_of(recipe, caller)


def plan_kind(recipe: Optional[Recipe]) -> Optional[str]:
    """The kind of the recipe's plan (``"delayed"``, ``"current"``, ``"block"``), or None for
    no recipe (FP8 off) and for a recipe that has no plan (e.g. MXFP8): for checks that only
    ask which kind a recipe is; the quantizer set refuses a recipe without a plan itself. The
    package branches on this, never on the recipe's class, so a new recipe is a new plan."""
    if recipe is None:
        return None
    try:
        return _plan_of(recipe).kind
    except NotImplementedError:
        return None


def new_fp8_state(recipe: Optional[Recipe]) -> dict:
    """The initial FP8 state of one dense layer: scale 1 and an all-zero history per role
    for delayed scaling, ``{}`` for every other recipe (and for no recipe)."""
    if plan_kind(recipe) != "delayed":
        return {}
    # The history length is no field of the plan (it shapes state, not numerics): the recipe's.
    return {role: {"scale": jnp.ones((1,), jnp.float32),
                   "amax_history": jnp.zeros((recipe.amax_history_len,), jnp.float32)}
            for role in ROLES}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QuantizerSet:
    """How :func:`~transformer_engine.jax.dense` quantizes: a recipe (None: no FP8, the
    GEMMs run in the inputs' dtype) and the FP8 state that the recipe needs."""

    recipe: Optional[Recipe] = None
    state: Mapping = dataclasses.field(default_factory=dict)

    def tree_flatten(self):
        return (dict(self.state),), self.recipe

    @classmethod
    def tree_unflatten(cls, recipe, children):
        return cls(recipe, children[0])


def make_quantizer_set(recipe: Optional[Recipe] = None, state: Optional[Mapping] = None,
                       *, use_autocast: bool = True) -> QuantizerSet:
    """A quantizer set for ``recipe`` (default: the autocast's, when ``use_autocast``).

    Delayed scaling needs ``state`` (a mapping as :func:`new_fp8_state` returns, usually
    read from the ``fp8_metas`` collection); the other recipes take none.
    """
    if recipe is None and use_autocast:
        recipe = get_fp8_recipe()
    if recipe is None:
        return QuantizerSet(None, {})
    if not isinstance(recipe, Recipe):
        raise TypeError(f"make_quantizer_set: recipe must be a Recipe, got {type(recipe).__name__}")
    if _plan_of(recipe, "make_quantizer_set").kind == "delayed":
        if state is None:
            raise ValueError(
                "make_quantizer_set: DelayedScaling needs the FP8 state (scale and amax_history "
                "of x, kernel and grad); create it with new_fp8_state(recipe) and keep it in "
                "the 'fp8_metas' collection, or use transformer_engine.jax.flax.DenseGeneral")
        _check_state(recipe, state)
        return QuantizerSet(recipe, {r: dict(state[r]) for r in ROLES})
    return QuantizerSet(recipe, {})


def _check_state(recipe: Recipe, state: Mapping) -> None:
    # The expected history length is the recipe's amax_history_len (no field of the plan).
    for role in ROLES:
        if role not in state or set(state[role]) != {"scale", "amax_history"}:
            raise ValueError(f"make_quantizer_set: state must map each of {ROLES} to a dict with "
                             "'scale' and 'amax_history', got "
                             f"{jax.tree_util.tree_structure(state)}")
        scale, history = state[role]["scale"], state[role]["amax_history"]
        if jnp.shape(scale) != (1,) or jnp.shape(history) != (recipe.amax_history_len,):
            raise ValueError(
                f"make_quantizer_set: state[{role!r}] must have scale [1] and amax_history "
                f"[{recipe.amax_history_len}] (the recipe's amax_history_len), got "
                f"{jnp.shape(scale)} and {jnp.shape(history)}")


def role_dtype(recipe: Recipe, role: str):
    """The jax FP8 dtype of ``role``'s data under ``recipe``."""
    return ops.fp8_dtype(_plan_of(recipe).dtype_of(_PLAN_ROLE[role]))


def role_mode(recipe: Recipe, role: str) -> ops.ScalingMode:
    """The scaling mode of ``role``'s FP8 data under ``recipe``."""
    return ops.ScalingMode[_plan_of(recipe).mode_of(_PLAN_ROLE[role]).upper()]


def quantize_role(x2: jax.Array, qset: QuantizerSet, role: str, *,
                  columnwise: bool = True) -> ops.QuantizedTensor:
    """Quantizes the [M, K] matrix ``x2`` of ``role`` into row-wise and (unless
    ``columnwise=False``) column-wise FP8 data (one fused pass), by the set's recipe; the
    TENSOR modes also give the amax."""
    recipe = qset.recipe
    plan = _plan_of(recipe)
    dtype = role_dtype(recipe, role)
    if plan.kind == "delayed":
        scale, first = step_scale(qset, role, lambda gate: ops.compute_amax(x2, gate=gate))
        return ops.quantize(x2, scale, dtype, rowwise=True, columnwise=columnwise,
                            compute_amax=True, amax_into=first)
    if plan.kind == "current":
        amax = ops.compute_amax(x2)
        scale, _ = ops.scale_from_amax(amax, dtype, force_pow2_scales=plan.force_pow2_scales,
                                       amax_epsilon=plan.amax_epsilon)
        q = ops.quantize(x2, scale, dtype, rowwise=True, columnwise=columnwise,
                         compute_amax=False)
        return q._replace(amax=amax)
    if plan.kind == "block":
        q = ops.quantize(x2, None, dtype, scaling_mode=role_mode(recipe, role), rowwise=True,
                         columnwise=columnwise,
                         compute_amax=False, force_pow2_scales=plan.force_pow2_scales,
                         amax_epsilon=plan.amax_epsilon)
        return q
    raise NotImplementedError(f"quantize_role: plan kind {plan.kind!r} is not supported")


# Whether delayed scaling applies its first-step rule (step_scale). On in every use; turned off
# only by the benchmarks' probe of what the rule's launches cost a step (past the first step
# the rule changes no bit, so a step without it computes the same as one with it).
first_step_rule = True


def step_scale(qset: QuantizerSet, role: str,
               amax_of) -> tuple[jax.Array, Optional[jax.Array]]:
    """The scale that delayed scaling gives ``role``'s tensor in this step, and the gated
    call's amax (the tensor's on a first step, else 0): the op that then casts the tensor
    raises that amax with its own (``amax_into``), which gives the tensor's amax either way
    and spares the zeroing of a fresh one. With ``first_step_rule`` off: the stored scale and
    None (the cast writes its amax afresh).

    A role whose amax history is still empty (all zero with the initial scale of 1: a first
    step, or a reset state) is
    scaled from the tensor's own amax, the formula of the scale update applied to it, so that
    a first step is as good as current scaling (a mean loss's gradient, about 1e-7, would
    underflow E5M2 at the initial scale of 1); every later step uses the stored scale. Whether
    the history is empty is known only on the device, so ``amax_of(gate)`` makes the tensor's
    amax with a gated call of the op that computes the tensor (the core's gate, tensor.h:
    it runs only while the gate, the history's max, is 0, else gives 0 after one early
    return); an amax of 0 leaves the stored scale, as the update's rule does.
    """
    state = qset.state[role]
    if not first_step_rule:
        return state["scale"], None
    # Empty: an all-zero history and the initial scale of 1 (a history of one step is all
    # zero again after each update; the scale tells the steps after the first apart).
    gate = jnp.max(state["amax_history"], keepdims=True) + jnp.abs(state["scale"] - 1.0)
    first = amax_of(gate)
    # Under vmap the state is shared: the scale of one call on the whole batch.
    amax = _amax_of_all_mapped(first)
    # The update's rule written in jnp rather than a call of the core's update: XLA fuses it
    # into the ops around it, where a call per role was a kernel and a copy of the stored
    # scale (the call writes in place) three times per GEMM at every step, for a rule that
    # only the first step needs. Same bits: one IEEE division by the amax, one by 2^margin.
    plan = _plan_of(qset.recipe)
    scale = _delayed_scale(amax, state["scale"], plan.fp8_max_of(_PLAN_ROLE[role]), plan.margin)
    return scale, first


def _delayed_scale(amax, scale, fp8_max: float, margin: int):
    """The core's delayed-scaling rule (numerics.h, delayed_scale) for an amax [1]: the
    largest scale that keeps ``amax`` within ``fp8_max`` less the margin's powers of two
    (float32's max where that overflows), or the stored ``scale`` where the amax is 0 or not
    finite."""
    computed = (fp8_max / amax) / (2.0 ** margin)
    computed = jnp.where(jnp.isinf(computed), jnp.finfo(jnp.float32).max, computed)
    return jnp.where(jnp.isfinite(amax) & (amax > 0), computed, scale).astype(jnp.float32)


@jax.custom_batching.custom_vmap
def _amax_of_all_mapped(amax):
    """The identity, except under ``jax.vmap``: the max over the mapped axis, unmapped.

    The FP8 state is shared by every mapped call (it is not mapped), so its update must see
    the amax of all of them, as one call on the whole batch would; and an unmapped new state
    is also what keeps jax from summing the mapped calls' states as if they were gradients.
    """
    return amax


@_amax_of_all_mapped.def_vmap
def _amax_of_all_mapped_vmap(axis_size, in_batched, amax):
    del axis_size
    if not in_batched[0]:
        return amax, False
    return jnp.max(amax, axis=0), False


def updated_state(recipe: Recipe, state: Mapping, amaxes: Mapping) -> dict:
    """The delayed-scaling state after a step whose amaxes were ``amaxes`` (role -> [1]).

    Each role's amax goes into slot 0 of its history, then the recipe's update runs: the
    new scale from the history, and the history rolled by one with slot 0 cleared.
    """
    amaxes = {r: _amax_of_all_mapped(amaxes[r]) for r in ROLES}
    scales = {r: state[r]["scale"] for r in ROLES}
    plan = _plan_of(recipe)
    if plan.algo != "callable":
        # One core call for every role (each with its format): it records the amaxes into
        # slot 0 itself, where a write per role and a call per format would be 5 launches.
        h, s, _ = ops.delayed_scaling_update_with_amaxes(
            [state[r]["amax_history"] for r in ROLES], [amaxes[r] for r in ROLES],
            [scales[r] for r in ROLES], [role_dtype(recipe, r) for r in ROLES],
            algo=plan.algo, margin=plan.margin)
        return {r: {"scale": sr, "amax_history": hr}
                for r, hr, sr in zip(ROLES, h, s, strict=True)}
    # User callables are written with jax ops (the recipe's contract): same rule, in jnp.
    # max with slot 0 (cleared by the last update): NaN propagates, as in the PyTorch package.
    histories = {r: state[r]["amax_history"].at[0].max(amaxes[r][0]) for r in ROLES}
    return {r: _update_with_callables(recipe, plan, histories[r], scales[r],
                                      plan.fp8_max_of(_PLAN_ROLE[r]))
            for r in ROLES}


def _update_with_callables(recipe: Recipe, plan: _plan.Plan, history, scale,
                           fp8_max: float) -> dict:
    # The plan says only that a callable is involved ("callable"); the callables themselves
    # (and the amax algorithm's name beside a user scaling callable) live on the recipe, and
    # the user's scaling callable is given the recipe, as its contract says.
    algo = recipe.amax_compute_algo
    if callable(algo):
        amax = jnp.reshape(algo(history), (1,)).astype(jnp.float32)
    elif algo == "max":
        amax = jnp.max(history, keepdims=True)
    else:
        amax = history[:1]
    if recipe.scaling_factor_compute_algo is not None:
        new_scale = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)
    else:
        new_scale = _delayed_scale(amax, scale, fp8_max, plan.margin)
    history = jnp.roll(history, -1, axis=0).at[0].set(0.0)
    return {"scale": jnp.asarray(new_scale, jnp.float32).reshape(1), "amax_history": history}


def update_collections(new: Mapping, original: Mapping):
    """``original`` (flax variables) with each collection of ``new`` put in its place.

    Typical use, after ``grads, new_vars = jax.grad(loss, argnums=(0, 1))(params, variables)``:
    ``variables = update_collections(new_vars, variables)`` (the ``fp8_metas`` gradient is
    the next FP8 state).
    """
    merged = dict(original)
    merged.update(dict(new))
    try:  # keep flax's FrozenDict when the original is one
        from flax.core import FrozenDict

        if isinstance(original, FrozenDict):
            return FrozenDict(merged)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    return merged
