"""te_grouped_gemm: each group equal, bit for bit, to te_gemm of that group alone (the grouped
call runs each group by te_gemm's rules), and within te_gemm's bounds of a float64 product.
Empty groups (M = 0, and K = 0: an expert with no token), per-group FP8 scales, errors that
name the group, and nothing written when any group is refused."""

from __future__ import annotations

import numpy as np
import pytest
from te_common_tests import _tolerances as tol
from te_common_tests._reference import stable_seed
from te_common_tests.test_gemm import (
    HP,
    Operand,
    fp8_block_operand,
    fp8_tensor_operand,
    hp_operand,
    random_matrix,
    reference,
)

from transformer_engine.common import _core as core


def _grouped(device, workspaces, a_ops, b_ops, out_dtype, *, transpose_a=False,
             transpose_b=True, biases=None, accumulate_into=None):
    """Runs the grouped GEMM; returns the groups' D as float64 arrays."""
    ds = []
    for i, (a, b) in enumerate(zip(a_ops, b_ops, strict=True)):
        m = a.value.shape[1] if transpose_a else a.value.shape[0]
        n = b.value.shape[0] if transpose_b else b.value.shape[1]
        d0 = (accumulate_into[i] if accumulate_into is not None
              else np.full((m, n), np.nan, np.float32))
        ds.append(device.put(d0.astype(HP[out_dtype])))
    core.grouped_gemm([a.on(device) for a in a_ops], [b.on(device) for b in b_ops], ds,
                      bias=None if biases is None else [None if x is None else device.put(x)
                                                        for x in biases],
                      transpose_a=transpose_a, transpose_b=transpose_b,
                      accumulate=accumulate_into is not None, use_split_accumulator=True,
                      workspace=workspaces(device), stream=device.stream)
    return [device.get(d).astype(np.float64) for d in ds]


def _single(device, workspaces, a, b, out_dtype, *, transpose_a=False,
            transpose_b=True, bias=None, accumulate_into=None):
    m = a.value.shape[1] if transpose_a else a.value.shape[0]
    n = b.value.shape[0] if transpose_b else b.value.shape[1]
    d0 = accumulate_into if accumulate_into is not None else np.full((m, n), np.nan, np.float32)
    d = device.put(d0.astype(HP[out_dtype]))
    core.gemm(a.on(device), b.on(device), d, bias=None if bias is None else device.put(bias),
              transpose_a=transpose_a, transpose_b=transpose_b,
              accumulate=accumulate_into is not None, use_split_accumulator=True,
              workspace=workspaces(device), stream=device.stream)
    return device.get(d).astype(np.float64)


def _check_groups(got, a_ops, b_ops, out, **kw):
    for i, (g, a, b) in enumerate(zip(got, a_ops, b_ops, strict=True)):
        want, absp, k = reference(a, b, transpose_b=kw.get("transpose_b", True),
                                  transpose_a=kw.get("transpose_a", False),
                                  bias=kw.get("bias", [None] * len(got))[i])
        if g.size:
            bound = tol.gemm_bound(absp, want, max(k, 1), out, fp8=a.dtype is not None)
            assert np.all(np.abs(g - want) <= bound), f"group {i}: {np.abs(g - want).max()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_high_precision_groups_equal_their_single_gemms(device, workspaces, dtype):
    """Experts of different token counts (one empty), one weight each: the forward shape."""
    rng = np.random.default_rng(stable_seed("grouped", dtype))
    k, n = 48, 40
    rows = [17, 0, 64, 5]
    a_ops = [hp_operand(random_matrix(rng, (m, k)), dtype) for m in rows]
    b_ops = [hp_operand(random_matrix(rng, (n, k)), dtype) for _ in rows]
    biases = [random_matrix(rng, (n,)).astype(HP[dtype]) if i % 2 == 0 else None
              for i in range(len(rows))]
    got = _grouped(device, workspaces, a_ops, b_ops, dtype, biases=biases)
    for i, (a, b) in enumerate(zip(a_ops, b_ops, strict=True)):
        alone = _single(device, workspaces, a, b, dtype, bias=biases[i])
        np.testing.assert_array_equal(got[i], alone, err_msg=f"group {i}")
    assert got[1].shape == (0, n)
    _check_groups(got, a_ops, b_ops, dtype, bias=biases)


