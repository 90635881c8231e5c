"""FP8 state written by NVIDIA Transformer Engine's modules loads into ours.

The states are built here as NVIDIA's ``get_extra_state`` lays them out: a dict with the
recipe object, ``scale_fwd`` [3G], ``amax_history_fwd`` [L, 3G], ``scale_bwd`` [2G],
``amax_history_bwd`` [L, 2G] and ``extra_fp8_variables``, pickled into a uint8 tensor (2.x)
or saved by ``torch.save`` into a BytesIO without the recipe and with ``scale_inv_*`` (1.x).
NVIDIA's recipe objects are stood in for by look-alike classes pickled under NVIDIA's module
path (its Format members hold ``_FormatHelper(max_fwd, max_bwd)``), so the bytes name what
NVIDIA's do. Every column holds a value of its own, so a column mapped to the wrong place
fails the checks; the expected places are written out per module from NVIDIA's tensor enums
(``FP8FwdTensors``: GEMM1_INPUT = 0, GEMM1_WEIGHT = 1, GEMM1_OUTPUT = 2, GEMM2_INPUT = 3, ...;
``FP8BwdTensors``: GRAD_OUTPUT1 = 0, GRAD_INPUT1 = 1, GRAD_OUTPUT2 = 2, ...).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import io
import os
import pickle
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
from te_torch_tests import _reference as ref
from te_torch_tests._tolerances import assert_gemm_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.module import _nvidia_state as reader

NV = "transformer_engine.common.recipe"
L = 4  # the checkpoint's history length (the modules' default is 1024)
E4M3, E5M2 = "float8_e4m3", "float8_e5m2"


# ------------------------------------------------ NVIDIA's recipe classes, as they pickle


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclasses.dataclass()
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Any = "max"
    scaling_factor_compute_algo: Any = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclasses.dataclass()
class Float8CurrentScaling:
    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False


_NVIDIA_CLASSES = (_FormatHelper, Format, DelayedScaling, Float8CurrentScaling)
for _cls in _NVIDIA_CLASSES:
    _cls.__module__ = NV


@contextlib.contextmanager
def _nvidia_recipe_module():
    """While pickling, NVIDIA's module path names the look-alikes (as in NVIDIA's process)."""
    fake = types.ModuleType(NV)
    for cls in _NVIDIA_CLASSES:
        setattr(fake, cls.__name__, cls)
    saved = sys.modules[NV]
    sys.modules[NV] = fake
    try:
        yield
    finally:
        sys.modules[NV] = saved


def _pickled(obj) -> torch.Tensor:
    """NVIDIA 2.x: the state's pickle as a uint8 tensor."""
    with _nvidia_recipe_module():
        data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _nvidia_state(gemms: int, nv_recipe=None, history=L) -> dict:
    """NVIDIA's delayed-scaling state of ``gemms`` GEMMs, a value of its own in every column:
    forward scales 2^(c-3), backward 2^(c+6); histories 10 (c+1) + row, 1000 (c+1) + row."""
    fwd, bwd = 3 * gemms, 2 * gemms
    rows = torch.arange(history, dtype=torch.float32)[:, None]
    return {
        "recipe": nv_recipe if nv_recipe is not None else DelayedScaling(amax_history_len=history),
        "scale_fwd": 2.0 ** (torch.arange(fwd, dtype=torch.float32) - 3),
        "amax_history_fwd": 10.0 * (torch.arange(fwd, dtype=torch.float32) + 1) + rows,
        "scale_bwd": 2.0 ** (torch.arange(bwd, dtype=torch.float32) + 6),
        "amax_history_bwd": 1000.0 * (torch.arange(bwd, dtype=torch.float32) + 1) + rows,
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": gemms,
                                "fp8_max_fwd": 448, "fp8_max_bwd": 57344},
    }


def _v2(state: dict) -> torch.Tensor:
    return _pickled(state)


def _v1(state: dict) -> io.BytesIO:
    """NVIDIA 1.x: torch.save of the state without a recipe, with the scale inverses."""
    old = {k: v for k, v in state.items() if k != "recipe"}
    old["scale_inv_fwd"] = 1.0 / old["scale_fwd"]
    old["scale_inv_bwd"] = 1.0 / old["scale_bwd"]
    buf = io.BytesIO()
    torch.save(old, buf)
    return buf


FORMS = {"2.x": _v2, "1.x": _v1}

# Where each of our columns comes from, by NVIDIA's enums (None: a new column).
LINEAR = {"fwd": [0, 1], "out": [2], "bwd": [0]}  # GEMM1_INPUT/WEIGHT, GEMM1_OUTPUT, GRAD_OUTPUT1
MLP = {"fwd": [0, 1, 3, 4], "out": [2, 5], "bwd": [0, 2]}  # FC1 = GEMM1, FC2 = GEMM2
GROUPED = [{"fwd": [0, 1], "out": [2], "bwd": [0]}, {"fwd": [3, 4], "out": [5], "bwd": [2]},
           {"fwd": [6, 7], "out": [8], "bwd": [4]}]
