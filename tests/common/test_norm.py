"""LayerNorm / RMSNorm forward and backward (norm.h) against float64 numpy formulas.

Values are compared within bounds derived below; every quantized output is compared bit for bit
with the reference cast of the core's own fp32 result, and on CUDA every output (statistics,
values, FP8 bytes, gradients) must equal the CPU's bit for bit: both take each sum in norm.h's
fixed order.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref
from te_common_tests._reference import stable_seed

from transformer_engine.common import _core as core

HP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
NORMS = {"layernorm": core.Norm.layernorm, "rmsnorm": core.Norm.rmsnorm}
SHAPES = [(1, 1), (3, 5), (17, 33), (2, 3, 40), (64, 1024), (129, 256), (5, 4096), (0, 16)]
SLOW_SHAPES = [(4, 16384), (3, 20000)]  # rows held in 16 vectors; rows too long for registers
# fp32 sums of N terms err by at most ~N * 2^-24 of the sum of magnitudes; the statistics pass
# that on to y relative to (1 + |xhat|) |g|. 4x room; plus half an ulp of the output dtype.
SUM_SLACK = 4 * 2.0**-24
HALF_ULP = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# Below the smallest normal the output grid is uniform: half its smallest subnormal, absolute.
HALF_SUBNORMAL = {"float32": 2.0**-150, "float16": 2.0**-25, "bfloat16": 2.0**-134}


def make_inputs(rng, shape, dtype, weight_dtype):
    x = (rng.standard_normal(shape) * 3 + rng.uniform(-2, 2)).astype(np.float32).astype(HP[dtype])
    n = shape[-1]
    gamma = rng.uniform(-1.5, 1.5, n).astype(np.float32).astype(HP[weight_dtype])
    beta = rng.uniform(-1, 1, n).astype(np.float32).astype(HP[weight_dtype])
    return x, gamma, beta


def forward_reference(x, gamma, beta, norm, eps, zero_centered):
    x64 = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    g = np.asarray(gamma, np.float64) + (1.0 if zero_centered else 0.0)
    if norm == "layernorm":
        mu = x64.mean(axis=1, keepdims=True)
        xhat = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=1, keepdims=True) + eps)
        y = xhat * g + np.asarray(beta, np.float64)
    else:
        mu = np.zeros((x64.shape[0], 1))
        xhat = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + eps)
        y = xhat * g
    return y, xhat, mu[:, 0], g


def run_forward(
    device,
    x,
    gamma,
    beta,
    norm,
    *,
    out_dtype="float32",
    fp8=None,
    transpose=False,
    eps=1e-5,
    zero_centered=False,
    scale=2.0,
    weights_at_offset=False,
):
    """out_dtype None: no high-precision output (FP8 only). weights_at_offset: gamma and beta
    start one element past an allocation's start (not 16-byte aligned)."""
    m, n = ref.matrix(x).shape
    arrays = {"rsigma": np.full(m, np.nan, np.float32)}
    if out_dtype is not None:
        arrays["y"] = np.full(x.shape, np.nan, HP[out_dtype])
    if norm == "layernorm":
        arrays["mu"] = np.full(m, np.nan, np.float32)
    if fp8 is not None:
        arrays.update(
            q=np.full(x.shape, 0xA5, np.uint8),
            scale=np.array([scale], np.float32),
            scale_inv=np.zeros(1, np.float32),
            amax=np.full(1, -1, np.float32),
        )
        if transpose:
            arrays["qt"] = np.full((n, m), 0xA5, np.uint8)
    on = {k: device.put(v) for k, v in arrays.items()}
    out_fp8 = None
    if fp8 is not None:
        out_fp8 = core.Tensor(
            on["q"],
            dtype=getattr(core.DType, "float8_" + fp8),
            scale=on["scale"],
            scale_inv=on["scale_inv"],
            amax=on["amax"],
            columnwise_data=on.get("qt"),
        )

    def put_weight(w):
        if not weights_at_offset:
            return device.put(w)
        return device.put(np.concatenate([w[:1], w]))[1:]

    core.norm_forward(
        NORMS[norm],
        device.put(x),
        put_weight(gamma),
        put_weight(beta) if norm == "layernorm" else None,
        output=on.get("y"),
        output_fp8=out_fp8,
        mu=on.get("mu"),
        rsigma=on["rsigma"],
        eps=eps,
        zero_centered_gamma=zero_centered,
        stream=device.stream,
    )
    return {k: device.get(v) for k, v in on.items()}


