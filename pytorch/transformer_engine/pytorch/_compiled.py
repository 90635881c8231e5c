"""The optional compiled module ``_linear_fast`` (``pytorch/csrc/linear_fast.cpp``), or None.

Built with the package for the torch release installed at build time (``pytorch/setup.py``);
None in a pure-Python build, under another torch release (its C++ ABI is not stable across
releases), or with ``TE_FAST_LINEAR=0`` in the environment. Its users (``fast_linear.py`` and
the delayed-scaling update in ``fp8.py``) fall back to the custom ops without it.
"""

from __future__ import annotations

import os

import torch


def _load():
    if os.environ.get("TE_FAST_LINEAR", "1") == "0":
        return None
    try:
        from . import _linear_fast as ext
    except ImportError:
        return None
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return ext if tuple(ext.torch_version) == (major, minor) else None


ext = _load()