def test_weight_gradients_of_experts_without_tokens_are_zero_or_kept(device,
                                                                      workspaces):
    """wgrad = dy_g^T @ x_g (transpose_a): an expert with no token has K = 0, so its gradient
    is 0, or stays as it was when accumulating into it."""
    rng = np.random.default_rng(5)
    n, kin = 24, 32
    tokens = [9, 0, 30]
    dys = [hp_operand(random_matrix(rng, (t, n)), "float32") for t in tokens]
    xs = [hp_operand(random_matrix(rng, (t, kin)), "float32") for t in tokens]
    got = _grouped(device, workspaces, dys, xs, "float32", transpose_a=True, transpose_b=False)
    np.testing.assert_array_equal(got[1], np.zeros((n, kin)))
    _check_groups(got, dys, xs, "float32", transpose_a=True, transpose_b=False)
    before = [random_matrix(rng, (n, kin)) for _ in tokens]
    acc = _grouped(device, workspaces, dys, xs, "float32", transpose_a=True, transpose_b=False,
                   accumulate_into=before)
    np.testing.assert_array_equal(acc[1], before[1].astype(np.float64))
    for i in (0, 2):
        alone = _single(device, workspaces, dys[i], xs[i], "float32", transpose_a=True,
                        transpose_b=False, accumulate_into=before[i])
        np.testing.assert_array_equal(acc[i], alone)


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_fp8_groups_take_each_their_own_scales(device, workspaces, out):
    """Per-tensor FP8: every expert's input and weight have their own scale (the weights'
    magnitudes differ by orders), and block-scaled groups beside them in another call."""
    rng = np.random.default_rng(stable_seed("grouped-fp8", out))
    k, n = 64, 32
    rows = [32, 0, 16]
    a_ops = [fp8_tensor_operand(random_matrix(rng, (m, k)) * 10.0 ** i, "e4m3", rng)
             if m else Operand(np.zeros((0, k)), {"data": np.zeros((0, k), np.uint8),
                                                  "scale_inv": np.ones(1, np.float32)},
                               core.DType.float8_e4m3)
             for i, m in enumerate(rows)]
    b_ops = [fp8_tensor_operand(random_matrix(rng, (n, k)) * 10.0 ** -i, "e4m3", rng)
             for i in range(len(rows))]
    got = _grouped(device, workspaces, a_ops, b_ops, out)
    for i, (a, b) in enumerate(zip(a_ops, b_ops, strict=True)):
        np.testing.assert_array_equal(got[i], _single(device, workspaces, a, b, out))
    _check_groups(got, a_ops, b_ops, out)

    a_blk = [fp8_block_operand(random_matrix(rng, (m, 256)), "e4m3", "block_1x128")
             for m in (48, 16)]
    b_blk = [fp8_block_operand(random_matrix(rng, (n, 256)), "e4m3", "block_128x128")
             for _ in range(2)]
    got = _grouped(device, workspaces, a_blk, b_blk, out)
    for i, (a, b) in enumerate(zip(a_blk, b_blk, strict=True)):
        np.testing.assert_array_equal(got[i], _single(device, workspaces, a, b, out))


def test_a_refused_group_is_named_and_nothing_is_written(device, workspaces):
    rng = np.random.default_rng(9)
    a_ops = [hp_operand(random_matrix(rng, (8, 16)), "float32") for _ in range(3)]
    b_ops = [hp_operand(random_matrix(rng, (4, 16)), "float32") for _ in range(2)]
    b_ops.append(hp_operand(random_matrix(rng, (4, 12)), "float32"))  # K = 12, not 16
    ds = [device.put(np.full((8, 4), 7.0, np.float32)) for _ in range(3)]
    with pytest.raises(ValueError, match=r"^grouped_gemm: group 2: b.data must have K = 16"):
        core.grouped_gemm([a.on(device) for a in a_ops], [b.on(device) for b in b_ops], ds,
                          workspace=workspaces(device), stream=device.stream)
    for d in ds:  # group 0 and 1 were valid, but nothing ran
        np.testing.assert_array_equal(device.get(d), np.full((8, 4), 7.0, np.float32))


