"""The optional compiled module ``_linear_fast`` (``pytorch/csrc/linear_fast.cpp``), or None.

Built with the package for the torch release installed at build time (``pytorch/setup.py``);
None in a pure-Python build, under another torch release (its C++ ABI is not stable across
releases), or with ``TE_FAST_LINEAR=0`` in the environment. Its users (``fast_linear.py`` and
the delayed-scaling update in ``fp8.py``) fall back to the custom ops without it: the same
numbers, more host time per call. So that this is never silent, a module that was built but
cannot load (another torch release, a load error) says why in one warning at import, and a
package built without it says so once, at the first FP8 forward of a te.Linear on a GPU
(``warn_if_missing``), where its host time matters.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

_REBUILD = ("reinstall transformer-engine-torch with --no-build-isolation against the torch "
            "in use to get it back")


def _load() -> tuple[object | None, str | None]:
    """(the module or None, why it is None when that is worth a warning)."""
    if os.environ.get("TE_FAST_LINEAR", "1") == "0":
        return None, None  # switched off on purpose
    if importlib.util.find_spec(f"{__package__}._linear_fast") is None:
        return None, "missing"
    try:
        from . import _linear_fast as mod
    except ImportError as err:
        return None, (f"te.Linear's compiled fast path could not be loaded ({err}); FP8 "
                      f"te.Linear runs its Python path, with more host time per call: "
                      f"{_REBUILD}")
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    built = tuple(mod.torch_version)
    if built != (major, minor):
        return None, (f"te.Linear's compiled fast path was built for torch "
                      f"{built[0]}.{built[1]} and torch {major}.{minor} is installed (its C++ "
                      f"ABI differs between releases), so it is off and FP8 te.Linear runs its "
                      f"Python path, with more host time per call: {_REBUILD}")
    return mod, None


ext, _why = _load()
if _why is not None and _why != "missing":
    warnings.warn(_why, RuntimeWarning, stacklevel=2)
_missing_said = _why != "missing"


def warn_if_missing() -> None:
    """Once per process, where the package was built without the compiled module."""
    global _missing_said
    if not _missing_said:
        _missing_said = True
        warnings.warn("te.Linear's compiled fast path is not part of this installation (the "
                      "package was built without torch or transformer-engine-common present), "
                      "so FP8 te.Linear runs its Python path, with more host time per call: "
                      f"{_REBUILD}", RuntimeWarning, stacklevel=3)
