"""Rotary position embedding (rope.h) through the binding, against a float64 numpy reference.

The reference is written from the header's formulas, token by token through each layout's
position map: the forward rotates feature i with its partner k at angle a_i, the backward is
the transpose (dx_i = dy_i cos a_i +- dy_k sin a_k). Angles that differ within a pair test the
general formulas, the usual layout their rotation form. On CUDA every output must equal the
CPU's bit for bit (both use rope_impl.h's sincos and element formula).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests._reference import stable_seed
from te_common_tests._tolerances import rope_bound

from transformer_engine.common import _core as core

HP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FORMATS = {"sbhd": core.RopeFormat.sbhd, "bshd": core.RopeFormat.bshd, "thd": core.RopeFormat.thd}

# name: (format, shape, cu_seqlens or None). D = 16 and 64 take the CUDA kernel's 128-bit path,
# D = 20 its scalar one; the THD cases have uneven lengths and an empty sequence.
CASES = {
    "sbhd": ("sbhd", (5, 3, 2, 16), None),
    "bshd": ("bshd", (3, 5, 2, 16), None),
    "thd": ("thd", (11, 3, 20), [0, 4, 4, 9, 11]),
    "sbhd-d64": ("sbhd", (37, 2, 4, 64), None),
    "thd-d64": ("thd", (50, 2, 64), [0, 1, 31, 31, 50]),
}


def batch_of(fmt, shape, cu):
    return len(cu) - 1 if fmt == "thd" else (shape[1] if fmt == "sbhd" else shape[0])


def token_positions(fmt, shape, cu, start):
    """The position of every token of the flattened [tokens, H, D] view (rope.h)."""
    if fmt == "thd":
        pos = np.concatenate([np.arange(cu[b + 1] - cu[b]) + (0 if start is None else start[b])
                              for b in range(len(cu) - 1)] + [np.zeros(0, np.int64)])
        return pos.astype(np.int64)
    s, b = (shape[0], shape[1]) if fmt == "sbhd" else (shape[1], shape[0])
    seq_index, batch_index = np.meshgrid(np.arange(s), np.arange(b), indexing="ij")
    if fmt == "bshd":
        seq_index, batch_index = seq_index.T, batch_index.T  # tokens in [b, s] order
    offset = 0 if start is None else np.asarray(start)[batch_index]
    return (seq_index + offset).reshape(-1)


def reference(x, freqs, fmt, cu, start, interleaved, backward):
    """(result, magnitude) in float64, in x's shape."""
    shape = x.shape
    x = np.asarray(x, np.float64).reshape(-1, shape[-2], shape[-1])  # [tokens, H, D]
    f = np.asarray(freqs, np.float64).reshape(freqs.shape[0], freqs.shape[-1])
    rot = f.shape[1]
    a = f[token_positions(fmt, shape, cu, start)][:, None, :]  # [tokens, 1, R]
    j = np.arange(rot)
    if interleaved:
        partner, first = j ^ 1, j % 2 == 0
    else:
        partner, first = np.where(j < rot // 2, j + rot // 2, j - rot // 2), j < rot // 2
    xr, xk = x[..., :rot], x[..., partner]
    if backward:  # the transpose: the partner's own sine, opposite sign
        term = np.where(first, 1.0, -1.0) * xk * np.sin(a[..., partner])
    else:
        term = np.where(first, -1.0, 1.0) * xk * np.sin(a)
    y, mag = x.copy(), np.abs(x)
    y[..., :rot] = xr * np.cos(a) + term
    mag[..., :rot] = np.abs(xr * np.cos(a)) + np.abs(term)
    return y.reshape(shape), mag.reshape(shape)


def make_freqs(rng, rows, rot, interleaved, shared):
    """Angles [rows, rot] fp32: the usual layout (a pair shares its angle) or arbitrary ones."""
    if not shared:
        return (rng.standard_normal((rows, rot)) * 4).astype(np.float32)
    inv = 1.0 / 300.0 ** (np.arange(0, rot, 2, dtype=np.float32) / rot)
    half = np.arange(rows, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
    return np.repeat(half, 2, axis=1) if interleaved else np.concatenate((half, half), axis=1)


def run(device, x, freqs, fmt, cu, start, interleaved, backward, out=None):
    """The core's result as numpy (out: the array it writes, default NaNs of x's dtype)."""
    out = device.put(np.full(x.shape, np.nan, x.dtype)) if out is None else out
    call = core.rope_backward if backward else core.rope_forward
    call(FORMATS[fmt], device.put(x), device.put(freqs), out, interleaved=interleaved,
         cu_seqlens=None if cu is None else device.put(np.asarray(cu, np.int32)),
         start_positions=None if start is None else device.put(np.asarray(start, np.int32)),
         stream=device.stream)
    return device.get(out)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("shared", [True, False], ids=["pairs", "arbitrary-angles"])
@pytest.mark.parametrize("with_start", [False, True], ids=["", "start"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", list(HP))
def test_matches_float64_reference(device, dtype, case, interleaved, partial, with_start,
                                   shared, backward):
    fmt, shape, cu = CASES[case]
    rng = np.random.default_rng(stable_seed(dtype, case, interleaved, partial, with_start,
                                            shared, backward))
    d = shape[-1]
    rot = (d // 2 if d % 4 == 0 else 12) if partial else d
    batch = batch_of(fmt, shape, cu)
    start = rng.integers(0, 9, batch) if with_start else None
    freqs = make_freqs(rng, 64, rot, interleaved, shared)
    x = (rng.standard_normal(shape) * 3).astype(np.float32).astype(HP[dtype])
    got = run(device, x, freqs, fmt, cu, start, interleaved, backward)
    want, mag = reference(x, freqs, fmt, cu, start, interleaved, backward)
    err = np.abs(got.astype(np.float64) - want)
    bound = rope_bound(mag, dtype)
    assert (err <= bound).all(), f"max err {err.max()} (bound there {bound.flat[err.argmax()]})"
    # The features beyond R are copied bit for bit.
    assert np.array_equal(bits(got[..., rot:]), bits(x[..., rot:]))
    if device.is_cuda:
        cpu = run(device.cpu, x, freqs, fmt, cu, start, interleaved, backward)
        assert np.array_equal(bits(got), bits(cpu)), "CUDA differs from the CPU path"


def test_backward_undoes_forward_with_shared_angles(cpu):
    """With the usual layout the backward is the rotation by -a: back to x up to rounding."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 2, 3, 16)).astype(np.float32)
    freqs = make_freqs(rng, 6, 16, False, True)
    y = run(cpu, x, freqs, "sbhd", None, None, False, False)
    back = run(cpu, y, freqs, "sbhd", None, None, False, True)
    _, mag = reference(x, freqs, "sbhd", None, None, False, False)
    assert (np.abs(back - x) <= 2 * rope_bound(mag, "float32")).all()


def test_empty_inputs_write_nothing_and_succeed(device):
    freqs = np.zeros((4, 8), np.float32)
    for fmt, shape, cu in (("sbhd", (0, 2, 2, 8), None), ("bshd", (2, 0, 2, 8), None),
                           ("thd", (0, 2, 8), [0, 0, 0])):
        got = run(device, np.zeros(shape, np.float32), freqs, fmt, cu, None, False, False)
        assert got.shape == shape


def test_large_angles_match_libm_and_huge_ones_give_nan(cpu):
    """Angles up to 2^20 radians keep fp32 accuracy (rope.h); |angle| >= 2^30 gives NaN."""
    angles = np.array([[1048575.5, -777777.25, 2.0**30, np.inf]], np.float32)
    freqs = np.concatenate((angles, angles), axis=1)  # pairs (j, j + 4) share the angle
    x = np.array([1, 1, 1, 1, 0, 0, 0, 0], np.float32).reshape(1, 1, 1, 8)
    y = run(cpu, x, freqs, "sbhd", None, None, False, False).reshape(-1)
    a = angles[0].astype(np.float64)
    np.testing.assert_allclose(y[:2], np.cos(a[:2]), rtol=0, atol=2.0**-24)
    np.testing.assert_allclose(y[4:6], np.sin(a[:2]), rtol=0, atol=2.0**-24)
    assert np.isnan(y[[2, 3, 6, 7]]).all()


# ------------------------------------------------------------------ argument errors


def _arrays():
    x = np.ones((4, 2, 2, 8), np.float32)
    return x, np.zeros((6, 8), np.float32), np.full(x.shape, 7.0, np.float32)


BAD = {
    # name: (exception, message fragments, call arguments as a function of x, freqs, out)
    "freqs-dtype": (TypeError, ["rope_forward", "freqs.data", "float32"],
                    lambda x, f, o: ("sbhd", x, f.astype(np.float16), o, {})),
    "odd-rot": (ValueError, ["rope_forward", "freqs.data", "even"],
                lambda x, f, o: ("sbhd", x, f[:, :7], o, {})),
    "rot-too-big": (ValueError, ["freqs.data", "at most the head dimension 4"],
                    lambda x, f, o: ("sbhd", x[..., :4], f, o[..., :4].copy(), {})),
    "too-few-rows": (ValueError, ["freqs.data", "at least S = 4 rows, got 3"],
                     lambda x, f, o: ("sbhd", x, f[:3], o, {})),
    "out-dtype": (TypeError, ["rope_forward", "output.data", "float32"],
                  lambda x, f, o: ("sbhd", x, f, o.astype(np.float16), {})),
    "out-shape": (ValueError, ["output.data", "shape [4, 2, 2, 8]"],
                  lambda x, f, o: ("sbhd", x, f, o.reshape(2, 4, 2, 8), {})),
    "rank": (ValueError, ["input.data", "[B, S, H, D]"],
             lambda x, f, o: ("bshd", x[0], f, o[0].copy(), {})),
    "cu-for-sbhd": (ValueError, ["cu_seqlens", "NULL for SBHD"],
                    lambda x, f, o: ("sbhd", x, f, o,
                                     {"cu_seqlens": np.array([0, 4], np.int32)})),
    "thd-without-cu": (ValueError, ["cu_seqlens", "THD"],
                       lambda x, f, o: ("thd", x[0], f, o[0].copy(), {})),
    "cu-decreasing": (ValueError, ["cu_seqlens.data", "decrease"],
                      lambda x, f, o: ("thd", x[0], f, o[0].copy(),
                                       {"cu_seqlens": np.array([0, 2, 1, 2], np.int32)})),
    "cu-total": (ValueError, ["cu_seqlens.data[-1]", "T = 2"],
                 lambda x, f, o: ("thd", x[0], f, o[0].copy(),
                                  {"cu_seqlens": np.array([0, 1, 3], np.int32)})),
    "cu-int64": (TypeError, ["cu_seqlens.data", "int32"],
                 lambda x, f, o: ("thd", x[0], f, o[0].copy(),
                                  {"cu_seqlens": np.array([0, 2], np.int64)})),
    "start-length": (ValueError, ["start_positions.data", "shape [2]"],
                     lambda x, f, o: ("sbhd", x, f, o,
                                      {"start_positions": np.zeros(3, np.int32)})),
    "start-negative": (ValueError, ["start_positions.data", ">= 0", "-1"],
                       lambda x, f, o: ("sbhd", x, f, o,
                                        {"start_positions": np.array([0, -1], np.int32)})),
    "start-past-freqs": (ValueError, ["freqs.data", "every position used, up to 6"],
                         lambda x, f, o: ("sbhd", x, f, o,
                                          {"start_positions": np.array([3, 0], np.int32)})),
}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("name", list(BAD))
def test_bad_arguments_name_op_and_argument_and_write_nothing(name, backward):
    exc, fragments, make = BAD[name]
    x, freqs, out = _arrays()
    fmt, xa, fa, oa, kwargs = make(x, freqs, out)
    xa, fa = np.ascontiguousarray(xa), np.ascontiguousarray(fa)
    before = oa.copy()
    call = core.rope_backward if backward else core.rope_forward
    with pytest.raises(exc) as info:
        call(FORMATS[fmt], xa, fa, oa, **kwargs)
    message = str(info.value)
    op = "rope_backward" if backward else "rope_forward"
    for fragment in fragments:
        fragment = fragment.replace("rope_forward", op)
        if backward:  # the same roles under the backward's names
            fragment = {"input.data": "grad_output.data",
                        "output.data": "grad_input.data"}.get(fragment, fragment)
        assert fragment in message, message
    assert np.array_equal(bits(oa), bits(before)), "the output was written"


def test_output_overlapping_the_input_is_refused():
    x = np.ones((4, 2, 2, 8), np.float32)
    with pytest.raises(ValueError, match="rope_forward: output.data must not overlap the input "
                                         "input.data"):
        core.rope_forward(core.RopeFormat.sbhd, x, np.zeros((4, 8), np.float32), x)
    assert (x == 1).all()


@pytest.mark.cuda
def test_cuda_positions_past_freqs_give_nan(cuda_device):
    """The CUDA path does not read positions on the host (rope.h): a sequence that runs past
    the rows of freqs gets NaN in its rotated features from there on, and nothing else moves."""
    x = np.random.default_rng(3).standard_normal((4, 2, 2, 16)).astype(np.float32)
    freqs = make_freqs(np.random.default_rng(4), 6, 8, False, True)
    y = run(cuda_device, x, freqs, "sbhd", None, [0, 4], False, False)
    assert not np.isnan(y[:, 0]).any() and not np.isnan(y[:2, 1]).any()
    assert np.isnan(y[2:, 1, :, :8]).all()
    assert np.array_equal(bits(y[:, 1, :, 8:]), bits(x[:, 1, :, 8:]))
