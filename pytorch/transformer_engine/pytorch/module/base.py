"""What every te module shares: its delayed-scaling state and how it is checkpointed.

Delayed scaling keeps, per module, amax histories and scales of the forward roles (column 0
``input``, column 1 ``weight``) and of the backward role (``grad_output``). They are
non-persistent buffers, so they move with ``.to()`` / ``.cuda()``; checkpoints carry them in
the module's versioned extra state (``get_extra_state``), together with a summary of the
recipe that produced them.
"""

from __future__ import annotations

from typing import Any

import torch

from transformer_engine.common.recipe import DelayedScaling, Recipe

EXTRA_STATE_VERSION = 1
# name -> (rows of the history or None for a scale vector, columns)
_META = {
    "amax_history_fwd": ("history", 2),
    "scale_fwd": ("scale", 2),
    "scale_inv_fwd": ("scale", 2),
    "amax_history_bwd": ("history", 1),
    "scale_bwd": ("scale", 1),
    "scale_inv_bwd": ("scale", 1),
}


_SUMMARIES: dict = {}


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


class FP8Module(torch.nn.Module):
    """Base of te modules: delayed-scaling buffers and the extra state that saves them."""

    def __init__(self, device: torch.device, history_len: int | None = None) -> None:
        super().__init__()
        self._recipe_summary: dict = {}
        self._make_fp8_meta(history_len or DelayedScaling().amax_history_len, device)

    def _make_fp8_meta(self, history_len: int, device: torch.device) -> None:
        for name, (kind, columns) in _META.items():
            if kind == "history":
                t = torch.zeros(history_len, columns, dtype=torch.float32, device=device)
            else:
                t = torch.ones(columns, dtype=torch.float32, device=device)
            self.register_buffer(name, t, persistent=False)

    def _fit_fp8_meta(self, recipe: DelayedScaling) -> None:
        """Meets a delayed recipe: a new history length starts the histories afresh."""
        self._recipe_summary = recipe_summary(recipe)
        length = self.amax_history_fwd.shape[0]
        if length != recipe.amax_history_len:
            if torch.compiler.is_compiling():
                # New buffers in the middle of a traced graph would not be the module's.
                raise RuntimeError(
                    f"{type(self).__name__}: the recipe's amax_history_len="
                    f"{recipe.amax_history_len} differs from this module's delayed-scaling "
                    f"state ({length} steps), which cannot be reallocated inside "
                    "torch.compile; run one eager forward under this recipe first")
            self._make_fp8_meta(recipe.amax_history_len, self.amax_history_fwd.device)

    def _apply(self, fn, recurse=True):
        # module.half() / .to(dtype) would cast the scaling state too; it stays fp32 (the
        # core's ops take nothing else) and only follows the module to its device.
        saved = {name: self._buffers[name] for name in _META}
        result = super()._apply(fn, recurse)
        for name, old in saved.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device)
        return result

    def get_extra_state(self) -> dict:
        state: dict[str, Any] = {"version": EXTRA_STATE_VERSION,
                                 "recipe": dict(self._recipe_summary)}
        for name in _META:
            state[name] = getattr(self, name).detach().cpu().clone()
        return state

    def set_extra_state(self, state: Any) -> None:
        if state is None:  # a checkpoint written before the module saw FP8
            return
        if not isinstance(state, dict) or "version" not in state:
            raise ValueError(f"{type(self).__name__}.set_extra_state: state must be a dict "
                             f"with a 'version', got {type(state).__name__}")
        if state["version"] != EXTRA_STATE_VERSION:
            raise ValueError(f"{type(self).__name__}.set_extra_state: state version must be "
                             f"{EXTRA_STATE_VERSION}, got {state['version']!r}")
        device = self.amax_history_fwd.device
        for name in _META:
            self.register_buffer(name, state[name].to(device, torch.float32).clone(),
                                 persistent=False)
        self._recipe_summary = dict(state.get("recipe", {}))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # A plain nn.Linear checkpoint has no FP8 state; it loads with fresh scales.
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)
