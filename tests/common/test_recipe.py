"""Tests of transformer_engine.common.recipe: pure Python, no GPU and no framework needed."""

import ast
import dataclasses
import doctest
import math
import pickle
import re

import pytest

from transformer_engine.common import recipe as recipe_module
from transformer_engine.common.recipe import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)

ALL_RECIPES = [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling]
PREDICATES = {
    DelayedScaling: "delayed",
    Float8CurrentScaling: "float8_current_scaling",
    Float8BlockScaling: "float8_block_scaling",
    MXFP8BlockScaling: "mxfp8",
}


def _history_max(history):
    """Module level, so a recipe holding it can be pickled."""
    return max(history)


class _Index:
    """An integer-like object that is not an int, like a NumPy integer."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


# ---------------------------------------------------------------------------------------------
# Format


@pytest.mark.parametrize(
    "fmt, max_fwd, max_bwd, fwd_name, bwd_name",
    [
        (Format.E4M3, 448.0, 448.0, "float8_e4m3", "float8_e4m3"),
        (Format.E5M2, 57344.0, 57344.0, "float8_e5m2", "float8_e5m2"),
        (Format.HYBRID, 448.0, 57344.0, "float8_e4m3", "float8_e5m2"),
    ],
)
def test_format_limits_and_names(fmt, max_fwd, max_bwd, fwd_name, bwd_name):
    assert (fmt.max_fwd, fmt.max_bwd) == (max_fwd, max_bwd)
    assert (fmt.fwd_dtype_name, fmt.bwd_dtype_name) == (fwd_name, bwd_name)


def test_format_maxima_match_bit_layouts():
    # Independent derivation: E4M3 (no infinities) tops out at 1.75 * 2**8 (mantissa 110,
    # since 111 at the top exponent is NaN); E5M2 at 1.75 * 2**15 (the top exponent is Inf/NaN).
    assert Format.E4M3.max_fwd == (1 + 0.5 + 0.25) * 2.0**8
    assert Format.E5M2.max_fwd == (1 + 0.5 + 0.25) * 2.0**15


def test_format_members_and_lookup_by_name():
    assert [f.name for f in Format] == ["E4M3", "E5M2", "HYBRID", "E2M1"]
    assert Format["HYBRID"] is Format.HYBRID
    assert Format("E4M3") is Format.E4M3
    assert repr(Format.E5M2) == "Format.E5M2"


# ---------------------------------------------------------------------------------------------
# Defaults, predicates, class constants


def test_delayed_scaling_defaults():
    r = DelayedScaling()
    assert r.margin == 0
    assert r.fp8_format is Format.HYBRID
    assert r.amax_history_len == 1024
    assert r.amax_compute_algo == "max"
    assert r.scaling_factor_compute_algo is None
    assert r.reduce_amax is True
    assert (r.fp8_dpa, r.fp8_mha) == (False, False)


def test_float8_current_scaling_defaults():
    r = Float8CurrentScaling()
    assert r.fp8_format is Format.HYBRID
    assert r.power_2_scale is False
    assert r.amax_epsilon == 0.0 and type(r.amax_epsilon) is float
    assert (r.fp8_dpa, r.fp8_mha) == (False, False)


def test_float8_block_scaling_defaults():
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    assert r.power_2_scale is True
    assert r.amax_epsilon == 0.0


def test_mxfp8_defaults():
    assert MXFP8BlockScaling().fp8_format is Format.E4M3


def test_block_sizes_are_class_constants_not_fields():
    assert Float8BlockScaling.block_size == 128
    assert MXFP8BlockScaling.block_size == 32
    for cls in (Float8BlockScaling, MXFP8BlockScaling):
        assert "block_size" not in {f.name for f in dataclasses.fields(cls)}
        assert "block_size" not in repr(cls())


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_exactly_one_predicate_is_true(cls):
    r = cls()
    assert isinstance(r, Recipe)
    truths = {name: getattr(r, name)() for name in PREDICATES.values()}
    assert truths == {name: name == PREDICATES[cls] for name in PREDICATES.values()}


def test_base_recipe_predicates_are_false():
    r = Recipe()
    assert not (r.delayed() or r.float8_current_scaling() or r.float8_block_scaling() or r.mxfp8())


# ---------------------------------------------------------------------------------------------
# Validation: (class, keyword arguments, exception type, exact message)

_INT = "DelayedScaling: margin must be a non-negative int, got "
_LEN = "DelayedScaling: amax_history_len must be a positive int, got "
_ALGO = "DelayedScaling: amax_compute_algo must be 'max', 'most_recent' or a callable, got "
_EPS = "Float8CurrentScaling: amax_epsilon must be a finite, non-negative float, got "
_DIM = "Float8BlockScaling: w_block_scaling_dim must be 1 or 2, got "
_FMT = "must be a Format member (Format.E4M3 or Format.HYBRID), got "

INVALID = [
    (DelayedScaling, dict(margin=-1), ValueError, _INT + "-1"),
    (DelayedScaling, dict(margin=1.5), TypeError, _INT + "1.5 of type float"),
    (DelayedScaling, dict(margin="2"), TypeError, _INT + "'2' of type str"),
    (DelayedScaling, dict(margin=True), TypeError, _INT + "True of type bool"),
    (DelayedScaling, dict(margin=None), TypeError, _INT + "None of type NoneType"),
    (DelayedScaling, dict(amax_history_len=0), ValueError, _LEN + "0"),
    (DelayedScaling, dict(amax_history_len=16.0), TypeError, _LEN + "16.0 of type float"),
    (DelayedScaling, dict(amax_compute_algo="mean"), ValueError, _ALGO + "'mean'"),
    (DelayedScaling, dict(amax_compute_algo="MAX"), ValueError, _ALGO + "'MAX'"),
    (DelayedScaling, dict(amax_compute_algo=3), TypeError, _ALGO + "3 of type int"),
    (
        DelayedScaling,
        dict(scaling_factor_compute_algo="max"),
        TypeError,
        "DelayedScaling: scaling_factor_compute_algo must be None or a callable, "
        "got 'max' of type str",
    ),
    (
        DelayedScaling,
        dict(reduce_amax=1),
        TypeError,
        "DelayedScaling: reduce_amax must be a bool, got 1 of type int",
    ),
    (
        DelayedScaling,
        dict(fp8_dpa=None),
        TypeError,
        "DelayedScaling: fp8_dpa must be a bool, got None of type NoneType",
    ),
    (
        DelayedScaling,
        dict(fp8_mha=True),
        ValueError,
        "DelayedScaling: fp8_dpa must be True when fp8_mha is True, got False",
    ),
    (
        DelayedScaling,
        dict(fp8_format="E4M3"),
        TypeError,
        "DelayedScaling: fp8_format " + _FMT + "'E4M3' of type str; convert a name with "
        "Format['E4M3']",
    ),
    (DelayedScaling, dict(fp8_format=0), TypeError, "DelayedScaling: fp8_format " + _FMT
     + "0 of type int"),
    (
        Float8CurrentScaling,
        dict(power_2_scale="yes"),
        TypeError,
        "Float8CurrentScaling: power_2_scale must be a bool, got 'yes' of type str",
    ),
    (Float8CurrentScaling, dict(amax_epsilon=-1e-3), ValueError, _EPS + "-0.001"),
    (Float8CurrentScaling, dict(amax_epsilon=math.inf), ValueError, _EPS + "inf"),
    (Float8CurrentScaling, dict(amax_epsilon=math.nan), ValueError, _EPS + "nan"),
    (Float8CurrentScaling, dict(amax_epsilon="0"), TypeError, _EPS + "'0' of type str"),
    (Float8CurrentScaling, dict(amax_epsilon=False), TypeError, _EPS + "False of type bool"),
    (
        Float8CurrentScaling,
        dict(fp8_mha=True),
        ValueError,
        "Float8CurrentScaling: fp8_dpa must be True when fp8_mha is True, got False",
    ),
    (Float8BlockScaling, dict(w_block_scaling_dim=0), ValueError, _DIM + "0"),
    (Float8BlockScaling, dict(w_block_scaling_dim=3), ValueError, _DIM + "3"),
    (Float8BlockScaling, dict(w_block_scaling_dim=2.0), TypeError, _DIM + "2.0 of type float"),
    (
        Float8BlockScaling,
        dict(x_block_scaling_dim=-1),
        ValueError,
        "Float8BlockScaling: x_block_scaling_dim must be 1 or 2, got -1",
    ),
    (
        Float8BlockScaling,
        dict(grad_block_scaling_dim="1"),
        TypeError,
        "Float8BlockScaling: grad_block_scaling_dim must be 1 or 2, got '1' of type str",
    ),
    (
        Float8BlockScaling,
        dict(amax_epsilon=-1.0),
        ValueError,
        "Float8BlockScaling: amax_epsilon must be a finite, non-negative float, got -1.0",
    ),
    (
        MXFP8BlockScaling,
        dict(fp8_format=None),
        TypeError,
        "MXFP8BlockScaling: fp8_format " + _FMT + "None of type NoneType",
    ),
]


@pytest.mark.parametrize(
    "cls, kwargs, exc, message", INVALID, ids=[f"{c.__name__}-{k}" for c, k, _, _ in INVALID]
)
def test_invalid_arguments_raise_with_message(cls, kwargs, exc, message):
    with pytest.raises(exc) as info:
        cls(**kwargs)
    assert type(info.value) is exc
    assert str(info.value) == message


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_all_e5m2_is_rejected_and_hybrid_suggested(cls):
    with pytest.raises(ValueError) as info:
        cls(fp8_format=Format.E5M2)
    message = str(info.value)
    assert message.startswith(
        f"{cls.__name__}: fp8_format must be Format.E4M3 or Format.HYBRID, got Format.E5M2"
    )
    assert "precision" in message and "use Format.HYBRID" in message


@pytest.mark.parametrize("cls", ALL_RECIPES)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_e4m3_and_hybrid_are_accepted(cls, fmt):
    assert cls(fp8_format=fmt).fp8_format is fmt


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_fields_are_keyword_only(cls):
    with pytest.raises(TypeError):
        cls(Format.E4M3)


def test_valid_non_default_values_are_kept():
    r = DelayedScaling(margin=3, amax_history_len=1, amax_compute_algo="most_recent",
                       reduce_amax=False, fp8_dpa=True, fp8_mha=True)
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (3, 1, "most_recent")
    assert (r.reduce_amax, r.fp8_dpa, r.fp8_mha) == (False, True, True)
    b = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=2)
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (2, 1, 2)


def test_callables_are_accepted():
    def scale_fn(amax, scale, fp8_max, recipe):
        return fp8_max / amax / 2**recipe.margin

    r = DelayedScaling(amax_compute_algo=_history_max, scaling_factor_compute_algo=scale_fn)
    assert r.amax_compute_algo([1.0, 4.0, 2.0]) == 4.0
    assert r.scaling_factor_compute_algo(2.0, 1.0, 448.0, r) == 224.0


def test_integer_like_values_are_stored_as_int():
    r = DelayedScaling(margin=_Index(2), amax_history_len=_Index(16))
    assert type(r.margin) is int and type(r.amax_history_len) is int
    assert r == DelayedScaling(margin=2, amax_history_len=16)
    b = Float8BlockScaling(w_block_scaling_dim=_Index(1))
    assert type(b.w_block_scaling_dim) is int and b.w_block_scaling_dim == 1


def test_integer_epsilon_is_stored_as_float():
    r = Float8CurrentScaling(amax_epsilon=1)
    assert type(r.amax_epsilon) is float
    assert r == Float8CurrentScaling(amax_epsilon=1.0)


# ---------------------------------------------------------------------------------------------
# Frozen, hashable, picklable, readable


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_every_field_is_frozen(cls):
    r = cls()
    for field in dataclasses.fields(cls):
        before = getattr(r, field.name)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(r, field.name, before)
        assert getattr(r, field.name) is before


NON_DEFAULT = [
    DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=16,
                   amax_compute_algo="most_recent", reduce_amax=False, fp8_dpa=True),
    Float8CurrentScaling(power_2_scale=True, amax_epsilon=1e-12, fp8_dpa=True, fp8_mha=True),
    Float8BlockScaling(fp8_format=Format.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1,
                       power_2_scale=False),
    MXFP8BlockScaling(fp8_format=Format.HYBRID),
]
ROUND_TRIP = [cls() for cls in ALL_RECIPES] + NON_DEFAULT + [
    DelayedScaling(amax_compute_algo=_history_max)
]


def _round_trip_id(r) -> str:
    """repr without function addresses, which differ between processes (pytest-xdist's
    workers must collect the same ids)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(r))


