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

With ``distribute_saved_activations=True`` (Megatron-LM's option) the input kept for the
recompute, the block's first tensor argument, is kept split over ``tp_group``: each rank keeps
its 1/tp of the flattened values, and the recompute all-gathers them back. That is only right
where every rank of the group has the same input, as at the input of a tensor-parallel block
without sequence parallelism (with it, each rank has its own part of the sequence).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch.utils.checkpoint

from . import fp8
from .distributed import gather_first_dim, group_size

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


def _first_tensor(args: tuple) -> int:
    """The index of the argument ``distribute_saved_activations`` splits."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            return i
    raise TypeError("te.checkpoint: distribute_saved_activations=True needs a tensor among "
                    "the positional arguments (the input it splits over tp_group), got "
                    f"{tuple(type(a).__name__ for a in args)}")


def _checkpoint_split_input(function: Callable, args: tuple, i: int, kwargs: dict,
                            tp_group: Any, contexts: Callable):
    """The checkpoint with ``args[i]`` kept as this rank's slice of it."""
    import torch.distributed as dist

    inp = args[i]
    size, numel = tp_group.size(), inp.numel()
    chunk = -(-numel // size)  # the last slices are padded with zeros to one length
    start = min(dist.get_rank(tp_group) * chunk, numel)
    piece = inp.detach().reshape(-1)[start:start + chunk]
    kept = inp.new_zeros(chunk)  # a copy, so that nothing here holds the whole input
    kept[:piece.numel()] = piece
    shape, requires_grad = inp.shape, inp.requires_grad
    # The first run takes the input itself (the graph's edge to its gradient); the list is
    # emptied after it, so the recompute gathers the values back from the slices.
    first_run = [inp]

    def run(kept: torch.Tensor, *rest, **kw):
        if first_run:
            whole = first_run[0]
        else:
            whole = gather_first_dim(kept, tp_group)[:numel].view(shape)
            # te modules save differently for inputs that need no gradient; the recompute
            # must save what the first run saved.
            whole.requires_grad_(requires_grad)
        return function(*rest[:i], whole, *rest[i:], **kw)

    try:
        return torch.utils.checkpoint.checkpoint(run, kept, *args[:i], *args[i + 1:],
                                                 use_reentrant=False, context_fn=contexts,
                                                 preserve_rng_state=True, **kwargs)
    finally:
        first_run.clear()


def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable[[], Any]] = None, tp_group: Any = None,
               use_reentrant: Optional[bool] = None, **kwargs):
    """``function(*args, **kwargs)``, its activations recomputed in the backward instead of
    kept, with the FP8 scales and RNG state of this call (see the module docstring).

    Args:
        function: the block; it must run the same te modules each time it is called.
        args, kwargs: passed to ``function``.
        distribute_saved_activations: keep the first tensor in ``args`` split over
            ``tp_group`` (1/tp of its values per rank, zero-padded when its element count is
            not a multiple of tp; an empty one is not split) and all-gather it for the
            recompute. Every rank of the group must pass the same values (the input of a
            tensor-parallel block without sequence parallelism), and all of them must run
            the backward. The recompute sees a contiguous tensor of the input's shape, dtype
            and ``requires_grad``; the caller's tensor is not changed (NVIDIA's replaces its
            data by the slice), so the memory goes where nothing else holds the input, as
            when it is the previous block's output.
        get_rng_state_tracker: returns an object with ``get_states()`` / ``set_states()``
            (a model-parallel RNG tracker) whose states are saved and restored as torch's
            RNG state is.
        tp_group: the group of ``distribute_saved_activations``; unused without it. None
            (NVIDIA's falls back to the default group, which spans data-parallel ranks
            whose inputs differ) or a group of one rank: nothing is split.
        use_reentrant: accepted for compatibility; the recompute always goes through torch's
            non-reentrant checkpoint (the gradients are the same). NVIDIA's splits the input
            only in its reentrant mode (and ignores ``distribute_saved_activations``
            otherwise), so False together with ``distribute_saved_activations=True`` raises
            ValueError.

    Example:
        >>> mlp = te.LayerNormMLP(1024, 4096)  # doctest: +SKIP
        >>> with te.fp8_autocast():  # doctest: +SKIP
        ...     y = te.checkpoint(mlp, x)
        >>> y.sum().backward()  # doctest: +SKIP
    """
    if not callable(function):
        raise TypeError(f"te.checkpoint: function must be callable, got "
                        f"{type(function).__name__}")
    split = False
    if distribute_saved_activations:
        if use_reentrant is False:
            raise ValueError("te.checkpoint: distribute_saved_activations=True needs "
                             "use_reentrant=True or None (NVIDIA's splits the input only in "
                             "its reentrant mode), got use_reentrant=False")
        i = _first_tensor(args)  # refused on one rank as on many
        split = (tp_group is not None and group_size("te.checkpoint", tp_group) > 1
                 and args[i].numel() > 0)
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

    if split:
        return _checkpoint_split_input(function, args, i, kwargs, tp_group, contexts)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=contexts, preserve_rng_state=True,
                                             **kwargs)
