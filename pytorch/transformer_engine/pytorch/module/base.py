"""What every te module shares: its delayed-scaling state and how it is checkpointed.

Delayed scaling keeps, per module, amax histories and scales of the forward roles and of the
backward role of each of its GEMMs: GEMM g (0 for a single linear layer; FC1 = 0, FC2 = 1 in
an MLP) owns forward columns 2g (``input``) and 2g + 1 (``weight``) and backward column g
(``grad_output``), so each FP8 operand has its own history. They are non-persistent buffers,
so they move with ``.to()`` / ``.cuda()``; checkpoints carry them in the module's versioned
extra state (``get_extra_state``), together with a summary of the recipe that produced them.

Inside :func:`transformer_engine.pytorch.checkpoint` a module's forward runs twice; the
second run (the recompute in the backward) must quantize with the scales of the first and
record nothing: :meth:`FP8Module._fp8_meta_of` gives it those scales and no history.
"""

from __future__ import annotations

import io
import weakref
from typing import Any, Optional

import torch

from transformer_engine.common.recipe import DelayedScaling, Recipe

from .. import calibration, first_step, fp8, ops
from ..float8_tensor import Float8Tensor
from ..quantization import Operand, Plan, kind_of, plan_of, quantize, record_amax
from . import _nvidia_state
from ._deferred_init import DeferredInit

EXTRA_STATE_VERSION = 1
# name -> (kind, columns per GEMM)
_META = {
    "amax_history_fwd": ("history", 2),
    "scale_fwd": ("scale", 2),
    "scale_inv_fwd": ("scale", 2),
    "amax_history_bwd": ("history", 1),
    "scale_bwd": ("scale", 1),
    "scale_inv_bwd": ("scale", 1),
    # The output of GEMM g when it is written in FP8 (``fp8_output``, for an FP8 consumer
    # such as attention under fp8_mha); updated with the forward roles.
    "amax_history_out": ("history", 1),
    "scale_out": ("scale", 1),
    "scale_inv_out": ("scale", 1),
}
# Added to the extra state after checkpoints of version 1 were written: optional on load.
_OPTIONAL = ("amax_history_out", "scale_out", "scale_inv_out")


_SUMMARIES: dict = {}


def with_leading_dims(out, inp: torch.Tensor):
    """The [M, N] result of an autograd function over ``inp`` [..., K] (a tensor, or a tuple of
    them) with inp's leading dimensions: [..., N]. The view is made here, outside the function:
    autograd forbids in-place ops on views that a custom function returns, and a layer's output
    may be modified in place (nn.ReLU(inplace=True), a residual ``+=``). A Float8Tensor output
    (fp8_output) has its shape already."""
    if isinstance(out, tuple):
        return tuple(with_leading_dims(t, inp) for t in out)
    if out.dim() == inp.dim():
        return out
    return out.view(*inp.shape[:-1], out.shape[-1])


_DUMMY_WGRADS: dict = {}


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """NVIDIA's stand-in weight gradient for Megatron-LM's layers under gradient-accumulation
    fusion: the real gradient went into ``main_grad``, but autograd still wants a tensor. One
    buffer per (shape, dtype, device), made on the first call and returned (detached) by every
    later one, so all layers and microbatches share it; it holds whatever its last user wrote,
    unless ``zero`` (then it is zero-filled on that call). On the current CUDA device when
    there is one, else the CPU."""
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    key = (tuple(shape), dtype, device)
    buffer = _DUMMY_WGRADS.get(key)
    if buffer is None:
        buffer = _DUMMY_WGRADS[key] = torch.empty(key[0], dtype=dtype, device=device)
    if zero:
        buffer.zero_()
    return buffer.detach()


def recipe_summary(recipe: Recipe) -> dict:
    """Plain values that describe a recipe (no callables), for checkpoints; made once per
    recipe (forward calls it every step). Callers must not modify it."""
    summary = _SUMMARIES.get(recipe)
    if summary is None:
        summary = _SUMMARIES[recipe] = _summarize(recipe)
    return summary


