"""FP8 autocast: which recipe the modules use, and the delayed-scaling update at its exit.

``fp8_autocast`` / ``autocast`` set a process-wide state that ``te`` modules read in their
forward. Contexts nest; the innermost one decides how a module runs. Modules that recorded
amaxes under delayed scaling register here, and when the OUTERMOST context exits their
forward scales (``input``, ``weight``) are updated together: the amaxes are all-reduced
(MAX) over the group when one is given, then one ``delayed_scaling_update`` call per FP8
format and device covers every module's history. Backward scales are updated in each
module's backward, right after the gradient's amax is recorded.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import Any, Iterator, Optional

import torch

from transformer_engine.common.recipe import DelayedScaling, Recipe

from . import _compiled, float8_tensor, ops
from .calibration import QuantizationCalibrationConfig
from .ops._backend import algo_code, dtype_code, plain_eager, stream_of
from .quantization import kind_of

__all__ = ["autocast", "fp8_autocast", "fp8_model_init", "is_fp8_available"]


@dataclasses.dataclass
class _State:
    enabled: bool = False
    calibrating: bool = False
    recipe: Optional[Recipe] = None
    group: Any = None  # torch.distributed ProcessGroup or None
    depth: int = 0
    # the calibration metadata's config while a forward calibrates with FP8 off, else None
    # (calibration.py)
    calibration: Optional[QuantizationCalibrationConfig] = None
    # id(module) -> (module, recipe, group): forward amaxes waiting for the exit update.
    pending: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _ModelInit:
    enabled: bool = False
    recipe: Optional[Recipe] = None


@dataclasses.dataclass
class _Recompute:
    """The activation checkpoint in progress (checkpoint.py), as delayed-scaling modules see it.

    While its function first runs, ``recording`` collects a copy of the forward scales each
    delayed-scaling forward quantized with, in call order; the recompute in the backward
    (``replay``) hands the same copies back in the same order, and its modules record no amax.
    """

    recording: Optional[list] = None
    sources: Optional[list] = None  # the live scales each recorded copy was taken from
    replay: Optional[list] = None
    index: int = 0
    # NVIDIA's activation_recompute_forward (a caller's own checkpoint, distributed.py): its
    # first runs also queue each copy under the live scale it was taken from, and its
    # recompute phase (replay is QUEUED) takes them back per scale, first in first out, since
    # the caller recomputes many layers in an order of its own.
    queue: bool = False
    # id(live scale) -> (weak reference to it, its queued copies); by id, since tensors do
    # not compare as keys
    queues: dict = dataclasses.field(default_factory=dict)

    def queue_of(self, scale: torch.Tensor, make: bool) -> Optional[collections.deque]:
        entry = self.queues.get(id(scale))
        if entry is not None and entry[0]() is scale:
            return entry[1]
        if not make:
            return None
        queue = collections.deque()
        self.queues[id(scale)] = (weakref.ref(scale), queue)
        return queue

    @property
    def replaying(self) -> bool:
        return self.replay is not None


STATE = _State()
MODEL_INIT = _ModelInit()
RECOMPUTE = _Recompute()
QUEUED: list = []  # RECOMPUTE.replay in activation_recompute_forward's recompute phase


def checkpoint_scales(scale_fwd: torch.Tensor) -> torch.Tensor:
    """The forward scales a delayed-scaling forward uses: ``scale_fwd`` itself, or inside an
    activation checkpoint's recompute the copy its first run took (the autocast exit has
    updated ``scale_fwd`` since; quantizing with the new scales would change the bytes)."""
    r = RECOMPUTE
    if r.replay is QUEUED:
        queue = r.queue_of(scale_fwd, make=False)
        if not queue:
            raise RuntimeError("activation_recompute_forward: the recompute phase ran an FP8 "
                               "forward under delayed scaling that no first run (with "
                               "activation_recompute=True) recorded")
        return queue.popleft()
    if r.replay is not None:
        if r.index >= len(r.replay):
            raise RuntimeError("te.checkpoint: the recompute ran more FP8 forwards under "
                               f"delayed scaling than the first run ({len(r.replay)}); the "
                               "checkpointed function must run the same modules each time")
        scales = r.replay[r.index]
        r.index += 1
        return scales
    if r.recording is not None:
        copy = scale_fwd.detach().clone()
        r.recording.append(copy)
        r.sources.append(scale_fwd)
        if r.queue:
            r.queue_of(scale_fwd, make=True).append(copy)
    return scale_fwd


def refresh_recorded(scale: torch.Tensor) -> None:
    """A first step wrote a scale into live forward scales (first_step.py): the copy an
    activation checkpoint's first run recorded of them takes it too, so that the recompute
    quantizes as the first run did."""
    r = RECOMPUTE
    if r.recording is None:
        return
    ptr = scale.untyped_storage().data_ptr()
    for source, copy in zip(r.sources, r.recording, strict=True):
        if source.untyped_storage().data_ptr() == ptr:
            copy.copy_(source)


@torch.compiler.assume_constant_result
def is_fp8_available() -> tuple[bool, str]:
    """Whether te modules can run in FP8 here, and why (or why not).

    On a machine without CUDA the answer is True: the core's CPU path quantizes and multiplies
    FP8 operands exactly as the GPU would (FP8 values, fp32 accumulation), only slowly, so FP8
    numerics can be developed and tested on a CPU. On CUDA, FP8 tensor cores need compute
    capability 8.9 (Ada) or newer and a core built with its CUDA kernels.

    A process constant: torch.compile calls it while tracing and keeps the answer, rather than
    tracing it (the device queries it makes on a first call, such as the device's name, are not
    traceable, so a compiled step whose autocast was the process's first failed on a GPU).
    """
    global _CUDA
    if _CUDA is None:  # asked at every autocast entry: ~1 us each, and it cannot change
        _CUDA = torch.cuda.is_available()
    index = torch.cuda.current_device() if _CUDA else -1
    answer = _AVAILABLE.get(index)
    if answer is None:
        answer = _AVAILABLE[index] = _fp8_availability()
    return answer


_CUDA: Optional[bool] = None  # torch.cuda.is_available(), once asked
_AVAILABLE: dict = {}  # device index (-1: no CUDA) -> (bool, reason); devices do not change


def _fp8_availability() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return True, ("no CUDA device: FP8 is emulated by the core's CPU path "
                      "(FP8 values, fp32 math)")
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if (major, minor) < (8, 9):
        return False, f"{name} has compute capability {major}.{minor}; FP8 needs 8.9 or newer"
    if not ops._backend.core().built_with_cuda():
        return False, "the core (transformer-engine-common) was built without its CUDA kernels"
    return True, f"{name} (compute capability {major}.{minor}) has FP8 tensor cores"


_DEFAULT_RECIPE = DelayedScaling()  # recipes are frozen: one default serves every context


def _check_recipe(recipe: Any) -> Recipe:
    if recipe is None:
        return _DEFAULT_RECIPE
    if not isinstance(recipe, Recipe):
        raise TypeError("fp8_autocast: fp8_recipe must be a transformer_engine.common.recipe "
                        f"recipe or None, got {type(recipe).__name__}")
    return recipe


class fp8_autocast(contextlib.ContextDecorator):  # noqa: N801 (used like a function)
    """Runs te modules in FP8 inside the block.

    Args:
        enabled: compute in FP8 (False: high precision, e.g. to switch FP8 off in a region).
        calibrating: with ``enabled=False``, compute in high precision but record the
            forward amaxes of delayed scaling, so the scales are ready when FP8 is switched
            on (with FP8 enabled they are recorded anyway), and the calibration metadata of
            the default :class:`QuantizationCalibrationConfig` (calibration.py).
        fp8_recipe: how tensors are scaled; ``DelayedScaling()`` when None.
        fp8_group: process group whose ranks share amaxes (all-reduce MAX) before the scale
            update, when the recipe has ``reduce_amax``; None means no reduction.
        calibration_config: a :class:`QuantizationCalibrationConfig`: calibrate (as
            ``calibrating=True``) and keep the calibration metadata by it. Needs
            ``enabled=False``: FP8 forwards do not record it.

    Example:
        >>> with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):  # doctest: +SKIP
        ...     out = model(inp)
        >>> out.sum().backward()  # doctest: +SKIP

    (A class rather than a generator: entering and leaving it is part of every small step's
    host time, and a generator-based context costs twice as much.)
    """

    def __init__(self, enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group: Any = None,
                 calibration_config: Optional[QuantizationCalibrationConfig] = None) -> None:
        if calibration_config is not None:
            if not isinstance(calibration_config, QuantizationCalibrationConfig):
                raise TypeError("fp8_autocast: calibration_config must be a "
                                "QuantizationCalibrationConfig or None, got "
                                f"{type(calibration_config).__name__}")
            if enabled:
                raise NotImplementedError(
                    "fp8_autocast: calibration_config is recorded by calibrating forwards "
                    "with FP8 off here (enabled=False); FP8 forwards (enabled=True) do not "
                    "record calibration metadata")
            calibrating = True
        elif calibrating and not enabled:
            calibration_config = QuantizationCalibrationConfig()
        self._args = (bool(enabled), bool(calibrating), fp8_recipe, fp8_group)
        self._calibration = calibration_config
        self._saved: list = []  # the state each (re-)entry replaced, innermost last

    def __enter__(self) -> None:
        enabled, calibrating, recipe, group = self._args
        recipe = _check_recipe(recipe)
        if enabled:
            ok, reason = is_fp8_available()
            if not ok:
                raise RuntimeError(f"fp8_autocast: FP8 is not available: {reason}")
        # (Not while torch.compile traces an autocast inside the compiled function: modules
        # meet a recipe of another history length there as they would without this.)
        if (_UNUSED and (enabled or calibrating) and kind_of(recipe) == "delayed"
                and (len(_UNUSED) > 1 or recipe.amax_history_len not in _UNUSED)
                and not torch.compiler.is_compiling()):
            _fit_unused(recipe.amax_history_len)
        state = STATE
        self._saved.append((state.enabled, state.calibrating, state.recipe, state.group,
                            state.calibration))
        state.enabled, state.calibrating, state.recipe, state.group, state.calibration = (
            enabled, calibrating, recipe, group, self._calibration)
        state.depth += 1

    def __exit__(self, *exc) -> None:
        state = STATE
        state.depth -= 1
        (state.enabled, state.calibrating, state.recipe, state.group,
         state.calibration) = self._saved.pop()
        if state.depth == 0 and state.pending:
            pending, state.pending = state.pending, {}
            update_forward_scales(pending.values())


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group: Any = None,
             calibration_config: Optional[QuantizationCalibrationConfig] = None
             ) -> fp8_autocast:
    """The same as :func:`fp8_autocast`, with the newer argument names."""
    return fp8_autocast(enabled, calibrating, recipe, amax_reduction_group, calibration_config)


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                   preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Modules built inside keep their weights only as FP8 :class:`Float8Tensor` parameters
    (1 byte per element; no high-precision copy), quantized as ``recipe`` asks for weights
    (per-tensor for delayed and current scaling, 128x128 blocks for block scaling). The
    optimizer updates them in place: the update runs in high precision and is quantized back.
    With ``preserve_high_precision_init_val=True`` each FP8 weight also keeps the value it was
    quantized from, in CPU memory (``weight.get_high_precision_init_val()``, e.g. for an
    optimizer's FP32 master weights, until ``weight.clear_high_precision_init_val()``).
    ``quantized_model_init`` is NVIDIA's newer name for the same context.
    """
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError("fp8_model_init: preserve_high_precision_init_val must be a bool, got "
                        f"{type(preserve_high_precision_init_val).__name__}")
    saved = (MODEL_INIT.enabled, MODEL_INIT.recipe, float8_tensor._PRESERVE_INIT[0])
    MODEL_INIT.enabled, MODEL_INIT.recipe = bool(enabled), _check_recipe(recipe)
    float8_tensor._PRESERVE_INIT[0] = bool(enabled) and preserve_high_precision_init_val
    try:
        yield
    finally:
        MODEL_INIT.enabled, MODEL_INIT.recipe, float8_tensor._PRESERVE_INIT[0] = saved