@pytest.mark.parametrize("r", ROUND_TRIP, ids=_round_trip_id)
def test_pickle_round_trip(r):
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        loaded = pickle.loads(pickle.dumps(r, protocol=protocol))
        assert type(loaded) is type(r)
        assert loaded == r and hash(loaded) == hash(r)
        assert loaded.fp8_format is r.fp8_format


@pytest.mark.parametrize("cls", ALL_RECIPES)
def test_equal_recipes_hash_equal(cls):
    a, b = cls(), cls()
    assert a is not b and a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert {a: "x"}[b] == "x"


@pytest.mark.parametrize("r", NON_DEFAULT, ids=repr)
def test_a_changed_field_makes_recipes_unequal(r):
    assert r != type(r)()


def test_different_recipe_kinds_are_unequal():
    kinds = [cls() for cls in ALL_RECIPES]
    assert len(set(kinds)) == len(kinds)
    # Same field values, different kind: still unequal.
    assert MXFP8BlockScaling() != Float8BlockScaling()
    assert Float8CurrentScaling() != DelayedScaling()


@pytest.mark.parametrize("r", [cls() for cls in ALL_RECIPES] + NON_DEFAULT, ids=repr)
def test_repr_is_readable_and_evaluates_back(r):
    text = repr(r)
    assert text.startswith(type(r).__name__ + "(")
    assert "fp8_format=Format." in text
    namespace = {name: getattr(recipe_module, name) for name in recipe_module.__all__}
    assert eval(text, namespace) == r


