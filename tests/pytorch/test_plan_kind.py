"""Checks that ask only which kind a recipe is go through its plan (kind_of)."""

import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from transformer_engine.pytorch.quantization import kind_of


def test_kind_of_each_recipe():
    assert kind_of(DelayedScaling()) == "delayed"
    assert kind_of(Float8CurrentScaling()) == "current"
    assert kind_of(Float8BlockScaling()) == "block"
    # No plan (the GEMM cannot run it): no kind, and no error for a check that only asks.
    assert kind_of(MXFP8BlockScaling()) is None


def test_calibration_records_only_under_delayed():
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    for recipe, recorded in ((DelayedScaling(), True), (Float8CurrentScaling(), False),
                             (MXFP8BlockScaling(), False)):
        m = te.Linear(32, 16)
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
            m(x)
        assert bool(m.amax_history_fwd.any()) == recorded, recipe


def test_history_length_at_creation_follows_delayed_kind():
    # A delayed recipe sizes a new module's state; the other kinds leave the default length.
    default = DelayedScaling().amax_history_len
    with te.fp8_autocast(enabled=False, calibrating=True,
                         fp8_recipe=DelayedScaling(amax_history_len=default + 3)):
        assert te.Linear(32, 16).amax_history_fwd.shape[0] == default + 3
    for recipe in (Float8CurrentScaling(), MXFP8BlockScaling()):
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe):
            assert te.Linear(32, 16).amax_history_fwd.shape[0] == default


def test_no_module_asks_the_recipe_class_which_kind_it_is():
    """A source scan of the package: no recipe predicate (``recipe.delayed()``, ...) and no
    isinstance against a concrete recipe class; the kind comes from the plan (kind_of). (Fields
    such as fp8_dpa or amax_history_len are read from the recipe: they are no plan field.)"""
    import ast
    from pathlib import Path

    from transformer_engine.common import recipe as r

    classes = {c.__name__ for c in (r.DelayedScaling, r.Float8CurrentScaling,
                                    r.Float8BlockScaling, r.MXFP8BlockScaling,
                                    r.NVFP4BlockScaling, r.CustomRecipe)}
    predicates = {name for name in vars(r.Recipe) if not name.startswith("_")}
    found = []
    for path in sorted(Path(te.__file__).resolve().parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in predicates:
                found.append(f"{path.name}:{node.lineno} {func.attr}()")
            elif (isinstance(func, ast.Name) and func.id in ("isinstance", "issubclass")
                  and len(node.args) == 2):
                names = {n.id if isinstance(n, ast.Name) else n.attr
                         for n in ast.walk(node.args[1])
                         if isinstance(n, (ast.Name, ast.Attribute))}
                if names & classes:
                    found.append(f"{path.name}:{node.lineno} {func.id}(..., {names & classes})")
    assert found == []
