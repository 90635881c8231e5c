"""The binding takes arrays of any DLPack source: numpy, torch and jax give identical results,
and FP8 / E8M0 arrays of torch and jax are taken natively, without a uint8 view."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

IN_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def from_numpy(source: str, a: np.ndarray):
    """The same values as an array of `source` (on the CPU)."""
    if source == "numpy":
        return a.copy()
    if source == "torch":
        torch = pytest.importorskip("torch")
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(a.copy())
    jnp = pytest.importorskip("jax.numpy")
    return jnp.asarray(a)


def values(shape=(33, 70), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)
    x.ravel()[:3] = [np.nan, np.inf, -0.0]
    return x.astype(np.float32).astype(dtype)


def quantize_numpy_outputs(x_source, shape, fmt=ref.E4M3, scale=2.0):
    m, k = shape
    data, col = np.zeros(shape, np.uint8), np.zeros((k, m), np.uint8)
    sinv, amax = np.zeros(1, np.float32), np.zeros(1, np.float32)
    out = core.Tensor(
        data,
        dtype=core.DType.float8_e4m3 if fmt is ref.E4M3 else core.DType.float8_e5m2,
        scale=np.array([scale], np.float32),
        scale_inv=sinv,
        amax=amax,
        columnwise_data=col,
    )
    core.quantize(x_source, out)
    return data, col, sinv, amax


@pytest.mark.parametrize("source", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_quantize_input_from_every_source(in_dtype, source):
    if source == "numpy" and in_dtype == "bfloat16":
        pytest.skip("numpy arrays cannot carry bfloat16 through DLPack")
    x = values(dtype=IN_DTYPES[in_dtype])
    data, col, sinv, amax = quantize_numpy_outputs(from_numpy(source, x), x.shape)
    want = ref.quantize_tensor(x, 2.0, ref.E4M3)
    ref.assert_fp8_equal(data, want["data"], ref.E4M3)
    ref.assert_fp8_equal(col, want["columnwise_data"], ref.E4M3)
    ref.assert_float_equal(amax, np.array([want["amax"]]))


def test_sources_give_identical_bytes():
    """The same fp32 values from numpy, torch and jax: the same bytes out, to the bit."""
    x = values(seed=1)
    results = {}
    for source in ("numpy", "torch", "jax"):
        try:
            results[source] = quantize_numpy_outputs(from_numpy(source, x), x.shape)
        except pytest.skip.Exception:
            continue
    assert "numpy" in results and len(results) >= 2, "needs torch or jax besides numpy"
    for source, arrays in results.items():
        for got, want in zip(arrays, results["numpy"], strict=True):
            ref.assert_same_bits(got, want, f"{source} against numpy")


def test_torch_outputs_match_numpy_outputs():
    torch = pytest.importorskip("torch")
    x = values(seed=2)
    want = quantize_numpy_outputs(x, x.shape)
    data, col = (
        torch.zeros(x.shape, dtype=torch.uint8),
        torch.zeros(x.shape[::-1], dtype=torch.uint8),
    )
    sinv, amax = torch.zeros(1), torch.zeros(1)
    core.quantize(
        from_numpy("torch", x),
        core.Tensor(
            data,
            dtype=core.DType.float8_e4m3,
            scale=torch.tensor([2.0]),
            scale_inv=sinv,
            amax=amax,
            columnwise_data=col,
        ),
    )
    for got, expected in zip((data, col, sinv, amax), want, strict=True):
        ref.assert_same_bits(got.numpy(), expected)


@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_torch_float8_natively(fmt):
    """torch.float8_e4m3fn / float8_e5m2 tensors name their format: no `dtype=` needed."""
    torch = pytest.importorskip("torch")
    torch_fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt.name]
    x = values(seed=3)
    data = torch.zeros(x.shape, dtype=torch_fp8)
    col = torch.zeros(x.shape[::-1], dtype=torch_fp8)
    out = core.Tensor(
        data, scale=torch.tensor([0.5]), scale_inv=torch.zeros(1), columnwise_data=col
    )
    core.quantize(torch.from_numpy(x), out)
    want = ref.quantize_tensor(x, 0.5, fmt)
    ref.assert_fp8_equal(data.view(torch.uint8).numpy(), want["data"], fmt)
    ref.assert_fp8_equal(col.view(torch.uint8).numpy(), want["columnwise_data"], fmt)
    # ... and back: dequantize reads the native FP8 tensor.
    back = torch.zeros(x.shape)
    core.dequantize(core.Tensor(data, scale_inv=torch.tensor([2.0])), back)
    ref.assert_float_equal(
        back.numpy(), ref.dequantize(want["data"], fmt, np.float32(2.0), np.float32)
    )


def test_torch_e8m0_scales_natively():
    torch = pytest.importorskip("torch")
    x = values((40, 96), seed=4)
    data = torch.zeros(x.shape, dtype=torch.float8_e4m3fn)
    sinv = torch.zeros((40, 3), dtype=torch.float8_e8m0fnu)
    core.quantize(
        torch.from_numpy(x), core.Tensor(data, scaling_mode=core.ScalingMode.mxfp8, scale_inv=sinv)
    )
    want = ref.quantize_blocks(x, "mxfp8", ref.E4M3)
    np.testing.assert_array_equal(sinv.view(torch.uint8).numpy(), want["scale_inv"])
    ref.assert_fp8_equal(data.view(torch.uint8).numpy(), want["data"], ref.E4M3)


@pytest.mark.parametrize("fmt", ref.FORMATS.values(), ids=lambda f: f.name)
def test_jax_float8_inputs(fmt):
    """jax FP8 and E8M0 arrays as the input of dequantize, per tensor and MXFP8."""
    jnp = pytest.importorskip("jax.numpy")
    codes = np.arange(256, dtype=np.uint8).reshape(4, 64)
    fp8 = jnp.asarray(codes.view(fmt.dtype))
    out = np.zeros(codes.shape, np.float32)
    core.dequantize(core.Tensor(fp8, scale_inv=jnp.asarray([0.25], jnp.float32)), out)
    ref.assert_float_equal(out, ref.dequantize(codes, fmt, np.float32(0.25), np.float32))
    e = np.array([[120, 130], [0, 254], [127, 255], [1, 200]], np.uint8)
    core.dequantize(
        core.Tensor(
            fp8,
            scaling_mode=core.ScalingMode.mxfp8,
            scale_inv=jnp.asarray(e.view(ml_dtypes.float8_e8m0fnu)),
        ),
        out,
    )
    per_element = ref.block_scale_inv_per_element("mxfp8", e, 4, 64)
    ref.assert_float_equal(out, ref.dequantize(codes, fmt, per_element, np.float32))


@pytest.mark.parametrize("source", ["numpy", "torch", "jax"])
def test_amax_and_transpose_from_every_source(source):
    x = values((17, 33), np.float16, seed=5)
    amax = np.zeros(1, np.float32)
    core.compute_amax(from_numpy(source, x), core.Tensor(amax=amax))
    ref.assert_float_equal(amax, np.array([ref.amax(x)]))
    out = np.zeros((33, 17), np.float16)
    core.transpose(from_numpy(source, x), out)
    ref.assert_same_bits(out, ref.transpose(x))


def test_mixed_sources_in_one_call():
    """A jax input, torch data, numpy scales: one call, the reference's bytes."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    x = values((8, 128), ml_dtypes.bfloat16, seed=6)
    data = torch.zeros(x.shape, dtype=torch.uint8)
    sinv = np.zeros((8, 1), np.float32)
    out = core.Tensor(
        data,
        dtype=core.DType.float8_e5m2,
        scaling_mode=core.ScalingMode.block_1x128,
        scale_inv=sinv,
    )
    core.quantize(from_numpy("jax", x), out)
    want = ref.quantize_blocks(x, "block_1x128", ref.E5M2)
    ref.assert_fp8_equal(data.numpy(), want["data"], ref.E5M2)
    ref.assert_float_equal(sinv, want["scale_inv"])


