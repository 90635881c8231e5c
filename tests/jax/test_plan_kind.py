"""The JAX package asks a recipe's plan (plan_kind, the plan's fields) what to do, never the
recipe's class or predicates: a source scan of the package, and a recipe that only its plan
describes running as the built-in recipe of the same plan does, bit for bit."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transformer_engine.jax as te
from transformer_engine.common import plan as _plan
from transformer_engine.common import recipe
from transformer_engine.jax.flax import LayerNormMLP
from transformer_engine.jax.quantizer import new_fp8_state, plan_kind

_PACKAGE = Path(te.__file__).resolve().parent

_RECIPE_CLASSES = (recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling,
                   recipe.MXFP8BlockScaling, recipe.NVFP4BlockScaling, recipe.CustomRecipe)
_PREDICATES = {name for name in vars(recipe.Recipe) if not name.startswith("_")}
_RECIPE_FIELDS = {f.name for cls in _RECIPE_CLASSES for f in dataclasses.fields(cls)}

# The reads of a recipe's fields that stay, by (file, field): the history length shapes the
# delayed-scaling state and is no field of the plan; the user's callables (and the amax
# algorithm's name beside a user scaling callable) are the recipe's own objects.
_ALLOWED = {
    ("quantizer.py", "amax_history_len"),
    ("quantizer.py", "amax_compute_algo"),
    ("quantizer.py", "scaling_factor_compute_algo"),
}


def _recipe_branches(source: str, filename: str) -> list[str]:
    """Where ``source`` asks a recipe's predicates, tests a concrete recipe class, or reads a
    recipe field (other than through a plan), as ``file:line what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _PREDICATES):
            what = f"{node.func.attr}()"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
            names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                     if isinstance(n, (ast.Name, ast.Attribute))}
            hit = names & {cls.__name__ for cls in _RECIPE_CLASSES}
            what = f"{node.func.id}(..., {sorted(hit)})" if hit else None
        elif isinstance(node, ast.Attribute) and node.attr in _RECIPE_FIELDS:
            # margin and amax_epsilon are the plan's fields too: a read of a plan (a name, or
            # a call such as _plan_of(recipe)) is fine.
            through_plan = (isinstance(node.value, ast.Call)
                            and "plan" in ast.unparse(node.value.func).lower())
            on_recipe = "recipe" in ast.unparse(node.value).lower() and not through_plan
            if (on_recipe or node.attr not in _plan.Plan._fields) and (
                    (filename, node.attr) not in _ALLOWED):
                what = f".{node.attr}"
        if what:
            found.append(f"{filename}:{node.lineno} {what}")
    return found


def test_no_module_branches_on_the_recipe_class():
    files = sorted(_PACKAGE.rglob("*.py"))
    assert any(f.name == "_fused.py" for f in files)
    found = [hit for f in files for hit in _recipe_branches(f.read_text(), f.name)]
    assert found == []


@pytest.mark.parametrize("code", [
    "if recipe.delayed():\n    pass\n",
    "ok = qset.recipe.float8_current_scaling()\n",
    "ok = isinstance(r, (recipe.DelayedScaling, int))\n",
    "eps = qset.recipe.amax_epsilon\n",
    "pow2 = r.power_2_scale\n",
])
def test_the_scan_finds_a_branch(code):
    assert len(_recipe_branches(code, "dense.py")) == 1
    assert _recipe_branches("eps = plan.amax_epsilon + _plan_of(qset.recipe).margin\n",
                            "dense.py") == []


def test_plan_kind_of_each_recipe():
    assert plan_kind(recipe.DelayedScaling()) == "delayed"
    assert plan_kind(recipe.Float8CurrentScaling()) == "current"
    assert plan_kind(recipe.Float8BlockScaling()) == "block"
    # No plan (the GEMM cannot run it), or no recipe: no kind, and no error for a check that
    # only asks.
    assert plan_kind(recipe.MXFP8BlockScaling()) is None
    assert plan_kind(None) is None


def test_state_follows_the_delayed_kind():
    state = new_fp8_state(recipe.DelayedScaling(amax_history_len=5))
    assert {r: state[r]["amax_history"].shape for r in state} == {
        r: (5,) for r in ("x", "kernel", "grad")}
    for r in (recipe.Float8CurrentScaling(), recipe.Float8BlockScaling(),
              recipe.MXFP8BlockScaling(), None):
        assert new_fp8_state(r) == {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PlannedOnly(recipe.Recipe):
    """A recipe that answers no predicate: only its plan says how it quantizes."""

    like: str  # the kind of the built-in recipe whose plan it takes
    amax_history_len: int = recipe.DelayedScaling().amax_history_len


_BUILT_IN = {"delayed": recipe.DelayedScaling(), "current": recipe.Float8CurrentScaling(),
             "block": recipe.Float8BlockScaling()}


def _two_steps(fp8_recipe):
    """Output and gradients of a LayerNormMLP over two training steps (the FP8 state of
    delayed scaling carried from the first to the second)."""
    mlp = LayerNormMLP(intermediate_dim=128, activations=("gelu",), use_bias=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 64), jnp.float32)
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        variables = mlp.init(jax.random.PRNGKey(1), x)

    def loss(variables, x):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            out, _ = mlp.apply(variables, x)
        return jnp.sum(jnp.sin(out)), out

    results = []
    for step in range(2):
        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(variables, x * (1.0 + step))
        results.append((out, grads))
        variables = te.update_collections({k: v for k, v in grads.items() if k != "params"},
                                          variables)
    return results


@pytest.mark.parametrize("kind", ["delayed", "current", "block"])
def test_a_recipe_known_by_its_plan_alone_runs_as_the_built_in(kind, monkeypatch):
    made = _plan.make_plan

    def make_plan(r, caller):
        return made(_BUILT_IN[r.like] if isinstance(r, _PlannedOnly) else r, caller)

    monkeypatch.setattr(_plan, "make_plan", make_plan)
    monkeypatch.setattr(_plan, "_PLANS", {})
    ours = _PlannedOnly(like=kind)
    assert plan_kind(ours) == kind
    got, want = _two_steps(ours), _two_steps(_BUILT_IN[kind])
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Delayed scaling kept and updated its state; the other kinds keep none.
    assert ("fp8_metas" in got[0][1]) == (kind == "delayed")