def _summarize(recipe: Recipe) -> dict:
    summary = {"recipe": type(recipe).__name__}
    for name, value in vars(recipe).items():
        if isinstance(value, (bool, int, float, str)):
            summary[name] = value
        elif hasattr(value, "name"):  # Format
            summary[name] = value.name
        else:
            summary[name] = "callable" if callable(value) else repr(value)
    return summary


def fp8_weight_param(t: torch.Tensor, plan_of) -> torch.nn.Parameter:
    """A weight parameter, kept only as FP8 (a Float8Tensor quantized as the recipe of an
    enclosing ``fp8_model_init`` asks for weights) when there is one; ``plan_of(recipe)``
    gives the recipe's plan."""
    init = fp8.MODEL_INIT
    if not init.enabled:
        return torch.nn.Parameter(t)
    plan = plan_of(init.recipe)
    # The recipe's scale options (block scaling's power-of-2 scales), kept by the tensor for
    # the optimizer's in-place updates. 1x128 runs along rows do not transpose, so such a
    # weight keeps its column-wise copy (for dgrad) quantized from the same values.
    return torch.nn.Parameter(Float8Tensor.quantize(
        t, plan.fwd_dtype, scaling_mode=plan.weight_mode,
        with_transpose=plan.weight_mode == "block_1x128",
        force_pow2_scales=plan.force_pow2_scales, amax_epsilon=plan.amax_epsilon))


