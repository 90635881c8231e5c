"""transpose against numpy's: raw elements of every dtype, the [M, K] view of any rank."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
}
SHAPES = [
    (1,),
    (1, 1),
    (3, 5),
    (17, 33),
    (2, 3, 40),
    (64, 96),
    (128, 128),
    (129, 257),
    (0, 16),
    (16, 0),
]


def random_elements(rng, shape, dtype):
    """Random bit patterns, NaNs and all: transpose must move bytes, not values."""
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def run_transpose(device, x, out_shape, fp8=None):
    out = device.put(np.zeros(out_shape, x.dtype) + np.array(1, x.dtype))
    if fp8 is None:
        core.transpose(device.put(x), out, stream=device.stream)
    else:  # FP8 bytes through Tensors that name their format
        core.transpose(
            core.Tensor(device.put(x), dtype=fp8), core.Tensor(out, dtype=fp8), stream=device.stream
        )
    return device.get(out)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose(device, dtype, shape):
    rng = np.random.default_rng([len(shape), *shape, np.dtype(DTYPES[dtype]).itemsize])
    x = random_elements(rng, shape, DTYPES[dtype])
    want = ref.transpose(x)
    got = run_transpose(device, x, want.shape)
    ref.assert_same_bits(got, want, "transpose")


@pytest.mark.parametrize("fp8", [core.DType.float8_e4m3, core.DType.float8_e5m2], ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (129, 257), (2, 3, 40)], ids=str)
def test_transpose_fp8_tensors(device, shape, fp8):
    x = random_elements(np.random.default_rng(list(shape)), shape, np.uint8)
    want = ref.transpose(x)
    ref.assert_same_bits(run_transpose(device, x, want.shape, fp8=fp8), want, "transpose")


def test_transpose_output_may_keep_leading_dims(device):
    """[K, *leading dims] is accepted as well as [K, M]: the same elements in the same order."""
    x = random_elements(np.random.default_rng(4), (2, 3, 40), np.float32)
    got = run_transpose(device, x, (40, 2, 3))
    ref.assert_same_bits(got, ref.transpose(x).reshape(40, 2, 3), "transpose")


def test_transpose_twice_is_identity(device):
    x = random_elements(np.random.default_rng(6), (33, 70), np.int16)
    once = run_transpose(device, x, (70, 33))
    ref.assert_same_bits(run_transpose(device, once, (33, 70)), x, "transpose of the transpose")


# ---------------------------------------------------------------- large shapes, CUDA only

LARGE = [
    ((1024, 4096), "bfloat16"),  # the fast, tiled kernels
    ((4096, 1024), "uint8"),
    ((2048, 2048), "float32"),
    ((64, 16), "float16"),
    ((1023, 4097), "bfloat16"),  # the generic kernels
    ((1, 100003), "uint8"),
    ((100003, 1), "float32"),
    ((7, 9, 1001), "int64"),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", LARGE, ids=lambda c: "x".join(map(str, c[0])) + "-" + c[1])
def test_cuda_large_transpose(cuda_device, case):
    shape, dtype = case
    x = random_elements(np.random.default_rng(list(shape)), shape, DTYPES[dtype])
    want = ref.transpose(x)
    got = run_transpose(cuda_device, x, want.shape)
    ref.assert_same_bits(got, want, "transpose")
    ref.assert_same_bits(
        got, run_transpose(cuda_device.cpu, x, want.shape), "transpose, CUDA vs CPU"
    )