# Modules whose delayed-scaling state no forward has used yet (zero histories, unit scales), by
# their history length. A module meets a recipe of another length by starting its state afresh
# at that length, which a compiled forward cannot do (the buffers it would replace are inputs
# of the graph); the entry of an autocast does it beforehand for these modules, whose first
# forward would do the same, so that torch.compile finds their state sized for the recipe.
_UNUSED: dict[int, weakref.WeakSet] = {}


def track_unused(module: torch.nn.Module, length: int) -> None:
    """Called by a new module (and a copy of one) whose state is still unused."""
    _UNUSED.setdefault(length, weakref.WeakSet()).add(module)


def mark_used(module: torch.nn.Module) -> None:
    """Called in eager code once a module's state is used (a forward recorded amaxes, a
    checkpoint was loaded): from then on, only its own forwards change its length."""
    module._fp8_unused = False
    for length, modules in list(_UNUSED.items()):
        modules.discard(module)
        if not modules:  # once every module is used, the entry's test is one dict read
            del _UNUSED[length]


def _fit_unused(length: int) -> None:
    """Gives every unused module's state ``length`` steps of history."""
    pending = STATE.pending  # compiled forwards that ran under an enclosing autocast
    for other in [n for n in _UNUSED if n != length]:
        for module in list(_UNUSED.pop(other)):
            if id(module) in pending:
                module._fp8_unused = False
            else:
                module._make_fp8_meta(length, module._buffers["amax_history_fwd"].device)
                track_unused(module, length)


