"""The Hopper kernels of hopper_gemm.h (CUTLASS, sm_90a) through the binding: hopper_gemm (the
block-scaled FP8 GEMM) and hopper_grouped_gemm (every group in one launch).

Every build has the entry points. One without the kernels (CPU-only, or CUDA without CUTLASS or
sm_90a) refuses every call with the reason and writes nothing; that is checked on the CPU, in
every build. On an sm_90 GPU with a build that has the kernels, their results are compared with
te_gemm / te_grouped_gemm, the CPU path and a float64 product. te_gemm itself runs the
block-scaled kernel for problems below M * N * K = 2^34 (the dispatch rule, gemm_cuda.cu) and
cuBLASLt from there on: the small cases below compare the kernel with itself through te_gemm (the
dispatch), the large one with cuBLASLt.
"""

from __future__ import annotations

import numpy as np
import pytest
from te_common_tests import _reference as ref
from te_common_tests import _tolerances as tol
from te_common_tests._reference import stable_seed
from te_common_tests.test_gemm import (
    HP,
    Operand,
    fp8_block_operand,
    fp8_dtype,
    fp8_tensor_operand,
    hp_operand,
    random_matrix,
    reference,
)

from transformer_engine.common import _core as core

NO_KERNELS = (
    "this build of the core has no Hopper kernels: built without CUTLASS or not for sm_90a"
)


# ---------------------------------------------------------------- every build, on the CPU


def test_a_cpu_build_has_no_hopper_kernels():
    if core.built_with_cuda():
        pytest.skip("a CUDA build: whether it has the kernels depends on CUTLASS and sm_90a")
    assert core.hopper_gemm_available() is False
    assert core.hopper_grouped_gemm_workspace_size(8) == 0  # hopper_gemm.h: no kernel to size


def _calls(cpu):
    """Both entry points with operands they would take on a GPU, on the CPU; d filled with 7."""
    rng = np.random.default_rng(1)
    a = fp8_block_operand(random_matrix(rng, (16, 128)), "e4m3", "block_1x128")
    b = fp8_block_operand(random_matrix(rng, (128, 128)), "e4m3", "block_128x128")
    d = np.full((16, 128), 7.0, np.float32)
    ga = [fp8_tensor_operand(random_matrix(rng, (16, 64)), "e4m3", rng) for _ in range(2)]
    gb = [fp8_tensor_operand(random_matrix(rng, (32, 64)), "e4m3", rng) for _ in range(2)]
    gd = [np.full((16, 32), 7.0, np.float32) for _ in range(2)]
    return {
        "hopper_block_scaled_gemm": (
            lambda: core.hopper_gemm(a.on(cpu), b.on(cpu), d, use_split_accumulator=True),
            [d],
        ),
        "hopper_grouped_gemm": (
            lambda: core.hopper_grouped_gemm([x.on(cpu) for x in ga], [x.on(cpu) for x in gb], gd),
            gd,
        ),
    }


@pytest.mark.parametrize("op", ["hopper_block_scaled_gemm", "hopper_grouped_gemm"])
def test_calls_are_refused_with_the_reason_and_write_nothing(cpu, op):
    call, outputs = _calls(cpu)[op]
    if core.hopper_gemm_available():
        # The kernels have no CPU path: refused by their argument checks.
        with pytest.raises(ValueError, match=rf"^{op}: .*on a CUDA device"):
            call()
    else:
        with pytest.raises(RuntimeError, match=rf"^{op}: {NO_KERNELS}$"):
            call()
    for d in outputs:
        np.testing.assert_array_equal(d, np.full(d.shape, 7.0, np.float32))


def test_grouped_argument_lists_must_match():
    a = np.ones((16, 16), np.float32)
    with pytest.raises(ValueError, match=r"^hopper_grouped_gemm: a, b, d .* one entry per group, "
                                         r"got 2, 1, 2"):
        core.hopper_grouped_gemm([a, a], [a], [a.copy(), a.copy()])


# ---------------------------------------------------------------- sm_90 GPU, with the kernels


@pytest.fixture
def hopper(cuda_device):
    """The CUDA device, when the kernels can run on it."""
    if not core.hopper_gemm_available():
        pytest.skip(f"{NO_KERNELS} (hopper_gemm_available() is False)")
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the kernels need an sm_90 GPU, got {torch.cuda.get_device_name()}")
    return cuda_device


def _d(device, m, n, out, d0=None):
    return device.put((np.full((m, n), np.nan, np.float32) if d0 is None else d0).astype(HP[out]))