def check_forward_values(got, x, gamma, beta, norm, out_dtype, eps=1e-5, zero_centered=False):
    y, xhat, mu, g = forward_reference(x, gamma, beta, norm, eps, zero_centered)
    n = x.shape[-1]
    bound = (
        SUM_SLACK * max(n, 1) * 8 * (1 + np.abs(xhat)) * np.abs(g)
        + HALF_ULP[out_dtype] * np.abs(y)
        + HALF_SUBNORMAL[out_dtype]
    )
    err = np.abs(got["y"].astype(np.float64).reshape(y.shape) - y)
    assert (err <= bound + 1e-30).all(), (
        f"y: max err {err.max()} (bound there {bound.flat[err.argmax()]})"
    )
    if norm == "layernorm" and mu.size:
        assert np.allclose(got["mu"], mu, rtol=1e-5, atol=1e-5)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(
        np.uint8 if a.dtype.itemsize == 1 else {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    )


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("shape", SHAPES)
def test_forward(device, norm, dtype, shape):
    rng = np.random.default_rng(stable_seed(norm, dtype, shape))
    x, gamma, beta = make_inputs(rng, shape, dtype, dtype)
    got = run_forward(device, x, gamma, beta, norm, out_dtype=dtype)
    check_forward_values(got, x, gamma, beta, norm, dtype)
    if device.is_cuda:
        want = run_forward(device.cpu, x, gamma, beta, norm, out_dtype=dtype)
        for k in want:
            np.testing.assert_array_equal(bits(got[k]), bits(want[k]), err_msg=f"cuda != cpu: {k}")


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(3, 5), (17, 33), (64, 1024), (32, 48), (0, 16)])
@pytest.mark.parametrize("transpose", [False, True])
def test_forward_fp8(device, norm, fp8, shape, transpose):
    """The FP8 output is the fp32 y (the float32 output of the same call) times scale, cast."""
    rng = np.random.default_rng(stable_seed(norm, fp8, shape))
    x, gamma, beta = make_inputs(rng, shape, "bfloat16", "float32")
    got = run_forward(device, x, gamma, beta, norm, fp8=fp8, transpose=transpose, scale=8.0)
    fmt = ref.FORMATS[fp8]
    want = ref.quantize_tensor(got["y"], np.float32(8.0), fmt)
    ref.assert_fp8_equal(got["q"], want["data"].reshape(got["q"].shape), fmt, "fp8")
    if transpose:
        m, n = ref.matrix(x).shape
        ref.assert_fp8_equal(got["qt"], want["data"].reshape(m, n).T, fmt, "fp8 transpose")
    ref.assert_float_equal(got["amax"], np.array([ref.amax(got["y"])]), "amax")
    ref.assert_float_equal(got["scale_inv"], np.array([want["scale_inv"]]), "scale_inv")
    if device.is_cuda:
        cpu = run_forward(device.cpu, x, gamma, beta, norm, fp8=fp8, transpose=transpose, scale=8.0)
        for k in cpu:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