@pytest.mark.cuda
def test_torch_float8_natively_on_cuda(cuda_device):
    import torch

    x = values((64, 256), ml_dtypes.bfloat16, seed=7)
    data = torch.zeros(x.shape, dtype=torch.float8_e4m3fn, device="cuda")
    sinv = torch.zeros((64, 8), dtype=torch.float8_e8m0fnu, device="cuda")
    out = core.Tensor(data, scaling_mode=core.ScalingMode.mxfp8, scale_inv=sinv)
    core.quantize(cuda_device.put(x), out, stream=cuda_device.stream)
    torch.cuda.synchronize()
    want = ref.quantize_blocks(x, "mxfp8", ref.E4M3)
    np.testing.assert_array_equal(sinv.view(torch.uint8).cpu().numpy(), want["scale_inv"])
    ref.assert_fp8_equal(data.view(torch.uint8).cpu().numpy(), want["data"], ref.E4M3)


def test_raw_buffer_tuples_match_arrays():
    """The fast (data_ptr, DType, shape, device) form reads and writes the same memory."""
    x = np.arange(-6, 6, dtype=np.float32).reshape(3, 4)
    amax = np.zeros(1, np.float32)
    raw_x = (x.ctypes.data, core.DType.float32, (3, 4), -1)
    core.compute_amax(raw_x, core.Tensor(amax=(amax.ctypes.data, core.DType.float32, (1,), -1)))
    assert amax[0] == 6.0
    d = np.zeros((3, 3), np.float32)
    core.gemm(raw_x, raw_x, (d.ctypes.data, core.DType.float32, (3, 3), -1))
    np.testing.assert_array_equal(d, x @ x.T)


def test_raw_buffer_tuple_of_another_form_is_a_type_error():
    with pytest.raises(TypeError, match=r"^compute_amax: input.data must be an array or a "
                                        r"\(data_ptr, DType, shape tuple, device\) tuple"):
        core.compute_amax((0, "float32", (1,)), core.Tensor(amax=np.zeros(1, np.float32)))


@pytest.mark.cuda
def test_cupy_arrays_on_cuda(cuda_device):
    """cupy speaks DLPack too: its arrays and its stream work like torch's."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    scale = np.array([4.0], np.float32)
    want = ref.quantize_tensor(x, scale[0], ref.E4M3)
    data = cp.zeros((64, 48), cp.uint8)
    scale_inv = cp.zeros(1, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = core.Tensor(data, dtype=core.DType.float8_e4m3, scale=cp.asarray(scale),
                          scale_inv=scale_inv)
        core.quantize(cp.asarray(x), out, stream=stream.ptr)
    stream.synchronize()
    ref.assert_fp8_equal(cp.asnumpy(data), want["data"], ref.E4M3, "cupy data")
    assert cp.asnumpy(scale_inv)[0] == want["scale_inv"]
