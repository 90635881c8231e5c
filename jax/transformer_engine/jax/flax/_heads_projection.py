"""``HeadsProjection``: the fused Q, K, V (or K, V) projection of :class:`MultiHeadAttention`,
one GEMM whose kernel is stored as NVIDIA stores it, ``[hidden, parts, heads * head_dim]``,
multiplied head-major under tensor parallelism.

Why head-major: under tensor parallelism the heads are split over the devices, so each
device holds, for each of q, k and v, the columns of its own heads. Flattened as stored
(``parts`` major), those columns are ``parts`` separate runs of the ``[parts * heads *
head_dim]`` GEMM dimension, which no contiguous split of it gives: XLA would reshuffle the
kernel and the output. Viewed ``[hidden, heads, parts, head_dim]`` (a transpose of the
parameter, local to each device when the heads are split) each device's columns are one
contiguous block, its q, k and v side by side, and the output ``[.., heads, parts,
head_dim]`` splits on its heads as the attention wants it. Every output element is the same
dot product as in the stored order, so the forward's numbers do not change, nor the FP8
scales (an amax is a max over the same values); the input gradient sums over the permuted
dimension in another order (last bits), so without tensor parallelism the stored order is
kept: the same bits as a ``LayerNormDenseGeneral`` (or ``DenseGeneral``) with
``features=(parts, heads * head_dim)``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import flax.linen as nn

import jax
import jax.numpy as jnp
from transformer_engine.jax.dense import dense
from transformer_engine.jax.flax._checks import check_input_features, compute_dtype_of
from transformer_engine.jax.flax.layernorm_dense import fp8_quantizer_set, norm_params
from transformer_engine.jax.flax.module import (
    Initializer,
    add_lora,
    dense_inits,
    lora_delta,
)
from transformer_engine.jax.layernorm_dense import layernorm_dense
from transformer_engine.jax.sharding import (
    with_sharding_constraint_by_logical_axes as constrain,
)

__all__ = ["HeadsProjection"]


class HeadsProjection(nn.Module):
    """[norm ->] x @ kernel for a kernel ``[hidden, parts, heads * head_dim]``, returning
    ``(out [.., heads, parts, head_dim], ln_out or None)``.

    The parameters and the ``fp8_metas`` state are those of
    :class:`~transformer_engine.jax.flax.LayerNormDenseGeneral` (``enable_layernorm``) or
    :class:`~transformer_engine.jax.flax.DenseGeneral` with ``features=(parts, heads *
    head_dim)``: ``scale``, ``ln_bias``, ``kernel``, ``bias``, the LoRA kernels, ``x_scale``,
    ... The axis keywords are theirs; ``head_major`` multiplies the kernel as ``[hidden,
    heads, parts, head_dim]`` (see the module doc), ``head_axis`` is the logical name of the
    heads in that view (the kernel's last axis is split over the same mesh axes). Errors name
    the module it stands for.
    """

    parts: int
    heads: int
    head_dim: int
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    use_bias: bool = False
    kernel_init: Optional[Initializer] = None
    bias_init: Initializer = nn.initializers.zeros
    return_layernorm_output: bool = False
    dtype: Any = jnp.float32
    kernel_axes: Tuple[Optional[str], ...] = ()
    bias_axes: Tuple[Optional[str], ...] = ()
    scale_axes: Tuple[Optional[str], ...] = ()
    ln_bias_axes: Tuple[Optional[str], ...] = ()
    input_axes: Tuple[Optional[str], ...] = ()
    head_major: bool = False
    head_axis: Optional[str] = None
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None

    @nn.compact
    def __call__(self, inputs: jax.Array):
        name = "LayerNormDenseGeneral" if self.enable_layernorm else "DenseGeneral"
        n, h, d = self.parts, self.heads, self.head_dim
        hidden = inputs.shape[-1]
        check_input_features(self, name, inputs, "scale" if self.enable_layernorm else "kernel")
        kernel_init, bias_init = dense_inits(self, 1)
        scale = ln_bias = None
        if self.enable_layernorm:
            scale, ln_bias = norm_params(self, hidden, self.layernorm_type,
                                         self.zero_centered_gamma, None,
                                         nn.initializers.zeros, self.dtype, self.scale_axes,
                                         self.ln_bias_axes)
        kernel = self.param("kernel", kernel_init, (hidden, n, h * d), self.dtype)
        bias = self.param("bias", bias_init, (n, h * d), self.dtype) if self.use_bias else None
        qset = fp8_quantizer_set(self)
        dtype = compute_dtype_of(inputs, self.dtype)
        x = constrain(inputs.astype(dtype), self.input_axes)
        kernel = constrain(kernel.astype(dtype), self.kernel_axes)
        if bias is not None:
            bias = constrain(bias.astype(dtype), self.bias_axes)
        if self.head_major:
            view = (self.kernel_axes[0], self.head_axis, None, None) if self.kernel_axes else ()
            kernel = constrain(_head_major(kernel, h, d, 1), view)
            bias = None if bias is None else _head_major(bias, h, d, 0)
        lora = self.enable_low_rank_adaptation
        if self.enable_layernorm:
            want_ln = self.return_layernorm_output or lora  # LoRA reads the normed input
            out = layernorm_dense(x, scale, ln_bias, kernel, bias, norm_type=self.layernorm_type,
                                  zero_centered_gamma=self.zero_centered_gamma,
                                  epsilon=self.epsilon, quantizer_set=qset,
                                  return_layernorm_output=want_ln,
                                  layernorm_input_axes=self.input_axes or None)
            out, ln_out = out if want_ln else (out, None)
        else:
            out = dense(x, kernel, bias, contracting_dims=((x.ndim - 1,), (0,)),
                        quantizer_set=qset, input_axes=self.input_axes or None)
            ln_out = x
        parts_axis = x.ndim - 1
        if lora:
            delta = lora_delta(self, ln_out, (x.ndim - 1,), (n, h * d),
                               self.low_rank_adaptation_dim, self.low_rank_adaptation_alpha,
                               self.dtype)
            out = add_lora(out, _head_major(delta, h, d, parts_axis) if self.head_major
                           else delta)
        if not self.head_major:
            out = _head_major(out, h, d, parts_axis)
        return out, (ln_out if self.return_layernorm_output else None)


def _head_major(t: jax.Array, heads: int, head_dim: int, parts_axis: int) -> jax.Array:
    """``t`` with axes ``[.., parts, heads * head_dim]`` from ``parts_axis`` on, as
    ``[.., heads, parts, head_dim]``."""
    lead = t.shape[:parts_axis]
    n = t.shape[parts_axis]
    t = t.reshape(*lead, n, heads, head_dim)
    return jnp.swapaxes(t, parts_axis, parts_axis + 1)