def test_groups_writing_one_buffer_or_reading_another_groups_output_are_refused(device):
    rng = np.random.default_rng(10)
    a = device.put(random_matrix(rng, (8, 16)))
    b = device.put(random_matrix(rng, (4, 16)))
    d = device.put(np.zeros((8, 4), np.float32))
    with pytest.raises(ValueError, match=r"^grouped_gemm: group 0 d.data must not overlap "
                                         r"group 1 d.data"):
        core.grouped_gemm([a, a], [b, b], [d, d], stream=device.stream)
    # inputs may be shared (two experts reading one weight): only outputs may not meet
    d_other = device.put(np.zeros((8, 4), np.float32))
    core.grouped_gemm([a, a], [b, b], [d, d_other], stream=device.stream)
    np.testing.assert_array_equal(device.get(d), device.get(d_other))
    d2 = device.put(np.zeros((8, 16), np.float32))
    a2 = device.put(random_matrix(rng, (16, 16)))
    with pytest.raises(ValueError, match=r"group 0 d.data must not overlap the input group 1 "
                                         r"a.data"):
        core.grouped_gemm([a, d2], [a2, a2], [d2, device.put(np.zeros((8, 16), np.float32))],
                          stream=device.stream)


def test_argument_lists_must_match_and_no_group_does_nothing():
    a = np.ones((4, 8), np.float32)
    b = np.ones((2, 8), np.float32)
    d = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match=r"^grouped_gemm: a, b, d .* one entry per group, got "
                                         r"2, 1, 2"):
        core.grouped_gemm([a, a], [b], [d, d.copy()])
    core.grouped_gemm([], [], [])  # no group: nothing to do
    core.grouped_gemm([a], [b], [d])
    np.testing.assert_array_equal(d, np.full((4, 2), 8.0, np.float32))


# --- groups stacked in one operand, sizes on the device (te_grouped_gemm_ragged) -------------


def _ragged(device, workspaces, a, b, sizes, out_dtype, *, transpose_a=False,
            transpose_b=True, bias=None, accumulate_into=None, d_shape=None):
    d0 = (accumulate_into if accumulate_into is not None
          else np.full(d_shape, np.nan, np.float32))
    d = device.put(d0.astype(HP[out_dtype]))
    core.grouped_gemm_ragged(a, b, d, device.put(np.asarray(sizes, np.int32)),
                             bias=None if bias is None else device.put(bias),
                             transpose_a=transpose_a, transpose_b=transpose_b,
                             accumulate=accumulate_into is not None,
                             workspace=workspaces(device), stream=device.stream)
    return device.get(d).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_groups_equal_their_single_gemms(device, workspaces, dtype):
    """Forward (b [G, N, K]), dgrad (b [G, K, N]) and weight gradients (d [G, K, N]) of
    experts stacked by rows, an empty expert and rows past the groups (capacity padding)."""
    rng = np.random.default_rng(stable_seed("ragged", dtype))
    sizes, m, k, n = [7, 0, 20, 5], 40, 24, 16
    x = random_matrix(rng, (m, k)).astype(HP[dtype])
    w = random_matrix(rng, (4, n, k)).astype(HP[dtype])
    bias = random_matrix(rng, (4, n)).astype(HP[dtype])
    got = _ragged(device, workspaces, device.put(x), device.put(w), sizes, dtype, bias=bias,
                  d_shape=(m, n))
    row = 0
    for g, rows in enumerate(sizes):
        alone = _single(device, workspaces, hp_operand(x[row:row + rows].astype(np.float32),
                                                       dtype),
                        hp_operand(w[g].astype(np.float32), dtype), dtype,
                        bias=bias[g])
        np.testing.assert_array_equal(got[row:row + rows], alone, err_msg=f"group {g}")
        row += rows
    np.testing.assert_array_equal(got[row:], np.zeros((m - row, n)))  # past the groups

    dy = random_matrix(rng, (m, n)).astype(HP[dtype])
    # dgrad: dx = dy @ w_g, w_g stored [N, K] and read as it is (transpose_b = 0)
    dx = _ragged(device, workspaces, device.put(dy), device.put(w), sizes, dtype,
                 transpose_b=False, d_shape=(m, k))
    dw = _ragged(device, workspaces, device.put(x), device.put(dy), sizes, "float32",
                 transpose_a=True, transpose_b=False, d_shape=(4, k, n))
    row = 0
    for g, rows in enumerate(sizes):
        xs, dys = x[row:row + rows].astype(np.float32), dy[row:row + rows].astype(np.float32)
        np.testing.assert_array_equal(
            dx[row:row + rows],
            _single(device, workspaces, hp_operand(dys, dtype),
                    hp_operand(w[g].astype(np.float32), dtype), dtype, transpose_b=False))
        np.testing.assert_array_equal(
            dw[g], _single(device, workspaces, hp_operand(xs, dtype), hp_operand(dys, dtype),
                           "float32", transpose_a=True, transpose_b=False))
        row += rows
    np.testing.assert_array_equal(dw[1], np.zeros((k, n)))  # the expert without tokens


