"""LayerNorm and RMSNorm as custom ops (``transformer_engine::norm_forward`` / ``norm_backward``).

The input is a matrix [M, N] normalized over its rows (callers flatten leading dimensions);
``norm`` is ``"layernorm"`` or ``"rmsnorm"``. Like the other ops these are functional (fresh
outputs, no argument mutated) with fake implementations for tracing. The statistics of the
forward, ``mu`` and ``rsigma`` ([M] fp32), are what the backward reads; RMSNorm has no
``mu``, and its ``mu`` and ``grad_beta`` come back as empty tensors (custom ops cannot return
None). Semantics, dtypes and the deterministic summation order: ``norm.h`` of the core.

``norm_forward_fp8`` writes the normalized output directly as per-tensor FP8 with a given
scale (delayed scaling), and its transpose and amax, in the same pass: the input of the GEMM
that follows, row-wise for the forward and column-wise for its wgrad.
"""

from __future__ import annotations

from typing import Optional

import torch

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
NORMS = ("layernorm", "rmsnorm")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(op: str, x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor],
           norm: str, forward: bool) -> None:
    if norm not in NORMS:
        raise ValueError(f"{op}: norm must be one of {NORMS}, got {norm!r}")
    if x.dim() != 2:
        raise ValueError(f"{op}: input must be a matrix [M, N], got shape {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: input must be float32, bfloat16 or float16, got {x.dtype}")
    n = x.shape[1]
    if gamma.shape != (n,):
        raise ValueError(f"{op}: gamma must have shape [{n}] (the input's last dimension), "
                         f"got {list(gamma.shape)}")
    if gamma.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{op}: gamma must be float32 or the input's dtype {x.dtype}, got "
                        f"{gamma.dtype}")
    if norm == "rmsnorm" and beta is not None:
        raise ValueError(f"{op}: RMSNorm takes no beta")
    if forward and norm == "layernorm" and beta is None:
        raise ValueError(f"{op}: LayerNorm needs beta (zeros for none)")
    if beta is not None and (beta.shape != gamma.shape or beta.dtype != gamma.dtype):
        raise ValueError(f"{op}: beta must match gamma ({list(gamma.shape)}, {gamma.dtype}), "
                         f"got {list(beta.shape)}, {beta.dtype}")


def _stats(x: torch.Tensor, norm: str) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    mu = x.new_empty((m if norm == "layernorm" else 0,), dtype=torch.float32)
    return mu, x.new_empty((m,), dtype=torch.float32)


def _te_norm(norm: str):
    return getattr(core().Norm, norm)


