"""The MLP block's activations as custom ops (``transformer_engine::activation_*``).

Inputs are matrices [M, K] (callers flatten leading dimensions). A gated activation
(``geglu``, ``swiglu``, ``reglu``) reads its input as [a, b] halves of K = 2N and writes N
columns. Each direction has a high-precision form and an FP8 form with a given per-tensor
scale (delayed scaling), which writes the FP8 data, its transpose and the amax in the same
pass: forward, the activation writes the next GEMM's input directly in FP8; backward, it
writes the previous GEMM's grad_output in FP8 together with the bias gradient ("dbias +
dactivation + cast + transpose"). ``identity`` makes the backward a linear layer's "dbias +
cast + transpose" of its grad_output. Semantics and bit-exactness: ``activation.h``.

``act`` is an activation's name, or for the one that takes parameters (clamped SwiGLU) the
name with its parameters as :func:`clamped_swiglu` writes it: a string is what a custom op's
argument can be, so the parameters travel with the name through every layer unchanged.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from transformer_engine.common.activation_params import ClampedSwiGLUParams

from ._backend import (
    amax_destination,
    amax_fake,
    check_fp8_dtype,
    core,
    custom_op,
    placeholder,
    raw,
    stream_of,
    te_dtype,
)

_NS = "transformer_engine"
ACTIVATIONS = ("identity", "gelu", "relu", "silu", "qgelu", "srelu", "geglu", "swiglu",
               "reglu", "qgeglu", "sreglu", "glu", "clamped_swiglu")
GATED = ("geglu", "swiglu", "reglu", "qgeglu", "sreglu", "glu", "clamped_swiglu")
# The activations that take parameters, with their names in order (activation.h).
PARAMETRIZED = {"clamped_swiglu": ("limit", "alpha", "linear_offset")}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def clamped_swiglu(limit: float = 7.0, alpha: float = 1.702, linear_offset: float = 1.0) -> str:
    """The ``act`` of clamped SwiGLU, ``g sigmoid(alpha g) * (u + linear_offset)`` with
    ``g = min(a, limit)`` and ``u = clamp(b, -limit, limit)`` (the defaults are NVIDIA TE's
    and GPT-OSS's). The parameters are used in fp32."""
    p = ClampedSwiGLUParams(limit, alpha, linear_offset).checked()
    return f"clamped_swiglu:{p.limit!r}:{p.alpha!r}:{p.linear_offset!r}"


@functools.lru_cache(maxsize=None)
def parse(act: str) -> tuple[str, Optional[tuple]]:
    """(name, parameters or None) of an ``act``; ValueError for one the core does not have."""
    name, _, rest = act.partition(":") if isinstance(act, str) else (act, "", "")
    if name not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if name not in PARAMETRIZED:
        if rest:
            raise ValueError(f"act {name!r} takes no parameters, got {act!r}")
        return name, None
    try:
        params = tuple(float(v) for v in rest.split(":"))
    except ValueError:
        params = ()
    if len(params) != len(PARAMETRIZED[name]):
        raise ValueError(f"act {name!r} needs its parameters {PARAMETRIZED[name]} (write it "
                         f"with ops.activation.{name}(...)), got {act!r}")
    return name, params


def is_gated(act: str) -> bool:
    return parse(act)[0] in GATED


def has_params(act: str) -> bool:
    """Whether ``act`` carries parameters (as clamped_swiglu writes them). A plain string test,
    no parse: the modules ask it in traced code, where torch.compile would look through
    parse's cache (the ops check the whole string)."""
    return ":" in act


def _check(op: str, x: torch.Tensor, act: str) -> int:
    """The output's column count, after checking the input."""
    try:
        parse(act)
    except ValueError as e:
        raise ValueError(f"{op}: {e}") from None
    if x.dim() != 2:
        raise ValueError(f"{op}: input must be a matrix [M, K], got shape {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: input must be float32, bfloat16 or float16, got {x.dtype}")
    if is_gated(act):
        if x.shape[1] % 2:
            raise ValueError(f"{op}: a gated activation ({act}) needs an even number of "
                             f"input columns [a, b], got shape {list(x.shape)}")
        return x.shape[1] // 2
    return x.shape[1]


def _check_grad(op: str, dy: torch.Tensor, x: torch.Tensor, act: str) -> None:
    n = _check(op, x, act)
    if dy.shape != (x.shape[0], n) or dy.dtype != x.dtype:
        raise ValueError(f"{op}: grad_output must be [{x.shape[0]}, {n}] in the input's dtype "
                         f"{x.dtype}, got {list(dy.shape)}, {dy.dtype}")


def _te_act(act: str):
    return getattr(core().Activation, parse(act)[0])


def _params(act: str):
    return parse(act)[1]


def _fp8_pair(x: torch.Tensor, m: int, n: int, rowwise: bool, columnwise: bool):
    if not (rowwise or columnwise):
        raise ValueError("activation: rowwise or columnwise must be True, got both False")
    data = x.new_empty((m, n), dtype=torch.uint8) if rowwise else placeholder(x)
    col = x.new_empty((n, m), dtype=torch.uint8) if columnwise else placeholder(x)
    return data, col


def _scalar(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, dtype=torch.float32)


def _dbias(x: torch.Tensor, with_dbias: bool) -> torch.Tensor:
    return x.new_empty((x.shape[1],) if with_dbias else (0,), dtype=torch.float32)


def _fp8_tensor(c, data, col, scale, scale_inv, raw_amax, fp8_dtype, rowwise, columnwise,
                gate=None):
    return c.Tensor(raw(data) if rowwise else None, dtype=te_dtype(fp8_dtype), scale=raw(scale),
                    scale_inv=raw(scale_inv), amax=raw_amax,
                    columnwise_data=raw(col) if columnwise else None,
                    gate=None if gate is None else raw(gate))


# ------------------------------------------------------------ forward


@custom_op(f"{_NS}::activation_forward", mutates_args=())
def activation_forward(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act(x)`` in x's dtype: [M, K] -> [M, K] (gated: [M, K / 2])."""
    n = _check("activation_forward", x, act)
    out = x.new_empty((x.shape[0], n))
    if x.numel() == 0:
        return out
    x = x.contiguous()  # kept alive across the call: raw() holds only its pointer
    core().activation_forward(_te_act(act), raw(x), raw(out), params=_params(act),
                              stream=stream_of(x))
    return out


@activation_forward.register_fake
def _(x, act):
    return x.new_empty((x.shape[0], _check("activation_forward", x, act)))


@custom_op(f"{_NS}::activation_forward_fp8", mutates_args=("amax_history",))
def activation_forward_fp8(
    x: torch.Tensor, act: str, scale: torch.Tensor, fp8_dtype: str, rowwise: bool,
    columnwise: bool, amax_history: Optional[torch.Tensor] = None, index: int = 0,
    gate: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 data of ``act(x) * scale`` (row-wise [M, N] and/or its transpose [N, M]),
    ``scale_inv`` and ``amax = max|act(x)|`` of the fp32 values: (data, col, scale_inv, amax).
    ``scale`` is [1] fp32. Given a delayed-scaling ``amax_history``, the amax is raised into
    ``amax_history[0, index]`` instead (and returned empty; see amax_destination). ``gate``
    ([1] fp32, the core's gate, tensor.h): the call runs only while it holds 0, else returns
    amax 0 and leaves the rest unwritten."""
    n = _check("activation_forward_fp8", x, act)
    check_fp8_dtype("activation_forward_fp8", fp8_dtype)
    data, col = _fp8_pair(x, x.shape[0], n, rowwise, columnwise)
    scale_inv = _scalar(x)
    amax, raw_amax, accumulate = amax_destination("activation_forward_fp8", x, amax_history,
                                                  index)
    c = core()
    x, scale = x.contiguous(), scale.contiguous()
    out = _fp8_tensor(c, data, col, scale, scale_inv, raw_amax, fp8_dtype, rowwise, columnwise,
                      gate)
    c.activation_forward(_te_act(act), raw(x), out, accumulate_amax=accumulate,
                         params=_params(act), stream=stream_of(x))
    return data, col, scale_inv, amax


@activation_forward_fp8.register_fake
def _(x, act, scale, fp8_dtype, rowwise, columnwise, amax_history=None, index=0, gate=None):
    n = _check("activation_forward_fp8", x, act)
    return (*_fp8_pair(x, x.shape[0], n, rowwise, columnwise), _scalar(x),
            amax_fake(x, amax_history))


# ------------------------------------------------------------ backward


def _input_arg(x: torch.Tensor, act: str) -> Optional[tuple]:
    return None if act == "identity" else raw(x)


@custom_op(f"{_NS}::activation_backward", mutates_args=())
def activation_backward(dy: torch.Tensor, x: torch.Tensor, act: str, with_dbias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``grad_input = act'(x) * dy`` [M, K] in x's dtype, and with ``with_dbias`` its fp32
    column sums [K] (else an empty tensor): (grad_input, dbias)."""
    _check_grad("activation_backward", dy, x, act)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dbias = _dbias(x, with_dbias)
    if x.shape[0] == 0:
        dbias.zero_()
        return dx, dbias
    dy, x = dy.contiguous(), x.contiguous()
    core().activation_backward(_te_act(act), raw(dy), _input_arg(x, act), raw(dx),
                               dbias=raw(dbias) if with_dbias else None, params=_params(act),
                               stream=stream_of(x))
    return dx, dbias


@activation_backward.register_fake
def _(dy, x, act, with_dbias):
    _check_grad("activation_backward", dy, x, act)
    return torch.empty_like(x, memory_format=torch.contiguous_format), _dbias(x, with_dbias)


@custom_op(f"{_NS}::activation_backward_fp8", mutates_args=("amax_history",))
def activation_backward_fp8(
    dy: torch.Tensor, x: torch.Tensor, act: str, scale: torch.Tensor, fp8_dtype: str,
    rowwise: bool, columnwise: bool, with_dbias: bool,
    amax_history: Optional[torch.Tensor] = None, index: int = 0,
    gate: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``grad_input = act'(x) * dy`` written as FP8 with ``scale`` (row-wise [M, K] and/or its
    transpose [K, M]) in one pass with its amax and (``with_dbias``) the fp32 column sums of
    the unscaled grad_input: (data, col, scale_inv, amax, dbias). For ``identity`` x is only
    read for its shape (its values may be anything, e.g. dy itself). ``amax_history`` and
    ``index`` and ``gate`` as for activation_forward_fp8."""
    op = "activation_backward_fp8"
    _check_grad(op, dy, x, act)
    check_fp8_dtype(op, fp8_dtype)
    m, k = x.shape
    data, col = _fp8_pair(x, m, k, rowwise, columnwise)
    return (data, col, *_backward_fp8(op, dy, x, act, scale, fp8_dtype, data, col, rowwise,
                                      columnwise, with_dbias, amax_history, index, gate))


def _backward_fp8(op, dy, x, act, scale, fp8_dtype, data, col, rowwise, columnwise, with_dbias,
                  amax_history, index, gate=None) -> tuple:
    """The core call of the FP8 activation backward into ``data`` / ``col``: (scale_inv, amax,
    dbias) as activation_backward_fp8 returns them."""
    scale_inv, dbias = _scalar(x), _dbias(x, with_dbias)
    amax, raw_amax, accumulate = amax_destination(op, x, amax_history, index)
    c = core()
    dy, x, scale = dy.contiguous(), x.contiguous(), scale.contiguous()
    out = _fp8_tensor(c, data, col, scale, scale_inv, raw_amax, fp8_dtype, rowwise, columnwise,
                      gate)
    c.activation_backward(_te_act(act), raw(dy), _input_arg(x, act), out,
                          dbias=raw(dbias) if with_dbias else None, accumulate_amax=accumulate,
                          params=_params(act), stream=stream_of(x))
    return scale_inv, amax, dbias


@activation_backward_fp8.register_fake
def _(dy, x, act, scale, fp8_dtype, rowwise, columnwise, with_dbias, amax_history=None,
      index=0, gate=None):
    _check_grad("activation_backward_fp8", dy, x, act)
    m, k = x.shape
    return (*_fp8_pair(x, m, k, rowwise, columnwise), _scalar(x), amax_fake(x, amax_history),
            _dbias(x, with_dbias))


@custom_op(f"{_NS}::activation_backward_fp8_into", mutates_args=("data", "amax_history"))
def activation_backward_fp8_into(
    data: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, act: str, scale: torch.Tensor,
    fp8_dtype: str, with_dbias: bool, amax_history: Optional[torch.Tensor] = None,
    index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """activation_backward_fp8 with its row-wise bytes written into ``data`` (contiguous
    uint8 of x's shape, e.g. rows of a larger buffer) instead of a new tensor, no column-wise
    copy: (scale_inv, amax, dbias). A gradient made in row chunks then needs no copy of each
    chunk into the whole."""
    op = "activation_backward_fp8_into"
    _check_grad(op, dy, x, act)
    check_fp8_dtype(op, fp8_dtype)
    if data.dtype != torch.uint8 or data.shape != x.shape or not data.is_contiguous():
        raise ValueError(f"{op}: data must be a contiguous uint8 tensor of x's shape "
                         f"{list(x.shape)}, got {data.dtype} {list(data.shape)}")
    return _backward_fp8(op, dy, x, act, scale, fp8_dtype, data, placeholder(x), True, False,
                         with_dbias, amax_history, index)


@activation_backward_fp8_into.register_fake
def _(data, dy, x, act, scale, fp8_dtype, with_dbias, amax_history=None, index=0):
    _check_grad("activation_backward_fp8_into", dy, x, act)
    return _scalar(x), amax_fake(x, amax_history), _dbias(x, with_dbias)


# ------------------------------------------------------------ current scaling's scale


def _scale_from_amax(c, x: torch.Tensor, amax: torch.Tensor, fp8_dtype: str,
                     force_pow2_scales: bool, amax_epsilon: float) -> torch.Tensor:
    scale, scale_inv = _scalar(x), _scalar(x)
    # The core reads the FP8 format from the data slot: an empty buffer of that format.
    out = c.Tensor(raw(placeholder(x)), dtype=te_dtype(fp8_dtype), scale=raw(scale),
                   scale_inv=raw(scale_inv), amax=raw(amax))
    c.compute_scale_from_amax(out, force_pow2_scales=force_pow2_scales,
                              amax_epsilon=amax_epsilon, stream=stream_of(x))
    return scale


@custom_op(f"{_NS}::activation_scale", mutates_args=())
def activation_scale(x: torch.Tensor, act: str, fp8_dtype: str, force_pow2_scales: bool,
                     amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling's scale of ``act(x)`` without writing it: (scale, amax), each [1]
    fp32, from the activation's amax-only pass (the fp32 values' amax, activation.h); the
    FP8 pass with that scale (activation_forward_fp8) follows."""
    _check("activation_scale", x, act)
    check_fp8_dtype("activation_scale", fp8_dtype)
    c = core()
    amax = _scalar(x)
    x = x.contiguous()
    c.activation_forward(_te_act(act), raw(x), c.Tensor(amax=raw(amax)), params=_params(act),
                         stream=stream_of(x))
    return _scale_from_amax(c, x, amax, fp8_dtype, force_pow2_scales, amax_epsilon), amax


@activation_scale.register_fake
def _(x, act, fp8_dtype, force_pow2_scales, amax_epsilon):
    return _scalar(x), _scalar(x)


@custom_op(f"{_NS}::activation_backward_scale", mutates_args=())
def activation_backward_scale(dy: torch.Tensor, x: torch.Tensor, act: str, fp8_dtype: str,
                              force_pow2_scales: bool, amax_epsilon: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`activation_scale` of the backward's ``act'(x) * dy``: (scale, amax)."""
    _check_grad("activation_backward_scale", dy, x, act)
    check_fp8_dtype("activation_backward_scale", fp8_dtype)
    c = core()
    amax = _scalar(x)
    dy, x = dy.contiguous(), x.contiguous()
    c.activation_backward(_te_act(act), raw(dy), _input_arg(x, act), c.Tensor(amax=raw(amax)),
                          params=_params(act), stream=stream_of(x))
    return _scale_from_amax(c, x, amax, fp8_dtype, force_pow2_scales, amax_epsilon), amax


@activation_backward_scale.register_fake
def _(dy, x, act, fp8_dtype, force_pow2_scales, amax_epsilon):
    return _scalar(x), _scalar(x)
