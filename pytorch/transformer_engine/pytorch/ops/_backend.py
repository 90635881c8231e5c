"""What every op module needs from the core: the binding, FP8 dtype names, the CUDA stream
and the GEMM workspace.

FP8 data travels between the ops as uint8 tensors; the FP8 format rides beside it as the
recipe's framework-neutral name (``"float8_e4m3"`` / ``"float8_e5m2"``), which is also the
name of the core's ``DType`` member.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from transformer_engine.common import core as _load_core

FP8_DTYPES = ("float8_e4m3", "float8_e5m2")
SCALING_MODES = ("tensor", "block_1x128", "block_128x128")
# torch's own FP8 dtypes, for data given natively instead of as bytes.
TORCH_FP8 = {"float8_e4m3": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
BLOCK = 128

_core = None
_workspaces: dict[int, tuple[torch.Tensor, tuple]] = {}  # device index -> (workspace, raw)


def core():
    """The native binding, loaded on first use (importing the package never needs it)."""
    global _core
    if _core is None:
        _core = _load_core()
    return _core


def check_fp8_dtype(op: str, fp8_dtype: str) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"{op}: fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")


def check_mode(op: str, mode: str) -> None:
    if mode not in SCALING_MODES:
        raise ValueError(f"{op}: scaling_mode must be one of {SCALING_MODES}, got {mode!r}")


# name -> the binding's enum member, looked up once (getattr on the enum class costs more
# than the dict).
_enums: dict = {}


def _enum(kind: str, name: str):
    """The member ``name`` of the binding's enum ``kind`` (``DType``, ``ScalingMode``)."""
    e = _enums.get((kind, name))
    if e is None:
        e = _enums[(kind, name)] = getattr(getattr(core(), kind), name)
    return e


def te_dtype(fp8_dtype: str):
    return _enum("DType", fp8_dtype)


def te_mode(mode: str):
    return _enum("ScalingMode", mode)


_codes: dict = {}


def enum_code(kind: str, name: str) -> int:
    """The core's value of member ``name`` of the binding's enum ``kind`` (``DType``,
    ``AmaxComputeAlgo``, ``Norm``, ``Activation``), for the compiled operators, which take ints."""
    if torch.compiler.is_compiling():
        return _traced_enum_code(kind, name)
    c = _codes.get((kind, name))
    if c is None:
        c = _codes[(kind, name)] = int(_enum(kind, name).value)
    return c


@torch._dynamo.assume_constant_result
def _traced_enum_code(kind: str, name: str) -> int:
    """enum_code for a traced graph, run at trace time and kept as a constant: traced, a read
    of the cache would become a guard on its contents (which a traced write then fails), and
    the binding's first load inside a trace a guard on a module object (which the compiler
    cannot make: a process whose first FP8 step is compiled)."""
    return int(_enum(kind, name).value)


def dtype_code(name: str) -> int:
    """The core's te_dtype value of a dtype name."""
    return enum_code("DType", name)


def algo_code(algo: str) -> int:
    """The core's te_amax_compute_algo value of an amax algorithm name (``"max"``,
    ``"most_recent"``)."""
    return enum_code("AmaxComputeAlgo", algo)


_TORCH_TO_TE = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.uint8: "uint8", torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3",
    torch.float8_e5m2: "float8_e5m2", torch.int32: "int32", torch.int64: "int64",
}
_te_dtypes: dict = {}


def _core_dtype(dtype: torch.dtype):
    te = _te_dtypes.get(dtype)
    if te is None:
        name = _TORCH_TO_TE.get(dtype)
        if name is None:
            raise TypeError(f"transformer_engine: tensors of dtype {dtype} cannot go to the "
                            "core")
        te = _te_dtypes[dtype] = _enum("DType", name)
    return te


def raw(t: torch.Tensor) -> tuple:
    """The binding's fast form of a tensor, ``(data_ptr, DType, shape, device)``: ~1 us
    instead of a DLPack export (~7 us). It carries no strides, so the tensor must be
    C-contiguous (checked), and the caller must keep it alive until the core call returns:
    the tuple holds a bare pointer. A view's offset is in its data_ptr."""
    if not t.is_contiguous():
        raise ValueError(f"transformer_engine: tensors must be C-contiguous for the core, got "
                         f"shape {list(t.shape)} with strides {t.stride()}")
    dtype = _te_dtypes.get(t.dtype) or _core_dtype(t.dtype)
    # t.shape is a torch.Size, a tuple already; get_device() is the CUDA index, -1 on the CPU,
    # in one call (t.device would build an object).
    return (t.data_ptr(), dtype, t.shape, t.get_device())