# ---------------------------------------------------------------------------------------------
# Module hygiene


def test_public_api():
    assert sorted(recipe_module.__all__) == sorted(
        ["Format", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling",
         "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe"]
    )


def test_imports_only_the_standard_library():
    # The recipes are shared by both frameworks and must import without torch, jax or the
    # native module; checked on the source, independent of what the package __init__ loads.
    with open(recipe_module.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no relative imports"
            imported.add(node.module.split(".")[0])
    assert imported <= {"dataclasses", "enum", "math", "numbers", "operator", "typing"}


def test_docstring_examples_run():
    result = doctest.testmod(recipe_module)
    assert result.attempted > 0 and result.failed == 0


# ---------------------------------------------------------------------------------------------
# NVIDIA Transformer Engine's names: recipes, keywords and predicates


def _qfactory(role):
    return None


NVIDIA_KINDS = {
    DelayedScaling(): "delayed",
    Float8CurrentScaling(): "float8_current_scaling",
    Float8BlockScaling(): "float8_block_scaling",
    MXFP8BlockScaling(): "mxfp8",
    NVFP4BlockScaling(): "nvfp4",
    CustomRecipe(qfactory=_qfactory): "custom",
}
_KIND_PREDICATES = ["delayed", "float8_current_scaling", "float8_block_scaling", "mxfp8",
                    "nvfp4", "custom"]


@pytest.mark.parametrize("r", list(NVIDIA_KINDS), ids=lambda r: type(r).__name__)
def test_every_recipe_answers_nvidia_predicates_on_instance_and_class(r):
    kind = NVIDIA_KINDS[r]
    for target in (r, type(r)):
        truths = {name: getattr(target, name)() for name in _KIND_PREDICATES}
        assert truths == {name: name == kind for name in _KIND_PREDICATES}
        assert all(type(v) is bool for v in truths.values())
        assert target.float8_per_tensor_scaling() is (kind in ("delayed",
                                                               "float8_current_scaling"))
    assert not (Recipe().nvfp4() or Recipe().custom() or Recipe().float8_per_tensor_scaling())


def test_format_e2m1_is_the_fp4_format_and_no_fp8_recipe_takes_it():
    assert Format.E2M1.max_fwd == Format.E2M1.max_bwd == 6.0
    assert Format.E2M1.fwd_dtype_name == "float4_e2m1"
    for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling):
        with pytest.raises(ValueError, match="E2M1 is a 4-bit format"):
            cls(fp8_format=Format.E2M1)