def test_stacked_weight_gradients_accumulate(device, workspaces):
    rng = np.random.default_rng(21)
    x, dy = random_matrix(rng, (10, 8)), random_matrix(rng, (10, 4))
    before = random_matrix(rng, (2, 8, 4))
    got = _ragged(device, workspaces, device.put(x), device.put(dy), [0, 10], "float32",
                  transpose_a=True, transpose_b=False, accumulate_into=before)
    np.testing.assert_array_equal(got[0], before[0].astype(np.float64))
    want = before[1].astype(np.float64) + x.astype(np.float64).T @ dy.astype(np.float64)
    assert np.allclose(got[1], want, rtol=1e-5, atol=1e-5)


def test_stacked_group_errors_name_the_argument():
    a = np.ones((6, 8), np.float32)
    b = np.ones((2, 4, 8), np.float32)
    d = np.full((6, 4), 3.0, np.float32)
    with pytest.raises(ValueError, match=r"^grouped_gemm_ragged: group_sizes must be >= 0 and "
                                         r"sum to at most M = 6 \(a's rows\), got 4 for group 1"):
        core.grouped_gemm_ragged(a, b, d, np.array([3, 4], np.int32))
    np.testing.assert_array_equal(d, np.full((6, 4), 3.0, np.float32))  # nothing written
    with pytest.raises(ValueError, match=r"b.data must be \[G, N, K\] or \[G, K, N\] with G = 3"):
        core.grouped_gemm_ragged(a, b, d, np.array([1, 2, 3], np.int64))
    with pytest.raises(TypeError, match=r"group_sizes.data must be int32 or int64"):
        core.grouped_gemm_ragged(a, b, d, np.array([1.0, 2.0], np.float32))
    with pytest.raises(TypeError, match=r"a.data must be float32, float16, bfloat16 or float8"):
        core.grouped_gemm_ragged(np.zeros((6, 8), np.int32), b, d, np.array([3, 3], np.int32))


# --- FP8 groups stacked in one operand --------------------------------------------------------


def _fp8_stack(parts: list[Operand]) -> Operand:
    """Operands quantized each with its own per-tensor scale, stacked: data [G, ...] and
    scale_inv [G] (or one operand's [1])."""
    return Operand(None, {"data": np.stack([p.arrays["data"] for p in parts]),
                          "scale_inv": np.concatenate([p.arrays["scale_inv"] for p in parts])},
                   parts[0].dtype)


def _fp8_rows(op: Operand, start: int, rows: int, transpose: bool = False) -> Operand:
    """A group's rows of a stacked per-tensor FP8 operand (transposed: its K-major copy)."""
    data = op.arrays["data"][start:start + rows]
    value = op.value[start:start + rows]
    if transpose:
        data, value = np.ascontiguousarray(data.T), value.T
    return Operand(value, {"data": data, "scale_inv": op.arrays["scale_inv"]}, op.dtype)


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("a_fmt", ["e4m3", "e5m2"])
def test_fp8_stacked_groups_equal_their_single_gemms(device, workspaces, out, a_fmt):
    """Forward / dgrad form: tokens with one scale, each weight with its own (b.scale_inv
    [G]) or all with one ([1]); each group bit for bit te_gemm of its slice. Group sizes are
    multiples of 16, as te_gemm's FP8 rule asks of M."""
    rng = np.random.default_rng(stable_seed("ragged fp8", out, a_fmt))
    sizes, m, k, n = [16, 0, 32, 16], 72, 32, 48
    x = fp8_tensor_operand(random_matrix(rng, (m, k)), a_fmt, rng)
    ws = [fp8_tensor_operand(random_matrix(rng, (n, k)) * (g + 1), "e4m3", rng) for g in range(4)]
    per_group = _fp8_stack(ws)
    got = _ragged(device, workspaces, x.on(device), per_group.on(device), sizes, out,
                  d_shape=(m, n))
    one = fp8_tensor_operand(random_matrix(rng, (4 * n, k)), "e4m3", rng)
    shared = Operand(None, {"data": one.arrays["data"].reshape(4, n, k),
                            "scale_inv": one.arrays["scale_inv"]}, one.dtype)
    got_shared = _ragged(device, workspaces, x.on(device), shared.on(device), sizes, out,
                         d_shape=(m, n))
    row = 0
    for g, rows in enumerate(sizes):
        xg = _fp8_rows(x, row, rows)
        np.testing.assert_array_equal(got[row:row + rows],
                                      _single(device, workspaces, xg, ws[g], out),
                                      err_msg=f"group {g}")
        wg = _fp8_rows(one, g * n, n)
        np.testing.assert_array_equal(got_shared[row:row + rows],
                                      _single(device, workspaces, xg, wg, out),
                                      err_msg=f"group {g}, one weight scale")
        row += rows
    np.testing.assert_array_equal(got[row:], np.zeros((m - row, n)))  # past the groups