def raw_view(t: torch.Tensor) -> tuple:
    """raw() of a tensor whose strides the call gives the core separately (attention's
    q, k, v read in place): no contiguity check."""
    dtype = _te_dtypes.get(t.dtype) or _core_dtype(t.dtype)
    return (t.data_ptr(), dtype, t.shape, t.get_device())


def raw_element(t: torch.Tensor, index: int) -> tuple:
    """The fast form of element ``index`` of the flat, contiguous tensor ``t`` as a [1]
    buffer: what ``raw(t.view(-1)[index:index + 1])`` gives, without making the view (a
    slice costs ~2 us of host time, more than the core call that reads it)."""
    if not t.is_contiguous():
        raise ValueError(f"transformer_engine: tensors must be C-contiguous for the core, got "
                         f"shape {list(t.shape)} with strides {t.stride()}")
    if not 0 <= index < t.numel():
        raise IndexError(f"transformer_engine: element {index} is out of range for a tensor "
                         f"of {t.numel()} elements")
    dtype = _te_dtypes.get(t.dtype) or _core_dtype(t.dtype)
    return (t.data_ptr() + index * t.element_size(), dtype, (1,), t.get_device())


def amax_destination(op: str, x: torch.Tensor, amax_history: Optional[torch.Tensor],
                     index: int) -> tuple[torch.Tensor, tuple, bool]:
    """Where an FP8 op writes max|y|: ``(returned amax, its fast form, accumulate)``.

    Without a history, a fresh [1] fp32 tensor that the op returns (overwritten). With a
    delayed-scaling ``amax_history`` [H, n], the op raises ``amax_history[0, index]`` in place
    (max with what the slot holds: the forwards of one step keep the largest) and returns an
    empty tensor: one core call, no separate record of the amax."""
    if amax_history is None or amax_history.numel() == 0:  # (empty: None, see custom_op)
        amax = x.new_empty(1, dtype=torch.float32)
        return amax, raw(amax), False
    return x.new_empty(0, dtype=torch.float32), history_slot(op, amax_history, index), True


def history_slot(op: str, amax_history: torch.Tensor, index: int) -> tuple:
    """The fast form of ``amax_history[0, index]`` (checked: a float32 [H, n] history)."""
    if (amax_history.dim() != 2 or amax_history.dtype != torch.float32
            or not 0 <= index < amax_history.shape[1]):
        raise ValueError(f"{op}: amax_history must be a float32 matrix [H, n] with n > "
                         f"index={index}, got {amax_history.dtype} of shape "
                         f"{list(amax_history.shape)}")
    return raw_element(amax_history, index)


def amax_fake(x: torch.Tensor, amax_history: Optional[torch.Tensor]) -> torch.Tensor:
    """The returned amax of amax_destination, for fake implementations."""
    none = amax_history is None or amax_history.numel() == 0
    return x.new_empty(1 if none else 0, dtype=torch.float32)


# torch's current CUDA stream as an int; the private call skips building a torch.cuda.Stream
# (microseconds per op). Builds of torch without CUDA lack it, and never reach it.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_of(t: torch.Tensor) -> int:
    """The ``stream=`` argument of the core: torch's current stream on t's CUDA device, so the
    core's kernels are ordered with torch's (and captured by a CUDA graph), 0 on the CPU."""
    if t.is_cuda:
        if _raw_stream is not None:
            return _raw_stream(t.get_device())
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def workspace_for(t: torch.Tensor) -> torch.Tensor | None:
    """The GEMM workspace tensor of t's CUDA device (see raw_workspace_for), None on the CPU."""
    if raw_workspace_for(t) is None:
        return None
    return _workspaces[t.get_device()][0]


def raw_workspace_for(t: torch.Tensor) -> tuple | None:
    """The fast form (raw()) of the GEMM workspace of t's CUDA device, None on the CPU, whose
    GEMM needs none: one uint8 buffer of ``gemm_workspace_size()`` bytes per device, kept for
    the process (so its fast form is made once too). Allocated on first use, outside any CUDA
    graph's memory pool (_outside_graph_pools), except while a graph is being captured: a
    first call inside torch.cuda.graph (no warm-up step before) leaves it in that graph's
    pool, where it stays valid as long as the process keeps it."""
    if not t.is_cuda:
        return None
    index = t.get_device()
    entry = _workspaces.get(index)
    if entry is None:
        size = max(int(core().gemm_workspace_size()), 1)
        device = torch.device("cuda", index)
        if torch.cuda.is_current_stream_capturing():
            ws = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            ws = _outside_graph_pools(lambda: torch.empty(size, dtype=torch.uint8, device=device))
        entry = _workspaces[index] = (ws, raw(ws))
    return entry[1]