class FP8Module(DeferredInit, torch.nn.Module):
    """Base of te modules: delayed-scaling buffers of ``num_gemms`` GEMMs, the extra state
    that saves them, and the FP8 copies of the weights."""

    # Whether the GEMM weights' gradients go into their main_grad (module/_main_grad.py).
    fuse_wgrad_accumulation = False
    # How NVIDIA's modules lay out this module's FP8 state (module/_nvidia_state.py): its
    # GEMMs one for one ("gemms"), or DotProductAttention's ("attention").
    _nvidia_layout = "gemms"
    # History columns (by buffer) that no delayed-scaling cast of this module ever writes:
    # not marked as waiting for a first-step scale (first_step.py), so a module whose every
    # used column has been written is done with the rule.
    _UNWRITTEN: dict[str, tuple[int, ...]] = {}

    def __init__(self, device: torch.device, history_len: int | None = None,
                 num_gemms: int = 1) -> None:
        super().__init__()
        # The recipe a checkpoint describes: the last one met, summarized when saved (the
        # summary reads every field, which a compiled forward should not trace), or the
        # summary a loaded checkpoint carried.
        self._recipe_summary: dict | Recipe = {}
        # The recipe the last FP8 forward met and its plan: a forward under the same recipe
        # object skips the lookups and the fit (None: meet the next recipe afresh).
        self._fp8_recipe: Recipe | None = None
        self._fp8_plan: Plan | None = None
        self._num_gemms = int(num_gemms)
        self._weight_caches: dict[int, Operand] = {}
        # Whether a forward wrote an FP8 output (fp8_output): the exit update then covers the
        # output scales too (only then: each history costs the update host time).
        self._has_fp8_output = False
        history_len = history_len or fp8.history_len_at_creation()
        self._make_fp8_meta(history_len, device)
        self._fp8_unused = True  # until a forward uses the state (fp8._UNUSED)
        fp8.track_unused(self, history_len)

    def _cast_columns(self, history: str, columns: int) -> list[int]:
        """The columns of the history buffer named ``history`` that a cast writes (all but
        ``_UNWRITTEN``'s): those a first step waits for."""
        never = self._UNWRITTEN.get(history, ())
        return [c for c in range(columns) if c not in never]

    def _make_fp8_meta(self, history_len: int, device: torch.device) -> None:
        self._fp8_recipe = None
        # The first-step rule's state for compiled graphs (first_step.trace_module).
        self._fp8_first_step = "first"
        for name, (kind, per_gemm) in _META.items():
            columns = per_gemm * self._num_gemms
            if kind == "history":
                t = torch.zeros(history_len, columns, dtype=torch.float32, device=device)
                first_step.mark_empty(t, self._cast_columns(name, columns))
            else:
                t = torch.ones(columns, dtype=torch.float32, device=device)
            self.register_buffer(name, t, persistent=False)

    # --------------------------------------- saved and restored state (graph.save_fp8_tensors)

    def _fit_history_len(self, length: int) -> None:
        """Gives the state ``length`` steps of history, as the next forward under a delayed
        recipe of that length would (a new length starts the histories afresh); a module
        whose state no forward has used stays tracked as unused."""
        if self._buffers["amax_history_fwd"].shape[0] == length:
            return
        unused = self._fp8_unused
        if unused:
            fp8.mark_used(self)
        self._make_fp8_meta(length, self._buffers["amax_history_fwd"].device)
        if unused:
            self._fp8_unused = True
            fp8.track_unused(self, length)

    def _save_fp8_state(self) -> dict:
        """Copies of the delayed-scaling buffers and of the first-step marks of their
        histories (first_step.py)."""
        b = self._buffers
        with torch.no_grad():
            values = {name: b[name].clone() for name in _META}
        marks = {name: set(getattr(b[name], first_step._MARK, ()))
                 for name, (kind, _) in _META.items() if kind == "history"}
        return {"values": values, "marks": marks, "first_step": self._fp8_first_step}

    def _restore_fp8_state(self, saved: dict) -> None:
        """Writes ``_save_fp8_state``'s copies back into the buffers, in place (a CUDA graph
        captured since holds their addresses).

        The marks come back too. A warm-up step takes the marks of the columns it quantizes
        (a first step scales each tensor from its own amax); once the buffers hold their
        earlier values again, a module saved before its first step is such a module again,
        and its next eager step must be the first step it would have been without the
        warm-up. A capture takes no first-step scale (first_step.step_scales: the graph's
        replays are later steps), so restored marks cannot end up in a graph."""
        b = self._buffers
        name = getattr(self, "_name", "") or type(self).__name__
        for key, value in saved["values"].items():
            if b[key].shape != value.shape:
                raise RuntimeError(
                    f"restore_fp8_tensors: {name}.{key} has shape {list(b[key].shape)} but "
                    f"was saved with {list(value.shape)}: a forward under a recipe of another "
                    "amax_history_len replaced the state after save_fp8_tensors")
        with torch.no_grad():
            for key, value in saved["values"].items():
                b[key].copy_(value)
        for key, columns in saved["marks"].items():
            first_step.mark_empty(b[key], columns)
        self._fp8_first_step = saved["first_step"]
        if any(saved["marks"].values()):
            # The next forward meets its recipe afresh: a forward under the recipe it last met
            # may skip the look at the marks (fast_linear.steady_forward). NVIDIA's flags
            # keep reading as before.
            self._set_nvidia_flags(self.fp8, self.fp8_calibration, self._nvidia_recipe())

    # ------------------------------------------------------------ forward scales and amaxes

    def _fp8_meta_of(self, recipe: Recipe) -> tuple[Plan, torch.Tensor, torch.Tensor | None]:
        """What an FP8 forward under ``recipe`` needs of the module's state: (plan, forward
        scales, forward history or None). Under delayed scaling the forward's amaxes go into
        the history (None: a checkpoint's recompute records nothing) and the module is
        registered for the exit update; the other recipes ignore both tensors."""
        # Under torch.compile the lookups run at trace time only, and an identity test would
        # make the graph's guards demand this very recipe object (a recompile per new one).
        compiling = torch.compiler.is_compiling()
        if compiling or recipe is not self._fp8_recipe:
            plan = self._plan_of(recipe)
            if plan.kind == "delayed":
                self._fit_fp8_meta(recipe)  # may make new buffers (and reset the cache)
            self._recipe_summary = recipe
            self._fp8_recipe, self._fp8_plan = recipe, plan
        plan = self._fp8_plan
        buffers = self._buffers  # one dict read instead of nn.Module.__getattr__ per buffer
        if plan.kind != "delayed":
            return plan, buffers["scale_fwd"], buffers["amax_history_fwd"]
        if fp8.RECOMPUTE.replaying:
            return plan, self._forward_scales(), None
        fp8.register_forward_amaxes(self, recipe)
        if compiling:
            state = first_step.trace_module(
                self._fp8_first_step, (buffers["amax_history_fwd"], buffers["amax_history_bwd"]))
            if state != self._fp8_first_step:
                self._fp8_first_step = state
        elif self._fp8_first_step == "first":  # eager: the marks decide, column by column
            self._fp8_first_step = "eager"
        return plan, self._forward_scales(), buffers["amax_history_fwd"]

    def _plan_of(self, recipe: Recipe) -> Plan:
        """plan_of(recipe), with an unsupported recipe reported in this module's name (plan_of
        speaks for te.Linear)."""
        try:
            return plan_of(recipe)
        except NotImplementedError as e:
            msg = str(e)
            msg = msg[len("te.Linear: "):] if msg.startswith("te.Linear: ") else msg
            name = getattr(self, "_name", "") or type(self).__name__
            raise NotImplementedError(f"{name}: the fp8_autocast recipe (fp8_recipe) cannot "
                                      f"run here: {msg}") from None

    def _backward_state(self, plan: Plan, recipe: Recipe) -> tuple[tuple, Recipe | None, Any]:
        """What an FP8 backward's delayed-scaling update needs: the backward roles' (history,
        scale, scale_inv); the recipe when the update must take the general path (user
        callables, or amaxes reduced over a group) else None, for one core call; the group."""
        group = fp8.STATE.group
        general = plan.kind == "delayed" and (plan.algo == "callable" or group is not None)
        b = self._buffers  # one dict read instead of nn.Module.__getattr__ per buffer
        meta = (b["amax_history_bwd"], b["scale_bwd"], b["scale_inv_bwd"])
        return meta, recipe if general else None, group

    def _output_meta(self, plan: Plan) -> tuple | None:
        """What an FP8 output of GEMM 0 needs (linear_fn.fp8_output): delayed scaling's output
        (scales, history; None in a checkpoint's recompute, which records nothing), () for
        current scaling, None where the plan has no per-tensor output (block scaling: the
        output stays high precision)."""
        if plan.kind == "current":
            return ()
        if plan.kind != "delayed":
            return None
        b = self._buffers
        scales = fp8.checkpoint_scales(b["scale_out"])
        if fp8.RECOMPUTE.replaying:
            return scales, None
        self._has_fp8_output = True
        return scales, b["amax_history_out"]

    def _forward_scales(self) -> torch.Tensor:
        """The forward scales this forward quantizes with: the buffer itself, except in the
        recompute of an activation checkpoint, which gets the copy its first run took."""
        return fp8.checkpoint_scales(self._buffers["scale_fwd"])

    def _weight_operand(self, plan: Plan, weight, need_col: bool, is_first_microbatch,
                        scales: torch.Tensor, history: torch.Tensor | None,
                        gemm: int = 0) -> Operand:
        """The FP8 copy of GEMM ``gemm``'s weight: the Float8Tensor's own bytes, the copy kept
        since the first microbatch, or a fresh quantization (recording its amax)."""
        if (isinstance(weight, Float8Tensor) and weight._fp8_dtype == plan.fwd_dtype
                and weight._scaling_mode == plan.weight_mode):
            empty = weight._data.new_empty(0)
            cache = not torch.compiler.is_compiling()
            if cache:
                first_step.written_elsewhere(history, 2 * gemm + 1)
            col, col_sinv = weight.transpose_data(cache) if need_col else (empty, empty)
            return Operand(weight._data, weight._scale_inv, col, col_sinv, plan.fwd_dtype,
                           plan.weight_mode)
        if is_first_microbatch is False:
            cached = self._weight_caches.get(gemm)
            if (cached is not None and cached.mode == plan.weight_mode
                    and cached.fp8_dtype == plan.fwd_dtype
                    and (cached.columnwise.numel() > 0 or not need_col)):
                return cached
        w = weight.dequantize() if isinstance(weight, Float8Tensor) else weight.detach()
        op = quantize(plan, "weight", w, True, need_col, scales, 2 * gemm + 1, history)
        if is_first_microbatch is not None:
            self._weight_caches[gemm] = op
        elif self._weight_caches:
            self._weight_caches.pop(gemm, None)
        return op

    def _calibrate_gemm_operands(self, operands, state, owner=None, gemm: int = -1) -> None:
        """A calibrating forward's bookkeeping (FP8 off) for the module's GEMM operands,
        ((name, tensor, is_activation), ...) in the order of its forward history's columns:
        under delayed scaling their amaxes go into that history for the next scale update;
        with a calibration config (fp8.py) the calibration metadata is kept too, on
        ``owner`` (default: this module; a GroupedLinear's group: the grouped module, its
        index ``gemm``), from the same amaxes."""
        recipe = state.recipe
        amaxes = None
        if kind_of(recipe) == "delayed":
            self._fit_fp8_meta(recipe)
            amaxes = [ops.amax(calibration.rows(t)) for _, t, _ in operands]
            for column, amax in enumerate(amaxes):
                record_amax(self.amax_history_fwd, column, amax)
            fp8.register_forward_amaxes(self, recipe)
        if state.calibration is not None:
            calibration.record(self if owner is None else owner, operands, recipe,
                               state.calibration, gemm, amaxes)

    def _fit_fp8_meta(self, recipe: DelayedScaling) -> None:
        """Meets a delayed recipe: a new history length starts the histories afresh."""
        self._fp8_recipe = None  # e.g. calibration: the next FP8 forward meets its recipe afresh
        self._recipe_summary = recipe
        length = self._buffers["amax_history_fwd"].shape[0]
        if torch.compiler.is_compiling():
            if length != recipe.amax_history_len:
                # New buffers in the middle of a traced graph would not be the module's. An
                # autocast entered outside the compiled function resizes unused state before
                # (fp8._UNUSED), so this is state a forward has used, or an autocast inside.
                name = getattr(self, "_name", "") or type(self).__name__
                raise RuntimeError(
                    f"{name}: the fp8_autocast recipe has amax_history_len="
                    f"{recipe.amax_history_len} but this module's delayed-scaling state "
                    f"holds {length} steps, and torch.compile cannot replace the state "
                    "inside a compiled function; run one eager forward under this recipe "
                    "first, or enter fp8_autocast outside the compiled function before the "
                    "module's first forward")
            return
        if self._fp8_unused:
            fp8.mark_used(self)
        if not fp8.STATE.enabled:  # a calibrating forward (NVIDIA's fp8_calibration)
            self.__dict__["_nvidia_flags"] = (False, True, None)
        if length != recipe.amax_history_len:
            self._make_fp8_meta(recipe.amax_history_len, self.amax_history_fwd.device)

    # ------------------------------------------------ NVIDIA's attributes (Megatron-LM's)
    # NVIDIA's modules set fp8, fp8_calibration and fp8_meta at the start of every forward
    # (init_fp8_metadata). Here they are read off the state when asked, so that a forward
    # writes nothing for them: a forward that meets a recipe sets _fp8_recipe anyway, and
    # init_fp8_metadata (and a calibrating forward) leave flags that hold until the next FP8
    # forward meets its recipe.

    @property
    def fp8(self) -> bool:
        """Whether the module runs in FP8: True once an FP8 forward has run (until
        ``init_fp8_metadata`` outside an FP8 autocast, or a calibrating forward, says
        otherwise), as NVIDIA's attribute after its forward."""
        if self._fp8_recipe is not None:
            return True
        flags = self.__dict__.get("_nvidia_flags")
        return bool(flags and flags[0])

    @fp8.setter
    def fp8(self, value: bool) -> None:
        self._set_nvidia_flags(bool(value), self.fp8_calibration)

    @property
    def fp8_calibration(self) -> bool:
        """Whether the module's last forward calibrated (an autocast with
        ``calibrating=True`` and FP8 off), or ``init_fp8_metadata`` found such an autocast."""
        flags = self.__dict__.get("_nvidia_flags")
        return self._fp8_recipe is None and bool(flags and flags[1])

    @fp8_calibration.setter
    def fp8_calibration(self, value: bool) -> None:
        self._set_nvidia_flags(self.fp8, bool(value))

    def _set_nvidia_flags(self, fp8_on: bool, calibrating: bool, recipe=None) -> None:
        self._fp8_recipe = None  # the next FP8 forward meets its recipe (and resets the flags)
        self.__dict__["_nvidia_flags"] = (fp8_on, calibrating, recipe)

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """NVIDIA's: ``fp8``, ``fp8_calibration`` and ``fp8_meta`` from the current autocast
        (Megatron-LM calls it before loading a state dict). The delayed-scaling state itself
        fits the recipe at the next forward, as always here; ``num_gemms`` is NVIDIA's count
        (this module knows its own)."""
        del num_gemms
        state = fp8.STATE
        on = state.enabled or state.calibrating
        recipe = (state.recipe or fp8._DEFAULT_RECIPE) if on else None
        self._set_nvidia_flags(bool(state.enabled), bool(state.calibrating), recipe)
        if on:
            self.fp8_meta["fp8_group"] = state.group

    def _nvidia_recipe(self) -> Recipe:
        """The recipe of the last FP8 forward, else the one init_fp8_metadata found, else
        the one the state was made or loaded under, else the default recipe."""
        if self._fp8_recipe is not None:
            return self._fp8_recipe
        flags = self.__dict__.get("_nvidia_flags")
        if flags and flags[2] is not None:
            return flags[2]
        summary = self._recipe_summary
        if isinstance(summary, Recipe):
            return summary
        loaded = _nvidia_state.recipe_from_summary(summary) if summary else None
        return loaded if loaded is not None else fp8._DEFAULT_RECIPE

    def _nvidia_checkpoint(self) -> bool:
        """NVIDIA's fp8_meta["fp8_checkpoint"]: the module holds FP8 state worth saving (a
        forward used it, it was loaded, or the module runs in FP8)."""
        return not self._fp8_unused or self.fp8 or self.fp8_calibration

    @property
    def fp8_meta(self) -> dict:
        """NVIDIA's dict of FP8 metadata, with the keys Megatron-LM reads: ``"recipe"``,
        ``"fp8_checkpoint"``, ``"fp8_group"``, ``"num_gemms"``. One dict per module: what a
        caller writes in it stays until the module's own value changes."""
        return nvidia_fp8_meta(self, self._nvidia_recipe(), self._nvidia_checkpoint(),
                               self._num_gemms)

    def _apply(self, fn, recurse=True):
        # module.half() / .to(dtype) would cast the scaling state too; it stays fp32 (the
        # core's ops take nothing else) and only follows the module to its device.
        saved = {name: self._buffers[name] for name in _META}
        result = super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                new = self._buffers[name] = old.to(new.device)
            first_step.move_marks(old, new)
        return result

    def __setstate__(self, state) -> None:
        # A copy (copy.deepcopy, pickle) of an unused module is an unused module too.
        super().__setstate__(state)
        self.__dict__.setdefault("_fp8_first_step", "eager")  # a pickle from before the rule
        if self.__dict__.setdefault("_fp8_unused", False):
            fp8.track_unused(self, self._buffers["amax_history_fwd"].shape[0])

    def get_extra_state(self) -> dict:
        summary = self._recipe_summary
        state: dict[str, Any] = {"version": EXTRA_STATE_VERSION,
                                 "recipe": recipe_summary(summary) if isinstance(summary, Recipe)
                                 else dict(summary)}
        for name in _META:
            state[name] = getattr(self, name).detach().cpu().clone()
        return state

    def set_extra_state(self, state: Any) -> None:
        """Loads our extra state (a dict, ``get_extra_state``'s), or NVIDIA Transformer
        Engine's (a uint8 tensor of pickled bytes, a BytesIO before its 2.0; empty where the
        module never ran in FP8), its delayed-scaling columns mapped onto ours
        (module/_nvidia_state.py). Everything is checked before anything is written."""
        checked = self._checked_extra_state(state)
        if checked is not None:
            self._install_extra_state(checked)

    def _checked_extra_state(self, state: Any) -> tuple | None:
        """The buffers, their empty history columns and the summary that ``state`` loads,
        made and checked without touching the module (None: nothing to load)."""
        name = type(self).__name__
        if state is None:  # a checkpoint written before the module saw FP8
            return None
        if isinstance(state, (torch.Tensor, io.BytesIO)):
            nvidia = _nvidia_state.decode(name, state)
            if nvidia is None:
                return None
            state = _nvidia_state.to_ours(name, nvidia, self._nvidia_layout, self._num_gemms,
                                          self._buffers["amax_history_fwd"].shape[0])
        if not isinstance(state, dict) or "version" not in state:
            raise ValueError(f"{name}.set_extra_state: state must be a dict with a 'version' "
                             "(this library's extra state) or NVIDIA Transformer Engine's "
                             f"(a uint8 tensor or a BytesIO), got {type(state).__name__}")
        if state["version"] != EXTRA_STATE_VERSION:
            raise ValueError(f"{name}.set_extra_state: state version must be "
                             f"{EXTRA_STATE_VERSION}, got {state['version']!r}")
        device = self._buffers["amax_history_fwd"].device
        buffers, empties, loaded = {}, {}, {}
        for key, (kind, per_gemm) in _META.items():
            t = state.get(key) if key in _OPTIONAL else state.get(key, "missing")
            columns = per_gemm * self._num_gemms
            if t is None:  # a checkpoint from before the FP8 output: fresh state, sized alike
                length = buffers["amax_history_fwd"].shape[0]
                t = torch.zeros(length, columns) if kind == "history" else torch.ones(columns)
            dims = 2 if kind == "history" else 1
            if not isinstance(t, torch.Tensor) or t.dim() != dims or t.shape[-1] != columns:
                got = (f"shape {list(t.shape)}" if isinstance(t, torch.Tensor)
                       else "nothing" if isinstance(t, str) else type(t).__name__)
                raise ValueError(f"{name}.set_extra_state: {key} must have {columns} columns "
                                 f"({per_gemm} per GEMM of this module) in a {dims}-d tensor, "
                                 f"got {got}")
            if (kind == "history" and buffers
                    and t.shape[0] != buffers["amax_history_fwd"].shape[0]):
                raise ValueError(f"{name}.set_extra_state: {key} must have the "
                                 f"{buffers['amax_history_fwd'].shape[0]} steps of "
                                 f"amax_history_fwd, got {t.shape[0]}")
            loaded[key] = t.detach().to("cpu", torch.float32)
            # Contiguous whatever the saved layout: quantize reaches single elements of these
            # buffers by address (ops.quantize_delayed).
            buffers[key] = t.to(device, torch.float32).clone(
                memory_format=torch.contiguous_format)
        for key in ("amax_history_fwd", "amax_history_bwd", "amax_history_out"):
            # columns as new (first_step.py): no amax, scale 1; a first step for them
            history, scale = loaded[key], loaded[key.replace("amax_history", "scale")]
            empties[key] = [c for c in self._cast_columns(key, history.shape[1])
                            if not bool(history[:, c].any()) and float(scale[c]) == 1.0]
        summary = state.get("recipe", {})
        return buffers, empties, dict(summary) if isinstance(summary, dict) else {}

    def _install_extra_state(self, checked: tuple) -> None:
        buffers, empties, summary = checked
        if self._fp8_unused:  # loaded state is kept until a forward meets another length
            fp8.mark_used(self)
        counts = [0, 0]  # empty history columns, all history columns
        for key, t in buffers.items():
            if key in empties:
                first_step.mark_empty(t, empties[key])
                counts[0] += len(empties[key])
                counts[1] += len(self._cast_columns(key, t.shape[1]))
            self.register_buffer(key, t, persistent=False)
        self._recipe_summary = summary
        # NVIDIA's flags stay as they were (its set_extra_state leaves them); the next FP8
        # forward meets its recipe afresh (the loaded history may not fit it).
        self.__dict__["_nvidia_flags"] = (self.fp8, self.fp8_calibration, None)
        self._fp8_recipe = None
        # Every column empty: a first step again; some: the marks decide (first_step.py).
        self._fp8_first_step = ("first" if counts[0] == counts[1] else
                                "eager" if counts[0] else "done")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # A plain nn.Linear checkpoint has no FP8 state; it loads with fresh scales.
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)


