"""NVIDIA Transformer Engine's FP8 extra state, read into this library's.

NVIDIA's modules save their delayed-scaling state as ``_extra_state``: from its 2.0 a uint8
tensor holding ``pickle.dumps(state)``, before that an ``io.BytesIO`` written by
``torch.save(state)``; an empty one where the module never ran in FP8. ``state`` is a dict:

* ``"recipe"``: the recipe object (2.x only; 1.x knew delayed scaling only);
* ``"scale_fwd"`` [3 * G], ``"amax_history_fwd"`` [L, 3 * G], ``"scale_bwd"`` [2 * G],
  ``"amax_history_bwd"`` [L, 2 * G]: under delayed scaling only, for the module's G GEMMs;
  1.x adds ``"scale_inv_fwd"`` / ``"scale_inv_bwd"``;
* ``"extra_fp8_variables"``: plain values of NVIDIA's ``fp8_meta`` (``num_gemms``,
  ``fp8_max_fwd``, ``fp8_max_bwd``, ...).

NVIDIA's columns per GEMM g (its ``FP8FwdTensors`` / ``FP8BwdTensors``): forward 3g = the
input, 3g + 1 = the weight, 3g + 2 = the output (GEMM1_INPUT, GEMM1_WEIGHT, GEMM1_OUTPUT,
GEMM2_INPUT, ...); backward 2g = the output's gradient, 2g + 1 = the input's gradient
(GRAD_OUTPUT1, GRAD_INPUT1, GRAD_OUTPUT2, ...). Ours (module/base.py): forward 2g = input,
2g + 1 = weight; ``*_out`` column g = the output; backward column g = the output's gradient.
NVIDIA's input gradients have no column here and are dropped. :func:`to_ours` maps a state
onto ours, the columns NVIDIA lacks as new ones; DotProductAttention's layout differs
(``_ATTENTION``).

te.GroupedLinear also writes its state in this layout (:func:`to_nvidia`, :func:`encode`), with
this library's own pieces under :data:`OURS_KEY`, which NVIDIA's loader does not read.

The bytes are decoded without running anything they name: an unpickler that finds only
torch's tensor rebuild functions (the storages through ``torch.load(weights_only=True)``),
a few builtin containers, and stand-ins for NVIDIA's recipe classes that keep their fields
as plain values; anything else is refused before it is called.
"""

from __future__ import annotations

import collections
import copyreg
import dataclasses
import inspect
import io
import math
import pickle
import types
from typing import Any, Optional

import torch

from transformer_engine.common import recipe as _recipe

# ------------------------------------------------------------------ decoding

_RECIPE_MODULE = "transformer_engine.common.recipe"
_FORMAT_NAMES = tuple(f.name for f in _recipe.Format)
# NVIDIA's Format members hold (max_fwd, max_bwd); ours hold the name (and the same maxima).
_FORMAT_BY_MAX = {(f.max_fwd, f.max_bwd): f.name for f in _recipe.Format}


class _Fields:
    """An object of one of NVIDIA's recipe classes (or their MMParams, QParams) as a pickle
    holds it: the class name and the fields of its state, nothing callable."""

    nvidia_class = ""
    fields: Any = types.MappingProxyType({})

    def __init__(self, *args, **kwargs) -> None:  # (a pickle calls the class only to refuse)
        raise pickle.UnpicklingError(f"{_RECIPE_MODULE}.{self.nvidia_class} called with "
                                     "arguments (a recipe pickles by its fields)")

    def __setstate__(self, state: Any) -> None:
        parts = state if isinstance(state, tuple) else (state,)  # (dict, slots) or dict
        fields = {}
        for part in parts:
            if isinstance(part, dict):
                fields.update((k, v) for k, v in part.items() if isinstance(k, str))
            elif part is not None:
                raise pickle.UnpicklingError(f"{_RECIPE_MODULE}.{self.nvidia_class}: state "
                                             f"of type {type(part).__name__}")
        self.fields = fields


class _FormatValue(tuple):
    """NVIDIA's ``_FormatHelper(max_fwd, max_bwd)``, the value of its Format members."""

    def __new__(cls, *args):
        return tuple.__new__(cls, args)