# DotProductAttention: q, k, v all take QKV (GEMM1_OUTPUT); d_o takes dO (GRAD_INPUT2)
ATTENTION = {"fwd": [2, 2, None, 2], "out": [None, None], "bwd": [None, 3]}

MODULES = {
    "Linear": (lambda: te.Linear(32, 16, device="cpu"), 1, LINEAR),
    "LayerNormLinear": (lambda: te.LayerNormLinear(32, 16, device="cpu"), 1, LINEAR),
    "LayerNormMLP": (lambda: te.LayerNormMLP(32, 64, device="cpu"), 2, MLP),
}


def _assert_mapped(module, state: dict, mapping: dict) -> None:
    """Each of ``module``'s columns holds its NVIDIA column (new ones: zero history, scale
    1), the inverses match, the history has the checkpoint's length."""
    for ours, nvidia in (("fwd", "fwd"), ("out", "fwd"), ("bwd", "bwd")):
        history, scale = getattr(module, f"amax_history_{ours}"), getattr(module, f"scale_{ours}")
        assert history.shape == (state["amax_history_fwd"].shape[0], len(mapping[ours]))
        for column, source in enumerate(mapping[ours]):
            if source is None:
                assert not history[:, column].any() and scale[column] == 1.0, (ours, column)
            else:
                assert torch.equal(history[:, column],
                                   state[f"amax_history_{nvidia}"][:, source]), (ours, column)
                assert scale[column] == state[f"scale_{nvidia}"][source], (ours, column)
        assert torch.equal(getattr(module, f"scale_inv_{ours}"), 1.0 / scale)


def _buffers(module) -> dict:
    return {n: b.clone() for n, b in module.named_buffers()}


def _unchanged(module, before: dict) -> bool:
    after = dict(module.named_buffers())
    return after.keys() == before.keys() and all(torch.equal(after[n], b)
                                                 for n, b in before.items())


# ------------------------------------------------ the columns


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("name", sorted(MODULES))
def test_columns_map_onto_ours(name, form):
    build, gemms, mapping = MODULES[name]
    state = _nvidia_state(gemms, DelayedScaling(margin=1, fp8_format=Format.E4M3,
                                                amax_history_len=L,
                                                amax_compute_algo="most_recent"))
    module = build()
    weights = {k: v.clone() for k, v in module.state_dict().items() if k != "_extra_state"}
    module.load_state_dict({**weights, "_extra_state": FORMS[form](state)})  # strict
    _assert_mapped(module, state, mapping)
    summary = module.get_extra_state()["recipe"]
    assert summary["recipe"] == "DelayedScaling" and summary["amax_history_len"] == L
    if form == "2.x":  # what NVIDIA's recipe said
        assert (summary["margin"], summary["fp8_format"], summary["amax_compute_algo"]) == (
            1, "E4M3", "most_recent")
        assert module.fp8_meta["recipe"] == recipe.DelayedScaling(
            margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=L,
            amax_compute_algo="most_recent")
    else:  # 1.x saved no recipe: delayed scaling's defaults, the format of its maxima
        assert (summary["margin"], summary["fp8_format"], summary["amax_compute_algo"]) == (
            0, "HYBRID", "max")
    # every NVIDIA column holds values: nothing is left as a first step but the new columns
    assert module._fp8_first_step == "done"


@pytest.mark.parametrize("form", sorted(FORMS))
def test_grouped_linear_takes_each_gemms_columns(form):
    """NVIDIA's GroupedLinear saves one _extra_state for its GEMMs; GEMM i's columns go to
    our gemms[i] (a state_dict with NVIDIA's keys, loaded strictly)."""
    state = _nvidia_state(3)
    module = te.GroupedLinear(3, 32, 16, device="cpu")
    keys = {k: v.clone() for k, v in module.state_dict().items()
            if not k.endswith("_extra_state")}
    assert sorted(keys) == ["bias0", "bias1", "bias2", "weight0", "weight1", "weight2"]
    module.load_state_dict({**keys, "_extra_state": FORMS[form](state)})
    for gemm, mapping in zip(module.gemms, GROUPED, strict=True):
        _assert_mapped(gemm, state, mapping)


def test_attention_takes_qkv_and_d_o():
    state = _nvidia_state(3)
    attn = te.DotProductAttention(2, 16, device="cpu")
    attn.set_extra_state(_v2(state))
    _assert_mapped(attn, state, ATTENTION)
    # under a current-scaling recipe NVIDIA's attention keeps S's and dP's columns only
    cs = _nvidia_state(1)
    fresh = te.DotProductAttention(2, 16, device="cpu")
    fresh.set_extra_state(_v2(cs))
    assert not fresh.amax_history_fwd.any() and bool((fresh.scale_fwd == 1).all())
    assert fresh._fp8_first_step == "first"


