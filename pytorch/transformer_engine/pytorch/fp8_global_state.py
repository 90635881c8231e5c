"""``FP8GlobalStateManager``: NVIDIA Transformer Engine's class for asking the FP8 state
(Megatron-LM imports it from ``transformer_engine.pytorch.fp8`` to learn whether it runs
inside an FP8 autocast and with which recipe). Here the state lives in ``fp8.py`` (``STATE``,
``MODEL_INIT``); this class reads and sets it under NVIDIA's method names. NVIDIA's methods
that hand out its internal buffers (amax buffers, meta keys) are not provided;
``add_fp8_tensors_to_global_buffer`` registers a module's forward scale update instead.
"""

from __future__ import annotations

from typing import Any

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
    def get_calibration_config(cls):
        """The QuantizationCalibrationConfig a calibrating forward keeps its calibration
        metadata by (calibration.py); None where no forward calibrates with FP8 off."""
        return fp8.STATE.calibration

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
        """Whether te modules are being captured into a CUDA graph: announced with
        ``graph.set_capture_start`` (as Megatron-LM does) or the current stream captures."""
        from . import graphs

        return graphs.capturing()

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta: dict) -> None:
        """Counts the module whose ``fp8_meta`` this is among those whose forward scales the
        outermost delayed-scaling autocast updates at its exit, as its forward does. For
        forwards that run without the module's Python code: the replay of a captured graph
        writes the amaxes into the module's histories, and this call (NVIDIA's, made by
        Megatron-LM at each replay) has their update follow. Outside an FP8 autocast of
        delayed scaling there is nothing to update."""
        from .module.base import fp8_meta_owner

        module = fp8_meta_owner(fp8_meta)
        if module is None:
            raise ValueError("FP8GlobalStateManager.add_fp8_tensors_to_global_buffer: fp8_meta "
                             "must be the fp8_meta dict of a transformer_engine module, got "
                             f"{type(fp8_meta).__name__}")
        s = fp8.STATE
        if s.enabled and fp8.kind_of(s.recipe) == "delayed":
            fp8.register_forward_amaxes(module, s.recipe)

    @classmethod
    def get_fp8_autocast_state(cls) -> tuple:
        """A snapshot of the autocast state, for :meth:`set_fp8_autocast_state`."""
        s = fp8.STATE
        return (s.enabled, s.calibrating, s.recipe, s.group, s.depth, s.calibration)

    @classmethod
    def set_fp8_autocast_state(cls, state: tuple) -> None:
        """Restores a snapshot of :meth:`get_fp8_autocast_state` (forward scale updates
        still pending stay pending until the outermost autocast exits)."""
        if not (isinstance(state, tuple) and len(state) == 6):
            raise TypeError("FP8GlobalStateManager.set_fp8_autocast_state: state must be the "
                            "tuple get_fp8_autocast_state returned, got "
                            f"{type(state).__name__}")
        s = fp8.STATE
        s.enabled, s.calibrating, s.recipe, s.group, s.depth, s.calibration = state

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
        s.calibration = None
        s.pending = {}
        fp8.MODEL_INIT.enabled, fp8.MODEL_INIT.recipe = False, None