class _Format:
    """A member of NVIDIA's (or our) Format, by name."""

    name = None

    def __init__(self, value: Any) -> None:
        name = None
        if isinstance(value, str):
            name = value if value in _FORMAT_NAMES else None
        elif (isinstance(value, tuple) and len(value) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            name = _FORMAT_BY_MAX.get((float(value[0]), float(value[1])))
        if name is None:
            raise pickle.UnpicklingError(f"{_RECIPE_MODULE}.Format: unknown member {value!r}")
        self.name = name

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"{_RECIPE_MODULE}.Format has no state to set")


def _getattr(obj: Any, name: Any) -> Any:
    """``getattr(Format, name)``, the other way a pickle may name an enum member."""
    if obj is _Format and name in _FORMAT_NAMES:
        return _Format(name)
    raise pickle.UnpicklingError("builtins.getattr is allowed on Format members only")


def _storage_from_bytes(data: Any):
    """torch.storage._load_from_bytes (how pickle.dumps saves a tensor's storage), read by
    torch's weights-only loader onto the CPU."""
    if not isinstance(data, (bytes, bytearray)):
        raise pickle.UnpicklingError("a storage must come as bytes")
    storage = torch.load(io.BytesIO(bytes(data)), map_location="cpu", weights_only=True)
    if not isinstance(storage, (torch.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"a storage's bytes held a {type(storage).__name__}")
    return storage


_STANDINS: dict[str, Any] = {
    name: type(name, (_Fields,), {"nvidia_class": name})
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                 "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "MMParams",
                 "QParams")}
_STANDINS.update(Format=_Format, _FormatHelper=_FormatValue, _OverrideLinearPrecision=_FormatValue)

# What NVIDIA's state needs besides the recipe: the tensor rebuild functions that torch's own
# weights-only unpickler allows (tests/pytorch/test_nvidia_extra_state.py checks that), and
# containers.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): torch._utils._rebuild_tensor_v3,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("torch", "Size"): torch.Size,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "getattr"): _getattr,
}
_ALLOWED.update({("torch", str(dtype).split(".")[1]): dtype for dtype in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8)})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == _RECIPE_MODULE:
            found = _STANDINS.get(name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of an FP8 state")
        return found


def _load(file, **kwargs) -> Any:
    return _Unpickler(file, **kwargs).load()


# For torch.load(pickle_module=...): torch.save's container with this unpickler inside.
_RESTRICTED_PICKLE = types.ModuleType("transformer_engine_fp8_state_pickle")
_RESTRICTED_PICKLE.Unpickler = _Unpickler
_RESTRICTED_PICKLE.load = _load


def decode(module: str, state: Any) -> Optional[dict]:
    """NVIDIA's extra state (a uint8 tensor or a BytesIO) as a dict, or None where it holds
    none (empty, or a pickled None). ValueError naming ``module`` for anything else."""
    where = f"{module}.set_extra_state"
    if isinstance(state, torch.Tensor):
        if state.numel() == 0:
            return None
        if state.dtype != torch.uint8:
            raise ValueError(f"{where}: a tensor extra state must be NVIDIA Transformer "
                             "Engine's (uint8 bytes of a pickled dict), got a tensor of dtype "
                             f"{state.dtype}")
        data = state.detach().reshape(-1).cpu().numpy().tobytes()
        form = "NVIDIA Transformer Engine's pickled FP8 state (a uint8 tensor)"
        try:
            decoded = _load(io.BytesIO(data))
        except Exception as e:  # anything the bytes make the unpickler do
            raise ValueError(f"{where}: expected {form}; its {len(data)} bytes do not decode "
                             f"as one: {type(e).__name__}: {e}") from None
    else:
        data = state.getvalue()
        if not data:
            return None
        form = "NVIDIA Transformer Engine 1.x's FP8 state (a BytesIO written by torch.save)"
        try:
            decoded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception:
            try:
                decoded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                                     pickle_module=_RESTRICTED_PICKLE)
            except Exception as e:
                raise ValueError(f"{where}: expected {form}; its {len(data)} bytes do not "
                                 f"decode as one: {type(e).__name__}: {e}") from None
    if decoded is None:
        return None
    if not isinstance(decoded, dict):
        raise ValueError(f"{where}: expected {form} holding a dict, got a "
                         f"{type(decoded).__name__}")
    return decoded