def _gemm(device, workspaces, a, b, out, *, bias=None, d0=None, hopper=False):
    """hopper_gemm, or te_gemm (on CUDA: our kernel or cuBLASLt by the dispatch rule; the CPU
    path on the CPU), as float64."""
    d = _d(device, a.value.shape[0], b.value.shape[0], out, d0)
    fn = core.hopper_gemm if hopper else core.gemm
    fn(a.on(device), b.on(device), d, bias=None if bias is None else device.put(bias),
       accumulate=d0 is not None, use_split_accumulator=True, workspace=workspaces(device),
       stream=device.stream)
    return device.get(d).astype(np.float64)


def _assert_close(got, want, cublaslt, on_cpu, bound, where):
    """got (the Hopper kernel) within bound of the float64 product want, and within twice it
    of cuBLASLt's and the CPU path's results (each of which is within bound of want)."""
    for what, other, limit in (("float64", want, bound), ("cuBLASLt", cublaslt, 2 * bound),
                               ("the CPU path", on_cpu, 2 * bound)):
        err = np.abs(got - other)
        assert np.all(err <= limit), (
            f"{where}hopper vs {what}: worst {np.max(err / limit):.3g} x the bound")


def _exact_block_operand(rng, shape, mode):
    """Small integers with power-of-two block scales: every product and partial sum of the GEMM
    is exact in float32, so any order of summation gives the same bits."""
    x = rng.integers(-4, 5, size=shape).astype(np.float32)
    q = ref.quantize_blocks(x, mode, ref.FORMATS["e4m3"], pow2=True)
    per_element = ref.block_scale_inv_per_element(mode, q["scale_inv"], *shape)
    value = ref.fp8_to_float32(q["data"], ref.FORMATS["e4m3"]).astype(np.float64) * per_element
    np.testing.assert_array_equal(value, x)  # the quantization itself is exact
    return Operand(value, {"data": q["data"], "scale_inv": q["scale_inv"]}, fp8_dtype("e4m3"),
                   mode)


@pytest.mark.cuda
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_block_scaled_exact_data_matches_cublaslt_and_the_cpu_bit_for_bit(hopper, cpu,
                                                                          workspaces, out):
    rng = np.random.default_rng(stable_seed("hopper-exact", out))
    m, n, k = 256, 384, 512  # |sums| <= 16 * 512: integers exact in float32; bf16 rounds alike
    a = _exact_block_operand(rng, (m, k), "block_1x128")
    b = _exact_block_operand(rng, (n, k), "block_128x128")
    bias = rng.integers(-8, 9, size=n).astype(np.float32).astype(HP["bfloat16"])
    got = _gemm(hopper, workspaces, a, b, out, bias=bias, hopper=True)
    np.testing.assert_array_equal(got, _gemm(hopper, workspaces, a, b, out, bias=bias))
    np.testing.assert_array_equal(got, _gemm(cpu, workspaces, a, b, out, bias=bias))


@pytest.mark.cuda
@pytest.mark.parametrize("mnk", [(128, 128, 128), (256, 384, 512), (144, 272, 1024)])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("epilogue", ["plain", "bias", "accumulate"])
def test_block_scaled_matches_cublaslt_and_the_cpu(hopper, cpu, workspaces, mnk, out, epilogue):
    """Random data, blocks of very different magnitudes. The tolerance: each of the three
    (Hopper kernel, cuBLASLt, CPU path) is within te_gemm's bound of the float64 product
    (_tolerances.gemm_bound: fp32 summation plus the FP8 tensor cores' accumulation between
    promotions, which the Hopper kernel does every 128 of K, plus the output's rounding), so
    two of them differ by at most twice that bound."""
    rng = np.random.default_rng(stable_seed("hopper-block", mnk, out, epilogue))
    m, n, k = mnk
    a = fp8_block_operand(random_matrix(rng, (m, k), 2.0), "e4m3", "block_1x128")
    b = fp8_block_operand(random_matrix(rng, (n, k), 2.0), "e4m3", "block_128x128")
    bias = random_matrix(rng, (n,)).astype(HP["bfloat16"]) if epilogue == "bias" else None
    d0 = random_matrix(rng, (m, n)).astype(HP[out]) if epilogue == "accumulate" else None
    want, absp, kk = reference(a, b, bias=bias, accumulate_into=d0)
    bound = tol.gemm_bound(absp, want, kk, out, fp8=True)
    got = _gemm(hopper, workspaces, a, b, out, bias=bias, d0=d0, hopper=True)
    cublaslt = _gemm(hopper, workspaces, a, b, out, bias=bias, d0=d0)
    on_cpu = _gemm(cpu, workspaces, a, b, out, bias=bias, d0=d0)
    _assert_close(got, want, cublaslt, on_cpu, bound, "")


