"""``transformer_engine_torch``: the module name NVIDIA Transformer Engine's programs import as
``tex`` for its enums. Only ``DType`` is here, so that ``tex.DType.kFloat8E4M3`` can be given
where ``fp8_dtype`` is asked for (``transformer_engine.pytorch.tensor``'s quantizers); the rest
of that extension is NVIDIA's internals, and asking for it raises an error that says so.
"""

from __future__ import annotations

import enum

from transformer_engine.common import core as _core

# NVIDIA's member names -> the core's DType names; the values are the core's own codes.
_NAMES = {
    "kByte": "uint8", "kInt32": "int32", "kInt64": "int64", "kFloat32": "float32",
    "kFloat16": "float16", "kBFloat16": "bfloat16", "kFloat8E4M3": "float8_e4m3",
    "kFloat8E5M2": "float8_e5m2",
}

DType = enum.IntEnum("DType", {nvidia: int(getattr(_core().DType, ours).value)
                               for nvidia, ours in _NAMES.items()})
DType.__doc__ = "Element types by NVIDIA's ``tex.DType`` names, valued by the core's codes."


def __getattr__(name: str):
    raise AttributeError(
        f"transformer_engine_torch.{name} does not exist here: this module gives only DType (the "
        f"element types by NVIDIA's names); the functions of NVIDIA's extension are its "
        f"internals, which this project does not reproduce (use transformer_engine.pytorch)")
