"""Calling an autograd.Function with less host time.

``Function.apply`` is a Python classmethod around the C++ ``_FunctionBase.apply``: it looks
for a ``setup_context``, and walks every argument (a pytree map) to unwrap tensors of finished
functorch transforms. For a module's autograd node in an eager step that layer costs about
2 us of host time per call on the development machine, as much as a third of what the
node's C++ side costs, and a small model's step is bound by host time. ``eager_apply`` calls
the C++ apply straight away where that layer would change nothing: no functorch transform is
active, the first argument (the one that comes from user code; the others are the module's own
parameters and state) is not a functorch wrapper, and torch.compile is not tracing (Dynamo
knows ``Function.apply``, not the C++ one). Elsewhere it calls ``Function.apply``.

It suits functions without ``setup_context`` (whose ``forward`` takes ``ctx``), as all of
this package's are.
"""

from __future__ import annotations

from typing import Callable

import torch

_C_APPLY = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
_functorch_active = torch._C._are_functorch_transforms_active
_is_wrapper = torch._C._functorch.is_functorch_wrapped_tensor
_is_compiling = torch.compiler.is_compiling


def eager_apply(function: type[torch.autograd.Function]) -> Callable:
    """``function.apply``, through the C++ apply where nothing else would differ."""
    slow = function.apply
    if _C_APPLY is None:  # (a torch without the C++ base class under that name)
        return slow
    fast = _C_APPLY.__get__(None, function)

    def apply(*args):
        if _is_compiling() or _functorch_active() or _is_wrapper(args[0]):
            return slow(*args)
        return fast(*args)

    apply.__doc__ = f"{function.__name__}.apply (autograd node of one call)"
    return apply
