"""The enum codes that Python code passes to the core as plain ints or names must be the C
headers' values.

The JAX package hands XLA FFI handlers ints (scaling modes, FP8 dtypes, amax algorithms, norm
types, activations, attention layouts, masks and backend); the PyTorch package's compiled
module takes ints for the amax algorithm and its own scaling kind; both look the binding's
enums up by name. A mirror that drifts from the header would quantize or mask with the wrong
mode without any error, so each one is read here against the header it copies. The headers are
parsed as text (``typedef enum { NAME = value, ... } te_type;``), so the test does not trust
the binding it also checks.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

import pytest

from transformer_engine.common import _core as core

ROOT = Path(__file__).resolve().parents[2]
HEADERS = ROOT / "cpp" / "include" / "transformer_engine"

_TYPEDEF = re.compile(r"typedef\s+enum\s*\{(?P<body>[^}]*)\}\s*(?P<name>\w+)\s*;")
_CPP_ENUM = re.compile(r"\benum\s+(?P<name>\w+)\s*(?::\s*\w+\s*)?\{(?P<body>[^}]*)\}\s*;")


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _enumerators(body: str) -> dict[str, int]:
    """NAME -> value, counting on from the previous value where none is written (as C does)."""
    values, nxt = {}, 0
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, value = (part.strip() for part in item.partition("="))
        nxt = int(value, 0) if value else nxt
        values[name] = nxt
        nxt += 1
    return values


def parse_enums(text: str, pattern: re.Pattern = _TYPEDEF) -> dict[str, dict[str, int]]:
    return {m["name"]: _enumerators(m["body"])
            for m in pattern.finditer(_strip_comments(text))}


def _header_enums() -> dict[str, dict[str, int]]:
    enums: dict = {}
    for header in sorted(HEADERS.glob("*.h")):
        enums.update(parse_enums(header.read_text()))
    return enums


C = _header_enums()


def _by_suffix(c_enum: str, prefix: str) -> dict[str, int]:
    """The header enum's values by the lower-case name after ``prefix``, without the COUNT
    sentinel (TE_SCALING_BLOCK_1X128 -> "block_1x128")."""
    return {k[len(prefix):].lower(): v for k, v in C[c_enum].items()
            if k.startswith(prefix) and not k.endswith("_COUNT")}


# ----------------------------------------------------------------------- the parser itself


def test_parser_reads_explicit_and_implicit_values():
    text = """
    /* a comment with } and ; inside */
    typedef enum {
      A_ONE = 1,  // trailing comment
      A_TWO,
      A_NEG = -1,
      A_ZERO
    } te_example;
    enum Kind : int64_t { kFirst = 0, kSecond = 5 };
    """
    assert parse_enums(text) == {"te_example": {"A_ONE": 1, "A_TWO": 2, "A_NEG": -1,
                                                "A_ZERO": 0}}
    assert parse_enums(text, _CPP_ENUM) == {"Kind": {"kFirst": 0, "kSecond": 5}}


def test_headers_hold_the_mirrored_enums():
    for name in ("te_dtype", "te_scaling_mode", "te_amax_compute_algo", "te_norm_type",
                 "te_activation", "te_attn_layout", "te_attn_mask_type", "te_attn_backend",
                 "te_softmax_mask_type", "te_rope_format"):
        assert C.get(name), f"{name} not found in {HEADERS}"


# ---------------------------------------------------------------- the binding's exported enums

_BINDING = [
    ("DType", "te_dtype", "TE_DTYPE_"),
    ("ScalingMode", "te_scaling_mode", "TE_SCALING_"),
    ("AmaxComputeAlgo", "te_amax_compute_algo", "TE_AMAX_COMPUTE_"),
    ("Norm", "te_norm_type", "TE_NORM_"),
    ("Activation", "te_activation", "TE_ACTIVATION_"),
    ("AttnLayout", "te_attn_layout", "TE_ATTN_LAYOUT_"),
    ("AttnMask", "te_attn_mask_type", "TE_ATTN_MASK_"),
    ("AttnBackend", "te_attn_backend", "TE_ATTN_BACKEND_"),
    ("SoftmaxMask", "te_softmax_mask_type", "TE_SOFTMAX_MASK_"),
    ("RopeFormat", "te_rope_format", "TE_ROPE_"),
]


@pytest.mark.parametrize("binding_enum, c_enum, prefix", _BINDING,
                         ids=[b[0] for b in _BINDING])
def test_binding_enums_equal_the_headers(binding_enum, c_enum, prefix):
    """Every member of the binding's enum, by name, has the header's value, and the binding
    exports every member (the frameworks look members up by the header's names)."""
    exported = {m.name: int(m.value) for m in getattr(core, binding_enum)}
    # te_norm_type's members are TE_NORM_LAYERNORM / _RMSNORM, the binding's layernorm/rmsnorm.
    assert exported == _by_suffix(c_enum, prefix)


# --------------------------------------------------------------------- the JAX package's mirrors


def _jax():
    pytest.importorskip("jax")
    from transformer_engine.jax import attention, ops

    return ops, attention


def _members(e: type[enum.IntEnum]) -> dict[str, int]:
    return {m.name.lower(): int(m) for m in e}


def test_jax_scaling_modes():
    ops, _ = _jax()
    assert _members(ops.ScalingMode) == _by_suffix("te_scaling_mode", "TE_SCALING_")


def test_jax_fp8_dtypes():
    ops, _ = _jax()
    dtypes = _by_suffix("te_dtype", "TE_DTYPE_")
    codes = {name: ops._TE_DTYPE[ops.fp8_dtype(name)] for name in ("float8_e4m3", "float8_e5m2")}
    assert codes == {name: dtypes[name] for name in codes}
    assert len(ops._TE_DTYPE) == len(codes)  # no mirror left unchecked


def test_jax_amax_algorithms():
    ops, _ = _jax()
    assert ops._AMAX_ALGOS == _by_suffix("te_amax_compute_algo", "TE_AMAX_COMPUTE_")


def test_jax_norm_types():
    ops, _ = _jax()
    assert _members(ops.NormType) == _by_suffix("te_norm_type", "TE_NORM_")


def test_jax_activations():
    ops, _ = _jax()
    assert _members(ops.Activation) == _by_suffix("te_activation", "TE_ACTIVATION_")


def test_jax_attention_layouts_masks_and_backend():
    _, attention = _jax()
    assert attention.LAYOUTS == _by_suffix("te_attn_layout", "TE_ATTN_LAYOUT_")
    assert attention.MASKS == _by_suffix("te_attn_mask_type", "TE_ATTN_MASK_")
    assert attention._BACKEND_AUTO == C["te_attn_backend"]["TE_ATTN_BACKEND_AUTO"]


# ----------------------------------------------------------------- the PyTorch package's mirrors


def _torch():
    pytest.importorskip("torch")
    import transformer_engine.pytorch  # noqa: F401  (the package, so its submodules import)
    from transformer_engine.pytorch import fast_linear, fp8
    from transformer_engine.pytorch.ops import _backend
    from transformer_engine.pytorch.ops import attention as attention_ops

    return fp8, fast_linear, _backend, attention_ops


def test_torch_amax_algorithms():
    """The compiled scale update takes the algorithms by the binding's codes (the header's)."""
    fp8, _, backend, _ = _torch()
    header = _by_suffix("te_amax_compute_algo", "TE_AMAX_COMPUTE_")
    assert set(fp8.COMPILED_ALGOS) == set(header)
    for name in fp8.COMPILED_ALGOS:
        assert backend.algo_code(name) == header[name]


def test_torch_names_are_members_of_the_binding_enums():
    """The PyTorch ops pass names that the binding looks up in its enums: each must exist."""
    _, _, backend, attention_ops = _torch()
    assert set(backend.FP8_DTYPES) <= set(_by_suffix("te_dtype", "TE_DTYPE_"))
    assert set(backend.SCALING_MODES) <= set(_by_suffix("te_scaling_mode", "TE_SCALING_"))
    assert tuple(attention_ops.LAYOUTS) == tuple(_by_suffix("te_attn_layout", "TE_ATTN_LAYOUT_"))
    assert tuple(attention_ops.MASKS) == tuple(_by_suffix("te_attn_mask_type", "TE_ATTN_MASK_"))
    assert tuple(attention_ops.CORE_BACKENDS) == tuple(
        k for k in _by_suffix("te_attn_backend", "TE_ATTN_BACKEND_") if k != "auto")
    assert tuple(attention_ops.SOFTMAX_MASKS) == tuple(
        _by_suffix("te_softmax_mask_type", "TE_SOFTMAX_MASK_"))
    for name in backend.FP8_DTYPES:
        assert backend.dtype_code(name) == _by_suffix("te_dtype", "TE_DTYPE_")[name]


def test_torch_attention_backend_indices():
    """DotProductAttention's backend indices (module/_attention_backend.py)."""
    pytest.importorskip("torch")
    from transformer_engine.pytorch.module import _attention_backend as attention

    backends = _by_suffix("te_attn_backend", "TE_ATTN_BACKEND_")
    assert attention._CORE_INDEX == {k: v for k, v in backends.items() if k != "auto"}


# -------------------------------------------------------------- the plan's FP8 maxima


def test_plan_fp8_maxima_are_the_formats():
    """The plan's FP8 maxima are the largest finite values of the formats (the header names
    448 and 57344; ml_dtypes computes them from the bit layouts)."""
    import ml_dtypes

    from transformer_engine.common.plan import FP8_MAX

    assert FP8_MAX == {"float8_e4m3": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
                       "float8_e5m2": float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}
