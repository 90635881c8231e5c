"""Outputs that share memory with each other or with an input are rejected before anything is
written: on CUDA they would be written concurrently, a race the CPU's sequential order hides."""

import numpy as np
import pytest

from transformer_engine.common import core


def test_scale_inv_sharing_amax_is_rejected():
    c = core()
    x = np.ones((2, 16), np.float32)
    q = np.full((2, 16), 0xAA, np.uint8)
    shared = np.full(1, 7.0, np.float32)
    out = c.Tensor(
        q, dtype=c.DType.float8_e4m3, scale=np.ones(1, np.float32), scale_inv=shared, amax=shared
    )
    with pytest.raises(ValueError, match="quantize: output.scale_inv must not overlap output.amax"):
        c.quantize(x, out)
    assert (q == 0xAA).all() and shared[0] == 7.0


def test_in_place_transpose_is_rejected():
    c = core()
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    before = a.copy()
    with pytest.raises(
        ValueError, match="transpose: output.data must not overlap the input input.data"
    ):
        c.transpose(a, a)
    np.testing.assert_array_equal(a, before)


def test_delayed_update_groups_sharing_a_history_are_rejected():
    c = core()
    history = np.array([4.0, 2.0], np.float32)
    scales = [np.ones(1, np.float32), np.ones(1, np.float32)]
    scale_invs = [np.zeros(1, np.float32), np.zeros(1, np.float32)]
    with pytest.raises(
        ValueError, match=r"amax_histories\[0\] must not overlap amax_histories\[1\]"
    ):
        c.delayed_scaling_update(
            [history, history], scales, scale_invs, fp8_dtype=c.DType.float8_e4m3
        )
    np.testing.assert_array_equal(history, [4.0, 2.0])
    assert all(s[0] == 1.0 for s in scales) and all(s[0] == 0.0 for s in scale_invs)
