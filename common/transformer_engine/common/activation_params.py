"""The parameters of the one activation that takes any, clamped SwiGLU (GPT-OSS's; the core's
CLAMPED_SWIGLU, activation.h), read from NVIDIA's ``activation_params`` dict once for both
frameworks:

    g sigmoid(alpha g) * (u + glu_linear_offset),  g = min(a, limit),  u = clamp(b, -limit, limit)

Example:
    >>> from transformer_engine.common.activation_params import clamped_swiglu_params
    >>> clamped_swiglu_params({"limit": 0.75})
    ClampedSwiGLUParams(limit=0.75, alpha=1.702, linear_offset=1.0)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

__all__ = ["ClampedSwiGLUParams", "clamped_swiglu_params", "check_no_params", "KEYS"]

# NVIDIA's keys of activation_params -> the fields below.
KEYS = {"limit": "limit", "alpha": "alpha", "glu_linear_offset": "linear_offset"}


class ClampedSwiGLUParams(NamedTuple):
    """Checked parameters (the defaults are NVIDIA TE's and GPT-OSS's); the kernels use them in
    fp32."""

    limit: float = 7.0
    alpha: float = 1.702
    linear_offset: float = 1.0

    def checked(self) -> "ClampedSwiGLUParams":
        """These parameters as floats, or ValueError naming the bad one."""
        for name in ("limit", "alpha"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"clamped_swiglu: {name} must be a finite number > 0, got "
                                 f"{value!r}")
        if not (_is_number(self.linear_offset) and math.isfinite(self.linear_offset)):
            raise ValueError(f"clamped_swiglu: linear_offset must be a finite number, got "
                             f"{self.linear_offset!r}")
        return ClampedSwiGLUParams(*(float(v) for v in self))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def clamped_swiglu_params(params: Optional[dict]) -> ClampedSwiGLUParams:
    """Clamped SwiGLU's parameters from NVIDIA's ``activation_params`` (None: the defaults;
    any subset of ``limit``, ``alpha``, ``glu_linear_offset``); TypeError or ValueError naming
    what is wrong."""
    if params is None:
        return ClampedSwiGLUParams()
    if not hasattr(params, "items"):
        raise TypeError(f"activation_params must be a dict or None, got "
                        f"{type(params).__name__}")
    unknown = sorted(set(params) - set(KEYS))
    if unknown:
        raise ValueError(f"activation_params of clamped_swiglu takes the keys {tuple(KEYS)}, "
                         f"got unknown {unknown}")
    try:
        return ClampedSwiGLUParams(**{KEYS[k]: v for k, v in params.items()}).checked()
    except ValueError as e:
        raise ValueError(f"activation_params: {e}") from None


def check_no_params(activation, params: Optional[dict]) -> None:
    """ValueError when ``params`` are given for an activation that takes none."""
    if params is not None and not hasattr(params, "items"):
        raise TypeError(f"activation_params must be a dict or None, got "
                        f"{type(params).__name__}")
    if params:
        raise ValueError(f"activation_params apply to clamped_swiglu only; {activation!r} "
                         f"takes none, got {dict(params)!r}")
