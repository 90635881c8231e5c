"""The compiled eager ops (``pytorch/csrc/eager/``): ``torch.ops.te_eager``, or None.

They are built on the LibTorch stable ABI for torch >= 2.11 (``pytorch/setup.py``), so one build
loads under every torch release from 2.11 on. None in a pure-Python build, under an older torch,
when the library cannot load, or with ``TE_FAST_LINEAR=0`` in the environment. Their users
(``fast_linear.py`` and the delayed-scaling update in ``fp8.py``) fall back to the custom ops
without them: the same numbers, more host time per call. So that this is never silent, a library
that was built but cannot load says why in one warning at import, and a package built without it
says so once, at the first FP8 forward of a te.Linear on a GPU (``warn_if_missing``), where its
host time matters.
"""

from __future__ import annotations

import importlib.machinery
import os
import warnings
from pathlib import Path

import torch

from . import first_step
from .first_step import has_empty
from .ops._backend import plain_eager

OLDEST_TORCH = (2, 11)  # the stable ABI version the library targets (setup.py)
_REBUILD = ("reinstall transformer-engine-torch with --no-build-isolation beside torch and "
            "transformer-engine-common to get it")


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_eager_ops{suffix}"
        if path.is_file():
            return path
    return None


def _load() -> tuple[object | None, str | None]:
    """(torch.ops.te_eager or None, why it is None when that is worth a warning)."""
    if os.environ.get("TE_FAST_LINEAR", "1") == "0":
        return None, None  # switched off on purpose
    path = _library_path()
    if path is None:
        return None, "missing"
    installed = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    if installed < OLDEST_TORCH:
        return None, (f"the compiled eager ops need torch >= {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} "
                      f"(the stable ABI they are built on) and torch {torch.__version__} is "
                      f"installed, so FP8 te.Linear, LayerNormLinear and LayerNormMLP run their "
                      f"Python path, with more host time per call")
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as err:
        return None, (f"the compiled eager ops could not be loaded ({err}); FP8 te.Linear, "
                      f"LayerNormLinear and LayerNormMLP run their Python path, with more host "
                      f"time per call: {_REBUILD}")
    return torch.ops.te_eager, None


# What the operators take for a tensor argument that is not needed (an operand of a GEMM that
# does not run) and for the GEMM workspace on the CPU (whose GEMM needs none).
NO_TENSOR = torch.empty(0, dtype=torch.uint8)

ops, _why = _load()
if _why is not None and _why != "missing":
    warnings.warn(_why, RuntimeWarning, stacklevel=2)
_missing_said = _why != "missing"


def serves(plan, history, tensors) -> bool:
    """The rule the compiled operators share: they compute a step under ``plan`` as the Python
    steps do where they are built; the recipe scales per tensor, with delayed scaling's
    ``history`` one that some step has written (None, a checkpoint's recompute, records nothing
    there; an unwritten one takes first_step.py's rule); and the call is eager with plain
    ``tensors`` (None where absent). Each caller adds its own conditions (token counts, the
    scale update, dtypes)."""
    if ops is None:
        return False
    if plan.kind == "delayed":
        if history is None or has_empty(history):
            return False
    elif plan.kind != "current":  # (delayed and current plans scale every role per tensor)
        return False
    return plain_eager(tensors)


def serves_traced(plan, history) -> bool:
    """The rule of the compiled operators that torch.compile's graphs call (as custom ops with
    fake implementations): built here, and a per-tensor plan whose step they compute as the
    Python steps do: current scaling, or delayed scaling in the graph of the steps whose
    histories are all written (first_step: "later"). A first step's graph keeps the Python
    steps, which apply its rule."""
    if ops is None:
        return False
    return plan.kind == "current" or (plan.kind == "delayed" and history is not None
                                      and first_step._compiled == "later")


# True while layer_block_op's fake implementation runs the eager node's Python on fake
# tensors: that code runs natively (torch.compiler.is_compiling() is False there), yet its
# tensors are fake and must reach the operators' fake implementations, never the C++ ones.
faking = False


def tracing() -> bool:
    """Whether the calls being made build a graph (traced by torch.compile, or a fake
    implementation's run) rather than run kernels."""
    return faking or torch.compiler.is_compiling()


def call(op, *args):
    """One of the compiled operators' custom ops: traced, through the operator (one graph node
    with its fake implementation's shapes); in eager mode its implementation straight away (the
    caller has checked what the custom op's eager test would check again, and each check costs
    host time)."""
    return op(*args) if tracing() else op.__wrapped__(*args)


def raise_if_failed(status: int) -> None:
    """Raises the error of a compiled operator that returned a nonzero status (they return
    their errors rather than throw them across into libtorch: csrc/eager/common.h says why)."""
    if status:
        raise RuntimeError(ops.last_error.default())


def warn_if_missing() -> None:
    """Once per process, where the package was built without the compiled ops."""
    global _missing_said
    if not _missing_said:
        _missing_said = True
        warnings.warn("the compiled eager ops are not part of this installation (the package "
                      "was built without torch or transformer-engine-common present), so FP8 "
                      "te.Linear, LayerNormLinear and LayerNormMLP run their Python path, with "
                      f"more host time per call: {_REBUILD}", RuntimeWarning, stacklevel=3)
