"""Fixtures and hooks of the JAX tests.

pytest imports test files by path (--import-mode=importlib), so the shared modules beside them
(_reference, _tolerances) become the package ``te_jax_tests``, a name nothing else uses.

References computed by XLA use full fp32 matmuls (no TF32 on a GPU). Tests marked ``cuda``
here also need jax itself to see a GPU: the repository-wide hook asks
torch, which may see a GPU that a CPU-only jaxlib cannot use.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

# jax would take 75% of the GPU's memory when its GPU backend starts; in a pytest process that
# also runs torch's CUDA tests (nox -s gpu) the two must share the device. Only allocation
# changes, no numerics. Set at collection, before any test starts a jax backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if "te_jax_tests" not in sys.modules:
    _package = types.ModuleType("te_jax_tests")
    _package.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["te_jax_tests"] = _package

_HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    # The references that XLA computes (flax's layers, jnp matmuls) in full fp32: on a GPU
    # jax's default lets fp32 dots use TF32, and the core's fp32 GEMM never does.
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def _jax_has_gpu() -> bool:
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items
            if item.get_closest_marker("cuda") is not None and _HERE in Path(item.path).parents]
    if not ours or _jax_has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU that jax can use")
    for item in ours:
        item.add_marker(skip)
