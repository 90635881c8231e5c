"""``LayerNormDenseGeneral``: a flax linen norm + dense layer over
:func:`transformer_engine.jax.layernorm_dense`."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn

import jax
import jax.numpy as jnp
from transformer_engine.jax.autocast import get_fp8_recipe
from transformer_engine.jax.dense import dense
from transformer_engine.jax.flax._checks import (
    check_input_features,
    check_logical_axes,
    check_sizes,
    compute_dtype_of,
    param_dtype_of,
    quantizer_set_for,
)
from transformer_engine.jax.flax.module import (
    Initializer,
    _as_tuple,
    add_lora,
    check_lora,
    dense_inits,
    fp8_state,
    lora_delta,
)
from transformer_engine.jax.layernorm_dense import layernorm_dense
from transformer_engine.jax.quantizer import plan_kind
from transformer_engine.jax.sharding import check_supported
from transformer_engine.jax.sharding import (
    with_sharding_constraint_by_logical_axes as constrain,
)

__all__ = ["LayerNormDenseGeneral"]

_NORM_TYPES = ("layernorm", "rmsnorm")


def norm_params(module: nn.Module, n: int, layernorm_type: str, zero_centered_gamma: bool,
                scale_init: Optional[Initializer], ln_bias_init: Initializer, param_dtype,
                scale_axes: Tuple[str, ...], ln_bias_axes: Tuple[str, ...]):
    """The norm's ``scale`` [n] and, for LayerNorm, ``ln_bias`` [n] (else None)."""
    name = type(module).__name__
    if layernorm_type not in _NORM_TYPES:
        raise ValueError(f"{name}: layernorm_type must be 'layernorm' or 'rmsnorm', got "
                         f"{layernorm_type!r}")
    if scale_init is None:
        scale_init = nn.initializers.zeros if zero_centered_gamma else nn.initializers.ones
    if scale_axes:
        scale_init = nn.with_logical_partitioning(scale_init, scale_axes)
    scale = module.param("scale", scale_init, (n,), param_dtype)
    if layernorm_type != "layernorm":
        return scale, None
    if ln_bias_axes:
        ln_bias_init = nn.with_logical_partitioning(ln_bias_init, ln_bias_axes)
    return scale, module.param("ln_bias", ln_bias_init, (n,), param_dtype)


def fp8_quantizer_set(module: nn.Module, prefix: str = ""):
    """The autocast's quantizer set for one GEMM of ``module``, with its state (delayed
    scaling) in the ``fp8_metas`` collection under ``prefix``."""
    recipe = get_fp8_recipe()
    state = fp8_state(module, recipe, prefix) if plan_kind(recipe) == "delayed" else None
    return quantizer_set_for(type(module).__name__, recipe, state)


