"""Delayed scaling's first step: a tensor whose amax history is still empty is scaled from
its own amax.

Delayed scaling quantizes with a scale made from earlier steps' amaxes. Before any step there
are none, and the initial scale of 1 loses what is small: a mean loss's output gradient
(about 1e-7 per element) underflows E5M2 and the first weight gradient comes out zero. So a
history column that no step has written yet gives its tensor the scale the update would make
from the tensor's own amax (the core's delayed-scaling formula, the recipe's margin); the
amax still goes into the history, and from the next step on the recipe runs as before. The
JAX package applies the same rule with the same core calls, so both give the same bits.

Whether a column is still empty is known on the host here, in eager mode: the module marks
its histories when it makes them (and when a checkpoint loads empty ones), and the first
quantization of each column takes the mark, so later steps pay nothing. A compiled graph
cannot take marks, so there the module decides at trace time from an attribute the compiler
guards on: its first step's graph computes the amaxes, and the graph of the steps after it
(traced again once the attribute has changed) has nothing of this rule. Where some columns
are empty and others not (a forward run eagerly without a backward before compiling), the op
that makes the tensor runs once more with the core's gate (tensor.h): it computes the amax
only while the column and its scale are as a new module has them (all zero, and 1: a history
of one step is all zero again after each update, so the history alone cannot tell), and costs
one early-returning launch on later steps.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import ops

# The columns no step has written yet live on the history tensor itself, as an attribute:
# a deep copy or a pickle of the module carries them, and a new tensor (a device move, a
# loaded checkpoint) gets them from the module (move_marks, mark_empty).
_MARK = "_te_empty_columns"


def mark_empty(history: torch.Tensor, columns=None) -> None:
    """Marks ``history``'s ``columns`` (default: all) as never written."""
    setattr(history, _MARK, set(range(history.shape[1])) if columns is None else set(columns))


def move_marks(old: torch.Tensor, new: torch.Tensor) -> None:
    """``new`` replaces ``old`` (a module moved to another device): it keeps old's marks."""
    cols = getattr(old, _MARK, None)
    if cols is not None and new is not old:
        mark_empty(new, cols)


# What the compiled graph of the module being traced does at its quantizations: "first" (a
# first step: every column is empty), "later" (none is) or "mixed" (ask the device: the gate).
# The module's forward sets it from an attribute of the module (trace_module), on which the
# compiler guards, so that the graph of a first step is traced again for the next step.
_compiled = "mixed"


def trace_module(module_state: str, histories) -> str:
    """Called by a module's forward while a compiler traces it, with the module's state of the
    rule: "first" (no step has written its histories), "done" (a compiled first step has), or
    "eager" (eager steps took the marks: they decide between "later" and "mixed"). Returns the
    module's state after this step."""
    global _compiled
    if module_state == "first":
        _compiled = "first"
        return "done"
    if module_state == "eager" and any(has_empty(h) for h in histories):
        _compiled = "mixed"
    else:
        _compiled = "later"
    return module_state


def has_empty(history: torch.Tensor) -> bool:
    """Whether some column of ``history`` is still marked as never written."""
    return bool(getattr(history, _MARK, None))


def waits(history: Optional[torch.Tensor], column: int) -> bool:
    """Whether ``column`` of ``history`` still waits for its first-step scale (eager mode)."""
    if history is None or column not in (getattr(history, _MARK, None) or ()):
        return False
    return not _capture_takes_marks(history)


def _capture_takes_marks(history: torch.Tensor) -> bool:
    """While a CUDA graph is being captured, a marked history gives up its marks and the
    rule does not apply: what is captured runs at every replay, and the replays are later
    steps (graphs.capturing; also for the marks that restore_fp8_tensors put back)."""
    from . import graphs  # (graphs imports this module)

    if not graphs.capturing():
        return False
    written_elsewhere_all(history)
    return True


def written_elsewhere(history: Optional[torch.Tensor], column: int) -> None:
    """The tensor of ``column`` is quantized without a first-step scale (an FP8 weight keeps its
    own bytes): the column is no longer waiting for one."""
    if history is not None:
        _take_mark(history, column)


def written_elsewhere_all(history: torch.Tensor) -> None:
    """No column of ``history`` waits for a first-step scale any more (its steps run where
    the rule does not: a CUDA graph's replays)."""
    if getattr(history, _MARK, None):
        setattr(history, _MARK, set())


def _take_mark(history: torch.Tensor, column: int) -> bool:
    cols = getattr(history, _MARK, None)
    if not cols or column not in cols:
        return False
    cols.discard(column)
    return True


def step_scales(scales: torch.Tensor, index: int, history: Optional[torch.Tensor],
                column: int, fp8_dtype: str, margin: int,
                amax_of: Callable[[Optional[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
    """The scales to quantize with in this step, ``scales[index]`` being the stored scale of
    the tensor whose amaxes go into ``history``'s ``column``: ``scales`` itself, where, while
    that column is empty, ``index`` now holds the scale from the tensor's own amax (written in
    place in eager mode, in a copy when compiled).
    ``amax_of(gate)`` gives that amax with the op that makes the tensor (``gate`` None: just
    run it; else the core's gate). ``history`` None (a checkpoint's recompute, which quantizes
    as its first run did) keeps ``scales``."""
    # A column is marked in every state that needs the rule (a compiled graph takes no marks),
    # so an unmarked history ends here: a later eager step pays one attribute lookup.
    if history is None or not getattr(history, _MARK, None):
        return scales
    if torch.compiler.is_compiling():
        if _compiled == "later":
            return scales
        stored = scales[index:index + 1]
        if _compiled == "first":  # this graph serves the first step alone
            amax = amax_of(None)
        else:
            amax = amax_of(history[:, column].amax().reshape(1) + (stored - 1.0).abs())
        # The core's update as a functional op, into a copy (a graph's inputs are not written
        # in place): the same bits as the eager step's (ops.first_step_scale).
        scale = ops.first_step_scale(stored, amax, fp8_dtype, margin)
        return torch.cat([scales[:index], scale, scales[index + 1:]])
    if _capture_takes_marks(history) or not _take_mark(history, column):
        return scales
    # The update's formula (scaling.h) on a one-step history holding the amax: an amax of 0
    # (an all-zero tensor) or a non-finite one keeps the stored scale. Written into the stored
    # scales, which the step's update makes from the history again, so that what recorded
    # them (an activation checkpoint's first run) sees it too.
    scale = scales[index:index + 1]
    scale.copy_(ops.first_step_scale(scale, amax_of(None), fp8_dtype, margin))
    from . import fp8  # (fp8 imports the modules that import this one)

    fp8.refresh_recorded(scales)
    return scales
