"""The core's operations as jax functions: each is one XLA FFI custom call (``_te_jax``).

These are the building blocks of :func:`transformer_engine.jax.dense`; they have no VJP of
their own. Shapes follow the core (``tensor.h``): a tensor is viewed as a matrix [M, K] (K
its last dimension), its column-wise FP8 copy is the transpose [K, M], and the scale
inverses of the block modes are laid out per block of that view.

Under ``jax.vmap`` every op runs once per element of the mapped axis (``sequential``).
While a mesh is in context (``jax.set_mesh``) or a ``MeshResource`` names mesh axes, the ops
are partitioned calls that follow their operands' shardings, each device computing on its
shards (:mod:`transformer_engine.jax.partitioning`; the block scaling modes excepted).
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple, Optional, Sequence

import numpy as np

import jax
import jax.numpy as jnp
from transformer_engine.common.activation_params import ClampedSwiGLUParams
from transformer_engine.jax._native import TARGETS, load

__all__ = ["ScalingMode", "QuantizedTensor", "fp8_dtype", "quantize", "dequantize",
           "compute_amax", "scale_from_amax", "delayed_scaling_update", "gemm", "grouped_gemm",
           "NormType",
           "norm_forward", "norm_forward_fp8", "norm_backward", "Activation", "ClampedSwiGLU",
           "is_gated", "kind_of",
           "activation_forward", "activation_forward_fp8", "activation_backward",
           "activation_backward_fp8", "activation_amax", "activation_backward_amax"]

load()

_VMAP = "sequential"
_F32 = jnp.float32


class ScalingMode(enum.IntEnum):
    """How FP8 data is scaled (the core's te_scaling_mode)."""

    TENSOR = 0
    BLOCK_1X128 = 1
    BLOCK_128X128 = 2
    MXFP8 = 3


# The core's te_amax_compute_algo (scaling.h), by the recipe's amax_compute_algo name.
_AMAX_ALGOS = {"max": 0, "most_recent": 1}

# The core's te_dtype codes of the FP8 formats, and their jax dtypes.
_TE_DTYPE = {jnp.dtype(jnp.float8_e4m3fn): 3, jnp.dtype(jnp.float8_e5m2): 4}
_BY_NAME = {"float8_e4m3": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}


def fp8_dtype(name: str):
    """The jax dtype of a recipe's format name (``"float8_e4m3"`` or ``"float8_e5m2"``)."""
    return jnp.dtype(_BY_NAME[name])


def _te_fp8(dtype) -> np.int32:
    dtype = jnp.dtype(dtype)
    if dtype not in _TE_DTYPE:
        raise TypeError(f"FP8 dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return np.int32(_TE_DTYPE[dtype])


def _empty(dtype=_F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((0,), dtype)


def _partitioner():
    """The partitioned forms of the ops (:mod:`transformer_engine.jax.partitioning`) while a
    mesh is in context or the mesh resource names axes, else None (the plain custom calls)."""
    from transformer_engine.jax import partitioning

    return partitioning if partitioning.active() else None


class QuantizedTensor(NamedTuple):
    """The FP8 buffers of one tensor; a slot that was not asked for is an empty array.

    ``data``: the row-wise FP8 data (the input's shape); ``columnwise_data``: the transpose
    [K, M] (MXFP8: the input's layout); ``scale_inv``: 1/scale [1] in TENSOR mode, else the
    row-wise block scale inverses; ``columnwise_scale_inv``: those of the column-wise data
    (block modes); ``amax``: max|input| [1].
    """

    data: jax.Array
    columnwise_data: jax.Array
    scale_inv: jax.Array
    columnwise_scale_inv: jax.Array
    amax: jax.Array


def _block_scale_shape(mode: ScalingMode, m: int, k: int) -> tuple[int, int]:
    if mode == ScalingMode.BLOCK_1X128:
        return m, -(-k // 128)
    if mode == ScalingMode.BLOCK_128X128:
        return -(-m // 128), -(-k // 128)
    return m, -(-k // 32)


def quantize(x: jax.Array, scale: Optional[jax.Array], dtype, *,
             scaling_mode: ScalingMode = ScalingMode.TENSOR, rowwise: bool = True,
             columnwise: bool = False, compute_amax: bool = True,
             force_pow2_scales: bool = False, amax_epsilon: float = 0.0,
             amax_into: Optional[jax.Array] = None) -> QuantizedTensor:
    """Quantizes ``x`` (fp32/fp16/bf16) to FP8 ``dtype`` in one pass: the row-wise data, the
    column-wise (transposed) data, or both, and the amax.

    ``scale`` ([1] fp32) is the TENSOR mode's scale; the block modes compute theirs per block
    (with ``force_pow2_scales`` and ``amax_epsilon``) and take ``scale=None``. ``amax_into``
    ([1] fp32, with ``compute_amax``): the amax returned is max(amax_into, max|x|), raised in
    place of amax_into's buffer (no zeroing of a fresh one).
    """
    mode = ScalingMode(scaling_mode)
    if x.ndim < 1:
        raise ValueError(f"quantize: x must have at least 1 dimension, got shape {x.shape}")
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    fp8 = jnp.dtype(dtype)
    _te_fp8(fp8)
    col_shape = x.shape if mode == ScalingMode.MXFP8 else (k, m)
    if mode == ScalingMode.TENSOR:
        if scale is None:
            raise ValueError("quantize: scale must be a [1] float32 array in TENSOR mode, got None")
        si = jax.ShapeDtypeStruct((1,), _F32)
        csi = _empty()
    else:
        scale = jnp.zeros((0,), _F32)
        sdt = jnp.float8_e8m0fnu if mode == ScalingMode.MXFP8 else _F32
        si = jax.ShapeDtypeStruct(_block_scale_shape(mode, m, k), sdt) if rowwise else _empty(sdt)
        if mode == ScalingMode.MXFP8:
            cshape = (-(-m // 32), k)
        else:
            cshape = _block_scale_shape(mode, k, m)
        csi = jax.ShapeDtypeStruct(cshape, sdt) if columnwise else _empty(sdt)
    results = (
        jax.ShapeDtypeStruct(x.shape, fp8) if rowwise else _empty(fp8),
        jax.ShapeDtypeStruct(col_shape, fp8) if columnwise else _empty(fp8),
        si,
        csi,
        jax.ShapeDtypeStruct((1,), _F32) if compute_amax else _empty(),
    )
    part = _partitioner()
    if part is not None and mode == ScalingMode.TENSOR:
        def body(xs, s):
            return tuple(quantize(xs, s, fp8, rowwise=rowwise, columnwise=columnwise,
                                  compute_amax=compute_amax))

        flat = (jax.ShapeDtypeStruct((m, k), fp8) if rowwise else _empty(fp8), *results[1:])
        out = part.quantize(x.reshape(m, k), scale, body, flat, rowwise=rowwise,
                            columnwise=columnwise, compute_amax=compute_amax)
        out = _raised("quantize", out, 4, amax_into)
        data = out[0].reshape(x.shape) if rowwise else out[0]
        return QuantizedTensor(data, *out[1:])
    out = _call_raising_amax("quantize", results, (x, scale), 4, amax_into,
                             scaling_mode=np.int32(mode), rowwise=bool(rowwise),
                             columnwise=bool(columnwise), compute_amax=bool(compute_amax),
                             force_pow2_scales=bool(force_pow2_scales),
                             amax_epsilon=np.float32(amax_epsilon))
    return QuantizedTensor(*out)


def dequantize(data: jax.Array, scale_inv: jax.Array, dtype=_F32, *,
               scaling_mode: ScalingMode = ScalingMode.TENSOR) -> jax.Array:
    """FP8 ``data`` times its ``scale_inv`` (per tensor or per block), in ``dtype``."""
    call = jax.ffi.ffi_call(TARGETS["dequantize"], jax.ShapeDtypeStruct(data.shape, dtype),
                            vmap_method=_VMAP)
    return call(data, scale_inv, scaling_mode=np.int32(ScalingMode(scaling_mode)))


def compute_amax(x: jax.Array, *, gate: Optional[jax.Array] = None) -> jax.Array:
    """max|x| as a [1] float32 array (NaN if any element is NaN).

    ``gate`` ([1] float32): the call runs only while it holds 0, else gives 0 at the cost of
    one early-returning launch (the core's gate, tensor.h). The FP8 casts below take it too.
    """
    part = _partitioner()
    if part is not None:
        return part.compute_amax(x, _gate(gate))
    call = jax.ffi.ffi_call(TARGETS["compute_amax"], jax.ShapeDtypeStruct((1,), _F32),
                            vmap_method=_VMAP)
    return call(x, _gate(gate))


def _gate(gate: Optional[jax.Array]) -> jax.Array:
    return _zeros_f32() if gate is None else jnp.reshape(gate, (1,)).astype(_F32)


def _call_raising_amax(target: str, results, args: tuple, amax_index: int,
                       amax_into: Optional[jax.Array], **attrs):
    """``ffi_call(target)`` of an op whose handler takes a last argument ``amax_in``: with
    ``amax_into`` ([1] fp32) the op raises that amax to max(itself, this call's) instead of
    writing its own (result ``amax_index`` aliases it: XLA hands the core that buffer, and the
    core skips the zeroing a fresh amax needs), else the argument is empty."""
    aliases = {}
    if amax_into is not None:
        _check_amax_into(target, results, amax_index, amax_into)
        aliases = {len(args): amax_index}
        amax_into = jnp.reshape(amax_into, (1,)).astype(_F32)
    call = jax.ffi.ffi_call(TARGETS[target], results, vmap_method=_VMAP,
                            input_output_aliases=aliases)
    return call(*args, _zeros_f32() if amax_into is None else amax_into, **attrs)


def _check_amax_into(target: str, results, amax_index: int, amax_into) -> None:
    if jnp.size(amax_into) != 1:
        raise ValueError(f"{target}: amax_into must be a [1] float32 amax, got shape "
                         f"{jnp.shape(amax_into)}")
    if results[amax_index].shape != (1,):
        raise ValueError(f"{target}: amax_into needs compute_amax=True (the call raises it "
                         "with its own amax)")


def _raised(target: str, out, amax_index: int, amax_into: Optional[jax.Array]):
    """A partitioned call's results with its amax raised to ``amax_into`` (jnp: the
    partitioned body writes its amax afresh)."""
    if amax_into is None:
        return out
    _check_amax_into(target, out, amax_index, amax_into)
    out = list(out)
    out[amax_index] = jnp.maximum(jnp.reshape(amax_into, (1,)).astype(_F32), out[amax_index])
    return tuple(out)


def scale_from_amax(amax: jax.Array, dtype, *, force_pow2_scales: bool = False,
                    amax_epsilon: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """Current scaling: (scale, scale_inv), each [1] float32, from ``amax`` for FP8 ``dtype``."""
    call = jax.ffi.ffi_call(TARGETS["scale_from_amax"], (jax.ShapeDtypeStruct((1,), _F32),) * 2,
                            vmap_method=_VMAP)
    return call(amax, fp8_dtype=_te_fp8(dtype), force_pow2_scales=bool(force_pow2_scales),
                amax_epsilon=np.float32(amax_epsilon))


def delayed_scaling_update(amax_histories: Sequence[jax.Array], scales: Sequence[jax.Array],
                           dtype, *, algo: str = "max", margin: int = 0
                           ) -> tuple[list, list, list]:
    """Delayed scaling of several tensors of one FP8 ``dtype`` in one call.

    Returns the rolled histories (slot 0 zeroed for the next amax), the new scales and the
    scale inverses. Each history is [H] or [H, n] float32 (slot 0: the amax of the step that
    just ran), each scale [n] float32.
    """
    return _delayed_update("delayed_scaling_update", amax_histories, None, scales,
                           [dtype] * len(amax_histories), algo, margin)


def delayed_scaling_update_with_amaxes(amax_histories: Sequence[jax.Array],
                                       step_amaxes: Sequence[jax.Array],
                                       scales: Sequence[jax.Array], dtypes: Sequence, *,
                                       algo: str = "max", margin: int = 0
                                       ) -> tuple[list, list, list]:
    """Delayed scaling of tensors of any FP8 ``dtypes`` (one per tensor) in one call, each
    history first recording its step's amax: slot 0 = max(slot 0, step amax), NaN kept.

    ``step_amaxes`` are [n] float32, one per history [H] or [H, n]. Returns what
    :func:`delayed_scaling_update` returns. One kernel where writing the amaxes into the
    histories and updating per format would take a write per tensor and a call per format.
    """
    return _delayed_update("delayed_scaling_update_with_amaxes", amax_histories, step_amaxes,
                           scales, dtypes, algo, margin)


def _delayed_update(op: str, amax_histories, step_amaxes, scales, dtypes, algo: str,
                    margin: int) -> tuple[list, list, list]:
    n = len(amax_histories)
    for name, given in (("scales", scales), ("step_amaxes", step_amaxes), ("dtypes", dtypes)):
        if given is not None and len(given) != n:
            raise ValueError(f"{op}: {name} must have one entry per history ({n}), "
                             f"got {len(given)}")
    if n == 0:
        return [], [], []
    if algo not in _AMAX_ALGOS:
        raise ValueError(f"{op}: algo must be 'max' or 'most_recent', got {algo!r}")
    amaxes = list(step_amaxes or [])
    results = ([jax.ShapeDtypeStruct(h.shape, _F32) for h in amax_histories]
               + [jax.ShapeDtypeStruct(s.shape, _F32) for s in scales]
               + [jax.ShapeDtypeStruct(s.shape, _F32) for s in scales])
    # The core updates histories and scales in place: XLA gives it copies (the aliases).
    first_scale = n + len(amaxes)
    aliases = {i: i for i in range(n)} | {first_scale + i: n + i for i in range(n)}
    call = jax.ffi.ffi_call(TARGETS["delayed_scaling_update"], results, vmap_method=_VMAP,
                            input_output_aliases=aliases)
    out = call(*amax_histories, *amaxes, *scales,
               fp8_dtypes=np.array([_te_fp8(d) for d in dtypes], np.int32),
               algo=np.int32(_AMAX_ALGOS[algo]), margin=np.int32(margin))
    return list(out[:n]), list(out[n:2 * n]), list(out[2 * n:])


def _gemm_workspace_bytes() -> int:
    """The CUDA workspace of the core's GEMM (0 in a CPU-only build): XLA allocates it as an
    extra result of the call, so it is planned and reused like any temporary."""
    from transformer_engine.common import core

    return int(core().gemm_workspace_size())


def gemm(a: jax.Array, b: jax.Array, *, a_scale_inv: Optional[jax.Array] = None,
         b_scale_inv: Optional[jax.Array] = None,
         a_scaling_mode: ScalingMode = ScalingMode.TENSOR,
         b_scaling_mode: ScalingMode = ScalingMode.TENSOR, transpose_a: bool = False,
         transpose_b: bool = False, bias: Optional[jax.Array] = None, out_dtype=None,
         compute_amax: bool = False, use_split_accumulator: bool = False):
    """D = op(a) @ op(b) (+ bias) with the core GEMM (see the core's gemm.h for the rules).

    op(a) is a [M, K] (any rank; D then keeps a's leading dimensions) or, with
    ``transpose_a``, a^T of a 2-D [K, M]; op(b) is b [K, N] or, with ``transpose_b``, b^T of
    [N, K]. FP8 operands need ``a_scale_inv``/``b_scale_inv``, ``transpose_a=False`` and
    ``transpose_b=True``. Returns D, or (D, amax of D) with ``compute_amax``.
    """
    if b.ndim != 2:
        raise ValueError(f"gemm: b must be 2-D, got shape {b.shape}")
    if transpose_a and a.ndim != 2:
        raise ValueError(f"gemm: a must be 2-D with transpose_a, got shape {a.shape}")
    n = b.shape[0] if transpose_b else b.shape[1]
    k_b = b.shape[1] if transpose_b else b.shape[0]
    k_a = a.shape[0] if transpose_a else a.shape[-1]
    if k_a != k_b:
        raise ValueError(f"gemm: the contraction dimensions of a ({k_a}, shape {a.shape}) and b "
                         f"({k_b}, shape {b.shape}) must match")
    lead = (a.shape[1],) if transpose_a else a.shape[:-1]
    out_dtype = jnp.dtype(out_dtype if out_dtype is not None else a.dtype)
    empty = jnp.zeros((0,), _F32)
    part = _partitioner()
    if (part is not None and ScalingMode(a_scaling_mode) == ScalingMode.TENSOR
            and ScalingMode(b_scaling_mode) == ScalingMode.TENSOR):
        def run(a_, a_si, b_, b_si, bias_):
            return gemm(a_, b_, a_scale_inv=a_si if a_si.size else None,
                        b_scale_inv=b_si if b_si.size else None, transpose_a=transpose_a,
                        transpose_b=transpose_b, bias=bias_ if bias_.size else None,
                        out_dtype=out_dtype, use_split_accumulator=use_split_accumulator)

        a2 = a if transpose_a else a.reshape(math.prod(lead), a.shape[-1])
        d, amax = part.gemm(a2, a_scale_inv if a_scale_inv is not None else empty, b,
                            b_scale_inv if b_scale_inv is not None else empty,
                            bias if bias is not None else jnp.zeros((0,), out_dtype),
                            transpose_a=transpose_a, transpose_b=transpose_b,
                            fp8=a_scale_inv is not None, compute_amax=compute_amax, run=run)
        d = d.reshape(*lead, n)
        return (d, amax) if compute_amax else d
    results = (jax.ShapeDtypeStruct((*lead, n), out_dtype),
               jax.ShapeDtypeStruct((1,), _F32) if compute_amax else _empty(),
               jax.ShapeDtypeStruct((_gemm_workspace_bytes(),), jnp.uint8))
    call = jax.ffi.ffi_call(TARGETS["gemm"], results, vmap_method=_VMAP)
    d, amax, _ = call(a, a_scale_inv if a_scale_inv is not None else empty, b,
                   b_scale_inv if b_scale_inv is not None else empty,
                   bias if bias is not None else jnp.zeros((0,), out_dtype),
                   transpose_a=bool(transpose_a), transpose_b=bool(transpose_b),
                   a_scaling_mode=np.int32(ScalingMode(a_scaling_mode)),
                   b_scaling_mode=np.int32(ScalingMode(b_scaling_mode)),
                   use_bias=bias is not None, compute_amax=bool(compute_amax),
                   use_split_accumulator=bool(use_split_accumulator))
    return (d, amax) if compute_amax else d


def grouped_gemm(a: jax.Array, b: jax.Array, group_sizes: jax.Array, *,
                 transpose_a: bool = False, transpose_b: bool = False,
                 bias: Optional[jax.Array] = None, out_dtype=None,
                 a_scale_inv: Optional[jax.Array] = None,
                 b_scale_inv: Optional[jax.Array] = None,
                 use_split_accumulator: bool = False) -> jax.Array:
    """The groups stacked by rows in ``a`` [M, K] (group g: the ``group_sizes[g]`` rows after
    the groups before it) with the core's te_grouped_gemm_ragged (gemm.h):

    * ``transpose_a=False``: D [M, N], ``D[rows g] = a[rows g] @ op(b[g]) (+ bias[g])``, b
      [G, K, N] (or [G, N, K] with ``transpose_b``), bias [G, N]; rows past the sizes' sum 0;
    * ``transpose_a=True``: D [G, K, N], ``D[g] = a[rows g]^T @ b[rows g]``, b [M, N].

    High precision, or FP8 data with per-tensor ``a_scale_inv`` [1] and ``b_scale_inv`` [1]
    (or [G], each group's weight its own, with ``transpose_a=False``); FP8 needs
    ``transpose_b`` in the first form and group sizes that are multiples of 16 (te_gemm's
    rule, checked on the device: a size that breaks it fails the call at run time).

    ``group_sizes`` int32 [G] stays on the device (traced): the sizes may change every step
    without a recompile. Under a mesh the call runs on whole operands (no sharding rule)."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
    if a.ndim != 2 or group_sizes.ndim != 1:
        raise ValueError(f"grouped_gemm: a must be 2-D [M, K] and group_sizes 1-D [G], got "
                         f"shapes {a.shape} and {group_sizes.shape}")
    groups = group_sizes.shape[0]
    if transpose_a:
        if b.ndim != 2 or b.shape[0] != a.shape[0]:
            raise ValueError(f"grouped_gemm: with transpose_a b must be [M, N] with a's M = "
                             f"{a.shape[0]}, got shape {b.shape}")
        shape = (groups, a.shape[1], b.shape[1])
    else:
        if b.ndim != 3 or b.shape[0] != groups:
            raise ValueError(f"grouped_gemm: b must be [G, K, N] (or [G, N, K] with "
                             f"transpose_b) with G = {groups}, got shape {b.shape}")
        shape = (a.shape[0], b.shape[1] if transpose_b else b.shape[2])
    if (a_scale_inv is None) != (b_scale_inv is None):
        raise ValueError("grouped_gemm: FP8 operands need both a_scale_inv and b_scale_inv, got "
                         f"only {'a' if b_scale_inv is None else 'b'}_scale_inv")
    if a_scale_inv is not None and out_dtype is None:
        raise ValueError("grouped_gemm: FP8 operands need out_dtype (float32, float16 or "
                         "bfloat16)")
    out_dtype = jnp.dtype(out_dtype if out_dtype is not None else a.dtype)
    results = (jax.ShapeDtypeStruct(shape, out_dtype),
               jax.ShapeDtypeStruct((_gemm_workspace_bytes(),), jnp.uint8))
    call = jax.ffi.ffi_call(TARGETS["grouped_gemm"], results, vmap_method=_VMAP)
    empty = jnp.zeros((0,), _F32)
    d, _ = call(a, a_scale_inv if a_scale_inv is not None else empty, b,
                b_scale_inv if b_scale_inv is not None else empty, group_sizes,
                bias if bias is not None else jnp.zeros((0,), out_dtype),
                transpose_a=bool(transpose_a), transpose_b=bool(transpose_b),
                use_bias=bias is not None, use_split_accumulator=bool(use_split_accumulator))
    return d


class NormType(enum.IntEnum):
    """The core's te_norm_type."""

    LAYERNORM = 0
    RMSNORM = 1


def _norm_backward_workspace_bytes(rows: int, cols: int) -> int:
    """The CUDA workspace of the core's norm backward for [rows, cols] (an extra result of
    the call, like the GEMM's; the CPU path ignores it)."""
    from transformer_engine.common import core

    return int(core().norm_backward_workspace_size(rows, cols))


def _norm_forward_call(x, gamma, beta, scale, fp8, *, norm_type, epsilon, zero_centered_gamma,
                       write_output, columnwise, compute_amax, gate=None, amax_into=None):
    kind = NormType(norm_type)
    m, n = math.prod(x.shape[:-1]), x.shape[-1]
    ln = kind == NormType.LAYERNORM
    if ln and beta is None:
        raise ValueError("norm_forward: LayerNorm needs beta, got None")
    results = (jax.ShapeDtypeStruct(x.shape, x.dtype) if write_output else _empty(x.dtype),
               jax.ShapeDtypeStruct((m,), _F32) if ln else _empty(),
               jax.ShapeDtypeStruct((m,), _F32),
               jax.ShapeDtypeStruct(x.shape, fp8) if fp8 is not None else _empty(jnp.uint8),
               jax.ShapeDtypeStruct((n, m), fp8) if columnwise else _empty(jnp.uint8),
               jax.ShapeDtypeStruct((1,), _F32) if fp8 is not None else _empty(),
               jax.ShapeDtypeStruct((1,), _F32) if compute_amax else _empty())
    args = (x, gamma, beta if ln else jnp.zeros((0,), gamma.dtype),
            scale if scale is not None else _zeros_f32(), _gate(gate))
    part = _partitioner()
    if part is not None:
        def body(xs, g, b, sc, gt):
            return _norm_forward_call(xs, g, b if ln else None, sc, fp8, norm_type=kind,
                                      epsilon=epsilon, zero_centered_gamma=zero_centered_gamma,
                                      write_output=write_output, columnwise=columnwise,
                                      compute_amax=compute_amax, gate=gt if gt.size else None)

        flat = list(results)
        for i in (0, 3):  # y and the FP8 data have x's shape: flattened to [M, N]
            if results[i].shape == x.shape:
                flat[i] = jax.ShapeDtypeStruct((m, n), results[i].dtype)
        out = list(part.norm_forward((x.reshape(m, n), *args[1:]), body, flat))
        for i in (0, 3):
            if results[i].shape == x.shape:
                out[i] = out[i].reshape(x.shape)
        return _raised("norm_forward", out, 6, amax_into)
    return _call_raising_amax("norm_forward", results, args, 6, amax_into,
                              norm_type=np.int32(kind), eps=np.float32(epsilon),
                              zero_centered_gamma=bool(zero_centered_gamma),
                              write_output=bool(write_output), fp8=fp8 is not None,
                              columnwise=bool(columnwise), compute_amax=bool(compute_amax))


def norm_forward(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array], *,
                 norm_type: NormType = NormType.LAYERNORM, epsilon: float = 1e-6,
                 zero_centered_gamma: bool = False):
    """LayerNorm or RMSNorm of ``x`` [.., N] over its last dimension (the core's norm.h).

    ``gamma`` and ``beta`` ([N], LayerNorm only) have x's dtype or float32. Returns
    ``(y, mu, rsigma)``: y in x's dtype, mu and rsigma [M] float32 (M the product of x's
    leading dims); mu is a zero-size array for RMSNorm.
    """
    y, mu, rsigma, *_ = _norm_forward_call(
        x, gamma, beta, None, None, norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, write_output=True, columnwise=False,
        compute_amax=False)
    return y, mu, rsigma


def norm_forward_fp8(x: jax.Array, gamma: jax.Array, beta: Optional[jax.Array],
                     scale: jax.Array, dtype, *, norm_type: NormType = NormType.LAYERNORM,
                     epsilon: float = 1e-6, zero_centered_gamma: bool = False,
                     write_output: bool = False, columnwise: bool = True,
                     compute_amax: bool = True, gate: Optional[jax.Array] = None,
                     amax_into: Optional[jax.Array] = None):
    """:func:`norm_forward` whose y comes out as per-tensor FP8 ``dtype`` with ``scale``
    ([1] float32), in the same pass: the operand of an FP8 GEMM.

    Returns ``(y, q, mu, rsigma)``: y in x's dtype when ``write_output`` (else None), q a
    :class:`QuantizedTensor` with the row-wise data, the transpose [N, M] when
    ``columnwise``, scale_inv [1] and max|y| when ``compute_amax`` (max(amax_into, max|y|)
    with ``amax_into``, raised in its buffer as :func:`quantize` does).
    """
    fp8 = jnp.dtype(dtype)
    _te_fp8(fp8)
    y, mu, rsigma, data, col, scale_inv, amax = _norm_forward_call(
        x, gamma, beta, scale, fp8, norm_type=norm_type, epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma, write_output=write_output,
        columnwise=columnwise, compute_amax=compute_amax, gate=gate, amax_into=amax_into)
    q = QuantizedTensor(data, col, scale_inv, _zeros_f32(), amax)
    return (y if write_output else None), q, mu, rsigma


def norm_backward(dy: jax.Array, x: jax.Array, mu: jax.Array, rsigma: jax.Array,
                  gamma: jax.Array, *, norm_type: NormType = NormType.LAYERNORM,
                  epsilon: float = 1e-6, zero_centered_gamma: bool = False):
    """The gradients ``(dx, dgamma, dbeta)`` of :func:`norm_forward`, from its mu and rsigma.

    dx has x's dtype, dgamma and dbeta gamma's; dbeta is a zero-size array for RMSNorm.
    """
    kind = NormType(norm_type)
    m, n = math.prod(x.shape[:-1]), x.shape[-1]
    ln = kind == NormType.LAYERNORM
    results = (jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct((n,), gamma.dtype),
               jax.ShapeDtypeStruct((n,), gamma.dtype) if ln else _empty(gamma.dtype),
               jax.ShapeDtypeStruct((_norm_backward_workspace_bytes(m, n),), jnp.uint8))
    part = _partitioner()
    if part is not None:
        def body(dys, xs, mus, rs, g):
            return norm_backward(dys, xs, mus, rs, g, norm_type=kind, epsilon=epsilon,
                                 zero_centered_gamma=zero_centered_gamma)

        flat = (jax.ShapeDtypeStruct((m, n), x.dtype), *results[1:3])
        dx, dgamma, dbeta = part.norm_backward(
            (dy.reshape(m, n), x.reshape(m, n), mu if ln else _zeros_f32(), rsigma, gamma),
            body, flat)
        return dx.reshape(x.shape), dgamma, dbeta
    call = jax.ffi.ffi_call(TARGETS["norm_backward"], results, vmap_method=_VMAP)
    dx, dgamma, dbeta, _ = call(dy, x, mu if ln else _zeros_f32(), rsigma, gamma,
                                norm_type=np.int32(kind), eps=np.float32(epsilon),
                                zero_centered_gamma=bool(zero_centered_gamma))
    return dx, dgamma, dbeta


def _zeros_f32() -> jax.Array:
    return jnp.zeros((0,), _F32)


class Activation(enum.IntEnum):
    """The core's te_activation (activation.h). The gated ones take [.., 2N] = [a, b] and
    give act(a) * b [.., N]."""

    IDENTITY = 0
    GELU = 1
    RELU = 2
    SILU = 3
    QGELU = 4
    SRELU = 5
    GEGLU = 6
    SWIGLU = 7
    REGLU = 8
    QGEGLU = 9
    SREGLU = 10
    GLU = 11
    CLAMPED_SWIGLU = 12


class ClampedSwiGLU(NamedTuple):
    """The ``act`` of clamped SwiGLU (GPT-OSS's; the core's CLAMPED_SWIGLU, the one activation
    with parameters): ``g sigmoid(alpha g) * (u + linear_offset)`` with ``g = min(a, limit)``
    and ``u = clamp(b, -limit, limit)``; the parameters are used in fp32. Hashable, so it
    passes as a static argument like an :class:`Activation`."""

    limit: float = 7.0
    alpha: float = 1.702
    linear_offset: float = 1.0

    def checked(self) -> "ClampedSwiGLU":
        return ClampedSwiGLU(*ClampedSwiGLUParams(*self).checked())


def kind_of(act) -> Activation:
    """The core's activation of an ``act`` (an Activation or a ClampedSwiGLU)."""
    return Activation.CLAMPED_SWIGLU if isinstance(act, ClampedSwiGLU) else Activation(act)


def _params_attrs(act) -> dict:
    """The FFI calls' parameter attributes (zeros for the activations without any)."""
    p = act.checked() if isinstance(act, ClampedSwiGLU) else ClampedSwiGLU(0.0, 0.0, 0.0)
    if kind_of(act) == Activation.CLAMPED_SWIGLU and not isinstance(act, ClampedSwiGLU):
        raise ValueError("activation: CLAMPED_SWIGLU takes parameters: pass "
                         "ops.ClampedSwiGLU(limit, alpha, linear_offset) as act")
    return {"limit": np.float32(p.limit), "alpha": np.float32(p.alpha),
            "linear_offset": np.float32(p.linear_offset)}


def is_gated(act) -> bool:
    return kind_of(act) in (Activation.GEGLU, Activation.SWIGLU, Activation.REGLU,
                            Activation.QGEGLU, Activation.SREGLU, Activation.GLU,
                            Activation.CLAMPED_SWIGLU)


def _activation_out_shape(x_shape, act):
    if not x_shape:
        raise ValueError("activation: the input must have rank >= 1, got a scalar")
    if is_gated(act):
        if x_shape[-1] % 2:
            raise ValueError(f"activation: a gated activation ({kind_of(act).name}) needs "
                             f"an even last dimension [a, b], got shape {tuple(x_shape)}")
        return (*x_shape[:-1], x_shape[-1] // 2)
    return tuple(x_shape)


def _fp8_results(shape, fp8, rowwise, columnwise, compute_amax):
    m, k = math.prod(shape[:-1]), shape[-1]
    return (jax.ShapeDtypeStruct(shape, fp8) if rowwise else _empty(fp8),
            jax.ShapeDtypeStruct((k, m), fp8) if columnwise else _empty(fp8),
            jax.ShapeDtypeStruct((1,), _F32),
            jax.ShapeDtypeStruct((1,), _F32) if compute_amax else _empty())


def _as_rows(x: jax.Array) -> jax.Array:
    """x as the [M, K] matrix that the partitioned ops lay out (K its last dimension)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _activation_forward_call(x, act, scale, gate, fp8, *, rowwise, columnwise, compute_amax,
                             amax_into=None):
    """The activation's custom call: (y or FP8 data, transpose, scale_inv, amax); ``fp8``
    None gives y in x's dtype (none with ``rowwise`` False: the amax alone) and empty FP8
    slots."""
    shape = _activation_out_shape(x.shape, act)
    if fp8 is None:
        y = jax.ShapeDtypeStruct(shape, x.dtype) if rowwise else _empty(x.dtype)
        results = (y, _empty(x.dtype), _empty(),
                   jax.ShapeDtypeStruct((1,), _F32) if compute_amax else _empty())
        args = (x, _zeros_f32(), _zeros_f32())
    else:
        results = _fp8_results(shape, fp8, rowwise, columnwise, compute_amax)
        args = (x, scale, _gate(gate))
    part = _partitioner()
    if part is not None:
        def body(xs, sc, gt):
            return _activation_forward_call(xs, act, sc, gt if gt.size else None, fp8,
                                            rowwise=rowwise, columnwise=columnwise,
                                            compute_amax=compute_amax)

        flat = list(results)
        if rowwise:
            flat[0] = jax.ShapeDtypeStruct((math.prod(shape[:-1]), shape[-1]), results[0].dtype)
        out = list(part.activation_forward((_as_rows(x), *args[1:]), body, flat,
                                           gated=is_gated(act), rowwise=rowwise,
                                           columnwise=columnwise and fp8 is not None,
                                           compute_amax=compute_amax))
        if rowwise:
            out[0] = out[0].reshape(shape)
        return _raised("activation_forward", out, 3, amax_into)
    return _call_raising_amax("activation_forward", results, args, 3, amax_into,
                              act=np.int32(kind_of(act)), rowwise=bool(rowwise),
                              columnwise=bool(columnwise) and fp8 is not None,
                              compute_amax=bool(compute_amax), **_params_attrs(act))


def activation_forward(x: jax.Array, act: Activation, *, compute_amax: bool = False):
    """act(x) in x's dtype (fp32/fp16/bf16), and max|act(x)| ([1] fp32) with
    ``compute_amax``: returns y, or (y, amax)."""
    act = act if isinstance(act, ClampedSwiGLU) else Activation(act)
    y, _, _, amax = _activation_forward_call(x, act, None, None, None, rowwise=True,
                                             columnwise=False, compute_amax=compute_amax)
    return (y, amax) if compute_amax else y


def activation_amax(x: jax.Array, act) -> jax.Array:
    """max|act(x)| ([1] fp32) of the fp32 values, without writing act(x): current scaling's
    first pass before the FP8 one."""
    act = act if isinstance(act, ClampedSwiGLU) else Activation(act)
    return _activation_forward_call(x, act, None, None, None, rowwise=False, columnwise=False,
                                     compute_amax=True)[3]


def activation_forward_fp8(x: jax.Array, act: Activation, scale: jax.Array, dtype, *,
                           rowwise: bool = True, columnwise: bool = True,
                           compute_amax: bool = True, gate: Optional[jax.Array] = None,
                           amax_into: Optional[jax.Array] = None) -> QuantizedTensor:
    """act(x) as per-tensor FP8 ``dtype`` with ``scale`` ([1] fp32), in one pass: the
    row-wise data, the transpose [N, M], or both, with scale_inv and the amax
    (max(amax_into, max|act(x)|) with ``amax_into``, raised in its buffer as
    :func:`quantize` does)."""
    act = act if isinstance(act, ClampedSwiGLU) else Activation(act)
    fp8 = jnp.dtype(dtype)
    _te_fp8(fp8)
    data, col, scale_inv, amax = _activation_forward_call(
        x, act, scale, gate, fp8, rowwise=rowwise, columnwise=columnwise,
        compute_amax=compute_amax, amax_into=amax_into)
    return QuantizedTensor(data, col, scale_inv, _zeros_f32(), amax)


def _activation_backward_call(dy, x, act, scale, fp8, dbias_dtype, *, rowwise, columnwise,
                              compute_amax, gate=None, amax_into=None):
    """The activation's backward custom call: (grad_input or its FP8 data, transpose,
    scale_inv, amax, dbias); ``fp8`` None gives grad_input in dy's dtype."""
    act = act if isinstance(act, ClampedSwiGLU) else Activation(act)
    identity = kind_of(act) == Activation.IDENTITY
    if not identity:
        expected = _activation_out_shape(x.shape, act)
        if tuple(dy.shape) != expected:
            raise ValueError(f"activation_backward: grad_output must have shape {expected} for "
                             f"an input of shape {tuple(x.shape)} ({kind_of(act).name}), got "
                             f"{tuple(dy.shape)}")
    shape = tuple(dy.shape) if identity else tuple(x.shape)
    if fp8 is None:
        dx = jax.ShapeDtypeStruct(shape, dy.dtype) if rowwise else _empty(dy.dtype)
        results = (dx, _empty(dy.dtype), _empty(),
                   jax.ShapeDtypeStruct((1,), _F32) if compute_amax else _empty())
    else:
        results = _fp8_results(shape, fp8, rowwise, columnwise, compute_amax)
    k = shape[-1]
    dbias = (jax.ShapeDtypeStruct((k,), dbias_dtype) if dbias_dtype is not None
             else _empty(dy.dtype))
    args = (dy, jnp.zeros((0,), dy.dtype) if identity else x,
            scale if scale is not None else _zeros_f32(), _gate(gate))
    part = _partitioner()
    if part is not None:
        def body(dys, xs, sc, gt):
            return _activation_backward_call(dys, None if identity else xs, act,
                                             sc if fp8 is not None else None, fp8, dbias_dtype,
                                             rowwise=rowwise, columnwise=columnwise,
                                             compute_amax=compute_amax,
                                             gate=gt if gt.size else None)

        flat = list(results) + [dbias]
        if rowwise:
            flat[0] = jax.ShapeDtypeStruct((math.prod(shape[:-1]), k), results[0].dtype)
        x2 = args[1] if identity else _as_rows(x)
        out = list(part.activation_backward((_as_rows(dy), x2, *args[2:]), body, flat,
                                            gated=is_gated(act),
                                            rowwise=rowwise,
                                            columnwise=columnwise and fp8 is not None,
                                            compute_amax=compute_amax))
        if rowwise:
            out[0] = out[0].reshape(shape)
        return _raised("activation_backward", out, 3, amax_into)
    # (with dbias under a target that XLA leaves out of its CUDA graphs: _native.TARGETS)
    target = "activation_backward" if dbias_dtype is None else "activation_backward_dbias"
    return _call_raising_amax(target, (*results, dbias), args, 3, amax_into,
                              act=np.int32(kind_of(act)), rowwise=bool(rowwise),
                              columnwise=bool(columnwise) and fp8 is not None,
                              compute_amax=bool(compute_amax),
                              compute_dbias=dbias_dtype is not None, **_params_attrs(act))


def activation_backward(dy: jax.Array, x: Optional[jax.Array], act: Activation, *,
                        dbias_dtype=None, compute_amax: bool = False):
    """d act(x)/dx * dy in dy's dtype, with the bias gradient (its column sums, in
    ``dbias_dtype``; None: not computed) and max|grad_input| in the same pass.

    ``x`` is the forward's input in dy's dtype (unused, may be None, for IDENTITY). Returns
    ``(dx, dbias, amax)``; the ones not asked for are None.
    """
    dx, _, _, amax, dbias = _activation_backward_call(dy, x, act, None, None, dbias_dtype,
                                                      rowwise=True, columnwise=False,
                                                      compute_amax=compute_amax)
    return dx, (dbias if dbias_dtype is not None else None), (amax if compute_amax else None)


def activation_backward_amax(dy: jax.Array, x: jax.Array, act) -> jax.Array:
    """max|act'(x) * dy| ([1] fp32) of the fp32 values, without writing them: current
    scaling's first pass before the FP8 one."""
    return _activation_backward_call(dy, x, act, None, None, None, rowwise=False,
                                     columnwise=False, compute_amax=True)[3]


def activation_backward_fp8(dy: jax.Array, x: Optional[jax.Array], act: Activation,
                            scale: jax.Array, dtype, *, dbias_dtype=None, rowwise: bool = True,
                            columnwise: bool = True, compute_amax: bool = True,
                            gate: Optional[jax.Array] = None,
                            amax_into: Optional[jax.Array] = None):
    """:func:`activation_backward` whose grad_input comes out as per-tensor FP8 ``dtype``
    (row-wise and/or the transpose, scale_inv, amax: max(amax_into, this call's) with
    ``amax_into``, raised in its buffer as :func:`quantize` does), with the bias gradient of
    the fp32 values in the same pass. With IDENTITY this is the fused bias gradient + cast +
    transpose of a dense layer's grad_output. Returns ``(q, dbias)`` (dbias None unless
    ``dbias_dtype``)."""
    fp8 = jnp.dtype(dtype)
    _te_fp8(fp8)
    data, col, scale_inv, amax, dbias = _activation_backward_call(
        dy, x, act, scale, fp8, dbias_dtype, rowwise=rowwise, columnwise=columnwise,
        compute_amax=compute_amax, gate=gate, amax_into=amax_into)
    q = QuantizedTensor(data, col, scale_inv, _zeros_f32(), amax)
    return q, (dbias if dbias_dtype is not None else None)