# ------------------------------------------------------------------ the recipe

# The fields of NVIDIA's recipes that a summary keeps (plain values; others are ignored).
_RECIPE_FIELDS = {
    "DelayedScaling": ("margin", "fp8_format", "amax_history_len", "amax_compute_algo",
                       "scaling_factor_compute_algo", "reduce_amax", "fp8_dpa", "fp8_mha"),
    "Float8CurrentScaling": ("fp8_format", "use_power_2_scales", "fp8_dpa", "fp8_mha"),
    "Float8BlockScaling": ("fp8_format", "use_f32_scales", "x_block_scaling_dim",
                           "w_block_scaling_dim", "grad_block_scaling_dim", "fp8_dpa",
                           "fp8_mha"),
    "MXFP8BlockScaling": ("margin", "fp8_format", "fp8_dpa", "fp8_mha"),
    "NVFP4BlockScaling": ("disable_rht", "disable_stochastic_rounding",
                          "disable_2d_quantization", "fp4_format", "fp8_format", "fp8_dpa",
                          "fp8_mha"),
    "CustomRecipe": ("fp8_dpa", "fp8_mha"),  # (its quantizer factory is code: never read)
}


def _plain(value: Any) -> Any:
    """A field's value as a summary holds it (a Format by name), or None to leave it out."""
    if isinstance(value, _Format):
        return value.name  # (None for one made without a member)
    if isinstance(value, (bool, int, float, str)):
        return value
    return None


