"""Transformer Engine: FP8 modules for PyTorch (:mod:`transformer_engine.pytorch`) and JAX
(:mod:`transformer_engine.jax`) over one native core (:mod:`transformer_engine.common`).

The package spans three wheels: transformer-engine-common ships this file and
``transformer_engine/common``, transformer-engine-torch ``transformer_engine/pytorch`` and
transformer-engine-jax ``transformer_engine/jax``; those two ship no ``__init__.py`` of their
own. ``__path__`` is extended pkgutil-style below, so the subpackages are found wherever their
wheel (or, in a source checkout, their folder on ``PYTHONPATH``) put them.

``import transformer_engine as te`` imports neither torch nor JAX: ``te.pytorch`` and ``te.jax``
import their package on first access.
"""

import importlib as _importlib
import pkgutil as _pkgutil
import re as _re

# Every sys.path entry that holds a transformer_engine/ folder contributes it, in sys.path order
# (as for a PEP 420 namespace), so a checkout's folder on PYTHONPATH comes before an installed
# copy of the same subpackage; folders this package was found in by other means follow. Unlike a
# namespace's, this path is fixed at import: a folder put on sys.path later is not searched.
_portions = _pkgutil.extend_path([], __name__)
__path__ = _portions + [folder for folder in __path__ if folder not in _portions]
del _portions

# The one source of our version: transformer_engine.common's __init__ (which imports nothing,
# the native core included). Importing it also makes `transformer_engine.common` an attribute.
from transformer_engine.common import __version__ as release  # noqa: E402

# The release of NVIDIA Transformer Engine whose Python API these packages implement
# (docs/nvidia_compat.md). Programs written for NVIDIA's package, Megatron-LM among them, choose
# the features and call signatures they use by comparing `__version__` with NVIDIA's releases;
# told our own release number (below 1.0) they would take the paths of NVIDIA's first releases.
api_level = "2.8.0"

# `release` is this project's own version, that of the wheels; `__version__` carries both: a
# PEP 440 local version such as 2.8.0+te0.1.0 orders as the API level (>= 2.8.0, < 2.9.0.dev0)
# and names the release after the "+" (where only letters, digits and dots are allowed).
__version__ = f"{api_level}+te{_re.sub(r'[^A-Za-z0-9.]', '.', release)}"

# Framework subpackage -> (the distribution that ships it, the meta-package extra that installs
# it). Imported on first access (module __getattr__ below), so `import transformer_engine`
# imports neither torch nor JAX; NVIDIA's package imports both eagerly, and programs written for
# it use `te.pytorch.Linear` after a plain `import transformer_engine as te`.
_FRAMEWORKS = {
    "pytorch": ("transformer-engine-torch", "pytorch"),
    "jax": ("transformer-engine-jax", "jax"),
}

# The frameworks are left out: `from transformer_engine import *` would import both, and fail
# where either is missing.
__all__ = ["__version__", "api_level", "release", "common"]


class FrameworkNotInstalledError(AttributeError):
    """``transformer_engine.pytorch`` or ``.jax`` was asked for where it cannot be imported:
    its wheel, or the framework itself, is not installed. An AttributeError, so that
    ``hasattr(transformer_engine, "pytorch")`` answers False instead of raising."""


def __getattr__(name):
    if name not in _FRAMEWORKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = f"{__name__}.{name}"
    try:
        return _importlib.import_module(module)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        dist, extra = _FRAMEWORKS[name]
        if module == missing or module.startswith(missing + "."):
            reason = f"{module} is not installed: it ships in the distribution {dist!r}"
        elif missing and missing.split(".")[0] != __name__:
            reason = f"{module} needs the module {missing!r}, which is not installed"
        else:  # a module of our own (or one unnamed) is missing: not a missing framework
            raise
        raise FrameworkNotInstalledError(
            f'{reason}. Install it with: pip install "transformer-engine[{extra}]=={release}" '
            "(pinned: the other releases of that name on PyPI are NVIDIA's)"
        ) from err


def __dir__():
    return sorted(set(globals()) | set(_FRAMEWORKS))