def _outside_graph_pools(make):
    """``make()`` run on a thread of its own, so that what it allocates comes from torch's
    ordinary memory and not from a CUDA graph pool the calling thread allocates into:
    torch.compile's reduce-overhead mode runs a graph's first (warm-up) call with the calling
    thread's allocations sent to the graphs' pool, and refuses a pool allocation that
    outlives the call without being one of its outputs, which a workspace kept for the
    process is."""
    made, failed = [], []

    def run():
        try:
            made.append(make())
        except BaseException as e:  # (re-raised on the calling thread)
            failed.append(e)

    worker = threading.Thread(target=run, name="transformer_engine workspace")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return made[0]


def block_grid(rows: int, cols: int, mode: str) -> tuple[int, int]:
    """Shape of the scale_inv of a [rows, cols] matrix in a block mode (tensor.h)."""
    if mode == "block_1x128":
        return rows, -(-cols // BLOCK)
    return -(-rows // BLOCK), -(-cols // BLOCK)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 data as uint8 (a view when t is a native torch float8 tensor)."""
    return t.view(torch.uint8) if t.dtype in TORCH_FP8.values() else t


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """Stands for an output that was not asked for (custom ops cannot return None)."""
    return like.new_empty(0, dtype=torch.uint8)


# Tensor types an eager call may take directly: plain tensors and parameters (a module's
# bias reaches the GEMM as its nn.Parameter; sending those through the dispatcher cost each
# biased GEMM ~170 us of host time).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(args, kwargs=None) -> bool:
    """True when a call can run its implementation directly: not traced (torch.compile, an
    active dispatch mode such as FakeTensorMode or make_fx) and no tensor subclass other than
    nn.Parameter among the arguments. (Plain loops: this runs before every eager op.)"""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
                return False
    return True


# The library every op of the package is defined in (kept alive: dropping it unregisters them).
_LIBRARIES: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "DEF")
    return lib


def custom_op(name: str, *, mutates_args=(), schema: Optional[str] = None):
    """A torch operator ``name`` ("namespace::op") over ``fn``, whose eager calls skip the
    dispatcher. ``schema`` (its written-out form, e.g. "(Tensor(a!) x) -> Tensor") stands for
    the one torch infers from ``fn``'s annotations, for functions that take ``*args``.

    Tracing (torch.compile, fake tensors) goes through the registered operator, which is what
    makes the op one graph node with its fake implementation. An eager call with plain tensors
    runs the same implementation directly: the dispatcher costs host time per call, more than
    the kernels of a small layer, and in eager mode it adds nothing (the ops have no autograd
    formula of their own; autograd.Functions call them).

    The operator is defined with the schema torch infers from ``fn``'s annotations and one
    kernel for every device (CompositeExplicitAutograd), not with torch.library.custom_op:
    that adds Python autograd and version-counter layers to every dispatched call (~20 us of
    host time per op in a compiled graph, which calls every op through the dispatcher), and
    these ops need neither (no autograd formula; the tensors they write in place are FP8
    state, never saved for a backward).

    A traced call gets an empty tensor for a mutated argument left None at its default (the
    ops read both as "none"): the boxed call drops trailing arguments at their defaults, and
    some torch releases then failed to trace the op.
    """
    namespace, short = name.split("::")

    def wrap(fn):
        lib = _library(namespace)
        written = schema or torch.library.infer_schema(fn, mutates_args=mutates_args)
        lib.define(short + written, tags=(torch.Tag.pt2_compliant_tag,))
        lib.impl(short, fn, "CompositeExplicitAutograd")
        op = getattr(getattr(torch.ops, namespace), short).default
        params = list(inspect.signature(fn).parameters.values())
        optional = [(i, p.name) for i, p in enumerate(params)
                    if p.name in mutates_args and p.default is None]

        def filled(args, kwargs):
            like = next(a for a in args if isinstance(a, torch.Tensor))
            args = list(args)
            for i, key in optional:
                if i < len(args):
                    if args[i] is None:
                        args[i] = like.new_empty(0, dtype=torch.float32)
                elif kwargs.get(key) is None:
                    kwargs = {**kwargs, key: like.new_empty(0, dtype=torch.float32)}
            return args, kwargs

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if plain_eager(args, kwargs):
                return fn(*args, **kwargs)
            if optional:
                args, kwargs = filled(args, kwargs)
            return op(*args, **kwargs)

        def register_fake(fake):
            torch.library.register_fake(name, fake, lib=lib)
            return fake

        call.register_fake = register_fake
        call.op = op
        return call

    return wrap