def history_len_at_creation() -> int:
    """The history length a new module's state starts with: that of the delayed recipe of an
    enclosing autocast or else fp8_model_init, the default otherwise (an autocast entered
    before the module existed could not size it)."""
    state, init = STATE, MODEL_INIT
    if (state.depth and (state.enabled or state.calibrating)
            and kind_of(state.recipe) == "delayed"):
        return state.recipe.amax_history_len
    if init.enabled and kind_of(init.recipe) == "delayed":
        return init.recipe.amax_history_len
    return _DEFAULT_RECIPE.amax_history_len


def register_forward_amaxes(module: torch.nn.Module, recipe: Recipe) -> None:
    """Called by a module's forward after it wrote amaxes into its forward history (not in a
    checkpoint's recompute, which writes none: the first run registered already)."""
    if RECOMPUTE.replaying:
        return
    STATE.pending[id(module)] = (module, recipe, STATE.group)


# ------------------------------------------------------------------ the scale update


def _reduce_amaxes(histories: list[torch.Tensor], group: Any) -> None:
    """All-reduce (MAX) the newest row of every history over ``group``, in one collective."""
    import torch.distributed as dist

    rows = torch.cat([h[0] for h in histories])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    offset = 0
    for h in histories:
        h[0].copy_(rows[offset:offset + h.shape[1]])
        offset += h.shape[1]