def test_use_power_2_scales_sets_power_2_scale():
    assert Float8CurrentScaling(use_power_2_scales=True).power_2_scale is True
    assert Float8CurrentScaling(use_power_2_scales=False).power_2_scale is False
    assert Float8CurrentScaling(use_power_2_scales=True) == Float8CurrentScaling(
        power_2_scale=True)
    assert Float8CurrentScaling(use_power_2_scales=True).fp8_quant_fwd_inp == QParams(
        power_2_scale=True)
    with pytest.raises(TypeError, match="use_power_2_scales must be a bool"):
        Float8CurrentScaling(use_power_2_scales=1)


def test_use_f32_scales_clears_power_2_scale():
    r = Float8BlockScaling(use_f32_scales=True)
    assert r.power_2_scale is False and r == Float8BlockScaling(power_2_scale=False)
    assert r.fp8_quant_fwd_weight.power_2_scale is False
    assert Float8BlockScaling(use_f32_scales=False).power_2_scale is True
    assert Float8BlockScaling().fp8_quant_bwd_grad == QParams(power_2_scale=True)


def test_an_alias_contradicting_our_field_raises():
    with pytest.raises(ValueError, match="use_f32_scales=False contradicts power_2_scale=False"):
        Float8BlockScaling(use_f32_scales=False, power_2_scale=False)
    with pytest.raises(ValueError, match="use_power_2_scales=False contradicts"):
        Float8CurrentScaling(use_power_2_scales=False, power_2_scale=True)