def test_a_state_without_delayed_scaling_loads_new_columns():
    """A current-scaling module's state holds the recipe alone: the scaling state is new
    (and a first step), the summary says what NVIDIA's recipe was."""
    layer = te.Linear(32, 16, device="cpu")
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=8)):
        layer(torch.randn(8, 32)).sum().backward()
    nvidia = {"recipe": Float8CurrentScaling(use_power_2_scales=True),
              "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1}}
    layer.set_extra_state(_v2(nvidia))
    assert layer.amax_history_fwd.shape == (8, 2) and not layer.amax_history_fwd.any()
    assert bool((layer.scale_fwd == 1).all()) and layer._fp8_first_step == "first"
    assert layer.get_extra_state()["recipe"] == {
        "recipe": "Float8CurrentScaling", "use_power_2_scales": True, "fp8_format": "HYBRID",
        "fp8_dpa": False, "fp8_mha": False}
    assert layer.fp8_meta["recipe"] == recipe.Float8CurrentScaling(power_2_scale=True)


# ------------------------------------------------ the loaded state in use


def _step(module, r, x, g, *args):
    with te.fp8_autocast(fp8_recipe=r):
        y = module(x, *args)
    (y * g).sum().backward()
    return y


def test_linear_runs_with_the_loaded_scales():
    """The forward quantizes input and weight with the loaded scales, the backward the
    gradient; the updates then take the loaded histories (each column's own maximum)."""
    torch.manual_seed(0)
    state = _nvidia_state(1)
    layer = te.Linear(32, 16, device="cpu")
    layer.set_extra_state(_v2(state))
    s_in, s_w, s_g = (state["scale_fwd"][0].item(), state["scale_fwd"][1].item(),
                      state["scale_bwd"][0].item())
    x = torch.randn(48, 32, requires_grad=True)
    g = torch.randn(48, 16) * 1e-3
    y = _step(layer, recipe.DelayedScaling(amax_history_len=L), x, g)
    qx = ref.quantize_tensor(x.detach(), s_in, E4M3)
    qw = ref.quantize_tensor(layer.weight.detach(), s_w, E4M3)
    qg = ref.quantize_tensor(g, s_g, E5M2)
    bias = layer.bias.detach().double()
    want, mag = ref.matmul_tn(qx, qw)
    assert_gemm_close(y, want + bias, mag + bias.abs(), torch.float32, "forward")
    want, mag = ref.matmul_tn(qg, qw.t())
    assert_gemm_close(x.grad, want, mag, torch.float32, "dgrad")
    want, mag = ref.matmul_tn(qg.t(), qx.t())
    assert_gemm_close(layer.weight.grad, want, mag, torch.float32, "wgrad")
    # with another scale the bytes differ: the check above can tell
    assert not torch.equal(qx, ref.quantize_tensor(x.detach(), s_w, E4M3))
    _assert_updated(layer, state, LINEAR)


def _assert_updated(module, state: dict, mapping: dict) -> None:
    """After one step under DelayedScaling(amax_history_len=L) (max, margin 0): each mapped
    column's scale is fp8_max over its loaded history's maximum (the step's amaxes are far
    smaller)."""
    for ours, nvidia, fmax in (("fwd", "fwd", 448.0), ("bwd", "bwd", 57344.0)):
        scale = getattr(module, f"scale_{ours}")
        for column, source in enumerate(mapping[ours]):
            if source is not None:
                peak = state[f"amax_history_{nvidia}"][:, source].max()
                assert scale[column] == torch.tensor(fmax) / peak, (ours, column)


def test_grouped_linear_runs_with_the_loaded_scales():
    torch.manual_seed(0)
    state = _nvidia_state(3)
    grouped = te.GroupedLinear(3, 32, 16, device="cpu")
    grouped.set_extra_state(_v2(state))
    splits = [16, 8, 24]
    x = torch.randn(48, 32, requires_grad=True)
    g = torch.randn(48, 16) * 1e-3
    y = _step(grouped, recipe.DelayedScaling(amax_history_len=L), x, g, splits)
    start = 0
    for i, rows in enumerate(splits):
        s_in, s_w = state["scale_fwd"][3 * i].item(), state["scale_fwd"][3 * i + 1].item()
        qx = ref.quantize_tensor(x.detach()[start:start + rows], s_in, E4M3)
        qw = ref.quantize_tensor(getattr(grouped, f"weight{i}").detach(), s_w, E4M3)
        bias = getattr(grouped, f"bias{i}").detach().double()
        want, mag = ref.matmul_tn(qx, qw)
        assert_gemm_close(y[start:start + rows], want + bias, mag + bias.abs(), torch.float32,
                          f"group {i}")
        start += rows
        _assert_updated(grouped.gemms[i], state, GROUPED[i])


def test_layernorm_linear_runs_with_the_loaded_scales():
    torch.manual_seed(0)
    state = _nvidia_state(1)
    layer = te.LayerNormLinear(32, 16, return_layernorm_output=True, device="cpu")
    layer.set_extra_state(_v1(state))
    x = torch.randn(48, 32, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=L)):
        y, ln_out = layer(x)
    (y * torch.randn(48, 16) * 1e-3).sum().backward()
    qx = ref.quantize_tensor(ln_out.detach(), state["scale_fwd"][0].item(), E4M3)
    qw = ref.quantize_tensor(layer.weight.detach(), state["scale_fwd"][1].item(), E4M3)
    bias = layer.bias.detach().double()
    want, mag = ref.matmul_tn(qx, qw)
    assert_gemm_close(y, want + bias, mag + bias.abs(), torch.float32, "forward")
    _assert_updated(layer, state, LINEAR)