# NVIDIA's name of the base class of its modules (Megatron-LM tests modules against it): here
# the base of te.Linear, LayerNormLinear, LayerNormMLP and DotProductAttention, as there.
# GroupedLinear is not one (its groups, te modules of their own, are), nor are
# MultiheadAttention and TransformerLayer (plain torch.nn.Module subclasses there too).
TransformerEngineBaseModule = FP8Module


# id(an fp8_meta dict) -> its module (weakly), for NVIDIA's calls that name a module by its
# fp8_meta (FP8GlobalStateManager.add_fp8_tensors_to_global_buffer).
_META_OWNERS: dict = {}


def fp8_meta_owner(meta: Any) -> Optional[torch.nn.Module]:
    """The module whose ``fp8_meta`` dict ``meta`` is, or None."""
    ref = _META_OWNERS.get(id(meta))
    module = ref() if ref is not None else None
    if module is None or module.__dict__.get("_nvidia_fp8_meta") is not meta:
        return None
    return module


def nvidia_fp8_meta(module: torch.nn.Module, recipe: Recipe, checkpoint: bool,
                    num_gemms: int) -> dict:
    """``module``'s NVIDIA fp8_meta dict, kept on the module, with the values the module
    derives now for "recipe" and "fp8_checkpoint"; a value a caller wrote stays until the
    derived one changes (as NVIDIA's next forward would overwrite it)."""
    meta = module.__dict__.get("_nvidia_fp8_meta")
    if meta is None:
        meta = module.__dict__["_nvidia_fp8_meta"] = {"fp8_group": None, "num_gemms": num_gemms}
        module.__dict__["_nvidia_fp8_meta_derived"] = {}
        _META_OWNERS[id(meta)] = weakref.ref(module)
    derived = module.__dict__["_nvidia_fp8_meta_derived"]
    for key, value in (("recipe", recipe), ("fp8_checkpoint", checkpoint)):
        if key not in derived or type(derived[key]) is not type(value) or derived[key] != value:
            meta[key] = derived[key] = value
    return meta


def set_group_of_children(module: torch.nn.Module, tp_group) -> None:
    """``set_tensor_parallel_group(tp_group)`` of each direct child that has one (a block's
    projections, a layer's blocks)."""
    for child in module.children():
        setter = getattr(child, "set_tensor_parallel_group", None)
        if setter is not None:
            setter(tp_group)