# Shapes that reach each CUDA forward path (norm_forward.cuh): rows held in registers at the
# widest (8192: 8 vectors per thread for 16-bit inputs; fp32 takes the general kernel there) and
# two rows per step (4096, 1024), vectors past the row end for some threads (2560) or for all
# (5120), bands of 16 rows, several bands per block (2304 rows), and row counts that are not a
# multiple of 16; the FP8 transpose is the transpose kernel's, after the norm.
FP8_ONLY_SHAPES = [(48, 8192), (40, 4096), (32, 2560), (16, 5120), (2304, 256), (37, 1024)]


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize("shape", FP8_ONLY_SHAPES)
@pytest.mark.parametrize("transpose", [False, True])
def test_forward_fp8_only(device, norm, dtype, shape, transpose):
    """The FP8 output alone, as FP8 layers ask for it: its bytes are the cast of the float32 y
    that a call with a float32 output writes, and on CUDA every output equals the CPU's."""
    rng = np.random.default_rng(stable_seed(norm, dtype, shape, "fp8 only"))
    x, gamma, beta = make_inputs(rng, shape, dtype, dtype)
    zc = norm == "rmsnorm"
    kw = dict(out_dtype=None, fp8="e4m3", transpose=transpose, zero_centered=zc, scale=8.0)
    got = run_forward(device, x, gamma, beta, norm, **kw)
    y = run_forward(device.cpu, x, gamma, beta, norm, zero_centered=zc)["y"]
    fmt = ref.FORMATS["e4m3"]
    want = ref.quantize_tensor(y, np.float32(8.0), fmt)
    ref.assert_fp8_equal(got["q"], want["data"], fmt, "fp8")
    if transpose:
        ref.assert_fp8_equal(got["qt"], want["columnwise_data"], fmt, "fp8 transpose")
    ref.assert_float_equal(got["amax"], np.array([want["amax"]]), "amax")
    if device.is_cuda:
        cpu = run_forward(device.cpu, x, gamma, beta, norm, **kw)
        for k in cpu:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fp32_weights", [False, True])
@pytest.mark.parametrize("n", [8192, 4096, 2560, 2048, 1000])
@pytest.mark.parametrize("weights_at_offset", [False, True])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_forward_weights(device, norm, dtype, fp32_weights, n, weights_at_offset, zero_centered):
    """gamma and beta in the input's dtype or fp32, zero-centered or not, at a 16-byte aligned
    address or one element past one, at a width of each variant of the CUDA row kernel for 16-bit
    inputs (8, 4, 2 and 1 vectors per thread, two rows a step from 4096 down; 2560 and 1000 leave
    vectors past the row end), which loads the weights into shared memory as vectors or one by
    one: the float32 and FP8 outputs follow the formulas, and on CUDA every output equals the
    CPU's bit for bit."""
    seed = stable_seed(norm, dtype, fp32_weights, n, weights_at_offset, zero_centered)
    weight_dtype = "float32" if fp32_weights else dtype
    x, gamma, beta = make_inputs(np.random.default_rng(seed), (20, n), dtype, weight_dtype)
    kw = dict(out_dtype="float32", fp8="e4m3", zero_centered=zero_centered)
    kw.update(weights_at_offset=weights_at_offset)
    got = run_forward(device, x, gamma, beta, norm, **kw)
    check_forward_values(got, x, gamma, beta, norm, "float32", zero_centered=zero_centered)
    fmt = ref.FORMATS["e4m3"]
    want = ref.quantize_tensor(got["y"], np.float32(2.0), fmt)
    ref.assert_fp8_equal(got["q"], want["data"].reshape(got["q"].shape), fmt, "fp8")
    ref.assert_float_equal(got["amax"], np.array([ref.amax(got["y"])]), "amax")
    if device.is_cuda:
        cpu = run_forward(device.cpu, x, gamma, beta, norm, **kw)
        for k in cpu:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [2.0, 0.0, np.inf])
@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_forward_fp8_nan_and_scale_edges(device, fp8, scale, out_dtype):
    """A row holding a NaN, and a zero or infinite scale: every NaN of the FP8 output is the
    byte 0x7F and every NaN of a 16-bit output the reference's pattern (the CUDA kernels patch
    the hardware conversions' NaN only where one may be), and on CUDA the FP8 bytes and the
    16-bit output equal the CPU's bit for bit (statistics and amax by NaN-ness: the CPU and GPU
    write different NaN payloads there)."""
    rng = np.random.default_rng(stable_seed(fp8, scale, out_dtype))
    x, gamma, beta = make_inputs(rng, (32, 1024), "bfloat16", "float32")
    x[5, 100] = np.nan
    kw = dict(out_dtype=out_dtype, fp8=fp8, transpose=True, scale=scale)
    got = run_forward(device, x, gamma, beta, "layernorm", **kw)
    y = run_forward(device.cpu, x, gamma, beta, "layernorm")["y"]
    fmt = ref.FORMATS[fp8]
    with np.errstate(divide="ignore"):  # scale_inv of a zero scale: Inf, as the core writes
        want = ref.quantize_tensor(y, np.float32(scale), fmt)
    ref.assert_fp8_equal(got["q"], want["data"], fmt, "fp8")
    ref.assert_fp8_equal(got["qt"], want["columnwise_data"], fmt, "fp8 transpose")
    nan_rows = np.isnan(got["y"].astype(np.float32)).any(axis=1)
    assert nan_rows[5] and np.isnan(got["y"][5].astype(np.float32)).all() and nan_rows.sum() == 1
    if device.is_cuda:
        cpu = run_forward(device.cpu, x, gamma, beta, "layernorm", **kw)
        for k in ("q", "qt", "y", "scale_inv", "mu", "rsigma", "amax"):
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


