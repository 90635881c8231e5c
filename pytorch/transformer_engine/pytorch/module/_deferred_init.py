"""``reset_parameters()``: initialize a module built on ``device="meta"`` (deferred init).

A te module constructed on the meta device has no data; after ``module.to_empty(device=...)``
its parameters and FP8 state hold garbage. ``reset_parameters()`` gives them the values the
constructor would have given on that device: it builds a fresh module with the same
arguments there and copies its parameters and buffers in place (the parameters stay the
objects an optimizer may already hold). A fresh build, rather than an initializer per
parameter, keeps one source of truth for what initialization means (the init methods, the
zeroed biases of the attention and MLP blocks, the tensor-parallel slices, the empty FP8
state) and draws from the generator exactly as construction does.
"""

from __future__ import annotations

import functools
import itertools

import torch

from .. import first_step

__all__ = ["DeferredInit"]


class _InitCall:
    """The constructor's arguments. Shared by copies of the module (a tensor-parallel group
    cannot be deep-copied, and the arguments are never changed), and not pickled (user
    callables such as an ``init_method`` lambda may not pickle): an unpickled module cannot
    reset."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.args, self.kwargs = args, kwargs

    def __deepcopy__(self, memo) -> "_InitCall":
        return self

    def __reduce__(self):
        return _forgotten, ()


def _forgotten() -> None:
    return None


class DeferredInit:
    """Mixin of the te modules: remembers the constructor's arguments, and resets from them."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        original = cls.__dict__.get("__init__")
        if original is None:
            return

        @functools.wraps(original)
        def __init__(self, *args, **kw):
            original(self, *args, **kw)
            # The outermost constructor returns last, so the call recorded is the user's.
            self.__dict__["_init_call"] = _InitCall(args, kw)

        cls.__init__ = __init__

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Gives the parameters and FP8 state the values the constructor makes on the device
        they are on now (after ``to_empty``); ``defer_init=True`` does nothing (NVIDIA's
        argument for leaving it to a later call)."""
        if defer_init:
            return
        name = getattr(self, "_name", None) or type(self).__name__
        tensors = itertools.chain(self.parameters(), self.buffers())
        device = next((t.device for t in tensors), None)
        if device is None:
            return
        if device.type == "meta":
            raise RuntimeError(f"{name}.reset_parameters: the module is on the meta device; "
                               "move it first with module.to_empty(device=...)")
        call = self.__dict__.get("_init_call")
        if call is None:
            raise RuntimeError(f"{name}.reset_parameters: the constructor's arguments are not "
                               "kept across pickling; build the module again instead")
        fresh = type(self)(*call.args, **{**call.kwargs, "device": device})
        with torch.no_grad():
            for (key, p), q in zip(self.named_parameters(), fresh.parameters(), strict=True):
                if p.shape != q.shape:
                    raise RuntimeError(f"{name}.reset_parameters: {key} has shape "
                                       f"{list(p.shape)}, the constructor makes "
                                       f"{list(q.shape)}")
                p.copy_(_like(q, p))
            for b, c in zip(self.buffers(), fresh.buffers(), strict=True):
                b.copy_(c)
                first_step.move_marks(c, b)
        for mine, new in zip(self.modules(), fresh.modules(), strict=True):
            for attr in ("_fp8_first_step", "_fp8_recipe", "_fp8_plan"):
                if attr in new.__dict__:
                    mine.__dict__[attr] = new.__dict__[attr]
            caches = mine.__dict__.get("_weight_caches")
            if caches:
                caches.clear()


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` laid out as ``param``: a DTensor parameter (FSDP2's shard) gets this rank's
    share of the whole value, which every rank made alike (so each takes its share of its own
    copy: no communication)."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, mesh, param.placements, src_data_rank=None)

