"""Fixtures of the op tests: the device an op runs on, and moving arrays there and back.

Every op test takes the ``device`` fixture and runs once on the CPU and once on a CUDA device
(that run is marked ``cuda``, so it is skipped on machines without a GPU). A test builds its
inputs as numpy arrays, puts them on the device with ``device.put``, calls the op with
``stream=device.stream`` and reads the results back with ``device.get`` (which synchronizes).
On CUDA a test also runs the op on ``device.cpu`` and compares the two bit for bit.

numpy has no bfloat16 that DLPack can carry, so bfloat16 arrays travel as torch tensors (on the
CPU too); tests that need them are skipped where torch is missing.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from transformer_engine.common import _core as core

# pytest imports test files by path (--import-mode=importlib, pytest.ini), so the helper
# modules beside them (_reference, _tolerances) are not importable by their bare names. This
# folder becomes the package `te_common_tests` instead: a name no other folder or installed
# package uses, and no change to sys.path.
if "te_common_tests" not in sys.modules:
    _package = types.ModuleType("te_common_tests")
    _package.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["te_common_tests"] = _package


def _torch():
    try:
        import torch
    except ImportError:
        pytest.skip("bfloat16 and CUDA arrays are made with torch, which is not installed")
    return torch


class Device:
    """Where an op runs: ``"cpu"`` or ``"cuda"`` (the current CUDA device)."""

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"Device({self.kind!r})"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def cpu(self) -> "Device":
        return Device("cpu")

    @property
    def stream(self) -> int:
        """The ``stream=`` argument of the ops: torch's current stream on CUDA, 0 on the CPU."""
        if not self.is_cuda:
            return 0
        return _torch().cuda.current_stream().cuda_stream

    def put(self, array: np.ndarray):
        """A copy of a numpy array on this device (numpy on the CPU, bfloat16 as torch)."""
        array = np.ascontiguousarray(array)
        if not self.is_cuda and array.dtype != ml_dtypes.bfloat16:
            copy = array.copy()
            copy.flags.writeable = array.flags.writeable  # a read-only input stays one
            return copy
        torch = _torch()
        if array.dtype == ml_dtypes.bfloat16:
            t = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(array.copy())
        return t.to("cuda") if self.is_cuda else t

    def get(self, array) -> np.ndarray:
        """The contents of an array of any source, as numpy, after the device's work is done."""
        if isinstance(array, np.ndarray):
            return array.copy()
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and isinstance(array, torch.Tensor):
            if array.is_cuda:
                torch.cuda.synchronize(array.device)
            t = array.detach().cpu()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
            if t.dtype.itemsize == 1 and t.dtype.is_floating_point:
                return t.view(torch.uint8).numpy().copy()
            return t.numpy().copy()
        return np.array(array)


def _cuda_usable() -> bool:
    return core.built_with_cuda()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> Device:
    if request.param == "cuda" and not _cuda_usable():
        # The machine has a GPU (the cuda marker skips otherwise) but this core has no kernels;
        # test_core_has_cuda_kernels fails on such a machine, once, instead of every op test.
        pytest.skip("this build of the core has no CUDA kernels")
    return Device(request.param)


@pytest.fixture
def cpu() -> Device:
    return Device("cpu")


@pytest.fixture
def cuda_device() -> Device:
    """The CUDA device alone, for tests of large shapes that only the GPU runs (mark them
    ``cuda``)."""
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not _cuda_usable():
        pytest.skip("this build of the core has no CUDA kernels")
    return Device("cuda")


@pytest.fixture(scope="module")
def workspaces():
    """The GEMM's CUDA workspace for a device (None on the CPU, which needs none)."""
    cache = {}

    def get(device):
        if not device.is_cuda:
            return None
        if "cuda" not in cache:
            cache["cuda"] = device.put(np.zeros(core.gemm_workspace_size(), np.uint8))
        return cache["cuda"]

    return get
