"""Dropout fused with the residual addition (dropout.h) through the binding, against a numpy
reference written from the header: the mask from splitmix64 of (offset + e) ^ splitmix64(seed),
then y = residual + x * factor and dx = dy * factor in fp32, rounded once. Every output must
equal the reference bit for bit on the CPU, and the CPU's bit for bit on CUDA.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from transformer_engine.common import _core as core

HP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
_M = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M
        return x ^ (x >> np.uint64(31))


def factors(n: int, seed: int, offset: int, p: float) -> np.ndarray:
    """1 / (1 - p) (fp32) where element e is kept, 0 where it drops (dropout.h)."""
    key = _mix64(np.array([seed], np.uint64))[0]
    with np.errstate(over="ignore"):
        counters = (np.uint64(offset) + np.arange(n, dtype=np.uint64)) & _M
    u = (_mix64(counters ^ key) >> np.uint64(40)).astype(np.float32) * np.float32(1 / 16777216)
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return np.where(u >= np.float32(p), scale, np.float32(0.0)).astype(np.float32)


def reference(x, residual, seed, offset, p):
    f = factors(x.size, seed, offset, p).reshape(x.shape)
    dropped = x.astype(np.float32) * f
    out = dropped if residual is None else residual.astype(np.float32) + dropped
    return out.astype(x.dtype)


def _data(shape, dtype, key):
    rng = np.random.default_rng(key)
    return (rng.standard_normal(shape).astype(np.float32) * 3).astype(HP[dtype])


def forward(device, x, residual, rng_state, p):
    y = device.put(np.full(x.shape, np.nan, x.dtype))
    core.dropout_add_forward(p, device.put(x), None if residual is None else device.put(residual),
                             device.put(np.asarray(rng_state, np.int64)), y, stream=device.stream)
    return device.get(y)


def backward(device, dy, rng_state, p):
    dx = device.put(np.full(dy.shape, np.nan, dy.dtype))
    core.dropout_backward(p, device.put(dy), device.put(np.asarray(rng_state, np.int64)), dx,
                          stream=device.stream)
    return device.get(dx)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16 if a.itemsize == 2 else np.uint32)


# Sizes: a multiple of the CUDA kernel's 16-byte runs, and an odd one (its scalar path).
@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("shape", [(64, 48), (3, 7, 11)])
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("with_residual", [True, False])
def test_matches_reference_bit_for_bit(device, dtype, shape, p, with_residual):
    x, r = _data(shape, dtype, 1), _data(shape, dtype, 2)
    state = (1234567, 2 ** 40 + 17)
    y = forward(device, x, r if with_residual else None, state, p)
    assert np.array_equal(_bits(y), _bits(reference(x, r if with_residual else None, *state, p)))
    dy = _data(shape, dtype, 3)
    dx = backward(device, dy, state, p)
    assert np.array_equal(_bits(dx), _bits(reference(dy, None, *state, p)))
    if device.is_cuda:  # (and so equal to the CPU's bits)
        assert np.array_equal(_bits(y), _bits(forward(device.cpu, x, r if with_residual else None,
                                                      state, p)))


def test_keep_rate_and_independence_of_seeds(cpu):
    n, p = 1 << 16, 0.3
    kept = factors(n, 5, 0, p) > 0
    # 4 standard deviations of a binomial's mean
    assert abs(kept.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n)
    other = factors(n, 6, 0, p) > 0
    assert abs((kept == other).mean() - (p * p + (1 - p) ** 2)) < 0.02
    x = np.ones(n, np.float32)
    y = forward(cpu, x, None, (5, 0), p)
    assert np.array_equal(y > 0, kept)


def test_in_place_on_the_residual(cpu):
    x, r = _data((8, 16), "float32", 4), _data((8, 16), "float32", 5)
    expect = reference(x, r, 9, 3, 0.2)
    buffer = r.copy()
    core.dropout_add_forward(0.2, x, buffer, np.asarray([9, 3], np.int64), buffer)
    assert np.array_equal(buffer, expect)


def test_bad_inputs_give_clear_errors(cpu):
    x = np.zeros((4, 8), np.float32)
    rng = np.asarray([1, 2], np.int64)
    with pytest.raises(ValueError, match=r"dropout_add_forward: p must be in \[0, 1\), got 1"):
        core.dropout_add_forward(1.0, x, None, rng, np.zeros_like(x))
    with pytest.raises(ValueError, match="residual.data must have the shape and dtype of x.data"):
        core.dropout_add_forward(0.1, x, np.zeros((4, 4), np.float32), rng, np.zeros_like(x))
    with pytest.raises(ValueError, match="rng_state.data"):
        core.dropout_add_forward(0.1, x, None, np.asarray([1], np.int64), np.zeros_like(x))
    with pytest.raises(ValueError, match="dx.data must have the shape and dtype of dy.data"):
        core.dropout_backward(0.1, x, rng, np.zeros((4, 8), np.float16))
    y = np.full((4, 8), 7.0, np.float32)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        core.dropout_backward(0.1, np.zeros((4, 8), np.int32), rng, y)
    assert (y == 7.0).all()  # nothing written on failure
