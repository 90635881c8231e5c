"""Which backend runs a DotProductAttention call, and why not the others.

Backends, tried in this order unless one is asked for:

* ``"cudnn"``: the core's entry point on cuDNN's fused kernels (CUDA, when the build has cuDNN).
* ``"cpu"``: the core's entry point on its CPU reference (CPU tensors).
* ``"unfused"``: torch matmuls around the core's scaled masked softmax (any device; no FP8).
* ``"cuda_math"``: the core's entry point on its plain CUDA math path (slow; any mask, FP8).

Ask for one with the ``attention_backend`` argument or the ``TE_ATTENTION_BACKEND``
environment variable (the argument wins). :func:`~transformer_engine.pytorch.get_attention_backend`
returns the choice and, for every backend passed over, the reason; ``TE_DEBUG_ATTENTION=1``
logs the same at each new choice (logger ``transformer_engine.attention``). Both variables are
read here and nowhere else. Choices are kept per kind of call (``_CHOICES``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Optional

import torch

from ..ops._backend import core
from ..ops.attention import config, sizes_of

BACKENDS = ("cudnn", "cpu", "unfused", "cuda_math")
_CORE_INDEX = {"cudnn": 0, "cuda_math": 1, "cpu": 2}
_TE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_LOG = logging.getLogger("transformer_engine.attention")


def env_backend() -> str:
    return os.environ.get("TE_ATTENTION_BACKEND", "auto")


def _debug() -> bool:
    return os.environ.get("TE_DEBUG_ATTENTION", "0") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """The backend a call runs on (``name``) and, per backend, ``""`` when it could take the
    call or the reason it cannot."""

    name: Optional[str]
    reasons: dict


def _backward_reasons(c, cfg, sizes, hp, device, fp8_grad: str) -> dict:
    """Per core backend, "" or why it cannot run the backward. The FP8 backward
    (attention_fn.py) takes E4M3 q, k, v, o and d_o in the recipe's gradient format
    ``fp8_grad``; cuDNN writes its gradients in that format too, the CPU and the CUDA math
    path in the input dtype."""
    if not fp8_grad:
        _, why, _ = c.attention_backend(cfg, sizes, hp, hp, hp, device_id=device, backward=True)
        return {name: why[i] for name, i in _CORE_INDEX.items()}
    e4m3, g8 = c.DType.float8_e4m3, getattr(c.DType, fp8_grad)
    reasons = {}
    for grad, names in ((g8, ("cudnn",)), (hp, ("cpu", "cuda_math"))):
        _, why, _ = c.attention_backend(cfg, sizes, e4m3, e4m3, grad, do_dtype=g8,
                                        device_id=device, backward=True)
        reasons.update({name: why[_CORE_INDEX[name]] for name in names})
    return reasons


def _core_reasons(key: tuple, grad: bool) -> dict:
    (layout, mask, wl, wr, scale, dropout, sizes, dtype, device, fp8_grad) = key
    c = core()
    cfg = config(layout, "padding" if mask == "arbitrary" else mask, wl, wr, scale, dropout,
                 sizes[3], sizes[4])
    hp = getattr(c.DType, dtype)
    # The FP8 forward writes o in E4M3 too (attention_fn.py).
    qkv = o = c.DType.float8_e4m3 if fp8_grad else hp
    try:
        _, why, _ = c.attention_backend(cfg, list(sizes), qkv, o, hp, device_id=device)
        why_b = _backward_reasons(c, cfg, list(sizes), hp, device, fp8_grad) if grad else {}
    except (TypeError, ValueError) as e:  # a request no core backend takes (FP8 of fp32, ...)
        return {name: str(e) for name in _CORE_INDEX}
    reasons = {name: why[i] for name, i in _CORE_INDEX.items()}
    for name, reason in why_b.items():
        if not reasons[name] and reason:
            reasons[name] = "backward: " + reason
    if mask == "arbitrary":
        for name in _CORE_INDEX:
            reasons[name] = reasons[name] or "arbitrary masks run on the unfused path only"
    return reasons


_CHOICES: dict = {}


@torch._dynamo.assume_constant_result
def choose_backend(key: tuple, grad: bool, asked: str) -> str:
    """The backend's name for a call (or an error message starting with '!')."""
    hit = _CHOICES.get((key, grad, asked))
    if hit is not None:
        return hit.name or "!"
    reasons = _core_reasons(key, grad)
    reasons["unfused"] = "the unfused path has no FP8" if key[-1] else ""
    order = BACKENDS if asked == "auto" else (asked,)
    name = next((b for b in order if not reasons[b]), None)
    info = AttentionBackend(name, reasons)
    _CHOICES[(key, grad, asked)] = info
    if _debug():
        _LOG.warning("DotProductAttention: %s (asked %s; reasons: %s)", name, asked, reasons)
    return name or "!"


def backend_key(q, k, v, layout, mask, window, scale, dropout, cu_q, max_sq, max_skv,
         fp8_grad: str) -> tuple:
    """The backend choice's key; fp8_grad is "" without FP8, else the recipe's gradient
    format ("float8_e5m2" under HYBRID)."""
    sizes = tuple(int(s) for s in sizes_of(q, k, v, layout, cu_q, max_sq, max_skv))
    if q.dtype not in _TE_NAMES:
        raise TypeError(f"DotProductAttention: query must be float32, float16 or bfloat16, got "
                        f"{q.dtype}")
    device = q.device.index if q.is_cuda else -1
    return (layout, mask, window[0], window[1], float(scale), float(dropout), sizes,
            _TE_NAMES[q.dtype], device, fp8_grad)


_FP8_FALLBACK_WARNED: set = set()


def _fp8_falls_back(key: tuple, grad: bool, asked: str, on_cuda: bool) -> bool:
    """Whether an FP8 call runs cuDNN's attention in high precision instead: when the
    automatic choice finds no fused FP8 kernel for it on a GPU (FP8 backward at a head dim
    other than 128 on sm_90, FP8 with dropout on sm_90, ...) but cuDNN runs it in high
    precision. The FP8 alternative would be the core's math path, correct but one to two
    orders of magnitude slower. Warns once per reason; an explicit attention_backend keeps
    what it asked for."""
    if asked != "auto" or not on_cuda or choose_backend(key, grad, asked) not in ("cuda_math", "!"):
        return False
    if choose_backend(key[:-1] + ("",), grad, asked) != "cudnn":
        return False
    why = _CHOICES[(key, grad, asked)].reasons.get("cudnn", "")
    if why not in _FP8_FALLBACK_WARNED:
        _FP8_FALLBACK_WARNED.add(why)
        warnings.warn(f"DotProductAttention: FP8 attention runs in high precision on cuDNN "
                      f"for this call (cuDNN has no FP8 kernel for it: {why}); pass "
                      "attention_backend='cuda_math' for the core's slow FP8 path",
                      stacklevel=4)
    return True