def test_layernorm_mlp_runs_with_the_loaded_histories():
    torch.manual_seed(0)
    state = _nvidia_state(2)
    mlp = te.LayerNormMLP(32, 64, device="cpu")
    mlp.set_extra_state(_v2(state))
    x = torch.randn(48, 32, requires_grad=True)
    y = _step(mlp, recipe.DelayedScaling(amax_history_len=L), x, torch.randn(48, 32) * 1e-3)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    _assert_updated(mlp, state, MLP)


def test_a_recipe_of_another_length_starts_afresh_as_for_our_checkpoints():
    nvidia = te.Linear(32, 16, device="cpu")
    nvidia.set_extra_state(_v2(_nvidia_state(1)))
    ours = te.Linear(32, 16, device="cpu")
    ours.load_state_dict(nvidia.state_dict())  # our own format, the same state
    x = torch.randn(8, 32)
    for module in (nvidia, ours):
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=16)):
            module(x)
    for name in ("amax_history_fwd", "scale_fwd", "scale_bwd"):
        assert torch.equal(getattr(nvidia, name), getattr(ours, name)), name
    assert nvidia.amax_history_fwd.shape == (16, 2)


# ------------------------------------------------ what is refused, and changes nothing


class _Call:
    """Pickles as a call of ``fn(*args)`` (what a malicious checkpoint holds)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _trained_linear():
    layer = te.Linear(32, 16, device="cpu")
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=L)):
        layer(torch.randn(8, 32)).sum().backward()
    return layer


def _malicious(marker: str) -> dict:
    """Checkpoints that would run a shell command (which would create ``marker``)."""
    command = f"touch {marker}"
    evil = _Call(os.system, command)
    inner = pickle.dumps(evil)  # what torch's own _load_from_bytes would torch.load
    storage_attack = _Call(torch.storage._load_from_bytes, inner)
    in_state = dict(_nvidia_state(1), extra_fp8_variables={"x": evil})
    buf = io.BytesIO()
    torch.save({"scale_fwd": evil}, buf)
    return {
        "os.system": _pickled(evil),
        "inside a state": _pickled(in_state),
        "a storage's bytes": _pickled(dict(_nvidia_state(1), scale_fwd=storage_attack)),
        "eval": _pickled(_Call(eval, f"__import__('os').system('{command}')")),
        "getattr": _pickled(_Call(getattr, torch.Size, "__subclasses__")),
        "a recipe called": _pickled(_Call(DelayedScaling, 0)),
        "1.x torch.save": buf,
    }


@pytest.mark.parametrize("attack", sorted(_malicious("unused")))
def test_malicious_pickles_are_refused_and_change_nothing(attack, tmp_path):
    marker = tmp_path / "ran"
    state = _malicious(str(marker))[attack]
    layer = _trained_linear()
    before = _buffers(layer)
    summary = copy.deepcopy(layer.get_extra_state()["recipe"])
    with pytest.raises(ValueError, match=r"Linear\.set_extra_state: expected NVIDIA"):
        layer.set_extra_state(state)
    assert not marker.exists()
    assert _unchanged(layer, before) and layer.get_extra_state()["recipe"] == summary


def test_refusals_name_what_was_expected_and_change_nothing():
    layer = _trained_linear()
    before = _buffers(layer)
    ones = torch.ones(2)
    cases = {
        "two GEMMs into one": (_v2(_nvidia_state(2)), r"the columns of 1 GEMM .*scale_fwd \[6\]"),
        "a zero scale": (_v2(dict(_nvidia_state(1), scale_bwd=torch.tensor([1.0, 0.0]))),
                         "scale_bwd must be finite and positive"),
        "histories of two lengths": (_v2(dict(_nvidia_state(1),
                                              amax_history_bwd=torch.zeros(3, 2))),
                                     "histories of one length"),
        "no tensors": (_v2({"recipe": DelayedScaling()}),
                       "must hold amax_history_fwd as a 2-d floating-point tensor, got nothing"),
        "a callable algorithm": (_v2(dict(_nvidia_state(1), recipe=DelayedScaling(
            amax_compute_algo=_Call(len, ())))), "is not part of an FP8 state"),
        "an E5M2 recipe": (_v2(_nvidia_state(1, DelayedScaling(fp8_format=Format.E5M2))),
                           "DelayedScaling in the checkpoint is not one this library takes"),
        "not a dict": (_v2([1, 2]), "holding a dict, got a list"),
        "not bytes of a pickle": (torch.ones(40, dtype=torch.uint8), "do not decode"),
        "a float tensor": (torch.ones(4), "got a tensor of dtype torch.float32"),
        "not a recipe": (_v2(dict(_nvidia_state(1), recipe={"margin": 0})),
                         "recipe must be one of NVIDIA's recipes"),
        # our own format: a bad entry after good ones (other values than the module's)
        "ours, scale_bwd of 3 columns": ({**layer.get_extra_state(), "scale_fwd": ones * 2,
                                          "scale_bwd": torch.ones(3)},
                                         "scale_bwd must have 1 columns"),
    }
    for what, (state, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            layer.set_extra_state(state)
        assert _unchanged(layer, before), what


def test_grouped_linear_checks_every_gemm_before_writing_any():
    grouped = te.GroupedLinear(3, 32, 16, device="cpu")
    before = _buffers(grouped)
    bad = _nvidia_state(3)
    bad["scale_bwd"][5] = float("inf")  # GEMM 3's grad_input: dropped, but checked
    for state, message in ((_v2(bad), "finite and positive"),
                           (_v2(_nvidia_state(2)), "the columns of 3 GEMMs"),
                           ({"version": 1}, "expected NVIDIA Transformer Engine's")):
        with pytest.raises(ValueError, match=message):
            grouped.set_extra_state(state)
        assert _unchanged(grouped, before)


def test_empty_states_load_and_change_nothing():
    """NVIDIA's modules that never ran in FP8 save an empty uint8 tensor (a BytesIO before
    2.0), or a pickled None."""
    layer = _trained_linear()
    before = _buffers(layer)
    for empty in (torch.empty(0, dtype=torch.uint8), io.BytesIO(), _pickled(None), None):
        layer.set_extra_state(empty)
        assert _unchanged(layer, before)
    grouped = te.GroupedLinear(2, 32, 16, device="cpu")
    state = {k: v for k, v in grouped.state_dict().items() if not k.endswith("_extra_state")}
    grouped.load_state_dict({**state, "_extra_state": torch.empty(0, dtype=torch.uint8)})


def test_the_unpickler_allows_only_what_torchs_weights_only_loader_does():
    allowed = getattr(torch._weights_only_unpickler, "_get_allowed_globals", None)
    if allowed is None:
        pytest.skip("this torch has no list of weights-only globals")
    torch_allows = allowed()
    for (module, name), obj in reader._ALLOWED.items():
        if module == "torch.storage":  # replaced: the storage's bytes go to weights_only
            assert obj is not torch.storage._load_from_bytes
        elif module == "builtins":
            assert name in ("set", "frozenset", "getattr")
        else:
            assert f"{module}.{name}" in torch_allows, (module, name)


# ------------------------------------------------ NVIDIA's attributes


def test_nvidia_attributes_follow_the_module():
    layer = te.Linear(32, 16, device="cpu")
    assert (layer.fp8, layer.fp8_calibration) == (False, False)
    assert layer.fp8_meta["fp8_checkpoint"] is False
    assert layer.fp8_meta["recipe"] == recipe.DelayedScaling()  # the default
    r = recipe.DelayedScaling(amax_history_len=8)
    with te.fp8_autocast(fp8_recipe=r):
        layer(torch.randn(8, 32))
    assert layer.fp8 and not layer.fp8_calibration
    assert layer.fp8_meta["recipe"] is r and layer.fp8_meta["fp8_checkpoint"] is True
    layer.init_fp8_metadata()  # outside any autocast, as Megatron-LM before a load
    assert (layer.fp8, layer.fp8_calibration) == (False, False)
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=r):
        layer(torch.randn(8, 32))
    assert (layer.fp8, layer.fp8_calibration) == (False, True)
    current = recipe.Float8CurrentScaling()
    with te.fp8_autocast(fp8_recipe=current):
        layer.init_fp8_metadata(num_gemms=1)
        assert layer.fp8 and layer.fp8_meta["recipe"] is current
        layer(torch.randn(8, 32))
    assert layer.fp8 and layer.fp8_meta["recipe"] is current
    # what a caller writes stays until the module's own value changes
    layer.fp8_meta["recipe"] = r
    assert layer.fp8_meta["recipe"] is r
    layer.set_extra_state(_v2(_nvidia_state(1)))
    assert layer.fp8_meta["recipe"] == recipe.DelayedScaling(amax_history_len=L)
    assert layer.fp8_meta["fp8_checkpoint"] is True


def test_grouped_linear_under_megatron_style_load_hook():
    """Megatron-LM's TEGroupedLinear calls init_fp8_metadata and reads fp8_meta["recipe"]
    in a load_state_dict pre-hook, and reads fp8 / fp8_calibration / fp8_checkpoint."""
    seen = []

    class Megatronish(te.GroupedLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

            def hook(module, state_dict, prefix, *rest):
                module.init_fp8_metadata(num_gemms=module.num_gemms)
                seen.append(module.fp8_meta["recipe"])

            self._register_load_state_dict_pre_hook(hook, with_module=True)

    grouped = Megatronish(2, 32, 16, device="cpu")
    assert not (grouped.fp8 or grouped.fp8_calibration or grouped.fp8_meta["fp8_checkpoint"])
    grouped.load_state_dict(grouped.state_dict())
    state = {k: v for k, v in grouped.state_dict().items() if not k.endswith("_extra_state")}
    grouped.load_state_dict({**state, "_extra_state": _v2(_nvidia_state(2))})
    assert len(seen) == 2 and grouped.fp8_meta["fp8_checkpoint"] is True
    assert grouped.fp8_meta["recipe"] == recipe.DelayedScaling(amax_history_len=L)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=L)):
        grouped(torch.randn(16, 32), [8, 8])
    assert grouped.fp8 and grouped.fp8_meta["num_gemms"] == 2


# ------------------------------------------------ te.GroupedLinear writes NVIDIA's layout

SPLITS = [16, 8, 24]


def _trained_grouped(r=None, steps=2, gemms=3):
    """A GroupedLinear after FP8 steps with each group's rows of its own magnitude (so every
    group's columns hold values of their own); the output columns (which no step here uses)
    get values of their own too."""
    torch.manual_seed(0)
    module = te.GroupedLinear(gemms, 32, 16, device="cpu")
    r = r or recipe.DelayedScaling(amax_history_len=L, margin=1, amax_compute_algo="most_recent")
    splits = SPLITS[:gemms]
    magnitude = torch.cat([torch.full((rows, 1), 4.0 ** i) for i, rows in enumerate(splits)])
    for step in range(steps):
        x = torch.randn(sum(splits), 32) * magnitude * (step + 1)
        with te.fp8_autocast(fp8_recipe=r):
            y = module(x, splits)
        (y * torch.randn_like(y) * magnitude * 1e-3).sum().backward()
    for i, gemm in enumerate(module.gemms):
        gemm.amax_history_out.copy_(torch.arange(L, dtype=torch.float32)[:, None] + 100.0 * i)
        gemm.scale_out.fill_(2.0 ** -(i + 1))
        gemm.scale_inv_out.copy_(1.0 / gemm.scale_out)
    return module


def _marks(module) -> list:
    return [{k: getattr(g._buffers[k], "_te_empty_columns", set())
             for k in ("amax_history_fwd", "amax_history_bwd", "amax_history_out")}
            for g in module.gemms]


def _assert_same_state(a, b) -> None:
    """Every buffer of every group bit for bit (dtype and shape too), the first-step marks and
    states, the recipe summaries."""
    for i, (ga, gb) in enumerate(zip(a.gemms, b.gemms, strict=True)):
        bufs = dict(gb.named_buffers())
        for name, t in ga.named_buffers():
            u = bufs[name]
            assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t), (i, name)
        assert gb._fp8_first_step == ga._fp8_first_step, i
        assert gb.get_extra_state()["recipe"] == ga.get_extra_state()["recipe"], i
    assert _marks(b) == _marks(a)


def test_grouped_linear_round_trips_its_own_state_bit_exact():
    source = _trained_grouped()
    # first-step marks that the values alone would not give back: a column with values
    # marked as never written, and the rule's state "eager" with no column marked
    source.gemms[2].amax_history_fwd._te_empty_columns = {0}
    source.gemms[1].amax_history_out._te_empty_columns = set()
    assert [g._fp8_first_step for g in source.gemms] == ["eager"] * 3
    state = source.state_dict()
    assert sorted(state) == ["_extra_state", "bias0", "bias1", "bias2",
                             "weight0", "weight1", "weight2"]
    loaded = te.GroupedLinear(3, 32, 16, device="cpu")
    loaded.load_state_dict(state)  # strict
    _assert_same_state(source, loaded)
    # the groups' values differ (a group loaded into another's place would show)
    assert not torch.equal(loaded.gemms[0].scale_fwd, loaded.gemms[1].scale_fwd)
    # a second save writes the same state, in as many bytes (a distributed checkpoint loads
    # into a tensor of the size it has; the bytes differ in torch's storage keys)
    again = loaded.state_dict()["_extra_state"]
    assert again.shape == state["_extra_state"].shape
    first, second = (reader.decode("test", t) for t in (state["_extra_state"], again))
    assert first[reader.OURS_KEY]["recipes"] == second[reader.OURS_KEY]["recipes"]
    fields = [{k: getattr(v, "name", v) for k, v in s["recipe"].fields.items()}
              for s in (first, second)]
    assert fields[0] == fields[1] and fields[0]["fp8_format"] == "HYBRID"
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(first[key], second[key]), key


def test_grouped_linear_writes_nvidias_keys_shapes_and_columns():
    module = _trained_grouped()
    n = module.num_gemms
    written = reader.decode("test", module.state_dict()["_extra_state"])
    assert set(written) == {"recipe", "scale_fwd", "amax_history_fwd", "scale_bwd",
                            "amax_history_bwd", "extra_fp8_variables", reader.OURS_KEY}
    assert written["scale_fwd"].shape == (3 * n,) and written["scale_bwd"].shape == (2 * n,)
    assert written["amax_history_fwd"].shape == (L, 3 * n)
    assert written["amax_history_bwd"].shape == (L, 2 * n)
    assert written["extra_fp8_variables"]["num_gemms"] == n
    for g, gemm in enumerate(module.gemms):
        # forward 3g input, 3g + 1 weight, 3g + 2 output; backward 2g grad_output
        for column, (name, ours) in enumerate((("fwd", 0), ("fwd", 1), ("out", 0))):
            assert written["scale_fwd"][3 * g + column] == getattr(gemm, f"scale_{name}")[ours]
            assert torch.equal(written["amax_history_fwd"][:, 3 * g + column],
                               getattr(gemm, f"amax_history_{name}")[:, ours])
        assert written["scale_bwd"][2 * g] == gemm.scale_bwd[0]
        assert torch.equal(written["amax_history_bwd"][:, 2 * g], gemm.amax_history_bwd[:, 0])
        # grad_input: none here, written as NVIDIA writes a new column
        assert written["scale_bwd"][2 * g + 1] == 1.0
        assert not written["amax_history_bwd"][:, 2 * g + 1].any()
    # every column a value of its own: a swapped column would have failed above
    assert len(set(written["scale_fwd"].tolist())) == 3 * n
    assert len(set(written["scale_bwd"][0::2].tolist())) == n
    # the recipe, read as NVIDIA's package would read it (its classes under its module path)
    data = module.state_dict()["_extra_state"].numpy().tobytes()
    with _nvidia_recipe_module():
        plain = pickle.loads(data)
    nv_recipe = plain["recipe"]
    assert type(nv_recipe) is DelayedScaling and nv_recipe.fp8_format is Format.HYBRID
    assert (nv_recipe.margin, nv_recipe.amax_history_len, nv_recipe.amax_compute_algo,
            nv_recipe.scaling_factor_compute_algo) == (1, L, "most_recent", None)


def test_grouped_linear_writes_an_empty_tensor_without_fp8_state():
    module = te.GroupedLinear(2, 32, 16, device="cpu")
    module(torch.randn(16, 32), [8, 8]).sum().backward()  # outside FP8
    state = module.state_dict()
    assert not any(k.startswith("gemms.") for k in state)
    extra = state["_extra_state"]
    assert extra.dtype == torch.uint8 and extra.numel() == 0
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=L)):
        module(torch.randn(16, 32), [8, 8])
    assert module.state_dict()["_extra_state"].numel() > 0


def test_grouped_linear_loads_our_earlier_per_group_form():
    source = _trained_grouped()
    old = {k: v for k, v in source.state_dict().items() if k != "_extra_state"}
    old.update({f"gemms.{i}._extra_state": g.get_extra_state()
                for i, g in enumerate(source.gemms)})
    loaded = te.GroupedLinear(3, 32, 16, device="cpu")
    result = loaded.load_state_dict(old)  # strict
    assert not result.missing_keys and not result.unexpected_keys
    for ga, gb in zip(source.gemms, loaded.gemms, strict=True):
        for name, t in ga.named_buffers():
            assert torch.equal(dict(gb.named_buffers())[name], t), name
    # checked as a whole: one bad group, and no group changes
    fresh = te.GroupedLinear(3, 32, 16, device="cpu")
    before = _buffers(fresh)
    old["gemms.2._extra_state"] = {**old["gemms.2._extra_state"], "scale_bwd": torch.ones(3)}
    with pytest.raises(ValueError, match="scale_bwd must have 1 columns"):
        fresh.load_state_dict(old)
    assert _unchanged(fresh, before)


def test_grouped_linear_writes_back_what_nvidias_state_held():
    """NVIDIA's state loads and is written back with the same values in every column we
    have; the input gradients' come back new (scale 1, history 0)."""
    state = _nvidia_state(3)
    module = te.GroupedLinear(3, 32, 16, device="cpu")
    module.set_extra_state(_v2(state))
    written = reader.decode("test", module.get_extra_state())
    for key in ("scale_fwd", "amax_history_fwd"):
        assert torch.equal(written[key], state[key]), key
    assert torch.equal(written["scale_bwd"][0::2], state["scale_bwd"][0::2])
    assert torch.equal(written["amax_history_bwd"][:, 0::2], state["amax_history_bwd"][:, 0::2])
    assert bool((written["scale_bwd"][1::2] == 1).all())
    assert not written["amax_history_bwd"][:, 1::2].any()


