"""Transformer Engine common: the compiled core shared by the framework packages, and the
FP8 recipes (:mod:`transformer_engine.common.recipe`).

The native binding (``transformer_engine.common._core``) is loaded on first use, so that
importing the recipes never needs it.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "core"]


def core():
    """Returns the native binding of the core, with a clear error when it is missing."""
    try:
        from transformer_engine.common import _core
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            "transformer_engine.common: the native core (_core) could not be loaded "
            f"({err}). Install the wheel 'transformer-engine-common' for this Python "
            "(pip install --find-links dist transformer-engine-common), or build it with "
            "'nox -s build'."
        ) from err
    return _core
