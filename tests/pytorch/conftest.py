"""Fixtures of the PyTorch tests: the device a test runs on, and the shared modules beside them.

Tests that take ``device`` run on the CPU (the core's CPU path emulates FP8 exactly) and on
CUDA; the CUDA run is marked ``cuda`` and skipped on machines without a GPU.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

# pytest imports test files by path (--import-mode=importlib), so the shared modules beside them
# (_reference, _tolerances) become the package `te_torch_tests`, a name nothing else uses.
if "te_torch_tests" not in sys.modules:
    _package = types.ModuleType("te_torch_tests")
    _package.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["te_torch_tests"] = _package


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> torch.device:
    if request.param == "cuda":
        from transformer_engine.common import core

        if not core().built_with_cuda():
            pytest.skip("this build of the core has no CUDA kernels")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@pytest.fixture
def record_calls(monkeypatch):
    """``record_calls(owner, *names)``: a list that gets a name each time ``owner.<name>`` is
    called (the function still runs), for tests that check which path a step took."""
    def record(owner, *names):
        seen = []
        for name in names:
            real = getattr(owner, name)

            def recording(*args, _name=name, _real=real, **kwargs):
                seen.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(owner, name, recording)
        return seen

    return record


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