@custom_op(f"{_NS}::norm_forward", mutates_args=())
def norm_forward(x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], norm: str,
                 eps: float, zero_centered_gamma: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y in x's dtype, mu [M] fp32 (empty for RMSNorm), rsigma [M] fp32). beta is
    required for LayerNorm and must be None for RMSNorm."""
    _check("norm_forward", x, gamma, beta, norm, True)
    if eps < 0:
        raise ValueError(f"norm_forward: eps must be >= 0, got {eps}")
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mu, rsigma = _stats(x, norm)
    if x.numel() == 0:
        return y, mu, rsigma
    # Locals keep every tensor alive across the call: raw() holds bare pointers.
    x, gamma = x.contiguous(), gamma.contiguous()
    beta = None if beta is None else beta.contiguous()
    core().norm_forward(_te_norm(norm), raw(x), raw(gamma), None if beta is None else raw(beta),
                        output=raw(y), mu=raw(mu) if norm == "layernorm" else None,
                        rsigma=raw(rsigma), eps=eps, zero_centered_gamma=zero_centered_gamma,
                        stream=stream_of(x))
    return y, mu, rsigma


@norm_forward.register_fake
def _(x, gamma, beta, norm, eps, zero_centered_gamma):
    _check("norm_forward", x, gamma, beta, norm, True)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), *_stats(x, norm))


def _fp8_outputs(x: torch.Tensor, columnwise: bool, with_output: bool):
    """y (or an empty tensor), data, col (or an empty tensor), scale_inv; amax comes from
    amax_destination."""
    m, n = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if with_output \
        else placeholder(x)
    data = x.new_empty((m, n), dtype=torch.uint8)
    col = x.new_empty((n, m), dtype=torch.uint8) if columnwise else placeholder(x)
    return y, data, col, x.new_empty(1, dtype=torch.float32)


@custom_op(f"{_NS}::norm_forward_fp8", mutates_args=("amax_history",))
def norm_forward_fp8(
    x: torch.Tensor, gamma: torch.Tensor, beta: Optional[torch.Tensor], norm: str, eps: float,
    zero_centered_gamma: bool, scale: torch.Tensor, fp8_dtype: str, columnwise: bool,
    with_output: bool, amax_history: Optional[torch.Tensor] = None, index: int = 0,
    gate: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """The normalized output as FP8 ``y * scale`` ([M, N] and, with ``columnwise``, its
    transpose [N, M]), computed from the same fp32 y as the high-precision output (in x's
    dtype, only ``with_output``; else an empty tensor). ``scale`` is [1] fp32. Returns
    (y, data, col, scale_inv, amax = max|y|, mu, rsigma). Given a delayed-scaling
    ``amax_history``, the amax is raised into ``amax_history[0, index]`` instead (and returned
    empty; see amax_destination). ``gate`` ([1] fp32, the core's gate, tensor.h): the call
    runs only while it holds 0, else returns amax 0 and leaves the rest unwritten."""
    _check("norm_forward_fp8", x, gamma, beta, norm, True)
    check_fp8_dtype("norm_forward_fp8", fp8_dtype)
    if eps < 0:
        raise ValueError(f"norm_forward_fp8: eps must be >= 0, got {eps}")
    y, data, col, scale_inv = _fp8_outputs(x, columnwise, with_output)
    amax, raw_amax, accumulate = amax_destination("norm_forward_fp8", x, amax_history, index)
    mu, rsigma = _stats(x, norm)
    if x.numel() == 0:  # no rows: nothing to normalize, the amax of nothing is 0
        if not accumulate:
            amax.zero_()
        torch.reciprocal(scale.float(), out=scale_inv)
        return y, data, col, scale_inv, amax, mu, rsigma
    c = core()
    x, gamma, scale = x.contiguous(), gamma.contiguous(), scale.contiguous()
    beta = None if beta is None else beta.contiguous()
    out = c.Tensor(raw(data), dtype=te_dtype(fp8_dtype), scale=raw(scale),
                   scale_inv=raw(scale_inv), amax=raw_amax,
                   columnwise_data=raw(col) if columnwise else None,
                   gate=None if gate is None else raw(gate))
    c.norm_forward(_te_norm(norm), raw(x), raw(gamma), None if beta is None else raw(beta),
                   output=raw(y) if with_output else None, output_fp8=out,
                   mu=raw(mu) if norm == "layernorm" else None, rsigma=raw(rsigma), eps=eps,
                   zero_centered_gamma=zero_centered_gamma, accumulate_amax=accumulate,
                   stream=stream_of(x))
    return y, data, col, scale_inv, amax, mu, rsigma


@norm_forward_fp8.register_fake
def _(x, gamma, beta, norm, eps, zero_centered_gamma, scale, fp8_dtype, columnwise,
      with_output, amax_history=None, index=0, gate=None):
    _check("norm_forward_fp8", x, gamma, beta, norm, True)
    return (*_fp8_outputs(x, columnwise, with_output), amax_fake(x, amax_history),
            *_stats(x, norm))


def _grads(x: torch.Tensor, gamma: torch.Tensor, norm: str):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dgamma = torch.empty_like(gamma, memory_format=torch.contiguous_format)
    dbeta = torch.empty_like(dgamma) if norm == "layernorm" else gamma.new_empty((0,))
    return dx, dgamma, dbeta


@custom_op(f"{_NS}::norm_backward", mutates_args=())
def norm_backward(dy: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
                  gamma: torch.Tensor, norm: str, zero_centered_gamma: bool,
                  grad_input_add: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (grad_input in x's dtype, grad_gamma and grad_beta in gamma's dtype; grad_beta
    empty for RMSNorm) from the forward's x, mu (ignored for RMSNorm) and rsigma.
    ``grad_input_add`` (x's shape and dtype): a residual gradient added into grad_input, with
    the bits of ``grad_input_add + grad_input`` taken in a step of its own."""
    _check("norm_backward", x, gamma, None, norm, False)
    for name, t in (("grad_output", dy), ("grad_input_add", grad_input_add)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(f"norm_backward: {name} must match the input ({list(x.shape)}, "
                             f"{x.dtype}), got {list(t.shape)}, {t.dtype}")
    dx, dgamma, dbeta = _grads(x, gamma, norm)
    if x.numel() == 0:  # no rows: the column sums are empty sums
        dgamma.zero_()
        dbeta.zero_()
        return dx, dgamma, dbeta
    c = core()
    rows, cols = x.shape
    workspace = None
    if x.is_cuda:
        size = int(c.norm_backward_workspace_size(rows, cols))
        workspace = torch.empty((max(size, 1),), dtype=torch.uint8, device=x.device)
    dy, x, rsigma, gamma = dy.contiguous(), x.contiguous(), rsigma.contiguous(), gamma.contiguous()
    mu = mu.contiguous() if norm == "layernorm" else None
    add_t = None if grad_input_add is None else grad_input_add.contiguous()  # (alive for the call)
    add = None if add_t is None else raw(add_t)
    c.norm_backward(_te_norm(norm), raw(dy), raw(x), None if mu is None else raw(mu),
                    raw(rsigma), raw(gamma), grad_input=raw(dx), grad_gamma=raw(dgamma),
                    grad_beta=raw(dbeta) if norm == "layernorm" else None, grad_input_add=add,
                    zero_centered_gamma=zero_centered_gamma,
                    workspace=None if workspace is None else raw(workspace),
                    stream=stream_of(x))
    return dx, dgamma, dbeta


@norm_backward.register_fake
def _(dy, x, mu, rsigma, gamma, norm, zero_centered_gamma, grad_input_add=None):
    _check("norm_backward", x, gamma, None, norm, False)
    return _grads(x, gamma, norm)