def test_aliases_survive_dataclasses_replace():
    r = Float8CurrentScaling(use_power_2_scales=True)
    assert dataclasses.replace(r, power_2_scale=False).power_2_scale is False
    assert dataclasses.replace(r, amax_epsilon=1.0).power_2_scale is True


def test_delayed_scaling_takes_the_keywords_megatron_passes():
    """Megatron-LM's TEDelayedScaling passes override_linear_precision and its module keywords
    (params_dtype, device), which NVIDIA's recipe ignores: accepted, nothing stored; a
    high-precision override is refused by name."""

    class MegatronStyle(DelayedScaling):
        def __init__(self, override=(False, False, False)):
            super().__init__(margin=0, fp8_format=Format.HYBRID, amax_compute_algo="max",
                             amax_history_len=16, override_linear_precision=override,
                             fp8_dpa=False, fp8_mha=False, params_dtype="bfloat16",
                             device="cpu")

    r = MegatronStyle()
    assert r.amax_history_len == 16
    assert "params_dtype" not in {f.name for f in dataclasses.fields(r)}
    assert DelayedScaling(override_linear_precision=(False, False, False)) == DelayedScaling()
    with pytest.raises(ValueError, match=r"override_linear_precision must be \(False, False, "
                                         r"False\), got \(False, False, True\)"):
        MegatronStyle((False, False, True))


def test_gemm_params_take_nvidia_keywords():
    r = Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=False),
                             fp8_gemm_dgrad=MMParams(), fp8_gemm_wgrad=MMParams())
    assert r == Float8CurrentScaling()
    assert Float8CurrentScaling().fp8_gemm_fprop.use_split_accumulator is False
    b = Float8BlockScaling()
    assert all(getattr(b, f).use_split_accumulator for f in
               ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"))
    with pytest.raises(ValueError, match="always accumulate split"):
        Float8BlockScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=False))
    with pytest.raises(TypeError, match="fp8_gemm_dgrad must be an MMParams"):
        Float8CurrentScaling(fp8_gemm_dgrad=True)


