"""te.make_graphed_callables: each module's forward and backward as CUDA graphs, FP8 included.

For a model that cannot be captured as one whole step (data-dependent control flow between
the layers, host work in the loop), graphing the layers one by one still removes their host
cost: a replay is one launch for the forward and one for the backward, whatever the module
does inside.

Built on ``torch.cuda.make_graphed_callables`` (the static inputs, the warm-up on a side
stream, the two graphs per callable and the autograd function that replays them). What FP8
adds is decided here: each module runs inside its own ``fp8_autocast`` during warm-up and
capture, so the forward graph holds the module's casts, its amax recording *and* the exit
update of its forward scales, and the backward graph holds the backward's own update of the
gradient scales. A replay therefore advances the FP8 state exactly as an eager step of the
module in its own ``fp8_autocast`` does; the caller's autocast has nothing left to do for it.

Differences from an eager module that follow from replaying a recording:
- The FP8 state after this call is the one before it: the warm-up runs real forwards and
  backwards (torch's, with uninitialized output gradients), whose amaxes are not the
  model's, so every buffer is put back in place once the graphs are made (the parameters and
  their ``.grad`` are not touched by the warm-up).
- A replay does not apply delayed scaling's first-step rule (first_step.py): a module that
  never ran quantizes its first replayed step with the initial scales of 1. Run one eager
  step before graphing to start from real scales.
- The recipe, the autocast arguments and the module's train/eval mode are those of the
  capture. A module in the other mode runs its eager forward.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import first_step
from .fp8 import fp8_autocast

# NVIDIA's flag that a caller (Megatron-LM's CUDA-graph manager) is capturing graphs of te
# modules: set_capture_start() / set_capture_end() around the capture, is_graph_capturing()
# reads it. What must not go into a graph reads capturing(), which also sees a capture that
# nobody announced (torch's own make_graphed_callables, a bare torch.cuda.graph).
_IS_GRAPH_CAPTURING = False


def set_capture_start() -> None:
    """Marks the beginning of a CUDA-graph capture of te modules (NVIDIA's)."""
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = True


def set_capture_end() -> None:
    """Marks the end of a CUDA-graph capture of te modules (NVIDIA's)."""
    global _IS_GRAPH_CAPTURING
    _IS_GRAPH_CAPTURING = False


def is_graph_capturing() -> bool:
    """Whether a caller announced a capture with :func:`set_capture_start` (NVIDIA's)."""
    return _IS_GRAPH_CAPTURING


def capturing() -> bool:
    """Whether te modules are being captured: announced, or the current stream captures."""
    return _IS_GRAPH_CAPTURING or (torch.cuda.is_available()
                                   and torch.cuda.is_current_stream_capturing())


def _fp8_modules(modules) -> list:
    """Every submodule of ``modules`` in order (None for those without FP8 state), as NVIDIA
    lists them: one entry per ``module.modules()`` element."""
    from .module.base import FP8Module

    if isinstance(modules, torch.nn.Module):
        modules = (modules,)
    return [m if isinstance(m, FP8Module) else None
            for module in modules for m in module.modules()]


def save_fp8_tensors(modules, fp8_recipe) -> Optional[list]:
    """NVIDIA's: copies of the delayed-scaling state of every te module in ``modules`` (each
    one's submodules included), to be put back by :func:`restore_fp8_tensors` once warm-up
    steps, whose amaxes are not the model's, have run. None unless ``fp8_recipe`` is a
    ``DelayedScaling`` (the other recipes keep no state across steps).

    Each module's state is first fitted to the recipe's ``amax_history_len`` (a new length
    starts the histories afresh, as the module's next forward under the recipe would do), so
    that the warm-up meets state of the right size and keeps its buffers: the graphs
    captured after it then hold the very buffers that :func:`restore_fp8_tensors` writes."""
    from transformer_engine.common.recipe import Recipe

    from .quantization import kind_of

    if not isinstance(fp8_recipe, Recipe) or kind_of(fp8_recipe) != "delayed":
        return None
    saved = []
    for m in _fp8_modules(modules):
        if m is None:
            saved.append(None)
            continue
        m._fit_history_len(fp8_recipe.amax_history_len)
        saved.append(m._save_fp8_state())
    return saved


def restore_fp8_tensors(modules, fp8_tensors: Optional[list]) -> None:
    """NVIDIA's: writes back, in place, the state :func:`save_fp8_tensors` copied of the same
    ``modules``; consumes ``fp8_tensors`` (as NVIDIA's does). Nothing for None."""
    if fp8_tensors is None:
        return
    targets = _fp8_modules(modules)
    if len(fp8_tensors) != len(targets):
        raise RuntimeError(f"restore_fp8_tensors: got the FP8 state of {len(fp8_tensors)} "
                           f"modules for {len(targets)}; save_fp8_tensors must have been "
                           "given the same modules")
    for m, state in zip(targets, fp8_tensors, strict=True):
        if (m is None) != (state is None):
            raise RuntimeError("restore_fp8_tensors: the modules are not those given to "
                               "save_fp8_tensors")
        if m is not None:
            m._restore_fp8_state(state)
    fp8_tensors.clear()

_NVIDIA_ONLY = ("_order", "_num_layers_per_chunk", "_reuse_graph_input_output_buffers")


class _Keywords:
    """A graphed forward's keyword inputs (NVIDIA's ``sample_kwargs``): the tensors become
    graph inputs after the positional ones (in the order of their names), everything else
    (None, flags, strings) is part of the recording and must come again unchanged."""

    def __init__(self, sample: dict, index: int) -> None:
        if not isinstance(sample, dict):
            raise TypeError(f"make_graphed_callables: sample_kwargs[{index}] must be a dict "
                            f"of keyword inputs, got {type(sample).__name__}")
        self.tensors = tuple(sorted(k for k, v in sample.items()
                                    if isinstance(v, torch.Tensor)))
        self.fixed = {k: v for k, v in sample.items() if not isinstance(v, torch.Tensor)}
        self.sample = tuple(sample[k] for k in self.tensors)  # the capture's graph inputs

    def flatten(self, kwargs: dict, where: str) -> tuple:
        """The tensor keywords in graph-input order, after checking ``kwargs`` against the
        recording."""
        if set(kwargs) != set(self.tensors) | set(self.fixed):
            raise TypeError(f"{where}: the graphed forward was captured with keywords "
                            f"{sorted(set(self.tensors) | set(self.fixed))}, got "
                            f"{sorted(kwargs)}")
        for name, value in self.fixed.items():
            if not _same(kwargs[name], value):
                raise ValueError(f"{where}: keyword {name!r} was {value!r} when the graphs "
                                 f"were captured and is part of them; got {kwargs[name]!r}")
        for name in self.tensors:
            if not isinstance(kwargs[name], torch.Tensor):
                raise TypeError(f"{where}: keyword {name!r} was a tensor when the graphs were "
                                f"captured, got {type(kwargs[name]).__name__}")
        return tuple(kwargs[name] for name in self.tensors)

    def rebuild(self, tail: tuple) -> dict:
        """The keywords of the module's call from the graph inputs after the positional
        ones."""
        return {**self.fixed, **dict(zip(self.tensors, tail, strict=True))}


def _same(a, b) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 (an object without a plain equality is not the same)
        return False


class _InAutocast(torch.nn.Module):
    """``module`` run inside ``fp8_autocast(*autocast_args)``: what torch captures (its
    positional inputs, then the tensors of its keywords). A module, so that torch passes the
    wrapped module's parameters to the backward graph."""

    def __init__(self, module: torch.nn.Module, autocast_args: tuple, positional: int,
                 keywords: _Keywords) -> None:
        super().__init__()
        self.module = module
        self._autocast_args = autocast_args
        self._positional = positional
        self._keywords = keywords
        # The module's own forward: its `forward` attribute becomes the replay afterwards.
        self._eager_forward = module.forward

    def forward(self, *args):
        enabled, calibrating, recipe, group = self._autocast_args
        kwargs = self._keywords.rebuild(args[self._positional:])
        with fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe,
                          fp8_group=group):
            return self._eager_forward(*args[:self._positional], **kwargs)