def _python_update(history, scale, scale_inv, fp8_max: float, recipe: DelayedScaling) -> None:
    """The update for recipes with user callables (their math is the user's, in torch ops)."""
    algo = recipe.amax_compute_algo
    if callable(algo):
        amax = algo(history)
    elif algo == "max":
        amax = history.amax(dim=0)
    else:
        amax = history[0]
    if recipe.scaling_factor_compute_algo is not None:
        new = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)
    else:
        valid = torch.isfinite(amax) & (amax > 0)
        new = (fp8_max / amax) / 2.0**recipe.margin
        new = torch.where(torch.isinf(new), torch.finfo(torch.float32).max, new)
        new = torch.where(valid, new, scale)
    scale.copy_(new)
    scale_inv.copy_(1.0 / scale)
    history.copy_(torch.roll(history, -1, dims=0))
    history[0].zero_()


COMPILED_ALGOS = ("max", "most_recent")  # the core's own; a callable runs in torch ops


def scale_update(histories: list, scales: list, scale_invs: list, fp8_dtype: str, algo: str,
                 margin: int) -> None:
    """``ops.delayed_scaling_update``; in eager mode through the compiled operator when it is
    built (the same core call without the custom op's wrapper: it runs at every autocast exit
    and in every backward, and a small model's step is bound by host time)."""
    if _compiled.ops is not None and algo in COMPILED_ALGOS and plain_eager(()):
        _compiled.raise_if_failed(_compiled.ops.delayed_scaling_update.default(
            histories, scales, scale_invs, dtype_code(fp8_dtype), algo_code(algo), margin,
            stream_of(histories[0]) if histories else 0))
    else:
        ops.delayed_scaling_update(histories, scales, scale_invs, fp8_dtype, algo, margin)