def test_attention_fields_exist_on_every_recipe_and_refuse_where_not_served():
    for r in NVIDIA_KINDS:
        assert r.fp8_dpa is False and r.fp8_mha is False
    assert Float8CurrentScaling(fp8_dpa=True).fp8_dpa is True
    for cls in (Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling):
        with pytest.raises(ValueError, match="FP8 attention runs under DelayedScaling"):
            cls(fp8_dpa=True)


def test_backward_override_values():
    for r in NVIDIA_KINDS:
        assert r.backward_override is None
    assert Float8CurrentScaling(backward_override="dequantized").backward_override == \
        "dequantized"
    assert MXFP8BlockScaling(backward_override="high_precision").backward_override == \
        "high_precision"
    with pytest.raises(ValueError, match="delayed scaling has no other backward mode"):
        DelayedScaling(backward_override="high_precision")
    with pytest.raises(ValueError, match="backward_override must be None, 'high_precision'"):
        Float8BlockScaling(backward_override="fp32")


def test_mxfp8_takes_nvidia_margin():
    assert MXFP8BlockScaling(margin=2).margin == 2
    with pytest.raises(ValueError, match="margin must be a non-negative int"):
        MXFP8BlockScaling(margin=-1)


def test_nvfp4_constructs_with_nvidia_keywords():
    r = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                          disable_2d_quantization=True, fp4_format=Format.E2M1,
                          fp8_format=Format.E4M3)
    assert r.disable_rht and r.fp4_format is Format.E2M1 and r.fp8_format is Format.E4M3
    assert r != NVFP4BlockScaling() and hash(NVFP4BlockScaling()) == hash(NVFP4BlockScaling())
    assert pickle.loads(pickle.dumps(r)) == r
    with pytest.raises(ValueError, match="fp8_format must be Format.E4M3"):
        NVFP4BlockScaling(fp8_format=Format.HYBRID)
    with pytest.raises(ValueError, match="fp4_format must be Format.E2M1"):
        NVFP4BlockScaling(fp4_format=Format.E4M3)


def test_custom_recipe_needs_a_callable_qfactory():
    r = CustomRecipe(qfactory=_qfactory)
    assert r.qfactory is _qfactory and r.fp8_format is Format.HYBRID
    with pytest.raises(TypeError, match="qfactory"):
        CustomRecipe()
    with pytest.raises(TypeError, match="qfactory must be a callable"):
        CustomRecipe(qfactory=3)


@pytest.mark.parametrize("r, message", [
    (NVFP4BlockScaling(), "NVFP4BlockScaling is not supported: this package has no FP4"),
    (CustomRecipe(qfactory=_qfactory),
     "CustomRecipe is not supported: custom quantizer factories (qfactory) are not supported"),
    (Float8CurrentScaling(backward_override="high_precision"),
     "Float8CurrentScaling(backward_override='high_precision') is not supported"),
    (Float8BlockScaling(backward_override="dequantized"),
     "Float8BlockScaling(backward_override='dequantized') is not supported"),
    (Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=True)),
     "Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=True)) is not "
     "supported"),
    (Float8CurrentScaling(fp8_gemm_wgrad=MMParams(use_split_accumulator=False)),
     "Float8CurrentScaling(fp8_gemm_wgrad=MMParams(use_split_accumulator=False)) is not "
     "supported"),
], ids=lambda v: type(v).__name__ if isinstance(v, Recipe) else "")
def test_the_plan_refuses_what_no_gemm_runs(r, message):
    from transformer_engine.common.plan import make_plan, plan_of

    for fn in (make_plan, plan_of):
        with pytest.raises(NotImplementedError) as info:
            fn(r, "te.Linear")
        assert str(info.value).startswith("te.Linear: " + message)


def test_the_plan_accepts_nvidia_defaults():
    from transformer_engine.common.plan import make_plan

    assert make_plan(Float8CurrentScaling(use_power_2_scales=True), "x").force_pow2_scales
    assert not make_plan(Float8BlockScaling(use_f32_scales=True), "x").force_pow2_scales