# NaNs of other payloads and signs than the one the norm writes (0x7FC00000).
FOREIGN_NANS = np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF],
                        np.uint32).view(np.float32)


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("n", [1024, 1000], ids=["rows_kernel", "general_kernel"])
def test_fp32_nan_is_one_pattern(device, norm, n):
    """fp32 inputs holding NaNs of any payload and sign, and an infinity (whose row's statistics
    turn NaN by arithmetic, inf - inf or inf * 0): every NaN the norm writes, in y, mu, rsigma,
    amax, dx, dgamma and dbeta, is 0x7FC00000, and on CUDA each output equals the CPU's bit for
    bit (the x86 CPU makes negative NaNs, the GPU 0x7FFFFFFF: both are rewritten)."""
    rng = np.random.default_rng(stable_seed(norm, n))
    x, gamma, beta = make_inputs(rng, (32, n), "float32", "float32")
    x[3, 7], x[9, 0], x[12, n - 1] = FOREIGN_NANS[:3]
    x[20, 5] = np.inf
    kw = dict(out_dtype="float32", fp8="e4m3", scale=2.0)
    fwd = run_forward(device, x, gamma, beta, norm, **kw)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dy[25, 3] = FOREIGN_NANS[3]
    back = run_backward(device, dy, x, gamma, norm, fwd.get("mu"), fwd["rsigma"])
    got = {**fwd, **back}
    nan_rows = np.isnan(got["y"]).any(axis=1)
    np.testing.assert_array_equal(np.flatnonzero(nan_rows), [3, 9, 12, 20])
    assert np.isnan(got["amax"]).all() and np.isnan(got["dgamma"]).all()
    for k in ("y", "mu", "rsigma", "amax", "dx", "dgamma", "dbeta"):
        if k in got:
            nan = np.isnan(got[k])
            assert np.all(bits(got[k])[nan] == 0x7FC00000), f"{k}: NaN pattern"
    if device.is_cuda:
        cpu_fwd = run_forward(device.cpu, x, gamma, beta, norm, **kw)
        cpu = {**cpu_fwd, **run_backward(device.cpu, dy, x, gamma, norm, cpu_fwd.get("mu"),
                                         cpu_fwd["rsigma"])}
        for k in got:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


@pytest.mark.parametrize("norm", list(NORMS))
def test_row_lengths_in_any_order(device, norm):
    """Long, short, then long rows again through one process: the CUDA kernels size their
    shared memory per call, and a short row must not leave a limit the next long one trips on."""
    for n in (1024, 256, 1024, 4096, 8):
        rng = np.random.default_rng(stable_seed(norm, n))
        x, gamma, beta = make_inputs(rng, (16, n), "float32", "float32")
        got = run_forward(device, x, gamma, beta, norm, out_dtype="float32")
        check_forward_values(got, x, gamma, beta, norm, "float32")


@pytest.mark.parametrize("norm", list(NORMS))
def test_zero_centered_gamma_and_fp32_weights(device, norm):
    rng = np.random.default_rng(1)
    x, gamma, beta = make_inputs(rng, (8, 96), "bfloat16", "float32")
    got = run_forward(
        device, x, gamma, beta, norm, out_dtype="bfloat16", zero_centered=True, eps=1e-3
    )
    check_forward_values(got, x, gamma, beta, norm, "bfloat16", eps=1e-3, zero_centered=True)


