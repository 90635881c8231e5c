"""``quantized_model_init``: NVIDIA Transformer Engine's current name for ``fp8_model_init``.

Modules built inside keep their weights only as FP8 :class:`Float8Tensor` parameters, exactly
as under :func:`fp8_model_init`, which this is (with the same arguments). With
``preserve_high_precision_init_val=True`` each such weight also keeps the high-precision
value it was quantized from, in CPU memory, for ``weight.get_high_precision_init_val()``
(e.g. to initialise an optimizer's FP32 master weights) until
``weight.clear_high_precision_init_val()`` drops it.

Example:

>>> import transformer_engine.pytorch as te  # doctest: +SKIP
>>> with te.quantized_model_init(enabled=True, preserve_high_precision_init_val=True):
...     layer = te.Linear(64, 64)  # doctest: +SKIP
>>> master = layer.weight.get_high_precision_init_val().float()  # doctest: +SKIP
>>> layer.weight.clear_high_precision_init_val()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Optional

from transformer_engine.common.recipe import Recipe

from .fp8 import fp8_model_init

__all__ = ["quantized_model_init"]


def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """Modules built inside keep FP8 weights only: :func:`fp8_model_init` under NVIDIA's
    newer name, with the same arguments.

    Args:
        enabled: build FP8 weights (False: ordinary high-precision weights).
        recipe: how weights are quantized; ``DelayedScaling()`` when None.
        preserve_high_precision_init_val: keep each FP8 weight's initial high-precision
            value on the CPU (``get_high_precision_init_val()`` /
            ``clear_high_precision_init_val()`` on the weight).
    """
    if not isinstance(preserve_high_precision_init_val, bool):
        raise TypeError("quantized_model_init: preserve_high_precision_init_val must be a "
                        f"bool, got {type(preserve_high_precision_init_val).__name__}")
    return fp8_model_init(enabled, recipe, preserve_high_precision_init_val)