def _as_tuples(sample_args, count: int) -> tuple:
    if count == 1 and isinstance(sample_args, tuple) and all(
            isinstance(a, torch.Tensor) for a in sample_args):
        return (sample_args,)
    if not isinstance(sample_args, (tuple, list)) or len(sample_args) != count or not all(
            isinstance(a, tuple) for a in sample_args):
        raise TypeError(f"make_graphed_callables: sample_args must be a tuple of tensors for "
                        f"one module, or one such tuple per module ({count}), got "
                        f"{type(sample_args).__name__}")
    return tuple(sample_args)


def _keywords_of(sample_kwargs, count: int) -> tuple:
    """One _Keywords per module: ``sample_kwargs`` is a dict for one module, or one dict (or
    None) per module."""
    if sample_kwargs is None:
        return tuple(_Keywords({}, i) for i in range(count))
    if count == 1 and isinstance(sample_kwargs, dict):
        sample_kwargs = (sample_kwargs,)
    if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != count:
        raise TypeError(f"make_graphed_callables: sample_kwargs must be a dict for one module, "
                        f"or one dict per module ({count}), got "
                        f"{type(sample_kwargs).__name__}")
    return tuple(_Keywords(kw or {}, i) for i, kw in enumerate(sample_kwargs))


def _refuse(fp8_weight_caching: bool, retain_graph_in_backward: bool,
            nvidia_only: dict) -> None:
    if fp8_weight_caching:
        raise NotImplementedError("make_graphed_callables: fp8_weight_caching=True is not "
                                  "supported (a replay casts the weights to FP8 every time); "
                                  "only False")
    if retain_graph_in_backward:
        raise NotImplementedError("make_graphed_callables: retain_graph_in_backward=True is "
                                  "not supported; only False")
    for name, value in nvidia_only.items():
        if name not in _NVIDIA_ONLY:
            raise TypeError(f"make_graphed_callables() got an unexpected keyword argument "
                            f"{name!r}")
        if value is not None and value is not False:
            raise NotImplementedError(f"make_graphed_callables: {name} (pipeline-parallel "
                                      "schedules) is not supported; only its default")


