"""``te.checkpoint``: activation recompute that gives the gradients of running without it.

The block runs once without keeping its activations and again in the backward, where its
saved tensors are needed. For te modules "again" must mean "the same": under delayed scaling
the autocast exit has updated the forward scales between the two runs, so the recompute
quantizes with copies of the scales the first run used (taken by the modules, fp8.RECOMPUTE)
and records no amax and registers nothing for the update (the first run did, once). The FP8
context (enabled, recipe, amax group) of the call is restored for the recompute, and so is the
RNG state (torch's checkpoint saves it; dropout masks repeat), together with the states of a
user's RNG tracker when one is given. With these, every recomputed FP8 operand has the bytes
of the first run's and the gradients are bit-identical to a run without recompute.

The recompute is torch's non-reentrant checkpoint (torch.utils.checkpoint), which this adds
the two contexts to.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch.utils.checkpoint

from . import fp8

__all__ = ["checkpoint"]


class _FirstRun(contextlib.AbstractContextManager):
    """The first run: modules append the forward scales they used to ``scales``."""

    def __init__(self, scales: list, tracker, tracker_states: dict) -> None:
        self.scales, self.tracker, self.tracker_states = scales, tracker, tracker_states

    def __enter__(self):
        if self.tracker is not None:
            self.tracker_states.update(self.tracker.get_states())
        fp8.RECOMPUTE.recording, fp8.RECOMPUTE.sources = self.scales, []
        return self

    def __exit__(self, *exc) -> None:
        fp8.RECOMPUTE.recording = fp8.RECOMPUTE.sources = None


class _Recompute(contextlib.AbstractContextManager):
    """The recompute: the FP8 context of the call, the first run's scales, no recording."""

    def __init__(self, scales: list, autocast: tuple, tracker, tracker_states: dict) -> None:
        self.scales, self.autocast = scales, autocast
        self.tracker, self.tracker_states = tracker, tracker_states

    def __enter__(self):
        state, r = fp8.STATE, fp8.RECOMPUTE
        self.saved = (state.enabled, state.calibrating, state.recipe, state.group,
                      r.recording, r.replay, r.index)
        state.enabled, state.recipe, state.group = self.autocast
        state.calibrating = False  # the first run calibrated already
        r.recording, r.replay, r.index = None, self.scales, 0
        if self.tracker is not None:
            self.saved_tracker = self.tracker.get_states()
            self.tracker.set_states(self.tracker_states)
        return self

    def __exit__(self, *exc) -> None:
        state, r = fp8.STATE, fp8.RECOMPUTE
        (state.enabled, state.calibrating, state.recipe, state.group, r.recording, r.replay,
         r.index) = self.saved
        if self.tracker is not None:
            self.tracker.set_states(self.saved_tracker)


def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable[[], Any]] = None, tp_group: Any = None,
               use_reentrant: Optional[bool] = None, **kwargs):
    """``function(*args, **kwargs)``, its activations recomputed in the backward instead of
    kept, with the FP8 scales and RNG state of this call (see the module docstring).

    Args:
        function: the block; it must run the same te modules each time it is called.
        args, kwargs: passed to ``function``.
        distribute_saved_activations: splitting the saved inputs over a tensor-parallel
            group; not implemented (only False).
        get_rng_state_tracker: returns an object with ``get_states()`` / ``set_states()``
            (a model-parallel RNG tracker) whose states are saved and restored as torch's
            RNG state is.
        tp_group: the group of ``distribute_saved_activations``; unused without it.
        use_reentrant: accepted for compatibility; the recompute always goes through torch's
            non-reentrant checkpoint (the gradients are the same).

    Example:
        >>> mlp = te.LayerNormMLP(1024, 4096)  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = te.checkpoint(mlp, x)
        >>> y.sum().backward()  # doctest: +SKIP
    """
    del tp_group, use_reentrant
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got "
                        f"{type(function).__name__}")
    if distribute_saved_activations:
        raise NotImplementedError("te.checkpoint: distribute_saved_activations=True is not "
                                  "implemented yet (it needs tensor parallelism)")
    if fp8.RECOMPUTE.recording is not None or fp8.RECOMPUTE.replaying:
        raise NotImplementedError("te.checkpoint: nested activation checkpoints are not "
                                  "supported; checkpoint the outer block only")
    scales: list = []
    tracker = get_rng_state_tracker() if get_rng_state_tracker is not None else None
    tracker_states: dict = {}
    autocast = (fp8.STATE.enabled, fp8.STATE.recipe, fp8.STATE.group)

    def contexts():
        return (_FirstRun(scales, tracker, tracker_states),
                _Recompute(scales, autocast, tracker, tracker_states))

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=contexts, preserve_rng_state=True,
                                             **kwargs)
