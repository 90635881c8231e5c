"""``LayerNormMLP``: a flax linen Transformer MLP block over
:func:`transformer_engine.jax.layernorm_mlp`."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import flax.linen as nn

import jax
import jax.numpy as jnp
from transformer_engine.jax import ops
from transformer_engine.jax.dense import dense
from transformer_engine.jax.flax._checks import (
    check_input_features,
    check_logical_axes,
    check_sizes,
    compute_dtype_of,
    param_dtype_of,
)
from transformer_engine.jax.flax.layernorm_dense import fp8_quantizer_set, norm_params
from transformer_engine.jax.flax.module import (
    Initializer,
    _as_matrix_init,
    _as_tuple,
    add_lora,
    check_lora,
    default_init,
    lora_delta,
)
from transformer_engine.jax.layernorm_dense import layernorm_dense
from transformer_engine.jax.layernorm_mlp import activation, activation_of, layernorm_mlp
from transformer_engine.jax.sharding import check_supported
from transformer_engine.jax.sharding import (
    with_sharding_constraint_by_logical_axes as constrain,
)

__all__ = ["LayerNormMLP"]


def _plain(value):
    """A dict as the user wrote it (flax stores module attributes as FrozenDicts)."""
    return dict(value) if hasattr(value, "items") else value


class LayerNormMLP(nn.Module):
    """norm -> dense (``intermediate_dim``) -> activation -> dense (back to the input's
    size), fused into one custom VJP (FP8 inside ``fp8_autocast``).

    Parameters: ``scale`` and ``ln_bias`` (LayerNorm) [K]; ``wi_kernel`` [K, A, F] and
    ``wi_bias`` [A, F] (A = 2 for the gated activations: index 0 activated, index 1 the
    linear half; F = ``intermediate_dim``); ``wo_kernel`` [F, K] and ``wo_bias`` [K]. Under
    delayed scaling each GEMM keeps its FP8 state in ``fp8_metas`` with the prefixes
    ``wi_`` and ``wo_`` (``wi_x_scale``, ``wi_x_amax_history``, ..., ``wo_grad_scale``).

    With ``intermediate_dropout_rate > 0`` and ``deterministic=False`` the block runs as
    ``layernorm_dense``, the activation, dropout and ``dense`` (the same parameters and
    FP8 state; the activation's output is then not written in FP8 by the activation).

    Attributes:
        intermediate_dim: F, the hidden size of the block.
        enable_layernorm: False: no norm before the first dense layer.
        layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
        epsilon: added to the variance (or mean square).
        zero_centered_gamma: ``scale`` stores g - 1.
        scale_init, ln_bias_init: initializers of the norm's parameters.
        activations: ``("gelu",)``, ``("relu",)``, ``("silu",)``, ``("quick_gelu",)``,
            ``("squared_relu",)``, ``("linear",)``, or gated ``("gelu", "linear")``,
            ``("silu", "linear")``, ``("relu", "linear")``.
        use_bias: biases on both dense layers.
        kernel_init, bias_init: initializers of the dense layers (``kernel_init`` sees each
            kernel as its [in, out] matrix).
        return_layernorm_output: return norm(x) as the call's second output (else None).
            NVIDIA's default is True; ours is False (ln_out is None unless asked for).
        intermediate_dropout_rate: dropout on the activation's output.
        intermediate_hidden_dropout_dims: axes of that output that share a dropout mask.
        intermediate_dropout_rng_name: the rng stream that this dropout draws from.
        dtype: the dtype of the parameters (NVIDIA's meaning). The computation and the outputs
            follow the input's dtype (an integer input is cast to ``dtype``).
        param_dtype: the former name of ``dtype``'s meaning: None, or equal to ``dtype``
            (anything else is an error, as it asked for a computation dtype).
        kernel_axes_1, kernel_axes_2, bias_axes_1, bias_axes_2, scale_axes, ln_bias_axes:
            logical axis names of the parameters, which are annotated with them
            (``nn.with_logical_partitioning``) and, under a mesh and a ``MeshResource``,
            laid out by them (:mod:`transformer_engine.jax.sharding`): e.g.
            ``kernel_axes_1=("embed", "act", "mlp")`` and ``kernel_axes_2=("mlp", "embed")``
            make the first GEMM column parallel and the second row parallel. No value
            changes. Default () where NVIDIA's name ``"embed"``, ``"act"``, ``"mlp"``:
            unannotated parameters unless asked for.
        layernorm_input_axes, dot_1_input_axes, dot_2_input_axes: logical axis names of the
            input (with the norm, and without it: the first GEMM's input) and of the second
            GEMM's input: under a mesh and a ``MeshResource`` the input is constrained to its
            layout (``dot_2_input_axes`` is checked; the fused block keeps the activation in
            the layout the first GEMM gives it).
        ffn1_ckpt_name, ffn2_ckpt_name: NVIDIA's names of the GEMMs' outputs for remat
            policies: accepted and recorded; the fused block saves what its custom VJP
            needs whatever the policy, so no name is applied (no value changes).
        activation_params: the parameters of ``activations=("clamped_silu",
            "clamped_linear")`` (clamped SwiGLU): ``{"limit": 7.0, "alpha": 1.702,
            "glu_linear_offset": 1.0}`` (the defaults; any subset); None for the others.
        axis: the contracted axis: only the last (-1) is supported.
        transpose_batch_sequence: accepted for NVIDIA's signature; a position-wise block
            computes the same either way.
        enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha: LoRA
            on both dense layers (``wi_lora_a_kernel`` [K, A, r], ``wi_lora_b_kernel``
            [A, r, F], ``wo_lora_a_kernel`` [F, r], ``wo_lora_b_kernel`` [r, K]; see
            :class:`~transformer_engine.jax.flax.DenseGeneral`). The block then runs as
            ``layernorm_dense``, the activation and ``dense``, as with dropout.

    The call returns ``(out, ln_out)`` as NVIDIA's module does: ``out`` in the input's
    shape, ``ln_out`` the norm's output (the input itself without ``enable_layernorm``)
    with ``return_layernorm_output``, else None.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import LayerNormMLP
        >>> mlp = LayerNormMLP(intermediate_dim=64, activations=("silu", "linear"))
        >>> variables = mlp.init(jax.random.PRNGKey(0), jnp.ones((16, 32)))
        >>> out, ln_out = mlp.apply(variables, jnp.ones((16, 32)))
        >>> out.shape, ln_out
        ((16, 32), None)
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    ln_bias_init: Initializer = nn.initializers.zeros
    activations: Sequence[str] = ("gelu",)
    use_bias: bool = False
    kernel_init: Optional[Initializer] = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros
    return_layernorm_output: bool = False
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    dtype: Any = jnp.float32
    param_dtype: Optional[Any] = None
    kernel_axes_1: Tuple[str, ...] = ()
    kernel_axes_2: Tuple[str, ...] = ()
    bias_axes_1: Tuple[str, ...] = ()
    bias_axes_2: Tuple[str, ...] = ()
    scale_axes: Tuple[str, ...] = ()
    ln_bias_axes: Tuple[str, ...] = ()
    intermediate_dropout_rng_name: str = "dropout"
    layernorm_input_axes: Optional[Tuple[str, ...]] = None
    dot_1_input_axes: Optional[Tuple[str, ...]] = None
    dot_2_input_axes: Optional[Tuple[str, ...]] = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    activation_params: Optional[dict] = None
    axis: Union[int, Sequence[int]] = -1
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None

    def _check_keywords(self, ndim: int) -> None:
        op = "LayerNormMLP"
        for name, rank in (("kernel_axes_1", 3), ("kernel_axes_2", 2), ("bias_axes_1", 2),
                           ("bias_axes_2", 1), ("scale_axes", 1), ("ln_bias_axes", 1),
                           ("layernorm_input_axes", ndim), ("dot_1_input_axes", ndim),
                           ("dot_2_input_axes", ndim)):
            check_logical_axes(op, name, getattr(self, name), rank)
        axis = _as_tuple(self.axis)
        if len(axis) != 1 or not isinstance(axis[0], int) or axis[0] % ndim != ndim - 1:
            raise ValueError(f"{op}: axis must be the last axis (-1), the norm's and the "
                             f"first GEMM's, got {self.axis!r}")
        check_lora(op, self.enable_low_rank_adaptation, self.low_rank_adaptation_dim,
                   self.low_rank_adaptation_alpha)

    def _activation_params(self):
        return None if self.activation_params is None else _plain(self.activation_params)

    def _lora(self, out, x, features, prefix, param_dtype):
        """out plus the LoRA update of one GEMM (out itself without LoRA)."""
        if not self.enable_low_rank_adaptation:
            return out
        return add_lora(out, lora_delta(self, x, (x.ndim - 1,), features,
                                        self.low_rank_adaptation_dim,
                                        self.low_rank_adaptation_alpha, param_dtype, prefix))

    def _param(self, name, init, shape, n_in, axes, dtype):
        init = _as_matrix_init(default_init(init) if n_in else init, n_in)
        if axes:
            init = nn.with_logical_partitioning(init, axes)
        return self.param(name, init, shape, dtype)

    @nn.compact
    def __call__(self, inputs: jax.Array, deterministic: bool = False):
        check_supported("LayerNormMLP")
        check_sizes("LayerNormMLP", intermediate_dim=self.intermediate_dim)
        param_dtype = param_dtype_of("LayerNormMLP", self.dtype, self.param_dtype)
        inputs = jnp.asarray(inputs)
        if inputs.ndim < 1:
            raise ValueError(f"LayerNormMLP: the input must have rank >= 1, got shape "
                             f"{inputs.shape}")
        check_input_features(self, "LayerNormMLP", inputs,
                             "scale" if self.enable_layernorm else "wi_kernel")
        self._check_keywords(inputs.ndim)
        try:
            act = activation_of(self.activations, self._activation_params())
        except (TypeError, ValueError) as e:
            raise type(e)(f"LayerNormMLP: {str(e).removeprefix('layernorm_mlp: ')}") from None
        if not 0.0 <= self.intermediate_dropout_rate < 1.0:
            raise ValueError("LayerNormMLP: intermediate_dropout_rate must be in [0, 1), got "
                             f"{self.intermediate_dropout_rate}")
        n_act = 2 if ops.is_gated(act) else 1
        k, f = inputs.shape[-1], int(self.intermediate_dim)
        gamma = beta = None
        if self.enable_layernorm:
            gamma, beta = norm_params(self, k, self.layernorm_type, self.zero_centered_gamma,
                                      self.scale_init, self.ln_bias_init, param_dtype,
                                      self.scale_axes, self.ln_bias_axes)
        k1 = self._param("wi_kernel", self.kernel_init, (k, n_act, f), 1, self.kernel_axes_1,
                         param_dtype)
        k2 = self._param("wo_kernel", self.kernel_init, (f, k), 1, self.kernel_axes_2,
                         param_dtype)
        b1 = b2 = None
        if self.use_bias:
            b1 = self._param("wi_bias", self.bias_init, (n_act, f), 0, self.bias_axes_1,
                             param_dtype)
            b2 = self._param("wo_bias", self.bias_init, (k,), 0, self.bias_axes_2, param_dtype)
        qsets = (fp8_quantizer_set(self, "wi_"), fp8_quantizer_set(self, "wo_"))
        dtype = compute_dtype_of(inputs, param_dtype)
        x = constrain(inputs.astype(dtype), self.layernorm_input_axes if self.enable_layernorm
                      else self.dot_1_input_axes)
        k1 = constrain(k1.astype(dtype), self.kernel_axes_1)
        k2 = constrain(k2.astype(dtype), self.kernel_axes_2)
        b1 = None if b1 is None else constrain(b1.astype(dtype), self.bias_axes_1)
        b2 = None if b2 is None else constrain(b2.astype(dtype), self.bias_axes_2)
        if gamma is not None:
            gamma = constrain(gamma, self.scale_axes)
            beta = None if beta is None else constrain(beta, self.ln_bias_axes)
        lora = self.enable_low_rank_adaptation
        second = dict(k2=k2, b2=b2, qset=qsets[1], deterministic=deterministic,
                      param_dtype=param_dtype)
        if not self.enable_layernorm:
            # No norm: the same block from its unfused parts.
            h = self._lora(dense(x, k1, b1, quantizer_set=qsets[0],
                                 input_axes=self.dot_1_input_axes or None), x, (n_act, f), "wi_",
                           param_dtype)
            out = self._second_half(h.reshape(*h.shape[:-2], n_act * f), **second)
            return out, (x if self.return_layernorm_output else None)
        norm = dict(norm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
                    epsilon=self.epsilon)
        if (self.intermediate_dropout_rate > 0.0 and not deterministic) or lora:
            # Unfused: dropout, or LoRA, acts between the GEMMs.
            want_ln = self.return_layernorm_output or lora
            h = layernorm_dense(x, gamma, beta, k1, b1, quantizer_set=qsets[0],
                                return_layernorm_output=want_ln,
                                layernorm_input_axes=self.layernorm_input_axes or None, **norm)
            h, ln = h if want_ln else (h, None)
            h = self._lora(h, ln, (n_act, f), "wi_", param_dtype)
            out = self._second_half(h.reshape(*h.shape[:-2], n_act * f), **second)
            return out, (ln if self.return_layernorm_output else None)
        out = layernorm_mlp(x, gamma, beta, (k1, k2), None if b1 is None else (b1, b2),
                            activations=self.activations, quantizer_sets=qsets,
                            return_layernorm_output=self.return_layernorm_output,
                            activation_params=self._activation_params(),
                            norm_input_axes=self.layernorm_input_axes or None, **norm)
        return out if self.return_layernorm_output else (out, None)

    def _second_half(self, h, k2, b2, qset, deterministic, param_dtype):
        a = constrain(activation(h, self.activations, self._activation_params()),
                      self.dot_2_input_axes)
        if self.intermediate_dropout_rate > 0.0:
            a = nn.Dropout(rate=self.intermediate_dropout_rate,
                           broadcast_dims=tuple(self.intermediate_hidden_dropout_dims),
                           rng_collection=self.intermediate_dropout_rng_name)(
                               a, deterministic=deterministic)
        return self._lora(dense(a, k2, b2, quantizer_set=qset,
                                input_axes=self.dot_2_input_axes or None), a,
                          (k2.shape[-1],), "wo_", param_dtype)