def make_graphed_callables(
    modules, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
    sample_kwargs=None, fp8_enabled: bool = False, fp8_calibrating: bool = False,
    fp8_recipe=None, fp8_group: Any = None, fp8_weight_caching: bool = False,
    pool: Optional[tuple] = None, retain_graph_in_backward: bool = False, **nvidia_only,
):
    """Graphs of each module's forward and backward, FP8 state updates inside them.

    Args:
        modules: one ``torch.nn.Module`` or a tuple of them (graphed in order, sharing a
            memory pool: call them in that order).
        sample_args: a tuple of CUDA tensors for one module, or one tuple per module; the
            shapes, dtypes and ``requires_grad`` every later call must have.
        num_warmup_iters: eager forwards and backwards before the capture (the FP8 state
            is put back after them: see the module docstring).
        allow_unused_input: as in ``torch.cuda.make_graphed_callables``.
        fp8_enabled, fp8_calibrating, fp8_recipe, fp8_group: the ``fp8_autocast`` each module
            runs in, at capture and so at every replay.
        pool: a memory pool handle (``torch.cuda.graph_pool_handle()``) to share with other
            graphs.

        sample_kwargs: keyword inputs of the forward, a dict for one module or one dict (or
            None) per module: tensors are graph inputs like ``sample_args`` (every call
            passes tensors of their shapes), any other value is recorded in the graphs, so
            every call must pass it again unchanged (else ValueError).

    Returns the modules (one, or the tuple), whose ``forward`` replays the graphs while the
    module is in the train/eval mode it was captured in. ``fp8_weight_caching=True``,
    ``retain_graph_in_backward=True`` and NVIDIA's pipeline-schedule arguments raise
    ``NotImplementedError``.
    """
    _refuse(fp8_weight_caching, retain_graph_in_backward, nvidia_only)
    single = isinstance(modules, torch.nn.Module)
    group = (modules,) if single else tuple(modules)
    for m in group:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"make_graphed_callables: modules must be torch.nn.Module "
                            f"objects, got {type(m).__name__}")
    args = _as_tuples(sample_args, len(group))
    keywords = _keywords_of(sample_kwargs, len(group))
    # torch captures positional inputs only: each module's tensor keywords follow its own
    inputs = tuple(a + kw.sample for a, kw in zip(args, keywords, strict=True))
    for i, sample in enumerate(inputs):
        for t in sample:
            if not (isinstance(t, torch.Tensor) and t.is_cuda):
                raise ValueError(f"make_graphed_callables: sample_args[{i}] (and the tensors "
                                 f"of sample_kwargs) must hold CUDA tensors (CUDA graphs), got "
                                 f"{t.device if isinstance(t, torch.Tensor) else type(t).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables: CUDA graphs need a CUDA device; none is "
                           "available")
    autocast_args = (bool(fp8_enabled), bool(fp8_calibrating), fp8_recipe, fp8_group)
    wrappers = tuple(_InAutocast(m, autocast_args, len(a), kw).train(m.training)
                     for m, a, kw in zip(group, args, keywords, strict=True))
    kwargs = {"num_warmup_iters": num_warmup_iters, "allow_unused_input": allow_unused_input}
    if pool is not None:
        kwargs["pool"] = pool
    saved = [(b, b.clone()) for m in group for b in m.buffers()]
    torch.cuda.make_graphed_callables(wrappers, inputs, **kwargs)
    with torch.no_grad():
        for b, value in saved:  # in place: the graphs hold these very buffers
            b.copy_(value)
            first_step.written_elsewhere_all(b)
    for m, w in zip(group, wrappers, strict=True):
        _replay_in_mode(m, w)
    return group[0] if single else group


def _replay_in_mode(module: torch.nn.Module, wrapper: _InAutocast) -> None:
    """Points ``module.forward`` at the wrapper's graphed forward (torch replaced it) while
    the module is in the train/eval mode of the capture; in the other mode the module runs its
    own forward, in the caller's autocast."""
    graphed: Callable = wrapper.forward
    eager: Callable = wrapper._eager_forward
    captured = wrapper.training
    keywords = wrapper._keywords
    where = f"{type(module).__name__} (graphed)"

    def forward(*args, **kwargs):
        if module.training != captured:
            return eager(*args, **kwargs)
        return graphed(*args, *keywords.flatten(kwargs, where))

    module.forward = forward