class LayerNormDenseGeneral(nn.Module):
    """LayerNorm or RMSNorm over the last axis, then a dense layer, fused (FP8 inside
    ``fp8_autocast``: the norm writes the GEMM's FP8 input itself under delayed scaling).

    Parameters: ``scale`` and ``ln_bias`` (LayerNorm) [K] of the norm, ``kernel``
    ``(K, *features)`` and ``bias`` ``features``. Under delayed scaling the FP8 state lives
    in ``fp8_metas`` as :class:`~transformer_engine.jax.flax.DenseGeneral` keeps it
    (``x_scale``, ``x_amax_history``, ... for the roles ``x``, ``kernel``, ``grad``).

    Attributes:
        features: output size(s).
        axis: the contracted input axis; the norm's axis too, so it must be the last.
        enable_layernorm: False: no norm (a plain dense layer over ``axis``).
        layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
        epsilon: added to the variance (or mean square).
        zero_centered_gamma: ``scale`` stores g - 1.
        scale_init: initializer of ``scale`` (default ones, or zeros with zero_centered_gamma).
        ln_bias_init: initializer of ``ln_bias``.
        use_bias: add a bias of shape ``features``.
        kernel_init, bias_init: initializers of the dense layer (``kernel_init`` sees the
            [K, prod(features)] matrix).
        return_layernorm_output: return norm(x) as the call's second output (else None).
            NVIDIA's default is True; ours is False, so ln_out is None unless asked for
            (an NVIDIA program that reads ln_out without setting it gets None, not a
            wrong array).
        dtype: the dtype of the parameters (NVIDIA's meaning). The computation and the outputs
            follow the input's dtype (an integer input is cast to ``dtype``).
        param_dtype: the former name of ``dtype``'s meaning: None, or equal to ``dtype``
            (anything else is an error, as it asked for a computation dtype).
        kernel_axes, bias_axes, scale_axes, ln_bias_axes: logical axis names of the
            parameters, which are annotated with them (``nn.with_logical_partitioning``) and,
            under a mesh and a ``MeshResource``, laid out by them (see
            :mod:`transformer_engine.jax.sharding`; ``("embed", "mlp")``: column parallel).
            No value changes. Default () where NVIDIA's defaults name ``"embed"`` for the
            norm's: unannotated parameters unless asked for.
        layernorm_input_axes, dot_input_axes: logical axis names of the input (with the
            norm, and without it): under a mesh and a ``MeshResource`` the input is
            constrained to that layout. The norm needs its features whole on each device.
        depth_scaling: None, or the output is divided by it (NVIDIA's meaning).
        transpose_batch_sequence: accepted for NVIDIA's signature; a position-wise layer
            computes the same either way.
        enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA
            on the dense layer, from the normed input (see
            :class:`~transformer_engine.jax.flax.DenseGeneral`).

    The call returns ``(out, ln_out)`` as NVIDIA's module does: ``out`` [..., *features],
    ``ln_out`` the norm's output (the input itself without ``enable_layernorm``) with
    ``return_layernorm_output``, else None.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import LayerNormDenseGeneral
        >>> layer = LayerNormDenseGeneral(features=32)
        >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((16, 64)))
        >>> out, ln_out = layer.apply(variables, jnp.ones((16, 64)))
        >>> out.shape, ln_out
        ((16, 32), None)
    """

    features: Union[int, Sequence[int]]
    axis: Union[int, Sequence[int]] = -1
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    ln_bias_init: Initializer = nn.initializers.zeros
    use_bias: bool = False
    kernel_init: Optional[Initializer] = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros
    return_layernorm_output: bool = False
    dtype: Any = jnp.float32
    param_dtype: Optional[Any] = None
    kernel_axes: Tuple[str, ...] = ()
    bias_axes: Tuple[str, ...] = ()
    scale_axes: Tuple[str, ...] = ()
    ln_bias_axes: Tuple[str, ...] = ()
    layernorm_input_axes: Optional[Tuple[str, ...]] = None
    dot_input_axes: Optional[Tuple[str, ...]] = None
    depth_scaling: Optional[float] = None
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None

    @nn.compact
    def __call__(self, inputs: jax.Array):
        check_supported("LayerNormDenseGeneral")
        check_sizes("LayerNormDenseGeneral", features=self.features)
        param_dtype = param_dtype_of("LayerNormDenseGeneral", self.dtype, self.param_dtype)
        lora = self.enable_low_rank_adaptation
        check_lora("LayerNormDenseGeneral", lora, self.low_rank_adaptation_dim,
                   self.low_rank_adaptation_alpha)
        inputs = jnp.asarray(inputs)
        if inputs.ndim < 1:
            raise ValueError(f"LayerNormDenseGeneral: the input must have rank >= 1, got shape "
                             f"{inputs.shape}")
        features = _as_tuple(self.features)
        axis = tuple(a % inputs.ndim for a in _as_tuple(self.axis))
        if self.enable_layernorm and axis != (inputs.ndim - 1,):
            raise ValueError("LayerNormDenseGeneral: axis must be the last axis (-1) when "
                             f"enable_layernorm (the norm's axis), got {self.axis}")
        if len(set(axis)) != len(axis):
            raise ValueError(f"LayerNormDenseGeneral: axis must not repeat an axis, got "
                             f"{self.axis}")
        if self.enable_layernorm or axis == (inputs.ndim - 1,):  # the param's axis 0 is K
            check_input_features(self, "LayerNormDenseGeneral", inputs,
                                 "scale" if self.enable_layernorm else "kernel")
        kernel_shape = tuple(inputs.shape[a] for a in axis) + features
        op = "LayerNormDenseGeneral"
        for name, rank in (("kernel_axes", len(kernel_shape)), ("bias_axes", len(features)),
                           ("scale_axes", 1), ("ln_bias_axes", 1),
                           ("layernorm_input_axes", inputs.ndim),
                           ("dot_input_axes", inputs.ndim)):
            check_logical_axes(op, name, getattr(self, name), rank)
        kernel_init, bias_init = dense_inits(self, len(axis))
        scale = ln_bias = None
        if self.enable_layernorm:
            scale, ln_bias = norm_params(self, inputs.shape[-1], self.layernorm_type,
                                         self.zero_centered_gamma, self.scale_init,
                                         self.ln_bias_init, param_dtype, self.scale_axes,
                                         self.ln_bias_axes)
        kernel = self.param("kernel", kernel_init, kernel_shape, param_dtype)
        bias = self.param("bias", bias_init, features, param_dtype) if self.use_bias else None
        qset = fp8_quantizer_set(self)
        dtype = compute_dtype_of(inputs, param_dtype)
        x = constrain(inputs.astype(dtype), self.layernorm_input_axes if self.enable_layernorm
                      else self.dot_input_axes)
        kernel = constrain(kernel.astype(dtype), self.kernel_axes)
        bias = None if bias is None else constrain(bias.astype(dtype), self.bias_axes)
        scale = None if scale is None else constrain(scale, self.scale_axes)
        ln_bias = None if ln_bias is None else constrain(ln_bias, self.ln_bias_axes)
        if not self.enable_layernorm:
            out = dense(x, kernel, bias, contracting_dims=(axis, tuple(range(len(axis)))),
                        quantizer_set=qset, input_axes=self.dot_input_axes or None)
            ln_out = x
        else:
            want_ln = self.return_layernorm_output or lora  # LoRA reads the normed input
            out = layernorm_dense(x, scale, ln_bias, kernel, bias,
                                  norm_type=self.layernorm_type,
                                  zero_centered_gamma=self.zero_centered_gamma,
                                  epsilon=self.epsilon, quantizer_set=qset,
                                  return_layernorm_output=want_ln,
                                  layernorm_input_axes=self.layernorm_input_axes or None)
            out, ln_out = out if want_ln else (out, None)
        if lora:
            out = add_lora(out, lora_delta(self, ln_out, axis, features,
                                           self.low_rank_adaptation_dim,
                                           self.low_rank_adaptation_alpha, param_dtype))
        if self.depth_scaling is not None:
            out = out / jnp.asarray(self.depth_scaling, out.dtype)
        return out, (ln_out if self.return_layernorm_output else None)
