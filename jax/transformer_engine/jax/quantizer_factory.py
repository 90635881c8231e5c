"""NVIDIA's quantizer objects, for JAX programs written against them: ``QuantizerFactory``,
``Quantizer``, ``ScaledTensor``, ``QuantizeLayout`` and ``noop_quantizer_set`` (exported by
:mod:`transformer_engine.jax.quantize`).

Here a recipe decides how a layer's tensors are quantized (:func:`make_quantizer_set`); NVIDIA's
programs build quantizers from a scaling mode and FP8 dtypes instead. Both of their uses map
onto ours:

* ``QuantizerFactory.create_set(scaling_mode=..., fwd_dtype=..., bwd_dtype=...)`` gives the
  :class:`~transformer_engine.jax.QuantizerSet` that :func:`~transformer_engine.jax.dense` and
  the fused layers take: the scaling mode's recipe, with the dtypes as its ``fp8_format``
  (e4m3/e4m3: ``E4M3``, e4m3/e5m2: ``HYBRID``) and, for delayed scaling, fresh state (scale 1,
  empty history), as NVIDIA's fresh quantizers have. Without a scaling mode: the enclosing
  autocast's recipe (none: no FP8), as NVIDIA's default follows its quantize config.
* ``QuantizerFactory.create(scaling_mode=..., q_dtype=...)`` gives one tensor's
  :class:`Quantizer`: ``quantize(x)`` returns a :class:`ScaledTensor` (FP8 data, its scale
  inverse, ``dequantize()``) made by the core's kernels. Current scaling scales from the
  tensor's own amax; block scaling per block; delayed scaling with the quantizer's scale, and
  ``quantizer.update(amax)`` returns the quantizer with the amax recorded and the next scale
  (the objects are immutable, as JAX values are; NVIDIA's change in place).

Refused with a clear error: grouped quantizers (``n_groups``) and NVFP4.

Example:
    >>> import jax.numpy as jnp
    >>> from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode
    >>> q = QuantizerFactory.create(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING,
    ...                             q_dtype=jnp.float8_e4m3fn)
    >>> q.quantize(jnp.array([[1.0, -2.0]])).dequantize().tolist()
    [[1.0, -2.0]]
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Optional

import jax
import jax.numpy as jnp
from transformer_engine.common import recipe as _recipe
from transformer_engine.jax import ops
from transformer_engine.jax.autocast import get_fp8_recipe
from transformer_engine.jax.quantizer import QuantizerSet, make_quantizer_set, new_fp8_state

__all__ = ["QuantizeLayout", "ScaledTensor", "Quantizer", "QuantizerFactory",
           "noop_quantizer_set"]

_E4M3, _E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
# (forward dtype, backward dtype) -> the recipe's fp8_format.
_FORMATS = {(_E4M3, _E4M3): _recipe.Format.E4M3, (_E4M3, _E5M2): _recipe.Format.HYBRID}


class QuantizeLayout(enum.Enum):
    """Which copies of a tensor a quantizer makes: row-wise (the tensor's layout), column-wise
    (its transpose, for the GEMM that contracts the other dimension), or both."""

    ROWWISE = "rowwise"
    COLWISE = "colwise"
    ROWWISE_COLWISE = "rowwise_colwise"

    @property
    def is_rowwise(self) -> bool:
        return self is not QuantizeLayout.COLWISE

    @property
    def is_colwise(self) -> bool:
        return self is not QuantizeLayout.ROWWISE


def _mode(scaling_mode, caller: str):
    from transformer_engine.jax.quantize import ScalingMode, _as_mode

    mode = _as_mode(scaling_mode, caller)
    if mode in (ScalingMode.NVFP4_1D_SCALING, ScalingMode.NVFP4_2D_SCALING):
        raise NotImplementedError(f"{caller}: {mode.name} (FP4 data) is not implemented here")
    return mode


def _fp8(dtype, caller: str, name: str) -> jnp.dtype:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        dtype = None
    if dtype not in (_E4M3, _E5M2):
        raise TypeError(f"{caller}: {name} must be jnp.float8_e4m3fn or jnp.float8_e5m2, got "
                        f"{dtype!r}")
    return dtype


def _refuse_groups(n_groups, caller: str) -> None:
    if n_groups:
        raise NotImplementedError(f"{caller}: n_groups={n_groups!r}: grouped quantizers (one "
                                  "per group of a grouped GEMM) are not implemented here")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class ScaledTensor:
    """One tensor in FP8: ``data`` (row-wise, the tensor's shape) and/or ``colwise_data`` (the
    transpose of its [M, K] matrix view), their scale inverses, the amax of the values and the
    dtype ``dequantize()`` returns."""

    data: Optional[jax.Array]
    scale_inv: Optional[jax.Array]
    colwise_data: Optional[jax.Array]
    colwise_scale_inv: Optional[jax.Array]
    amax: jax.Array
    scaling_mode: object  # quantize.ScalingMode
    dq_dtype: jnp.dtype
    shape: tuple

    def tree_flatten(self):
        return ((self.data, self.scale_inv, self.colwise_data, self.colwise_scale_inv,
                 self.amax), (self.scaling_mode, self.dq_dtype, self.shape))

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def dequantize(self) -> jax.Array:
        """The values in ``dq_dtype`` and the tensor's shape (from the row-wise data, else the
        column-wise)."""
        mode = self.scaling_mode.core_mode
        if self.data is not None:
            m = math.prod(self.shape[:-1])
            out = ops.dequantize(self.data.reshape(m, -1), self.scale_inv, self.dq_dtype,
                                 scaling_mode=mode)
            return out.reshape(self.shape)
        if mode == ops.ScalingMode.MXFP8:
            # MXFP8's column-wise copy keeps the layout, one power-of-two scale per 32 rows of
            # a column: exact in fp32 (an FP8 value times a power of two)
            rows = self.colwise_data.shape[0]
            factor = jnp.repeat(self.colwise_scale_inv.astype(jnp.float32), 32, axis=0)[:rows]
            out = self.colwise_data.astype(jnp.float32) * factor
            return out.astype(self.dq_dtype).reshape(self.shape)
        out = ops.dequantize(self.colwise_data, self.colwise_scale_inv, self.dq_dtype,
                             scaling_mode=mode)
        return out.T.reshape(self.shape)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Quantizer:
    """One tensor's quantizer (see the module docstring). ``scale`` and ``amax_history`` are
    delayed scaling's state (None for the other modes)."""

    scaling_mode: object  # quantize.ScalingMode
    q_dtype: jnp.dtype
    q_layout: QuantizeLayout = QuantizeLayout.ROWWISE_COLWISE
    scale: Optional[jax.Array] = None
    amax_history: Optional[jax.Array] = None
    margin: int = 0
    amax_algo: str = "max"  # the delayed-scaling rule over the history ("max", "most_recent")

    def tree_flatten(self):
        return ((self.scale, self.amax_history),
                (self.scaling_mode, self.q_dtype, self.q_layout, self.margin,
                 self.amax_algo))

    @classmethod
    def tree_unflatten(cls, aux, children):
        mode, dtype, layout, margin, algo = aux
        return cls(mode, dtype, layout, *children, margin, algo)

    @property
    def is_delayed(self) -> bool:
        from transformer_engine.jax.quantize import ScalingMode

        return self.scaling_mode is ScalingMode.DELAYED_TENSOR_SCALING

    def quantize(self, x: jax.Array, is_rowwise: Optional[bool] = None,
                 is_colwise: Optional[bool] = None, dq_dtype=None,
                 flatten_axis: int = -1) -> ScaledTensor:
        """``x`` (fp32/fp16/bf16) in FP8: the copies ``q_layout`` names (or those asked for),
        of x viewed as the matrix [prod(shape[:flatten_axis]), prod(shape[flatten_axis:])]."""
        x = jnp.asarray(x)
        rowwise = self.q_layout.is_rowwise if is_rowwise is None else bool(is_rowwise)
        colwise = self.q_layout.is_colwise if is_colwise is None else bool(is_colwise)
        if not (rowwise or colwise):
            raise ValueError("Quantizer.quantize: is_rowwise or is_colwise must be True, got "
                             "both False")
        # rows: the dims before flatten_axis; columns: the rest (a vector is one row)
        split = flatten_axis % x.ndim if x.ndim >= 1 else 0
        if x.ndim < 1 or not -x.ndim <= flatten_axis < x.ndim or (x.ndim > 1 and split == 0):
            raise ValueError(f"Quantizer.quantize: flatten_axis must split x's dims into two "
                             f"non-empty groups, got {flatten_axis} for shape {x.shape}")
        m = math.prod(x.shape[:split])
        x2 = x.reshape(m, math.prod(x.shape[split:]))
        mode = self.scaling_mode.core_mode
        if mode != ops.ScalingMode.TENSOR:
            q = ops.quantize(x2, None, self.q_dtype, scaling_mode=mode, rowwise=rowwise,
                             columnwise=colwise)
            rsi, csi = q.scale_inv, q.columnwise_scale_inv
        else:
            if self.is_delayed:
                scale = self.scale
            else:
                scale, _ = ops.scale_from_amax(ops.compute_amax(x2), self.q_dtype)
            q = ops.quantize(x2, scale, self.q_dtype, rowwise=rowwise, columnwise=colwise)
            rsi = csi = q.scale_inv
        return ScaledTensor(q.data.reshape(x.shape) if rowwise else None,
                            rsi if rowwise else None, q.columnwise_data if colwise else None,
                            csi if colwise else None, q.amax, self.scaling_mode,
                            jnp.dtype(dq_dtype or x.dtype), tuple(x.shape))

    def update(self, amax: jax.Array) -> "Quantizer":
        """Delayed scaling: this quantizer with ``amax`` recorded in its history and the next
        scale from it (the recipe's rule: the core's delayed-scaling update). The other modes
        keep no state: the quantizer itself."""
        if not self.is_delayed:
            return self
        history = self.amax_history.at[0].set(jnp.reshape(amax, ()).astype(jnp.float32))
        (history,), (scale,), _ = ops.delayed_scaling_update(
            [history], [self.scale], self.q_dtype, algo=self.amax_algo,
            margin=self.margin)
        return dataclasses.replace(self, scale=scale, amax_history=history)