def _megatron_split(tensor: torch.Tensor, gemms: int) -> list:
    """Megatron-LM's TEGroupedLinear saves each expert's piece of the grouped state on its
    own: the state decoded with pickle, each tensor viewed as [roles, gemms] (3 forward, 2
    backward roles; histories [L, roles, gemms]) and GEMM g's slice taken, pickled again."""
    state = pickle.loads(tensor.numpy().tobytes())
    pieces = []
    for g in range(gemms):
        piece = {"recipe": state["recipe"],
                 "extra_fp8_variables": dict(state["extra_fp8_variables"], num_gemms=1)}
        for kind in ("fwd", "bwd"):
            piece[f"scale_{kind}"] = state[f"scale_{kind}"][g::gemms].clone()
            piece[f"amax_history_{kind}"] = state[f"amax_history_{kind}"][:, g::gemms].clone()
        pieces.append(torch.frombuffer(bytearray(pickle.dumps(piece)), dtype=torch.uint8))
    return pieces


def _megatron_merge(pieces: list) -> torch.Tensor:
    """And its load hook's inverse: the pieces' columns interleaved back."""
    states = [pickle.loads(p.numpy().tobytes()) for p in pieces]
    merged = {"recipe": states[0]["recipe"],
              "extra_fp8_variables": dict(states[0]["extra_fp8_variables"],
                                          num_gemms=len(states))}
    for kind in ("fwd", "bwd"):
        merged[f"scale_{kind}"] = torch.stack([s[f"scale_{kind}"] for s in states], 1).reshape(-1)
        history = torch.stack([s[f"amax_history_{kind}"] for s in states], 2)
        merged[f"amax_history_{kind}"] = history.reshape(history.shape[0], -1)
    return torch.frombuffer(bytearray(pickle.dumps(merged)), dtype=torch.uint8)


