"""Argument checks shared by the te modules, so that a bad argument is reported in the
module's own words (module, argument, what it takes, what it got) rather than by an error
from deep inside torch or the core."""

from __future__ import annotations

import operator
from typing import Optional

import torch


def check_sizes(op: str, **sizes) -> None:
    """Each size must be a positive int (a zero or negative one would make empty or invalid
    parameters, or divide by zero later)."""
    for name, value in sizes.items():
        try:  # ints of any kind (numpy's too), not floats or bools
            ok = not isinstance(value, bool) and operator.index(value) > 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{op}: {name} must be positive (an int > 0), got {value!r}")


def check_params_dtype(op: str, dtype: Optional[torch.dtype]) -> None:
    """Parameters must be floating point: they are trained and multiply activations."""
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"{op}: params_dtype must be a floating-point torch.dtype (float32, "
                        f"bfloat16 or float16), got {dtype}")


def check_device(op: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    """``t`` must be on ``ref``'s device (the module's parameters). A meta tensor has no data
    for the kernels; get_device() gives -1 for both it and a CPU tensor, hence is_meta."""
    if t.is_meta != ref.is_meta or t.get_device() != ref.get_device():
        raise RuntimeError(f"{op}: {name} must be on the device of the module's parameters "
                           f"({ref.device}), got {t.device}")


def check_float_input(op: str, name: str, t: torch.Tensor) -> None:
    """An integer or bool input would be multiplied with weights cast to its dtype."""
    if not t.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be a floating-point tensor (float32, bfloat16 or "
                        f"float16), got {t.dtype}")


def refuse_non_defaults(op: str, why: str, **given) -> None:
    """NotImplementedError naming the first argument given a value other than its default
    (``given``: name -> (value, default)): NVIDIA's keywords for features not built here are
    accepted at their defaults only, never silently ignored."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            raise NotImplementedError(f"{op}: {name}={value!r} is not supported here (only "
                                      f"{default!r}); {why}")



# NVIDIA TE's module keywords for features not built here: (default, why anything else is
# refused). A program that passes them at their defaults runs unchanged.
_UNBUILT = {
    **{name: (False, "userbuffers communication overlap is not implemented")
       for name in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                    "ub_bulk_wgrad")},
    "symmetric_ar_type": (None, "symmetric-memory all-reduce is not implemented (the "
                                "tensor-parallel all-reduce is torch.distributed's)"),
}


def refuse_unbuilt(op: str, **given) -> None:
    """NotImplementedError naming the first of NVIDIA's keywords for a feature not built here
    (``_UNBUILT``) that was given a value other than its default: accepted at their
    defaults, never silently ignored."""
    for name, value in given.items():
        default, why = _UNBUILT[name]
        refuse_non_defaults(op, why, **{name: (value, default)})