@pytest.mark.parametrize("accumulate", [False, True])
def test_fp8_stacked_weight_gradients_equal_their_single_gemms(device, workspaces, accumulate):
    """Weight-gradient form on row-wise FP8 x [M, K] (E4M3) and dy [M, N] (E5M2): each group
    bit for bit te_gemm of its transposed rows (K-major, as FP8 GEMMs read them); an expert
    without tokens gets 0, or keeps its gradient when accumulating. The sizes (each group's
    K here) are multiples of 16, as te_gemm's FP8 rule asks; rows past them are not read."""
    rng = np.random.default_rng(stable_seed("ragged fp8 wgrad", accumulate))
    sizes, m, k, n = [16, 0, 16, 32], 70, 32, 16
    x = fp8_tensor_operand(random_matrix(rng, (m, k)), "e4m3", rng)
    dy = fp8_tensor_operand(random_matrix(rng, (m, n)), "e5m2", rng)
    before = random_matrix(rng, (4, k, n)) if accumulate else None
    got = _ragged(device, workspaces, x.on(device), dy.on(device), sizes, "float32",
                  transpose_a=True, transpose_b=False, accumulate_into=before,
                  d_shape=(4, k, n))
    row = 0
    for g, rows in enumerate(sizes):
        want = _single(device, workspaces, _fp8_rows(x, row, rows, transpose=True),
                       _fp8_rows(dy, row, rows, transpose=True), "float32",
                       accumulate_into=None if before is None else before[g])
        np.testing.assert_array_equal(got[g], want, err_msg=f"group {g}")
        row += rows
    empty = before[1].astype(np.float64) if accumulate else np.zeros((k, n))
    np.testing.assert_array_equal(got[1], empty)


def test_fp8_stacked_group_errors_name_the_argument(cpu):
    rng = np.random.default_rng(5)
    x = fp8_tensor_operand(random_matrix(rng, (6, 16)), "e4m3", rng)
    w = fp8_tensor_operand(random_matrix(rng, (32, 16)), "e4m3", rng)
    w2 = Operand(None, {"data": w.arrays["data"].reshape(2, 16, 16),
                        "scale_inv": np.ones(3, np.float32)}, w.dtype)
    sizes = np.array([3, 3], np.int32)
    d = np.full((6, 16), 3.0, np.float32)
    with pytest.raises(TypeError, match=r"^grouped_gemm_ragged: b.data must be float8 when "
                                        r"a.data is, got float32"):
        core.grouped_gemm_ragged(x.on(cpu), np.ones((2, 16, 16), np.float32), d, sizes)
    with pytest.raises(ValueError, match=r"b.scale_inv must be float32 \[1\] or \[G\] = \[2\] "
                                         r"\(one per group\), got float32 \[3\]"):
        core.grouped_gemm_ragged(x.on(cpu), w2.on(cpu), d, sizes)
    dy = fp8_tensor_operand(random_matrix(rng, (6, 16)), "e5m2", rng)
    dw = np.full((2, 16, 16), 3.0, np.float32)
    two = Operand(None, {"data": dy.arrays["data"], "scale_inv": np.ones(2, np.float32)},
                  dy.dtype)
    with pytest.raises(ValueError, match=r"b.scale_inv must be float32 \[1\], got"):
        core.grouped_gemm_ragged(x.on(cpu), two.on(cpu), dw, sizes,
                                 transpose_a=True, transpose_b=False)
    blocks = fp8_block_operand(random_matrix(rng, (6, 128)), "e4m3", "block_1x128")
    with pytest.raises(ValueError, match=r"take per-tensor scaling for a and b, got "
                                         r"block_1x128 and tensor"):
        core.grouped_gemm_ragged(blocks.on(cpu), w2.on(cpu), d, sizes)
    np.testing.assert_array_equal(d, np.full((6, 16), 3.0, np.float32))  # nothing written
    np.testing.assert_array_equal(dw, np.full((2, 16, 16), 3.0, np.float32))