def _delayed_summary(where: str, fields: dict, history_len: int, extra: dict) -> dict:
    """Our summary (base.recipe_summary) of NVIDIA's DelayedScaling with ``fields``; without
    them (1.x), the defaults with the state's history length and the format its maxima say."""
    from .base import recipe_summary  # (base imports this module)

    if fields is None:
        kwargs: dict[str, Any] = {"amax_history_len": history_len}
        maxima = (extra.get("fp8_max_fwd"), extra.get("fp8_max_bwd"))
        if all(isinstance(m, (int, float)) and not isinstance(m, bool) for m in maxima):
            name = _FORMAT_BY_MAX.get((float(maxima[0]), float(maxima[1])))
            if name is not None:
                kwargs["fp8_format"] = _recipe.Format[name]
    else:
        if fields.get("scaling_factor_compute_algo") is not None:
            raise ValueError(f"{where}: NVIDIA's recipe has a scaling_factor_compute_algo, "
                             "which a checkpoint cannot carry here (a function is code)")
        kwargs = {}
        for name in _RECIPE_FIELDS["DelayedScaling"]:
            if name in fields and name != "scaling_factor_compute_algo":
                value = _plain(fields[name])
                if value is None:
                    raise ValueError(f"{where}: NVIDIA's DelayedScaling.{name} must be a "
                                     "plain value (bool, int, float, str or a Format), got "
                                     f"a {type(fields[name]).__name__}")
                kwargs[name] = (_recipe.Format[value] if isinstance(fields[name], _Format)
                                else value)
    try:
        return dict(recipe_summary(_recipe.DelayedScaling(**kwargs)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: NVIDIA's DelayedScaling in the checkpoint is not one "
                         f"this library takes: {e}") from None


def _summary(where: str, state: dict, history_len: int) -> tuple[dict, bool]:
    """(our summary of the state's recipe, whether it is delayed scaling)."""
    extra = state.get("extra_fp8_variables", {})
    if not isinstance(extra, dict):
        raise ValueError(f"{where}: extra_fp8_variables must be a dict, got "
                         f"{type(extra).__name__}")
    recipe = state.get("recipe")
    if recipe is None:  # 1.x: delayed scaling, the only recipe it had
        return _delayed_summary(where, None, history_len, extra), True
    name = getattr(type(recipe), "nvidia_class", None)
    if not isinstance(recipe, _Fields) or name not in _RECIPE_FIELDS:
        raise ValueError(f"{where}: the state's recipe must be one of NVIDIA's recipes "
                         f"({', '.join(_RECIPE_FIELDS)}), got {type(recipe).__name__}")
    if name == "DelayedScaling":
        return _delayed_summary(where, recipe.fields, history_len, extra), True
    summary: dict[str, Any] = {"recipe": name}
    for field in _RECIPE_FIELDS[name]:
        value = _plain(recipe.fields.get(field))
        if value is not None:
            summary[field] = value
    return summary, False


# ------------------------------------------------------------------ the columns

# DotProductAttention: NVIDIA's has three GEMMs' columns, of which q, k and v share forward
# column 2 (QKV, GEMM1_OUTPUT) and the output's gradient is backward column 3 (dO,
# GRAD_INPUT2); its O, S, dQKV and dP columns have none here (ours computes o's, p's and the
# FP8 gradients' scales from bounds). Ours: forward 0 = q, 1 = k, 2 = p (unused), 3 = v;
# backward 0 = ds (unused), 1 = d_o. Under a current-scaling recipe NVIDIA's keeps delayed
# state for S and dP alone (one GEMM's columns): none of it maps.
_ATTENTION = {
    3: {"fwd": [2, 2, None, 2], "out": [None, None], "bwd": [None, 3]},
    1: {"fwd": [None] * 4, "out": [None, None], "bwd": [None, None]},
}


def _sources(layout: str, num_gemms: int, nvidia_gemms: int) -> Optional[dict]:
    """For each of our column groups, the NVIDIA column each of our columns takes (None: a
    new column), or None where NVIDIA's state has the wrong number of GEMMs."""
    if layout == "attention":
        return _ATTENTION.get(nvidia_gemms)
    if nvidia_gemms != num_gemms:
        return None
    return {"fwd": [3 * g + r for g in range(num_gemms) for r in (0, 1)],
            "out": [3 * g + 2 for g in range(num_gemms)],
            "bwd": [2 * g for g in range(num_gemms)]}


def _expected(layout: str, num_gemms: int) -> str:
    if layout == "attention":
        return "3 GEMMs (or 1 under a current-scaling recipe)"
    return f"{num_gemms} GEMM{'s' if num_gemms > 1 else ''}"


def _tensor(where: str, state: dict, key: str, dims: int) -> torch.Tensor:
    t = state.get(key)
    if type(t) is not torch.Tensor or t.dim() != dims or not t.dtype.is_floating_point:
        got = (f"a {t.dim()}-d {t.dtype} tensor" if isinstance(t, torch.Tensor)
               else "nothing" if t is None else f"a {type(t).__name__}")
        raise ValueError(f"{where}: NVIDIA's delayed-scaling state must hold {key} as a "
                         f"{dims}-d floating-point tensor, got {got}")
    return t.detach().to("cpu", torch.float32)


def to_ours(module: str, state: dict, layout: str, num_gemms: int, history_len: int) -> dict:
    """NVIDIA's decoded state as our extra state (version 1) for a module of ``num_gemms``
    GEMMs laid out as ``layout`` (``"gemms"`` or ``"attention"``); ``history_len``: the
    module's, for a state without delayed scaling (which loads as new columns)."""
    where = f"{module}.set_extra_state"
    has_tensors = "amax_history_fwd" in state or "scale_fwd" in state
    if has_tensors:
        history_len = _tensor(where, state, "amax_history_fwd", 2).shape[0]
    summary, delayed = _summary(where, state, history_len)
    fwd_cols, bwd_cols = 2 * num_gemms, num_gemms
    ours = {"version": 1, "recipe": summary,
            "amax_history_fwd": torch.zeros(history_len, fwd_cols),
            "scale_fwd": torch.ones(fwd_cols),
            "amax_history_bwd": torch.zeros(history_len, bwd_cols),
            "scale_bwd": torch.ones(bwd_cols),
            "amax_history_out": torch.zeros(history_len, num_gemms),
            "scale_out": torch.ones(num_gemms)}
    if delayed:
        hist = {"fwd": _tensor(where, state, "amax_history_fwd", 2),
                "bwd": _tensor(where, state, "amax_history_bwd", 2)}
        scale = {"fwd": _tensor(where, state, "scale_fwd", 1),
                 "bwd": _tensor(where, state, "scale_bwd", 1)}
        fwd, bwd = scale["fwd"].shape[0], scale["bwd"].shape[0]
        nvidia_gemms = fwd // 3
        sources = (_sources(layout, num_gemms, nvidia_gemms)
                   if fwd % 3 == 0 and bwd == 2 * nvidia_gemms else None)
        if (sources is None or hist["fwd"].shape[1] != fwd or hist["bwd"].shape[1] != bwd
                or hist["bwd"].shape[0] != hist["fwd"].shape[0]):
            raise ValueError(
                f"{where}: NVIDIA's delayed-scaling state for this module must have the "
                f"columns of {_expected(layout, num_gemms)} (3 forward and 2 backward per "
                f"GEMM, histories of one length), got scale_fwd {list(scale['fwd'].shape)}, "
                f"amax_history_fwd {list(hist['fwd'].shape)}, scale_bwd "
                f"{list(scale['bwd'].shape)}, amax_history_bwd {list(hist['bwd'].shape)}")
        for kind in ("fwd", "bwd"):
            s = scale[kind]
            if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
                raise ValueError(f"{where}: NVIDIA's scale_{kind} must be finite and positive, "
                                 f"got {s.tolist()}")
        for ours_kind, nvidia_kind in (("fwd", "fwd"), ("out", "fwd"), ("bwd", "bwd")):
            for column, source in enumerate(sources[ours_kind]):
                if source is not None:
                    ours[f"amax_history_{ours_kind}"][:, column] = hist[nvidia_kind][:, source]
                    ours[f"scale_{ours_kind}"][column] = scale[nvidia_kind][source]
    for kind in ("fwd", "bwd", "out"):
        ours[f"scale_inv_{kind}"] = ours[f"scale_{kind}"].reciprocal()
    return ours


def split_gemms(state: dict, num_gemms: int) -> list[dict]:
    """Our extra state of ``num_gemms`` GEMMs as one state per GEMM (te.GroupedLinear's
    layers)."""
    parts = []
    for g in range(num_gemms):
        part: dict[str, Any] = {"version": state["version"], "recipe": dict(state["recipe"])}
        for kind, per_gemm in (("fwd", 2), ("bwd", 1), ("out", 1)):
            for name in (f"amax_history_{kind}", f"scale_{kind}", f"scale_inv_{kind}"):
                part[name] = state[name][..., per_gemm * g:per_gemm * (g + 1)].clone()
        parts.append(part)
    return parts


def merge_gemms(module: str, parts: list[dict]) -> dict:
    """Our extra states of single GEMMs (te.GroupedLinear's layers) as one state of
    ``len(parts)`` GEMMs: :func:`split_gemms` inverted (the recipe summary: the first's)."""
    lengths = {p["amax_history_fwd"].shape[0] for p in parts}
    if len(lengths) != 1:
        raise RuntimeError(f"{module}.get_extra_state: NVIDIA's layout needs one history length "
                           f"for all GEMMs; the groups' histories hold {sorted(lengths)} steps "
                           "(run an FP8 forward of the module to fit them to one recipe)")
    state: dict[str, Any] = {"version": parts[0]["version"], "recipe": dict(parts[0]["recipe"])}
    for name in parts[0]:
        if isinstance(parts[0][name], torch.Tensor):
            state[name] = torch.cat([p[name] for p in parts], dim=-1)
    return state


# ------------------------------------------------------------------ writing NVIDIA's layout

# The key of the written dict that holds this library's own pieces, which NVIDIA's layout has
# no place for. NVIDIA's set_extra_state reads only its keys ("recipe", the four tensors,
# "extra_fp8_variables") and ignores this one.
OURS_KEY = "own_state"
_OURS_VERSION = 1
_FIRST_STEP_STATES = ("first", "eager", "done")
_HISTORIES = ("amax_history_fwd", "amax_history_bwd", "amax_history_out")


class _Pickler(pickle.Pickler):
    """pickle.Pickler that writes a recipe as NVIDIA's pickle names one: its class in
    ``transformer_engine.common.recipe``, made without arguments, with its plain fields as its
    state; a Format member as ``getattr(Format, name)``. The restricted unpickler above reads
    that into its stand-ins; NVIDIA's package (and a plain pickle.loads here) into its
    recipe."""

    def reducer_override(self, obj):
        if isinstance(obj, _recipe.Format):
            return getattr, (_recipe.Format, obj.name)
        if isinstance(obj, _recipe.Recipe):
            return copyreg.__newobj__, (type(obj),), dict(obj.__dict__)
        return NotImplemented


def _delayed(recipe: _recipe.Recipe) -> bool:
    """Whether ``recipe`` keeps delayed-scaling state (its plan's kind)."""
    from ..quantization import kind_of  # (imported late: the package imports this module)

    return kind_of(recipe) == "delayed"


def _nvidia_recipe(recipe: _recipe.Recipe, history_len: int) -> _recipe.Recipe:
    """``recipe`` as the written state holds it: an object of the recipe class of ours that
    NVIDIA's package has by that name, holding the plain fields only (no callable, no nested
    object: NVIDIA's class defaults stand for them), the history length the state's."""
    cls = next((c for c in type(recipe).__mro__
                if c.__module__ == _RECIPE_MODULE and c.__name__ in _RECIPE_FIELDS), None)
    if cls is None:
        raise RuntimeError(f"a recipe of type {type(recipe).__name__} has no counterpart in "
                           "NVIDIA Transformer Engine's checkpoint layout")
    fields = {}
    for field in dataclasses.fields(recipe):
        value = getattr(recipe, field.name)
        if value is None or isinstance(value, (bool, int, float, str, _recipe.Format)):
            fields[field.name] = value
    if _delayed(recipe):
        fields["amax_history_len"] = history_len
    plain = cls.__new__(cls)
    plain.__dict__.update(fields)  # (frozen dataclasses: no __setattr__)
    return plain


def to_nvidia(state: dict, recipe: _recipe.Recipe, num_gemms: int, ours: dict) -> dict:
    """Our extra state of ``num_gemms`` GEMMs (laid out as :func:`to_ours` makes it) as
    NVIDIA's GroupedLinear writes its own under ``recipe``: the recipe, under delayed scaling
    the four tensors (each of NVIDIA's columns from the one of ours that :func:`to_ours`
    takes from it; the input gradients', which we lack, as NVIDIA makes new ones: scale 1,
    history 0), ``extra_fp8_variables``; ``ours`` goes under :data:`OURS_KEY`, with the
    tensors of our state that the NVIDIA part does not carry."""
    history_len = state["amax_history_fwd"].shape[0]
    nvidia: dict[str, Any] = {"recipe": _nvidia_recipe(recipe, history_len)}
    carried = set()
    if _delayed(recipe):
        sources = _sources("gemms", num_gemms, num_gemms)
        for kind, columns in (("fwd", 3 * num_gemms), ("bwd", 2 * num_gemms)):
            nvidia[f"scale_{kind}"] = torch.ones(columns)
            nvidia[f"amax_history_{kind}"] = torch.zeros(history_len, columns)
        for ours_kind, nvidia_kind in (("fwd", "fwd"), ("out", "fwd"), ("bwd", "bwd")):
            for column, target in enumerate(sources[ours_kind]):
                nvidia[f"amax_history_{nvidia_kind}"][:, target] = (
                    state[f"amax_history_{ours_kind}"][:, column])
                nvidia[f"scale_{nvidia_kind}"][target] = state[f"scale_{ours_kind}"][column]
            carried.update((f"amax_history_{ours_kind}", f"scale_{ours_kind}"))
    extra: dict[str, Any] = {"fp8_checkpoint": True, "num_gemms": num_gemms}
    fmt = getattr(recipe, "fp8_format", None)
    if isinstance(fmt, _recipe.Format):
        extra.update(fp8_max_fwd=float(fmt.max_fwd), fp8_max_bwd=float(fmt.max_bwd))
    nvidia["extra_fp8_variables"] = extra
    tensors = {name: t.detach().to("cpu", torch.float32).clone()
               for name, t in state.items()
               if isinstance(t, torch.Tensor) and name not in carried}
    nvidia[OURS_KEY] = {"version": _OURS_VERSION, **ours, "tensors": tensors}
    return nvidia


def encode(state: dict) -> torch.Tensor:
    """NVIDIA 2.x's extra state: the pickled dict's bytes as a uint8 tensor. Without the
    pickle's memo (the state holds no cycles), so that its size depends on the values alone,
    not on which of them are the same objects (a loaded module's summaries are copies): a
    distributed checkpoint reads the tensor into one of the size it has."""
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL)
    pickler.fast = True
    pickler.dump(state)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def with_ours(module: str, state: dict, ours: Any, num_gemms: int) -> dict:
    """Checks the pieces of ours that a decoded state holds under :data:`OURS_KEY` (written by
    :func:`to_nvidia`) and returns them: ``recipes`` (one summary per GEMM), ``first_step``
    (the first-step rule's state per GEMM), ``empty`` (per GEMM, each history's columns still
    waiting for their first step); ``state`` (:func:`to_ours`'s) takes the tensors."""
    where = f"{module}.set_extra_state"

    def fail(what: str) -> ValueError:
        return ValueError(f"{where}: the state's {OURS_KEY!r} (this library's pieces) {what}")

    if not isinstance(ours, dict) or ours.get("version") != _OURS_VERSION:
        raise fail(f"must be a dict of version {_OURS_VERSION}")
    recipes, steps, empty = ours.get("recipes"), ours.get("first_step"), ours.get("empty")
    tensors = ours.get("tensors")
    if (not isinstance(recipes, list) or len(recipes) != num_gemms
            or not all(isinstance(r, dict) for r in recipes)):
        raise fail(f"must hold 'recipes', a list of {num_gemms} dicts")
    if (not isinstance(steps, list) or len(steps) != num_gemms
            or not all(s in _FIRST_STEP_STATES for s in steps)):
        raise fail(f"must hold 'first_step', a list of {num_gemms} of {_FIRST_STEP_STATES}")
    if (not isinstance(empty, list) or len(empty) != num_gemms
            or not all(isinstance(e, dict) and set(e) == set(_HISTORIES) for e in empty)):
        raise fail(f"must hold 'empty', a list of {num_gemms} dicts of {_HISTORIES}")
    if not isinstance(tensors, dict) or not all(
            name in state and type(t) is torch.Tensor and t.dim() == state[name].dim()
            and t.dtype == torch.float32 for name, t in tensors.items()):
        raise fail("must hold 'tensors', float32 tensors of our state's buffers")
    state = dict(state)
    state.update(tensors)
    per_gemm = {"amax_history_fwd": 2, "amax_history_bwd": 1, "amax_history_out": 1}
    for marks in empty:
        for name, columns in marks.items():
            if not isinstance(columns, list) or not all(
                    type(c) is int and 0 <= c < per_gemm[name] for c in columns):
                raise fail(f"'empty' must list {name}'s columns of one GEMM, got {columns!r}")
    return state


# ------------------------------------------------------------------ a recipe from a summary

def recipe_from_summary(summary: dict) -> Optional[_recipe.Recipe]:
    """Our recipe that a checkpoint's summary describes (its plain fields; the others at
    their defaults), or None where it names none this library builds or a field is a
    function."""
    cls = getattr(_recipe, str(summary.get("recipe")), None)
    if (not (isinstance(cls, type) and issubclass(cls, _recipe.Recipe))
            or cls in (_recipe.Recipe, _recipe.CustomRecipe)):  # (a user's quantizers: code)
        return None
    kwargs: dict[str, Any] = {}
    for name in inspect.signature(cls).parameters:
        if name not in summary:
            continue
        value = summary[name]
        if value == "callable":
            return None
        if name in ("fp8_format", "fp4_format"):
            if value not in _FORMAT_NAMES:
                return None
            value = _recipe.Format[value]
        elif value == "None":
            value = None
        elif isinstance(value, str) and name not in ("amax_compute_algo", "backward_override"):
            continue  # a repr (MMParams): the default
        if isinstance(value, float) and not math.isfinite(value):
            return None
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError):
        return None