def test_megatron_style_split_and_merge_of_our_state():
    source = _trained_grouped()
    assert isinstance(source.fp8_meta["recipe"], recipe.DelayedScaling)
    assert source.fp8_meta["recipe"].amax_history_len == L  # what Megatron's views use
    pieces = _megatron_split(source.state_dict()["_extra_state"], 3)
    piece = reader.decode("test", pieces[1])
    assert piece["scale_fwd"].shape == (3,) and piece["amax_history_fwd"].shape == (L, 3)
    assert piece["scale_bwd"].shape == (2,) and piece["amax_history_bwd"].shape == (L, 2)
    merged = _megatron_merge(pieces)
    original = reader.decode("test", source.state_dict()["_extra_state"])
    again = reader.decode("test", merged)
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(again[key], original[key]), key
    assert reader.OURS_KEY not in again  # Megatron keeps NVIDIA's keys only
    loaded = te.GroupedLinear(3, 32, 16, device="cpu")
    weights = {k: v for k, v in source.state_dict().items() if k != "_extra_state"}
    loaded.load_state_dict({**weights, "_extra_state": merged})
    for ga, gb in zip(source.gemms, loaded.gemms, strict=True):
        for kind in ("fwd", "bwd", "out"):
            for name in (f"amax_history_{kind}", f"scale_{kind}", f"scale_inv_{kind}"):
                assert torch.equal(getattr(gb, name), getattr(ga, name)), name
        assert gb.get_extra_state()["recipe"] == ga.get_extra_state()["recipe"]


def test_distributed_checkpoint_of_a_grouped_linear(tmp_path):
    """torch.distributed.checkpoint (one process) saves the module's state and loads it into
    one that has FP8 state of the same layout (a fresh module's empty _extra_state has
    another size, which DCP refuses, as for NVIDIA's modules)."""
    import torch.distributed.checkpoint as dcp

    source = _trained_grouped()
    dcp.save(source.state_dict(), checkpoint_id=str(tmp_path))
    target = _trained_grouped(recipe.DelayedScaling(amax_history_len=L, margin=1,
                                                    amax_compute_algo="most_recent"), steps=1)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path))
    target.load_state_dict(state)
    _assert_same_state(source, target)
    for i in range(3):
        assert torch.equal(getattr(target, f"weight{i}"), getattr(source, f"weight{i}"))


def test_grouped_linear_has_nvidias_attributes():
    module = te.GroupedLinear(2, 32, 16, bias=True, return_bias=True, device="cpu")
    assert (module.tp_size, module.sequence_parallel, module.apply_bias) == (1, False, False)
    assert te.GroupedLinear(2, 32, 16, device="cpu").apply_bias is True
