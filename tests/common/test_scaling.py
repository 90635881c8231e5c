"""amax, the current-scaling scale and the delayed-scaling update against plain models of the
C API's doc comments (quantize.h, scaling.h), bit for bit."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

IN_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SHAPES = [(1,), (1, 1), (3, 5), (17, 33), (2, 3, 40), (129, 257), (0,), (0, 16), (16, 0)]
FLT_MAX = float(np.finfo(np.float32).max)


def fp8_dtype(fmt):
    return getattr(core.DType, "float8_" + fmt.name)


def bits32(*values) -> np.ndarray:
    return np.array(values, np.uint32).view(np.float32)


# ---------------------------------------------------------------- compute_amax


def run_amax(device, x):
    out = device.put(np.array([-5.0], np.float32))
    core.compute_amax(device.put(x), core.Tensor(amax=out), stream=device.stream)
    return device.get(out)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_compute_amax(device, in_dtype, shape):
    rng = np.random.default_rng([len(shape), *shape])
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(IN_DTYPES[in_dtype])
    got = run_amax(device, x)
    ref.assert_float_equal(got, np.array([ref.amax(x)]), "amax")
    if device.is_cuda:
        ref.assert_same_bits(got, run_amax(device.cpu, x), "amax, CUDA vs CPU")


AMAX_SPECIAL = {
    "nan_first": ([np.nan] + [1.0] * 99, np.nan),
    "nan_last": ([1.0] * 99 + [np.nan], np.nan),
    "negative_nan": ([1.0, -2.0, *bits32(0xFFC00001), 3.0], np.nan),
    "nan_beside_inf": ([np.inf, np.nan, -np.inf], np.nan),
    "inf": ([1.0, np.inf, 2.0], np.inf),
    "minus_inf": ([1.0, -np.inf, 2.0], np.inf),
    "negative_largest": ([-7.5, 3.0, 7.25], 7.5),
    "minus_zero_only": ([-0.0, -0.0], 0.0),  # +0: amax is a magnitude
    "fp32_denormals": ([1e-45, -3e-40, 2e-41], 3e-40),
    "fp32_max": ([-FLT_MAX, 1.0], FLT_MAX),
}


@pytest.mark.parametrize("case", AMAX_SPECIAL, ids=str)
def test_compute_amax_special_values(device, case):
    values, expected = AMAX_SPECIAL[case]
    x = np.array(values, np.float32)
    got = run_amax(device, x)
    ref.assert_float_equal(got, np.array([expected], np.float32), "amax (documented value)")
    ref.assert_float_equal(got, np.array([ref.amax(x)]), "amax (reference)")


def test_compute_amax_of_an_empty_tensor_is_zero(device):
    got = run_amax(device, np.zeros((0, 8), np.float32))
    ref.assert_float_equal(got, np.array([0.0], np.float32))


# ---------------------------------------------------------------- compute_scale_from_amax

AMAXES = [
    0.0,
    -0.0,
    1e-45,
    1e-40,
    1.2e-38,
    1e-30,
    1.0,
    3.0,
    448.0,
    57344.0,
    1e30,
    FLT_MAX,
    np.inf,
    -np.inf,
    np.nan,
    -1.0,
]


def run_scale_from_amax(device, amax, fmt, columnwise_only=False, **config):
    arrays = {
        "amax": np.array([amax], np.float32),
        "scale": np.array([-2.0], np.float32),
        "scale_inv": np.array([-3.0], np.float32),
        "columnwise_data" if columnwise_only else "data": np.zeros((2, 3), np.uint8),
    }
    on_device = {name: device.put(a) for name, a in arrays.items()}
    core.compute_scale_from_amax(
        core.Tensor(dtype=fp8_dtype(fmt), **on_device), stream=device.stream, **config
    )
    return {name: device.get(a) for name, a in on_device.items()}


@pytest.mark.parametrize("pow2", [False, True], ids=["any_scale", "pow2"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-6, 2.0])
@pytest.mark.parametrize("amax", AMAXES, ids=lambda a: f"{a:g}")
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_compute_scale_from_amax(device, fmt, amax, epsilon, pow2):
    def run(d):
        return run_scale_from_amax(d, amax, fmt, force_pow2_scales=pow2, amax_epsilon=epsilon)

    got = run(device)
    scale, scale_inv = ref.scale_from_amax(np.float32(amax), fmt.max, epsilon, pow2)
    ref.assert_float_equal(got["scale"], np.array([scale]), "scale")
    ref.assert_float_equal(got["scale_inv"], np.array([scale_inv]), "scale_inv")
    ref.assert_float_equal(got["amax"], np.array([amax], np.float32), "amax (an input)")
    if device.is_cuda:
        on_cpu = run(device.cpu)
        for name in got:
            ref.assert_float_equal(got[name], on_cpu[name], f"{name}, CUDA vs CPU")


def test_scale_from_amax_documented_values(device):
    """Values written out from quantize.h's rule, independent of the reference's code."""
    cases = [  # (format, amax, epsilon, pow2, scale)
        (ref.E4M3, 2.0, 0.0, False, 224.0),
        (ref.E5M2, 2.0, 0.0, False, 28672.0),
        (ref.E4M3, 3.0, 0.0, True, 128.0),  # 149.33 rounded down to a power of two
        (ref.E4M3, 0.5, 4.0, False, 112.0),  # the amax is raised to epsilon
        (ref.E4M3, 0.0, 0.0, False, 1.0),
        (ref.E4M3, np.nan, 0.0, False, 1.0),
        (ref.E4M3, np.inf, 0.0, False, 1.0),
        (ref.E4M3, 1e-45, 0.0, False, FLT_MAX),  # 448 / 1.4e-45 overflows
        (ref.E4M3, 1e-45, 0.0, True, 2.0**127),
    ]
    for fmt, amax, epsilon, pow2, scale in cases:
        got = run_scale_from_amax(device, amax, fmt, force_pow2_scales=pow2, amax_epsilon=epsilon)
        assert got["scale"][0] == np.float32(scale), (fmt.name, amax, epsilon, pow2, got["scale"])
        assert got["scale_inv"][0] == np.float32(1) / np.float32(scale)


def test_scale_from_amax_takes_the_format_from_columnwise_data(device):
    got = run_scale_from_amax(device, 2.0, ref.E5M2, columnwise_only=True)
    assert got["scale"][0] == np.float32(57344.0 / 2.0)


# ---------------------------------------------------------------- delayed_scaling_update

ALGOS = {"max": core.AmaxComputeAlgo.max, "most_recent": core.AmaxComputeAlgo.most_recent}


def run_update(device, groups, fmt, algo, margin):
    """groups: list of (history, scale) numpy pairs. Returns [(history, scale, scale_inv)]."""
    on_device = [
        (device.put(h), device.put(s), device.put(np.full(np.shape(s), 123.0, np.float32)))
        for h, s in groups
    ]
    core.delayed_scaling_update(
        [g[0] for g in on_device],
        [g[1] for g in on_device],
        [g[2] for g in on_device],
        fp8_dtype=fp8_dtype(fmt),
        algo=ALGOS[algo],
        margin=margin,
        stream=device.stream,
    )
    return [tuple(device.get(a) for a in g) for g in on_device]


def check_update(device, groups, fmt, algo, margin):
    got = run_update(device, groups, fmt, algo, margin)
    for i, ((history, scale), (h, s, si)) in enumerate(zip(groups, got, strict=True)):
        want_h, want_s, want_si = ref.delayed_scaling_update(history, scale, fmt.max, algo, margin)
        ref.assert_float_equal(h, want_h, f"group {i}: history")
        ref.assert_float_equal(s, want_s, f"group {i}: scale")
        ref.assert_float_equal(si, want_si, f"group {i}: scale_inv")
    if device.is_cuda:
        on_cpu = run_update(device.cpu, groups, fmt, algo, margin)
        for i, (g, c) in enumerate(zip(got, on_cpu, strict=True)):
            for name, a, b in zip(("history", "scale", "scale_inv"), g, c, strict=True):
                ref.assert_float_equal(a, b, f"group {i}: {name}, CUDA vs CPU")
    return got


def history_column(*values):
    return np.array(values, np.float32)


# One history column per edge case; old scale 4.0 throughout, so a kept scale shows.
EDGE_HISTORIES = {
    "plain": history_column(2.0, 7.0, 1.0, 0.5),
    "zero": history_column(0.0, 0.0, 0.0, 0.0),
    "zero_most_recent_only": history_column(0.0, 3.0, 0.0, 0.0),
    "tiny_denormal": history_column(1e-45, 0.0, 0.0, 0.0),  # 448/1e-45 = Inf -> FLT_MAX
    "tiny_normal": history_column(1.2e-38, 1e-39, 0.0, 0.0),
    "nan_most_recent": history_column(np.nan, 1.0, 2.0, 3.0),
    "nan_older": history_column(1.0, 2.0, np.nan, 3.0),
    "inf_most_recent": history_column(np.inf, 1.0, 2.0, 3.0),
    "inf_older": history_column(1.0, np.inf, 2.0, 3.0),
    "huge": history_column(FLT_MAX, 1.0, 0.0, 0.0),
    "amax_at_fp8_max": history_column(448.0, 57344.0, 0.0, 0.0),
}


@pytest.mark.parametrize("margin", [0, 1, 5])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
@pytest.mark.parametrize("case", EDGE_HISTORIES, ids=str)
def test_delayed_update_edge_cases(device, case, fmt, algo, margin):
    history = EDGE_HISTORIES[case]
    check_update(device, [(history, np.array([4.0], np.float32))], fmt, algo, margin)


def test_delayed_update_documented_values(device):
    """A few results written out from scaling.h's rule, independent of the reference's code."""
    groups = [
        (history_column(2.0, 7.0, 1.0), np.array([4.0], np.float32)),
        (history_column(0.0, 7.0, 1.0), np.array([4.0], np.float32)),
        (history_column(np.nan, 1.0, 1.0), np.array([4.0], np.float32)),
    ]
    (h0, s0, si0), (h1, s1, si1), (h2, s2, si2) = run_update(device, groups, ref.E4M3, "max", 1)
    assert s0[0] == np.float32(448.0 / 7.0 / 2.0) and si0[0] == np.float32(1) / s0[0]
    np.testing.assert_array_equal(h0, [0.0, 1.0, 2.0])  # rolled one step, slot 0 zeroed
    assert s1[0] == np.float32(32.0)  # max(0, 7, 1) = 7: the zero is not the amax
    assert s2[0] == 4.0 and si2[0] == 0.25  # NaN keeps the scale; scale_inv follows it
    ((_, s3, _),) = run_update(device, groups[1:2], ref.E4M3, "most_recent", 0)
    assert s3[0] == 4.0  # history[0] = 0 keeps the scale


@pytest.mark.parametrize("margin", [0, 3, 126])
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_delayed_update_many_groups(device, fmt, algo, margin):
    """One call updates groups of every shape: [H] and [H, n] histories, H = 1 included, and
    the 2-D histories column by column (each column is one tensor's history)."""
    rng = np.random.default_rng([margin, len(algo), fmt.mantissa_bits])

    def positive(*shape):
        return (10.0 ** rng.uniform(-4, 4, size=shape)).astype(np.float32)

    edge_columns = np.stack(list(EDGE_HISTORIES.values()), axis=1)  # [4, 11]
    groups = [
        (positive(1), positive(1)),
        (positive(16), positive(1)),
        (positive(1, 5), positive(5)),
        (positive(7, 3), positive(3)),
        (edge_columns, positive(edge_columns.shape[1])),
        (positive(1024, 2), positive(2)),
    ]
    check_update(device, groups, fmt, algo, margin)


def test_delayed_update_of_no_groups_is_a_no_op():
    core.delayed_scaling_update([], [], [], fp8_dtype=core.DType.float8_e4m3)


@pytest.mark.parametrize("algo", ALGOS)
def test_delayed_update_over_many_steps(device, algo):
    """A training loop: each step writes its amax into history[0] and updates. The model and
    the core agree at every step, so the roll, the zeroed slot and the scales compose."""
    rng = np.random.default_rng(len(algo))
    fmt, margin = ref.E5M2, 2
    history = np.zeros((4, 3), np.float32)
    scale = np.ones(3, np.float32)
    h_dev, s_dev, si_dev = device.put(history), device.put(scale), device.put(scale)
    for step in range(10):
        amax = (10.0 ** rng.uniform(-2, 2, size=3)).astype(np.float32)
        if step == 4:
            amax[1] = np.nan  # a bad step in tensor 1
        history[0] = amax
        h_dev[0] = device.put(amax)  # in place: the core's own history goes on
        core.delayed_scaling_update(
            [h_dev],
            [s_dev],
            [si_dev],
            fp8_dtype=fp8_dtype(fmt),
            algo=ALGOS[algo],
            margin=margin,
            stream=device.stream,
        )
        history, scale, scale_inv = ref.delayed_scaling_update(
            history, scale, fmt.max, algo, margin
        )
        ref.assert_float_equal(device.get(h_dev), history, f"step {step}: history")
        ref.assert_float_equal(device.get(s_dev), scale, f"step {step}: scale")
        ref.assert_float_equal(device.get(si_dev), scale_inv, f"step {step}: scale_inv")


# ------------------------------------------------ delayed_scaling_update_with_amaxes


def recorded(slot0, amax):
    """scaling.h: history[0] = max(history[0], step_amax), NaN in either gives NaN."""
    slot0, amax = np.float32(slot0), np.float32(amax)
    return np.float32(np.nan) if np.isnan(slot0) or np.isnan(amax) else max(slot0, amax)


def run_update_with_amaxes(device, groups, algo, margin):
    """groups: (history, step_amax, scale, fmt). Returns [(history, scale, scale_inv)]."""
    on_device = [(device.put(h), device.put(a), device.put(s),
                  device.put(np.full(np.shape(s), 123.0, np.float32))) for h, a, s, _ in groups]
    core.delayed_scaling_update_with_amaxes(
        [g[0] for g in on_device], [g[1] for g in on_device], [g[2] for g in on_device],
        [g[3] for g in on_device], fp8_dtypes=[fp8_dtype(g[3]) for g in groups],
        algo=ALGOS[algo], margin=margin, stream=device.stream)
    return [tuple(device.get(a) for a in (g[0], g[2], g[3])) for g in on_device]


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("algo", ALGOS)
def test_update_with_amaxes_records_then_updates(device, algo, margin):
    """Each group as if its step amax had been maxed into slot 0 and then updated alone with
    its own format: histories of every shape (H = 1, [H, n], 1024 rows), step amaxes above,
    below and equal to slot 0, zero, NaN and Inf, E4M3 and E5M2 groups in the one call."""
    rng = np.random.default_rng([margin, len(algo)])

    def positive(*shape):
        return (10.0 ** rng.uniform(-4, 4, size=shape)).astype(np.float32)

    edge_columns = np.stack(list(EDGE_HISTORIES.values()), axis=1)  # [4, 11]
    edge_amaxes = np.array([0.5, 0.0, 9.0, np.nan, 1.0, np.inf, 3.0, 0.0, 2.0, 1.0, 500.0],
                           np.float32)
    groups = [
        (positive(1), positive(1), positive(1), ref.E4M3),
        (positive(16), np.zeros(1, np.float32), positive(1), ref.E5M2),
        (positive(1, 5), positive(5), positive(5), ref.E5M2),
        (positive(7, 3), positive(3), positive(3), ref.E4M3),
        (edge_columns, edge_amaxes, np.full(edge_columns.shape[1], 4.0, np.float32), ref.E4M3),
        (positive(1024, 2), positive(2) * 1e4, positive(2), ref.E5M2),
    ]
    got = run_update_with_amaxes(device, groups, algo, margin)
    for i, ((history, amax, scale, fmt), (h, s, si)) in enumerate(zip(groups, got, strict=True)):
        with_amax = np.array(history, np.float32)
        first = with_amax.reshape(with_amax.shape[0], -1)[0]
        first[:] = [recorded(a, b) for a, b in zip(first, np.reshape(amax, -1), strict=True)]
        want_h, want_s, want_si = ref.delayed_scaling_update(with_amax, scale, fmt.max, algo,
                                                             margin)
        ref.assert_float_equal(h, want_h, f"group {i}: history")
        ref.assert_float_equal(s, want_s, f"group {i}: scale")
        ref.assert_float_equal(si, want_si, f"group {i}: scale_inv")
    if device.is_cuda:
        on_cpu = run_update_with_amaxes(device.cpu, groups, algo, margin)
        for i, (g, c) in enumerate(zip(got, on_cpu, strict=True)):
            for name, a, b in zip(("history", "scale", "scale_inv"), g, c, strict=True):
                ref.assert_float_equal(a, b, f"group {i}: {name}, CUDA vs CPU")


def test_update_with_amaxes_documented_values(device):
    """scaling.h's rule written out: the step's 5 beats slot 0's 3 (E4M3: 448 / 5); a NaN step
    keeps the scale and stays in the history (E5M2)."""
    groups = [(history_column(3.0, 1.0, 2.0), np.array([5.0], np.float32),
               np.array([1.0], np.float32), ref.E4M3),
              (history_column(0.0, 1.0), np.array([np.nan], np.float32),
               np.array([2.0], np.float32), ref.E5M2)]
    (h0, s0, _), (h1, s1, si1) = run_update_with_amaxes(device, groups, "max", 0)
    np.testing.assert_array_equal(h0, [0.0, 2.0, 5.0])
    assert s0[0] == np.float32(448.0 / 5.0)
    assert s1[0] == 2.0 and si1[0] == 0.5 and np.isnan(h1[1])


def test_update_with_amaxes_errors_write_nothing(device):
    h, a, s, si = (device.put(np.array([1.0, 2.0], np.float32)), device.put(np.ones(1, np.float32)),
                   device.put(np.ones(1, np.float32)), device.put(np.full(1, 7.0, np.float32)))
    e4m3 = core.DType.float8_e4m3
    calls = {
        "fp8_dtypes must have one entry": dict(fp8_dtypes=[e4m3, e4m3]),
        "fp8_dtypes[0] must be float8_e4m3 or float8_e5m2, got float32":
            dict(fp8_dtypes=[core.DType.float32]),
    }
    for message, kwargs in calls.items():
        with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[")):
            core.delayed_scaling_update_with_amaxes([h], [a], [s], [si], stream=device.stream,
                                                    **kwargs)
    with pytest.raises(ValueError, match="step_amaxes, scales and scale_invs must have one entry"):
        core.delayed_scaling_update_with_amaxes([h], [], [s], [si], fp8_dtypes=[e4m3])
    with pytest.raises(ValueError, match=r"step_amaxes\[0\]"):
        core.delayed_scaling_update_with_amaxes(
            [h], [device.put(np.ones(2, np.float32))], [s], [si], fp8_dtypes=[e4m3],
            stream=device.stream)
    np.testing.assert_array_equal(device.get(h), [1.0, 2.0])
    np.testing.assert_array_equal(device.get(si), [7.0])
