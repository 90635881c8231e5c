"""Bad inputs through the Python binding: the right exception type, a message of the form
"<op>: <argument> must be <expected>, got <actual>" that names what was got, and no output
written (tensor.h: "on failure ... no output buffer has been written").

Each case builds otherwise valid arguments with one thing wrong, so that an op that wrote
before it finished checking would show it in the outputs, which start as sentinels.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pytest
from te_common_tests import _reference as ref

from transformer_engine.common import _core as core

E4M3, E5M2 = core.DType.float8_e4m3, core.DType.float8_e5m2
F32 = np.float32


@dataclasses.dataclass
class Bad:
    call: Callable[[], None]
    outputs: list  # arrays the call may write; they must be unchanged after the failure
    error: type
    fragments: tuple  # op name, argument name, what was got, ...


CASES: dict[str, Callable] = {}
CPU_ONLY = set()  # cases that build numpy-only arguments


def case(name, cpu_only=False):
    def register(build):
        CASES[name] = build
        if cpu_only:
            CPU_ONLY.add(name)
        return build

    return register


def quantize_output(d, shape=(4, 16), dtype=E4M3, mode="tensor", **slots):
    """Valid outputs of quantize for an input of `shape`, with `slots` replacing (None:
    removing) some; numpy arrays go to the device, anything else is passed as it is."""
    m, k = ref.matrix(np.empty(shape)).shape
    arrays = {
        "data": np.full(shape, 0xA5, np.uint8),
        "columnwise_data": np.full((k, m), 0xA5, np.uint8),
    }
    if mode == "tensor":
        arrays.update(
            scale=np.array([2.0], F32), scale_inv=np.array([-1.0], F32), amax=np.array([-1.0], F32)
        )
    else:
        sinv = np.uint8 if mode == "mxfp8" else F32
        arrays["scale_inv"] = np.full(ref.scale_inv_shape(mode, m, k), 7, sinv)
        arrays["columnwise_scale_inv"] = np.full(ref.scale_inv_shape(mode, m, k, True), 7, sinv)
        if mode == "mxfp8":
            arrays["columnwise_data"] = np.full(shape, 0xA5, np.uint8)
    arrays.update(slots)
    on_device = {
        n: d.put(a) if isinstance(a, np.ndarray) else a for n, a in arrays.items() if a is not None
    }
    tensor = core.Tensor(dtype=dtype, scaling_mode=getattr(core.ScalingMode, mode), **on_device)
    return tensor, [a for a in on_device.values() if not isinstance(a, (list, float, int))]


def x_in(d, shape=(4, 16), dtype=F32):
    return d.put(np.ones(shape, dtype))


def quantize_case(d, x=None, error=ValueError, fragments=(), config=None, **output):
    out, outputs = quantize_output(d, **output)
    x = x_in(d) if x is None else x
    return Bad(
        lambda: core.quantize(x, out, stream=d.stream, **(config or {})),
        outputs,
        error,
        ("quantize:", *fragments),
    )


# ---------------------------------------------------------------- quantize


@case("non_contiguous_input")
def _(d):
    x = d.put(np.ones((4, 32), F32))[:, ::2]
    return quantize_case(d, x, ValueError, ("input.data", "C-contiguous", "[4, 16]"))


@case("float64_input")
def _(d):
    return quantize_case(d, np.ones((4, 16), np.float64), TypeError, ("input.data", "float64"))


@case("int_input")
def _(d):
    return quantize_case(d, x_in(d, dtype=np.int32), TypeError, ("input.data", "int32", "[4, 16]"))


@case("fp8_input")
def _(d):
    x = core.Tensor(d.put(np.zeros((4, 16), np.uint8)), dtype=E4M3)
    return quantize_case(d, x, TypeError, ("input.data", "float8_e4m3"))


@case("output_not_fp8")
def _(d):
    return quantize_case(
        d, None, TypeError, ("output.data", "float8_e4m3 or float8_e5m2", "uint8"), dtype=None
    )


@case("output_wrong_dtype")
def _(d):
    return quantize_case(
        d, None, TypeError, ("output.data", "float8_e4m3", "float32"), data=np.zeros((4, 16), F32)
    )


@case("rowwise_shape_mismatch")
def _(d):
    return quantize_case(
        d,
        None,
        ValueError,
        ("output.data", "[4, 16]", "[4, 15]"),
        data=np.full((4, 15), 0xA5, np.uint8),
    )


@case("columnwise_not_transposed")
def _(d):
    return quantize_case(
        d,
        None,
        ValueError,
        ("output.columnwise_data", "transpose", "[16, 4]", "[4, 16]"),
        columnwise_data=np.full((4, 16), 0xA5, np.uint8),
    )


@case("columnwise_other_format")
def _(d):
    torch = pytest.importorskip("torch")  # FP8 arrays that carry their format natively
    where = "cuda" if d.is_cuda else "cpu"
    data = torch.zeros((4, 16), dtype=torch.float8_e4m3fn, device=where)
    col = torch.zeros((16, 4), dtype=torch.float8_e5m2, device=where)
    return quantize_case(
        d,
        None,
        TypeError,
        ("output.columnwise_data", "float8_e4m3", "float8_e5m2"),
        dtype=None,
        data=data,
        columnwise_data=col,
    )


@case("missing_scale")
def _(d):
    return quantize_case(
        d, None, ValueError, ("output.scale", "must be set", "got nothing"), scale=None
    )


@case("scale_wrong_dtype")
def _(d):
    return quantize_case(
        d,
        None,
        TypeError,
        ("output.scale", "float32", "float16 [1]"),
        scale=np.array([2.0], np.float16),
    )


@case("scale_two_elements")
def _(d):
    return quantize_case(
        d, None, ValueError, ("output.scale", "1 element", "[2]"), scale=np.array([2.0, 2.0], F32)
    )


@case("scale_inv_missing")
def _(d):
    return quantize_case(d, None, ValueError, ("output.scale_inv", "got nothing"), scale_inv=None)


@case("amax_wrong_shape")
def _(d):
    return quantize_case(
        d, None, ValueError, ("output.amax", "1 element", "float32 [2]"), amax=np.full(2, -1.0, F32)
    )


@case("missing_both_data_slots")
def _(d):
    return quantize_case(
        d,
        None,
        ValueError,
        ("output.data or output.columnwise_data", "got neither"),
        data=None,
        columnwise_data=None,
    )


@case("read_only_output", cpu_only=True)
def _(d):
    data = np.full((4, 16), 0xA5, np.uint8)
    data.flags.writeable = False
    return quantize_case(
        d, None, ValueError, ("output.data", "writable", "read-only [4, 16]"), data=data
    )


@case("block_scale_inv_wrong_shape")
def _(d):
    return quantize_case(
        d,
        x_in(d, (4, 200)),
        ValueError,
        ("output.scale_inv", "[4, 2]", "[4, 1]"),
        shape=(4, 200),
        mode="block_1x128",
        scale_inv=np.full((4, 1), 7, F32),
    )


@case("block_columnwise_scale_inv_wrong_shape")
def _(d):
    return quantize_case(
        d,
        x_in(d, (4, 200)),
        ValueError,
        ("output.columnwise_scale_inv", "[2, 1]", "[1, 2]"),
        shape=(4, 200),
        mode="block_128x128",
        columnwise_scale_inv=np.full((1, 2), 7, F32),
    )


@case("mxfp8_scale_inv_wrong_dtype")
def _(d):
    return quantize_case(
        d,
        x_in(d, (4, 64)),
        TypeError,
        ("output.scale_inv", "float8_e8m0", "float32"),
        shape=(4, 64),
        mode="mxfp8",
        scale_inv=np.full((4, 2), 7, F32),
    )


@case("mxfp8_columnwise_scale_inv_wrong_shape")
def _(d):
    return quantize_case(
        d,
        x_in(d, (40, 64)),
        ValueError,
        ("output.columnwise_scale_inv", "[2, 64]", "[40, 2]"),
        shape=(40, 64),
        mode="mxfp8",
        columnwise_scale_inv=np.full((40, 2), 7, np.uint8),
    )


@case("block_fp32_scale_inv_given_as_bytes")
def _(d):
    return quantize_case(
        d,
        x_in(d, (4, 200)),
        TypeError,
        ("output.scale_inv", "float32", "uint8"),
        shape=(4, 200),
        mode="block_1x128",
        scale_inv=np.full((4, 2), 7, np.uint8),
    )


@case("negative_epsilon")
def _(d):
    return quantize_case(
        d,
        x_in(d, (4, 200)),
        ValueError,
        ("amax_epsilon", ">= 0", "-1"),
        config={"amax_epsilon": -1.0},
        shape=(4, 200),
        mode="block_1x128",
    )


@case("nan_epsilon")
def _(d):
    return quantize_case(
        d,
        x_in(d, (4, 200)),
        ValueError,
        ("amax_epsilon", "finite", "nan"),
        config={"amax_epsilon": float("nan")},
        shape=(4, 200),
        mode="block_1x128",
    )


@case("non_array_input", cpu_only=True)
def _(d):
    return quantize_case(d, [[1.0] * 16] * 4, TypeError, ("input.data", "must be an array", "list"))


@case("non_array_output_slot", cpu_only=True)
def _(d):
    return quantize_case(
        d, None, TypeError, ("output.scale", "must be an array", "float"), scale=2.0
    )


@case("too_many_dimensions")
def _(d):
    shape = (1,) * 8 + (16,)
    return quantize_case(d, x_in(d, shape), ValueError, ("input.data", "at most 8", "9"))


# ---------------------------------------------------------------- dequantize, compute_amax, scales


@case("dequantize_wrong_output_shape")
def _(d):
    out = d.put(np.full((16, 4), 3.0, F32))
    t = core.Tensor(
        d.put(np.zeros((4, 16), np.uint8)), dtype=E4M3, scale_inv=d.put(np.ones(1, F32))
    )
    return Bad(
        lambda: core.dequantize(t, out, stream=d.stream),
        [out],
        ValueError,
        ("dequantize:", "output.data", "[4, 16]", "float32 [16, 4]"),
    )


@case("dequantize_output_not_high_precision")
def _(d):
    out = d.put(np.full((4, 16), 3, np.int16))
    t = core.Tensor(
        d.put(np.zeros((4, 16), np.uint8)), dtype=E4M3, scale_inv=d.put(np.ones(1, F32))
    )
    return Bad(
        lambda: core.dequantize(t, out, stream=d.stream),
        [out],
        TypeError,
        ("dequantize:", "output.data", "float32, float16 or bfloat16", "int16"),
    )


@case("dequantize_missing_scale_inv")
def _(d):
    out = d.put(np.full((4, 16), 3.0, F32))
    t = core.Tensor(d.put(np.zeros((4, 16), np.uint8)), dtype=E5M2)
    return Bad(
        lambda: core.dequantize(t, out, stream=d.stream),
        [out],
        ValueError,
        ("dequantize:", "input.scale_inv", "got nothing"),
    )


@case("dequantize_mxfp8_scale_inv_wrong_shape")
def _(d):
    out = d.put(np.full((4, 64), 3.0, F32))
    t = core.Tensor(
        d.put(np.zeros((4, 64), np.uint8)),
        dtype=E5M2,
        scaling_mode=core.ScalingMode.mxfp8,
        scale_inv=d.put(np.full((4, 1), 127, np.uint8)),
    )
    return Bad(
        lambda: core.dequantize(t, out, stream=d.stream),
        [out],
        ValueError,
        ("dequantize:", "input.scale_inv", "[4, 2]", "[4, 1]"),
    )


@case("compute_amax_no_amax_slot")
def _(d):
    out = d.put(np.full(1, -1.0, F32))  # a bare array is a plain tensor's data, not its amax
    x = x_in(d)
    return Bad(
        lambda: core.compute_amax(x, out, stream=d.stream),
        [out],
        ValueError,
        ("compute_amax:", "output.amax", "got nothing"),
    )


@case("scale_from_amax_block_mode")
def _(d):
    arrays = [
        d.put(np.zeros((4, 200), np.uint8)),
        d.put(np.ones(1, F32)),
        d.put(np.full(1, -1.0, F32)),
        d.put(np.full(1, -1.0, F32)),
    ]
    t = core.Tensor(
        arrays[0],
        dtype=E4M3,
        scaling_mode=core.ScalingMode.block_1x128,
        amax=arrays[1],
        scale=arrays[2],
        scale_inv=arrays[3],
    )
    return Bad(
        lambda: core.compute_scale_from_amax(t, stream=d.stream),
        arrays,
        ValueError,
        ("compute_scale_from_amax:", "scaling mode", "block_1x128"),
    )


@case("scale_from_amax_negative_epsilon")
def _(d):
    arrays = [
        d.put(np.zeros(4, np.uint8)),
        d.put(np.ones(1, F32)),
        d.put(np.full(1, -1.0, F32)),
        d.put(np.full(1, -1.0, F32)),
    ]
    t = core.Tensor(arrays[0], dtype=E4M3, amax=arrays[1], scale=arrays[2], scale_inv=arrays[3])
    return Bad(
        lambda: core.compute_scale_from_amax(t, amax_epsilon=-0.5, stream=d.stream),
        arrays,
        ValueError,
        ("compute_scale_from_amax:", "amax_epsilon", "-0.5"),
    )


# ---------------------------------------------------------------- transpose


@case("transpose_dtype_mismatch")
def _(d):
    out, x = d.put(np.full((16, 4), 1.0, np.float16)), x_in(d)
    return Bad(
        lambda: core.transpose(x, out, stream=d.stream),
        [out],
        TypeError,
        ("transpose:", "output.data", "float32", "float16 [16, 4]"),
    )


@case("transpose_not_transposed_shape")
def _(d):
    out, x = d.put(np.full((4, 16), 1.0, F32)), x_in(d)
    return Bad(
        lambda: core.transpose(x, out, stream=d.stream),
        [out],
        ValueError,
        ("transpose:", "output.data", "[16, 4]", "float32 [4, 16]"),
    )


# ---------------------------------------------------------------- delayed_scaling_update


def update_case(d, groups, error, fragments, **kwargs):
    """groups: (history, scale, scale_inv) numpy triples, put on the device."""
    on_device = [[d.put(a) if isinstance(a, np.ndarray) else a for a in g] for g in groups]
    lists = [list(column) for column in zip(*on_device, strict=True)] if on_device else [[], [], []]
    kwargs.setdefault("fp8_dtype", E4M3)
    outputs = [a for g in on_device for a in g if not isinstance(a, (list, float, int))]
    return Bad(
        lambda: core.delayed_scaling_update(*lists, stream=d.stream, **kwargs),
        outputs,
        error,
        ("delayed_scaling_update:", *fragments),
    )


def group(h=(4,), n=1):
    return np.full(h, 3.0, F32), np.full(n, 2.0, F32), np.full(n, -1.0, F32)


@case("update_mismatched_list_lengths")
def _(d):
    h, s, si = (d.put(a) for a in group())
    h2 = d.put(group()[0])
    return Bad(
        lambda: core.delayed_scaling_update([h, h2], [s], [si, si], fp8_dtype=E4M3),
        [h, h2, s, si],
        ValueError,
        ("delayed_scaling_update:", "scales and scale_invs", "(2)", "1 and 2"),
    )


@case("update_history_rank_3")
def _(d):
    return update_case(
        d,
        [group(), group((2, 2, 2), 4)],
        ValueError,
        ("amax_histories[1]", "[H] or [H, n]", "float32 [2, 2, 2]"),
    )


@case("update_empty_history")
def _(d):
    return update_case(d, [group((0,))], ValueError, ("amax_histories[0]", "H >= 1", "[0]"))


@case("update_scale_size_mismatch")
def _(d):
    return update_case(
        d, [group(), group((4, 3), 2)], ValueError, ("scales[1]", "3 elements", "float32 [2]")
    )


@case("update_history_wrong_dtype")
def _(d):
    h, s, si = group()
    return update_case(
        d,
        [(h.astype(np.float16), s, si)],
        TypeError,
        ("amax_histories[0]", "float32", "float16 [4]"),
    )


@case("update_negative_margin")
def _(d):
    return update_case(d, [group()], ValueError, ("margin", "[0, 126]", "-1"), margin=-1)


@case("update_margin_too_large")
def _(d):
    return update_case(d, [group()], ValueError, ("margin", "[0, 126]", "127"), margin=127)


@case("update_fp8_dtype_not_fp8")
def _(d):
    return update_case(
        d,
        [group()],
        TypeError,
        ("fp8_dtype", "float8_e4m3 or float8_e5m2", "float32"),
        fp8_dtype=core.DType.float32,
    )


@case("update_read_only_scale", cpu_only=True)
def _(d):
    h, s, si = group()
    s.flags.writeable = False
    return update_case(d, [(h, s, si)], ValueError, ("scales[0]", "writable", "read-only [1]"))


@case("update_non_array_history", cpu_only=True)
def _(d):
    _, s, si = group()
    return update_case(
        d, [([3.0, 3.0], s, si)], TypeError, ("amax_histories[0]", "must be an array", "list")
    )


# ---------------------------------------------------------------- the tests


def test_there_are_at_least_20_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", CASES)
def test_bad_input(device, name):
    if device.is_cuda and name in CPU_ONLY:
        pytest.skip("the case is about a numpy array")
    bad = CASES[name](device)
    before = [device.get(a) for a in bad.outputs]
    with pytest.raises(bad.error) as info:
        bad.call()
    message = str(info.value)
    for fragment in bad.fragments:
        assert fragment in message, f"{fragment!r} is not in the message {message!r}"
    assert message.startswith(bad.fragments[0]), (
        f"the message does not start with the op: {message!r}"
    )
    for i, (a, old) in enumerate(zip(bad.outputs, before, strict=True)):
        ref.assert_same_bits(device.get(a), old, f"output {i} was written by a call that failed")


@pytest.mark.cuda
@pytest.mark.parametrize("cpu_side", ["input", "output"])
def test_mixed_devices(cuda_device, cpu_side):
    """An input on the CPU and outputs on CUDA (or the reverse) is refused, naming both."""
    cpu = cuda_device.cpu
    x = x_in(cpu if cpu_side == "input" else cuda_device)
    out, outputs = quantize_output(cuda_device if cpu_side == "input" else cpu)
    before = [cuda_device.get(a) for a in outputs]
    with pytest.raises(ValueError) as info:
        core.quantize(x, out, stream=cuda_device.stream)
    message = str(info.value)
    first, second = ("cpu", "cuda:0") if cpu_side == "input" else ("cuda:0", "cpu")
    assert message.startswith("quantize: output.data must be on " + first), message
    assert "got float8_e4m3 [4, 16] on " + second in message, message
    for a, old in zip(outputs, before, strict=True):
        ref.assert_same_bits(cuda_device.get(a), old, "an output was written by a call that failed")


@pytest.mark.cuda
def test_mixed_devices_within_one_tensor(cuda_device):
    """A CUDA data slot with a CPU scale: the scale is named."""
    import torch

    x = torch.ones((4, 16), device="cuda")
    data = torch.full((4, 16), 0xA5, dtype=torch.uint8, device="cuda")
    scale = np.array([2.0], F32)
    out = core.Tensor(data, dtype=E4M3, scale=scale, scale_inv=torch.zeros(1, device="cuda"))
    with pytest.raises(ValueError, match=r"quantize: output\.scale must be on cuda:0 .*on cpu"):
        core.quantize(x, out, stream=cuda_device.stream)
    assert bool((data == 0xA5).all())