@pytest.mark.cuda
def test_block_scaled_above_the_dispatch_rule_runs_cublaslt_within_the_bound(hopper,
                                                                            workspaces):
    """M * N * K above 2^34: te_gemm takes cuBLASLt there, and both it and the kernel stay
    within te_gemm's bound of the float64 product (and so within twice it of each other)."""
    rng = np.random.default_rng(stable_seed("hopper-rule"))
    m, n, k = 2048, 2048, 4224  # 1.77e10 > 2^34 = 1.72e10
    assert m * n * k > 2**34
    a = fp8_block_operand(random_matrix(rng, (m, k)), "e4m3", "block_1x128")
    b = fp8_block_operand(random_matrix(rng, (n, k)), "e4m3", "block_128x128")
    want = a.value @ b.value.T
    absp = np.abs(a.value) @ np.abs(b.value).T
    bound = tol.gemm_bound(absp, want, k, "bfloat16", fp8=True)
    got = _gemm(hopper, workspaces, a, b, "bfloat16", hopper=True)
    cublaslt = _gemm(hopper, workspaces, a, b, "bfloat16")
    for what, x in (("hopper", got), ("te_gemm (cuBLASLt)", cublaslt)):
        err = np.abs(x - want)
        assert np.all(err <= bound), f"{what}: worst {np.max(err / bound):.3g} x the bound"


def _fp8_group(rng, m, k, spread):
    if m == 0:  # an expert without tokens: no amax to scale by
        return Operand(np.zeros((0, k)), {"data": np.zeros((0, k), np.uint8),
                                          "scale_inv": np.ones(1, np.float32)},
                       fp8_dtype("e4m3"))
    return fp8_tensor_operand(random_matrix(rng, (m, k)) * spread, "e4m3", rng)


@pytest.mark.cuda
@pytest.mark.parametrize("kind,out", [("fp8", "bfloat16"), ("fp8", "float32"),
                                      ("bf16", "bfloat16")])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_matches_cublaslt_grouped_gemm_and_the_cpu(hopper, cpu, workspaces, kind, out,
                                                           with_bias):
    """8 experts, three without tokens, each with its own scales (FP8 per tensor: magnitudes
    apart by orders) or bf16. Tolerance as for the block-scaled GEMM: each result within
    te_gemm's bound of the float64 product, so two results within twice it."""
    rng = np.random.default_rng(stable_seed("hopper-grouped", kind, out, with_bias))
    k, n = 512, 256
    # FP8 groups need M in multiples of 16 (te_gemm's rule); bf16 groups take any M.
    rows = ([0, 16, 48, 0, 112, 32, 0, 64] if kind == "fp8" else [0, 5, 48, 0, 113, 33, 0, 64])
    if kind == "fp8":
        a_ops = [_fp8_group(rng, m, k, 10.0 ** (g % 3)) for g, m in enumerate(rows)]
        b_ops = [_fp8_group(rng, n, k, 10.0 ** -(g % 3)) for g in range(len(rows))]
    else:
        a_ops = [hp_operand(random_matrix(rng, (m, k)), "bfloat16") for m in rows]
        b_ops = [hp_operand(random_matrix(rng, (n, k)), "bfloat16") for _ in rows]
    # A bias in every group with rows (the kernel's rule), none in the empty ones.
    biases = ([random_matrix(rng, (n,)).astype(HP["bfloat16"]) if m else None for m in rows]
              if with_bias else None)
    assert core.hopper_grouped_gemm_workspace_size(len(rows)) <= core.gemm_workspace_size()

    def run(device, fn, **kw):
        ds = [_d(device, m, n, out) for m in rows]
        fn([x.on(device) for x in a_ops], [x.on(device) for x in b_ops], ds,
           bias=None if biases is None else [None if x is None else device.put(x) for x in biases],
           use_split_accumulator=True, workspace=workspaces(device), stream=device.stream, **kw)
        return [device.get(d).astype(np.float64) for d in ds]

    got = run(hopper, core.hopper_grouped_gemm)
    cublaslt = run(hopper, core.grouped_gemm)
    on_cpu = run(cpu, core.grouped_gemm)
    for g, (a, b) in enumerate(zip(a_ops, b_ops, strict=True)):
        assert got[g].shape == (rows[g], n)
        if not rows[g]:
            continue
        want, absp, kk = reference(a, b, bias=None if biases is None else biases[g])
        bound = tol.gemm_bound(absp, want, kk, out, fp8=kind == "fp8")
        _assert_close(got[g], want, cublaslt[g], on_cpu[g], bound, f"group {g}: ")
