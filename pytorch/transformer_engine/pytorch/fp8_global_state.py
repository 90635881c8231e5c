"""``FP8GlobalStateManager``: NVIDIA Transformer Engine's class for asking the FP8 state
(Megatron-LM imports it from ``transformer_engine.pytorch.fp8`` to learn whether it runs
inside an FP8 autocast and with which recipe). Here the state lives in ``fp8.py`` (``STATE``,
``MODEL_INIT``); this class reads and sets it under NVIDIA's method names. NVIDIA's methods
that hand out its internal buffers (amax buffers, meta keys) are not provided.
"""

from __future__ import annotations

from typing import Any

import torch

from transformer_engine.common.recipe import Recipe

from . import availability, fp8

__all__ = ["FP8GlobalStateManager"]


class FP8GlobalStateManager:
    """Class methods over the process-wide FP8 state (never instantiated)."""

    @classmethod
    def is_fp8_available(cls) -> tuple[bool, str]:
        return availability.is_fp8_available(return_reason=True)

    @classmethod
    def is_fp8_block_scaling_available(cls) -> tuple[bool, str]:
        return availability.is_fp8_block_scaling_available(return_reason=True)

    @classmethod
    def is_mxfp8_available(cls) -> tuple[bool, str]:
        return availability.is_mxfp8_available(return_reason=True)

    @classmethod
    def is_nvfp4_available(cls) -> tuple[bool, str]:
        return availability.is_nvfp4_available(return_reason=True)

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        """Inside an enabled ``fp8_autocast`` (the innermost one decides)."""
        return fp8.STATE.enabled

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return fp8.STATE.calibrating

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        """Inside ``fp8_model_init`` / ``quantized_model_init(enabled=True)``."""
        return fp8.MODEL_INIT.enabled

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        """The innermost autocast's recipe; the default recipe outside any."""
        return fp8.STATE.recipe or availability.get_default_recipe()

    @classmethod
    def get_fp8_group(cls) -> Any:
        return fp8.STATE.group

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        """Whether the current stream is being captured into a CUDA graph (NVIDIA's flag is
        set by its make_graphed_callables; a capture is what it stands for)."""
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @classmethod
    def get_fp8_autocast_state(cls) -> tuple:
        """A snapshot of the autocast state, for :meth:`set_fp8_autocast_state`."""
        s = fp8.STATE
        return (s.enabled, s.calibrating, s.recipe, s.group, s.depth)

    @classmethod
    def set_fp8_autocast_state(cls, state: tuple) -> None:
        """Restores a snapshot of :meth:`get_fp8_autocast_state` (forward scale updates
        still pending stay pending until the outermost autocast exits)."""
        if not (isinstance(state, tuple) and len(state) == 5):
            raise TypeError("FP8GlobalStateManager.set_fp8_autocast_state: state must be the "
                            "tuple get_fp8_autocast_state returned, got "
                            f"{type(state).__name__}")
        s = fp8.STATE
        s.enabled, s.calibrating, s.recipe, s.group, s.depth = state

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        """Runs the pending forward scale updates of delayed scaling now (the outermost
        autocast's exit would). Backward scales are updated in each module's backward here,
        so ``forward=False`` has nothing to do."""
        s = fp8.STATE
        if forward and s.pending:
            pending, s.pending = s.pending, {}
            fp8.update_forward_scales(pending.values())

    @classmethod
    def reset(cls) -> None:
        """Leaves every autocast and model-init context (the state of a fresh process);
        pending forward scale updates are dropped."""
        s = fp8.STATE
        s.enabled, s.calibrating, s.recipe, s.group, s.depth = False, False, None, None, 0
        s.pending = {}
        fp8.MODEL_INIT.enabled, fp8.MODEL_INIT.recipe = False, None