@pytest.mark.slow
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("shape", SLOW_SHAPES)
def test_forward_long_rows(device, norm, shape):
    rng = np.random.default_rng(2)
    x, gamma, beta = make_inputs(rng, shape, "bfloat16", "bfloat16")
    got = run_forward(device, x, gamma, beta, norm, out_dtype="float32", fp8="e4m3")
    check_forward_values(got, x, gamma, beta, norm, "float32")
    if device.is_cuda:
        cpu = run_forward(device.cpu, x, gamma, beta, norm, out_dtype="float32", fp8="e4m3")
        for k in cpu:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


# ---------------------------------------------------------------- backward


def backward_reference(dy, x, gamma, norm, eps, zero_centered):
    _, xhat, _, g = forward_reference(x, gamma, gamma, norm, eps, zero_centered)
    x64 = np.asarray(x, np.float64).reshape(xhat.shape)
    dy64 = np.asarray(dy, np.float64).reshape(xhat.shape)
    if norm == "layernorm":
        var = ((x64 - x64.mean(1, keepdims=True)) ** 2).mean(1, keepdims=True)
    else:
        var = (x64**2).mean(1, keepdims=True)
    rsigma = 1 / np.sqrt(var + eps)
    dyg = dy64 * g
    m2 = (dyg * xhat).mean(1, keepdims=True)
    m1 = dyg.mean(1, keepdims=True) if norm == "layernorm" else 0.0
    dx = rsigma * (dyg - m1 - xhat * m2)
    return dx, (dy64 * xhat).sum(0), dy64.sum(0), rsigma, np.abs(dyg), np.abs(dy64)


def run_backward(device, dy, x, gamma, norm, mu, rsigma, zero_centered=False, add=None):
    """add: grad_input_add (x's shape; grad_input takes its dtype)."""
    m, n = ref.matrix(x).shape
    arrays = {"dx": np.full(x.shape, np.nan, x.dtype), "dgamma": np.full(n, np.nan, gamma.dtype)}
    if norm == "layernorm":
        arrays["dbeta"] = np.full(n, np.nan, gamma.dtype)
    on = {k: device.put(v) for k, v in arrays.items()}
    ws = None
    if device.is_cuda:
        ws = device.put(np.zeros(max(core.norm_backward_workspace_size(m, n), 1), np.uint8))
    core.norm_backward(
        NORMS[norm],
        device.put(dy),
        device.put(x),
        device.put(mu) if norm == "layernorm" else None,
        device.put(rsigma),
        device.put(gamma),
        grad_input=on["dx"],
        grad_gamma=on["dgamma"],
        grad_beta=on.get("dbeta"),
        grad_input_add=None if add is None else device.put(add),
        zero_centered_gamma=zero_centered,
        workspace=ws,
        stream=device.stream,
    )
    return {k: device.get(v) for k, v in on.items()}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", list(HP))
