"""``quantized_model_init``: NVIDIA Transformer Engine's current name for ``fp8_model_init``.

Modules built inside keep their weights only as FP8 :class:`Float8Tensor` parameters, exactly
as under :func:`fp8_model_init`, which this delegates to. With
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

import contextlib
from typing import Iterator, Optional

from transformer_engine.common.recipe import Recipe

from . import float8_tensor
from .fp8 import fp8_model_init

__all__ = ["quantized_model_init"]


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False) -> Iterator[None]:
    """Modules built inside keep FP8 weights only (see :func:`fp8_model_init`).

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
    flag = float8_tensor._PRESERVE_INIT
    saved = flag[0]
    flag[0] = bool(enabled) and preserve_high_precision_init_val
    try:
        with fp8_model_init(enabled=enabled, recipe=recipe):
            yield
    finally:
        flag[0] = saved