class QuantizerFactory:
    """NVIDIA's factory of quantizers and quantizer sets (see the module docstring)."""

    @staticmethod
    def create(n_quantizers: int = 1, scaling_mode=None, q_dtype=None,
               q_layout: Optional[QuantizeLayout] = None, n_groups: Optional[int] = None,
               **kwargs):
        """``n_quantizers`` quantizers (one: the quantizer itself, else a tuple). Keywords:
        delayed scaling's ``scale`` ([1] fp32, default 1), ``amax_history`` (default zeros
        of ``amax_history_len``, default 1024, NVIDIA's), ``margin`` and
        ``amax_compute_algo``. NO_SCALING gives None (no quantization)."""
        from transformer_engine.jax.quantize import ScalingMode

        op = "QuantizerFactory.create"
        _refuse_groups(n_groups, op)
        if scaling_mode is None:
            raise TypeError(f"{op}: scaling_mode must be a ScalingMode, got None")
        mode = _mode(scaling_mode, op)
        if not isinstance(n_quantizers, int) or n_quantizers < 1:
            raise ValueError(f"{op}: n_quantizers must be an int >= 1, got {n_quantizers!r}")
        if mode is ScalingMode.NO_SCALING:
            made = [None] * n_quantizers
        else:
            dtype = _fp8(q_dtype, op, "q_dtype")
            layout = QuantizeLayout.ROWWISE_COLWISE if q_layout is None else q_layout
            if not isinstance(layout, QuantizeLayout):
                raise TypeError(f"{op}: q_layout must be a QuantizeLayout or None, got "
                                f"{q_layout!r}")
            state = _delayed_state(op, mode, kwargs)
            made = [Quantizer(mode, dtype, layout, **state) for _ in range(n_quantizers)]
        return made[0] if n_quantizers == 1 else tuple(made)

    @staticmethod
    def create_set(n_quantizer_sets: int = 1, scaling_mode=None, fwd_dtype=None,
                   bwd_dtype=None, is_2x2x: Optional[bool] = None,
                   n_groups: Optional[int] = None, fp8_recipe=None, **kwargs):
        """``n_quantizer_sets`` QuantizerSets for :func:`dense` and the fused layers (one: the
        set itself, else a tuple): the recipe of ``scaling_mode`` with ``fwd_dtype`` /
        ``bwd_dtype`` as its format (default e4m3 / e5m2), or ``fp8_recipe`` itself; neither:
        the autocast's recipe. ``is_2x2x`` (which copies to make) is the kernels' choice here
        and is accepted for that reason."""
        from transformer_engine.jax.quantize import ScalingMode

        op = "QuantizerFactory.create_set"
        _refuse_groups(n_groups, op)
        if kwargs:
            raise TypeError(f"{op}: unexpected keywords {sorted(kwargs)} (quantizer sets here "
                            "carry a recipe; its state comes fresh)")
        if not isinstance(n_quantizer_sets, int) or n_quantizer_sets < 1:
            raise ValueError(f"{op}: n_quantizer_sets must be an int >= 1, got "
                             f"{n_quantizer_sets!r}")
        if fp8_recipe is not None and scaling_mode is not None:
            raise ValueError(f"{op}: give scaling_mode or fp8_recipe, not both")
        recipe = fp8_recipe
        if recipe is None and scaling_mode is not None:
            mode = _mode(scaling_mode, op)
            if mode is not ScalingMode.NO_SCALING:
                fwd = _fp8(fwd_dtype or _E4M3, op, "fwd_dtype")
                bwd = _fp8(bwd_dtype or _E5M2, op, "bwd_dtype")
                if (fwd, bwd) not in _FORMATS:
                    raise ValueError(f"{op}: (fwd_dtype, bwd_dtype) must be (e4m3, e4m3) or "
                                     f"(e4m3, e5m2), the recipes' formats, got ({fwd}, {bwd})")
                recipe = dataclasses.replace(mode.recipe, fp8_format=_FORMATS[fwd, bwd])
        elif recipe is None:
            recipe = get_fp8_recipe()
        if scaling_mode is not None and recipe is None:  # NO_SCALING
            made = [QuantizerSet(None, {}) for _ in range(n_quantizer_sets)]
        else:
            made = [make_quantizer_set(recipe, new_fp8_state(recipe), use_autocast=False)
                    for _ in range(n_quantizer_sets)]
        return made[0] if n_quantizer_sets == 1 else tuple(made)


def _delayed_state(op: str, mode, kwargs: dict) -> dict:
    from transformer_engine.jax.quantize import ScalingMode

    keys = {"scale", "amax_history", "amax_history_len", "margin", "amax_compute_algo"}
    unknown = sorted(set(kwargs) - keys)
    if unknown:
        raise TypeError(f"{op}: unexpected keywords {unknown}")
    if mode is not ScalingMode.DELAYED_TENSOR_SCALING:
        if kwargs:
            raise TypeError(f"{op}: {sorted(kwargs)} belong to delayed scaling, not "
                            f"{mode.name}")
        return {}
    length = kwargs.get("amax_history_len", 1024)
    scale = kwargs.get("scale", jnp.ones((1,), jnp.float32))
    history = kwargs.get("amax_history", jnp.zeros((length,), jnp.float32))
    return {"scale": jnp.asarray(scale, jnp.float32).reshape(1),
            "amax_history": jnp.asarray(history, jnp.float32),
            "margin": int(kwargs.get("margin", 0)),
            "amax_algo": kwargs.get("amax_compute_algo", "max")}


noop_quantizer_set = QuantizerSet(None, {})