@pytest.mark.parametrize(
    # (40, 8192): rows held in registers at the widest (fp32: the general kernel); (33, 2560):
    # vectors past the row end for some threads, and a last group of one row.
    "shape",
    [(1, 1), (3, 5), (17, 33), (2, 3, 40), (70, 256), (5, 4096), (40, 8192), (33, 2560), (0, 8)],
)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_backward(device, norm, dtype, shape, zero_centered):
    rng = np.random.default_rng(stable_seed(norm, dtype, shape, zero_centered))
    x, gamma, _ = make_inputs(rng, shape, dtype, dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(HP[dtype])
    eps = 1e-5
    fwd = run_forward(device.cpu, x, gamma, gamma, norm, eps=eps, zero_centered=zero_centered)
    mu = fwd.get("mu", np.zeros(fwd["rsigma"].shape, np.float32))
    got = run_backward(device, dy, x, gamma, norm, mu, fwd["rsigma"], zero_centered)
    dx, dgamma, dbeta, rsigma, abs_dyg, abs_dy = backward_reference(
        dy, x, gamma, norm, eps, zero_centered
    )
    n = x.shape[-1]
    rows = dx.shape[0]
    # dx: sums of N terms of |dyg| (1 + |xhat|) scaled by rsigma; the column sums of M terms.
    scale_dx = rsigma * (abs_dyg + abs_dyg.mean(1, keepdims=True) * 4) * 4
    bound_dx = (
        SUM_SLACK * max(n, 1) * 8 * scale_dx + HALF_ULP[dtype] * np.abs(dx) + HALF_SUBNORMAL[dtype]
    )
    err = np.abs(got["dx"].astype(np.float64).reshape(dx.shape) - dx)
    assert (err <= bound_dx + 1e-30).all(), f"dx: max err {err.max()}"
    col_bound = SUM_SLACK * max(rows, 1) * 8 * (abs_dy * 6).sum(0) + HALF_ULP[dtype] * np.abs(
        dgamma
    )
    assert (np.abs(got["dgamma"].astype(np.float64) - dgamma) <= col_bound + 1e-30).all(), "dgamma"
    if norm == "layernorm":
        b_bound = SUM_SLACK * max(rows, 1) * abs_dy.sum(0) + HALF_ULP[dtype] * np.abs(dbeta)
        assert (np.abs(got["dbeta"].astype(np.float64) - dbeta) <= b_bound + 1e-30).all(), "dbeta"
    if device.is_cuda:
        cpu = run_backward(device.cpu, dy, x, gamma, norm, mu, fwd["rsigma"], zero_centered)
        for k in cpu:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", list(HP))
# (3, 5), (17, 33): the general kernel; the others rows in registers, 1, 2, 4 and 8 vectors per
# thread for 16-bit inputs (fp32 at 8192: the general kernel)
@pytest.mark.parametrize("shape", [(3, 5), (17, 33), (70, 256), (16, 2048), (64, 4096), (40, 8192)])
def test_backward_adds_the_residual_gradient(device, norm, dtype, shape):
    """grad_input_add gives the bits of dx written in the dtype, then added in a separate step
    (fp32 sum, rounded to the dtype: what torch's add of the two does); the column sums are
    unchanged. A NaN in the added gradient comes out as the reference's NaN."""
    rng = np.random.default_rng(stable_seed("add", norm, dtype, shape))
    x, gamma, _ = make_inputs(rng, shape, dtype, dtype)
    dy = rng.standard_normal(shape).astype(np.float32).astype(HP[dtype])
    add = (rng.standard_normal(shape) * 4).astype(np.float32).astype(HP[dtype])
    add.reshape(-1)[rng.integers(add.size)] = np.nan
    fwd = run_forward(device.cpu, x, gamma, gamma, norm)
    mu = fwd.get("mu", np.zeros(fwd["rsigma"].shape, np.float32))
    plain = run_backward(device, dy, x, gamma, norm, mu, fwd["rsigma"])
    got = run_backward(device, dy, x, gamma, norm, mu, fwd["rsigma"], add=add)
    want = (plain["dx"].astype(np.float32) + add.astype(np.float32)).astype(HP[dtype])
    np.testing.assert_array_equal(bits(np.where(np.isnan(want), np.nan, want).astype(HP[dtype])),
                                  bits(np.where(np.isnan(got["dx"]), np.nan, got["dx"])
                                       .astype(HP[dtype])), err_msg="dx")
    for k in ("dgamma", "dbeta"):
        if k in plain:
            np.testing.assert_array_equal(bits(got[k]), bits(plain[k]), err_msg=k)
    if device.is_cuda:
        cpu = run_backward(device.cpu, dy, x, gamma, norm, mu, fwd["rsigma"], add=add)
        for k in cpu:
            np.testing.assert_array_equal(bits(got[k]), bits(cpu[k]), err_msg=f"cuda != cpu: {k}")


def test_backward_is_deterministic(device):
    rng = np.random.default_rng(9)
    x, gamma, _ = make_inputs(rng, (200, 384), "bfloat16", "float32")
    dy = rng.standard_normal((200, 384)).astype(ml_dtypes.bfloat16)
    fwd = run_forward(device.cpu, x, gamma, gamma, "layernorm")
    a = run_backward(device, dy, x, gamma, "layernorm", fwd["mu"], fwd["rsigma"])
    b = run_backward(device, dy, x, gamma, "layernorm", fwd["mu"], fwd["rsigma"])
    for k in a:
        np.testing.assert_array_equal(bits(a[k]), bits(b[k]), err_msg=k)


# ---------------------------------------------------------------- errors


def test_errors(cpu):
    f32 = np.float32
    x = np.zeros((4, 8), f32)
    g = np.ones(8, f32)
    rs = np.zeros(4, f32)
    mu = np.zeros(4, f32)
    y = np.zeros((4, 8), f32)
    ln, rms = core.Norm.layernorm, core.Norm.rmsnorm
    with pytest.raises(
        ValueError, match=r"^norm_forward: gamma.data must have shape \[8\], got float32 \[7\]"
    ):
        core.norm_forward(ln, x, np.ones(7, f32), g, output=y, mu=mu, rsigma=rs)
    with pytest.raises(
        TypeError, match=r"^norm_forward: gamma.data must be float32 \(the input's dtype\) or "
    ):
        core.norm_forward(ln, x, np.ones(8, np.float16), g, output=y, mu=mu, rsigma=rs)
    with pytest.raises(ValueError, match=r"^norm_forward: beta must be NULL for RMSNorm"):
        core.norm_forward(rms, x, g, g, output=y, rsigma=rs)
    with pytest.raises(ValueError, match=r"^norm_forward: beta must be a tensor handle"):
        core.norm_forward(ln, x, g, None, output=y, mu=mu, rsigma=rs)
    with pytest.raises(ValueError, match=r"^norm_forward: output or output_fp8 must be given"):
        core.norm_forward(ln, x, g, g, mu=mu, rsigma=rs)
    with pytest.raises(ValueError, match=r"^norm_forward: rsigma.data must have 4 elements"):
        core.norm_forward(ln, x, g, g, output=y, mu=mu, rsigma=np.zeros(3, f32))
    with pytest.raises(ValueError, match=r"^norm_forward: config.eps must be finite and >= 0"):
        core.norm_forward(ln, x, g, g, output=y, mu=mu, rsigma=rs, eps=-1.0)
    with pytest.raises(
        ValueError, match=r"^norm_forward: output_fp8.columnwise_data must have shape \[8, 4\]"
    ):
        q = core.Tensor(
            np.zeros((4, 8), np.uint8),
            dtype=core.DType.float8_e4m3,
            scale=np.ones(1, f32),
            scale_inv=np.ones(1, f32),
            columnwise_data=np.zeros((4, 8), np.uint8),
        )
        core.norm_forward(ln, x, g, g, output_fp8=q, mu=mu, rsigma=rs)
    with pytest.raises(
        ValueError, match=r"^norm_forward: rsigma.data must not overlap the input input.data"
    ):
        core.norm_forward(ln, x, g, g, output=y, mu=mu, rsigma=x.reshape(-1)[:4])
    with pytest.raises(TypeError, match=r"^norm_backward: grad_output.data must be float32"):
        core.norm_backward(
            ln,
            x.astype(np.float16),
            x,
            mu,
            rs,
            g,
            grad_input=y,
            grad_gamma=np.zeros(8, f32),
            grad_beta=np.zeros(8, f32),
        )
    backward = dict(grad_input=y, grad_gamma=np.zeros(8, f32), grad_beta=np.zeros(8, f32))
    with pytest.raises(
        TypeError, match=r"^norm_backward: grad_input_add.data must be float32, got float16"
    ):
        core.norm_backward(ln, x, x, mu, rs, g, grad_input_add=x.astype(np.float16), **backward)
    with pytest.raises(
        ValueError, match=r"^norm_backward: grad_input_add.data must have shape \[4, 8\]"
    ):
        core.norm_backward(ln, x, x, mu, rs, g, grad_input_add=np.zeros((4, 4), f32), **backward)
    with pytest.raises(ValueError, match=r"^norm_backward: grad_input.data must not overlap"):
        core.norm_backward(ln, x, x, mu, rs, g, grad_input_add=y, **backward)
    assert np.all(y == 0) and np.all(rs == 0)  # nothing written by the failed calls


@pytest.mark.cuda
def test_backward_needs_workspace_on_cuda(cuda_device):
    put = cuda_device.put
    x = put(np.zeros((64, 8), np.float32))
    with pytest.raises(ValueError, match=r"^norm_backward: workspace must have at least 128 bytes"):
        core.norm_backward(
            core.Norm.rmsnorm,
            x,
            x,
            None,
            put(np.ones(64, np.float32)),
            put(np.ones(8, np.float32)),
            grad_input=put(np.zeros((64, 8), np.float32)),
            grad_gamma=put(np.zeros(8, np.float32)),
            stream=cuda_device.stream,
        )
