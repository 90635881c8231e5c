"""Rotary position embedding as custom ops (``transformer_engine::rope_forward`` /
``rope_backward``), over the core's ``te_rope_forward`` / ``te_rope_backward``.

``x`` is [s, b, h, d] (``"sbhd"``), [b, s, h, d] (``"bshd"``) or [t, h, d] (``"thd"``, with
``cu_seqlens`` [b + 1]); ``freqs`` is the float32 matrix [P, R] of angles by position and
feature; ``start_positions`` [b] optionally offsets each sequence's positions. The backward
applies the transpose of the forward's rotation to the gradient (the rotation by minus the
angle). Both are functional and have fake implementations, so ``torch.compile`` traces them
as single graph nodes. Semantics, numerics and the checks of positions: ``rope.h`` of the core
(the CPU path checks ``cu_seqlens`` and ``start_positions`` values; the CUDA path cannot
without a synchronization and writes NaN for a token without a valid position).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._backend import _enum, core, custom_op, raw, stream_of

_NS = "transformer_engine"
FORMATS = ("sbhd", "bshd", "thd")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(op: str, x: torch.Tensor, freqs: torch.Tensor, tensor_format: str) -> None:
    """What the fake implementation can check too (shapes and dtypes, not values)."""
    if tensor_format not in FORMATS:
        raise ValueError(f"{op}: tensor_format must be one of {FORMATS}, got {tensor_format!r}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if freqs.dim() != 2 or freqs.dtype != torch.float32:
        raise ValueError(f"{op}: freqs must be a float32 matrix [P, R], got {freqs.dtype} of "
                         f"shape {list(freqs.shape)}")


def _index(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """cu_seqlens / start_positions as the core reads them: int32 on x's device."""
    if t is None:
        return None
    return t.to(device=device, dtype=torch.int32).contiguous()


def _run(op: str, backward: bool, x: torch.Tensor, freqs: torch.Tensor, tensor_format: str,
         interleaved: bool, cu_seqlens: Optional[torch.Tensor],
         start_positions: Optional[torch.Tensor]) -> torch.Tensor:
    _check(op, x, freqs, tensor_format)
    # Locals keep every tensor alive across the call: raw() holds bare pointers.
    x, freqs = x.contiguous(), freqs.contiguous()
    cu, start = _index(cu_seqlens, x.device), _index(start_positions, x.device)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    c = core()
    call = c.rope_backward if backward else c.rope_forward
    call(_enum("RopeFormat", tensor_format), raw(x), raw(freqs), raw(y), interleaved=interleaved,
         cu_seqlens=None if cu is None else raw(cu),
         start_positions=None if start is None else raw(start), stream=stream_of(x))
    return y


@custom_op(f"{_NS}::rope_forward", mutates_args=())
def rope_forward(x: torch.Tensor, freqs: torch.Tensor, tensor_format: str, interleaved: bool,
                 cu_seqlens: Optional[torch.Tensor], start_positions: Optional[torch.Tensor]
                 ) -> torch.Tensor:
    """x with the first R = freqs.shape[1] features of each head rotated; x's shape and dtype."""
    return _run("rope_forward", False, x, freqs, tensor_format, interleaved, cu_seqlens,
                start_positions)


@rope_forward.register_fake
def _(x, freqs, tensor_format, interleaved, cu_seqlens, start_positions):
    _check("rope_forward", x, freqs, tensor_format)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op(f"{_NS}::rope_backward", mutates_args=())
def rope_backward(dy: torch.Tensor, freqs: torch.Tensor, tensor_format: str, interleaved: bool,
                  cu_seqlens: Optional[torch.Tensor], start_positions: Optional[torch.Tensor]
                  ) -> torch.Tensor:
    """grad_input of rope_forward from grad_output dy; dy's shape and dtype."""
    return _run("rope_backward", True, dy, freqs, tensor_format, interleaved, cu_seqlens,
                start_positions)


@rope_backward.register_fake
def _(dy, freqs, tensor_format, interleaved, cu_seqlens, start_positions):
    _check("rope_backward", dy, freqs, tensor_format)
    return torch.empty_like(dy, memory_format=torch.contiguous_format)