def update_scales(entries, dtype_of, fp8_max_of) -> None:
    """Updates the delayed scales of many ((history, scale, scale_inv), recipe, group) entries.

    ``dtype_of(recipe)`` names the FP8 format of the scales, ``fp8_max_of(recipe)`` its max.
    Histories are all-reduced per group first, then grouped by (format, algo, margin, device)
    into one core call each; recipes with user callables take the Python update.
    """
    by_group: dict = {}
    python: list = []
    calls: dict = {}
    for entry in entries:
        (history, scale, scale_inv), recipe, group = entry
        if group is not None and recipe.reduce_amax:
            by_group.setdefault(id(group), (group, []))[1].append(history)
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            python.append(entry)
            continue
        # get_device() (an int) keys the device: t.device builds an object per call.
        key = (dtype_of(recipe), recipe.amax_compute_algo, recipe.margin, history.get_device())
        lists = calls.get(key)
        if lists is None:
            lists = calls[key] = ([], [], [])
        lists[0].append(history)
        lists[1].append(scale)
        lists[2].append(scale_inv)
    for group, histories in by_group.values():
        _reduce_amaxes(histories, group)
    for tensors, recipe, _ in python:
        _python_update(*tensors, fp8_max_of(recipe), recipe)
    for (fp8_dtype, algo, margin, _), (h, s, si) in calls.items():
        scale_update(h, s, si, fp8_dtype, algo, margin)


def _fwd_dtype(recipe: Recipe) -> str:
    return recipe.fp8_format.fwd_dtype_name


def _fwd_max(recipe: Recipe) -> float:
    return recipe.fp8_format.max_fwd


def update_forward_scales(entries) -> None:
    """The exit update: forward scales of (module, recipe, group) entries."""
    metas = []
    for m, r, g in entries:
        if m._fp8_unused:  # its first forward was compiled (eager forwards mark it earlier)
            mark_used(m)
        b = m._buffers  # one dict read instead of nn.Module.__getattr__ per buffer
        metas.append(((b["amax_history_fwd"], b["scale_fwd"], b["scale_inv_fwd"]), r, g))
        if m._has_fp8_output:  # FP8 outputs (fp8_output) have forward scales too
            metas.append(((b["amax_history_out"], b["scale_out"], b["scale_inv_out"]), r, g))
    update_scales(metas, _fwd_dtype, _fwd_max)


def update_backward_scales(tensors: tuple, recipe: Recipe, group: Any) -> None:
    """A module's backward update of its grad_output scale."""
    update_scales([(tensors, recipe, group)], lambda r: r.fp8_format.bwd_dtype_name,
                  lambda r: r.fp8_format.max_bwd)


def __getattr__(name: str):
    # NVIDIA's programs import the state's query class from here; it reads this module's
    # state, so it lives in a module of its own that imports this one.
    if name == "FP8GlobalStateManager":
        from .fp8_global_state import FP8GlobalStateManager
        return FP8GlobalStateManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
