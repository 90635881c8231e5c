"""``DenseGeneral``: a flax linen dense layer over :func:`transformer_engine.jax.dense`."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Tuple, Union

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
from transformer_engine.jax.layernorm import layernorm
from transformer_engine.jax.quantizer import (
    FP8_COLLECTION,
    ROLES,
    new_fp8_state,
    plan_kind,
)
from transformer_engine.jax.sharding import check_supported
from transformer_engine.jax.sharding import (
    with_sharding_constraint_by_logical_axes as constrain,
)

__all__ = ["DenseGeneral", "LayerNorm"]

Initializer = Callable[..., jax.Array]


def _as_tuple(v) -> tuple:
    return tuple(v) if isinstance(v, Sequence) else (v,)


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _as_matrix_init(init: Initializer, n_in: int) -> Initializer:
    """``init`` over the flattened [contracted, kept] matrix, drawn in float32 and rounded to a
    16-bit parameter dtype. Flax's random initializers drawn directly in bf16 (or fp16) take
    only 128 distinct values; weights on that lattice sit on FP8's rounding boundaries
    together, so the first small updates flip many of their FP8 values at once and FP8
    training sees those updates about 1.6 times as large as they are. torch's ``normal_``
    draws in float32 for a bf16 tensor too."""

    def matrix_init(key, shape, dtype):
        flat = (math.prod(shape[:n_in]), math.prod(shape[n_in:])) if n_in else (math.prod(shape),)
        draw = jnp.float32 if jnp.dtype(dtype) in _HALF else dtype
        return jnp.reshape(init(key, flat, draw), shape).astype(dtype)

    return matrix_init


def dense_inits(module, n_in: int):
    """(kernel_init, bias_init) of a dense module: its ``kernel_init`` (the default one when
    None) over ``n_in`` contracted dims and its ``bias_init``, as matrix initializers (see
    _as_matrix_init), annotated with its ``kernel_axes`` / ``bias_axes`` where given."""
    kernel_init = _as_matrix_init(default_init(module.kernel_init), n_in)
    bias_init = _as_matrix_init(module.bias_init, 0)
    if module.kernel_axes:
        kernel_init = nn.with_logical_partitioning(kernel_init, module.kernel_axes)
    if module.bias_axes:
        bias_init = nn.with_logical_partitioning(bias_init, module.bias_axes)
    return kernel_init, bias_init


class DenseGeneral(nn.Module):
    """A dense layer over any input axes, in FP8 inside ``fp8_autocast``.

    The kernel has shape ``(*x.shape[axis], *features)`` (flax's [in, out] layout). Inside an
    enabled ``fp8_autocast`` the three GEMMs run in FP8 with the autocast's recipe; outside,
    in the input's dtype through the same core GEMM. Under delayed scaling the layer keeps, per
    tensor role ``x``, ``kernel`` and ``grad``, a ``<role>_scale`` [1] and a
    ``<role>_amax_history`` [amax_history_len] in the ``fp8_metas`` collection; their
    gradient is the next state (merge it with ``update_collections``).

    Attributes:
        features: output size(s).
        axis: input axis or axes contracted with the kernel.
        use_bias: add a bias of shape ``features``.
        kernel_init: initializer of the kernel (None: flax's ``lecun_normal``, NVIDIA's
            variance_scaling(1, fan_in, truncated_normal)).
        bias_init: initializer of the bias.
        dtype: the dtype of the parameters (NVIDIA's meaning). The computation and the output
            follow the input's dtype (the parameters are cast to it; an integer input is
            cast to ``dtype``).
        param_dtype: the former name of ``dtype``'s meaning: None, or equal to ``dtype``
            (anything else is an error, as it asked for a computation dtype).
        kernel_axes: logical axis names of the kernel: the parameter is annotated with them
            (``nn.with_logical_partitioning``) and, under a mesh and a ``MeshResource``,
            laid out by them (:mod:`transformer_engine.jax.sharding`: e.g.
            ``("embed", "mlp")`` column parallel, ``("mlp", "embed")`` row parallel, "embed"
            split over the FSDP axis). No value changes.
        bias_axes: logical axis names of the bias (annotated and laid out likewise).
        input_axes: logical axis names of the input (e.g. ``("batch", "length", "embed")``):
            under a mesh and a ``MeshResource`` the input is constrained to that layout.
        transpose_batch_sequence: accepted for NVIDIA's signature; a dense layer over
            ``axis`` computes the same either way.
        enable_low_rank_adaptation: add LoRA: ``lora_a_kernel``
            ``(*in, *features[:-1], low_rank_adaptation_dim)`` and ``lora_b_kernel``
            ``(*features[:-1], low_rank_adaptation_dim, features[-1])`` (zeros at init); the
            output gains (x @ A @ B) * alpha / dim, computed in fp32 outside FP8.
        low_rank_adaptation_dim: the rank of the update.
        low_rank_adaptation_alpha: None (scale 1, NVIDIA's meaning) or alpha (scale alpha /
            dim).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import DenseGeneral
        >>> layer = DenseGeneral(features=32)
        >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((16, 64)))
        >>> layer.apply(variables, jnp.ones((16, 64))).shape
        (16, 32)
    """

    features: Union[int, Sequence[int]]
    axis: Union[int, Sequence[int]] = -1
    use_bias: bool = True
    kernel_init: Optional[Initializer] = nn.initializers.lecun_normal()
    bias_init: Initializer = nn.initializers.zeros
    dtype: Any = jnp.float32
    param_dtype: Optional[Any] = None
    kernel_axes: Tuple[str, ...] = ()
    bias_axes: Tuple[str, ...] = ()
    input_axes: Optional[Tuple[str, ...]] = ()
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: Optional[float] = None

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        check_supported("DenseGeneral")
        check_sizes("DenseGeneral", features=self.features)
        param_dtype = param_dtype_of("DenseGeneral", self.dtype, self.param_dtype)
        check_lora("DenseGeneral", self.enable_low_rank_adaptation,
                   self.low_rank_adaptation_dim, self.low_rank_adaptation_alpha)
        inputs = jnp.asarray(inputs)
        if inputs.ndim < 1:
            raise ValueError(f"DenseGeneral: inputs must have rank >= 1, got shape "
                             f"{inputs.shape}")
        features = _as_tuple(self.features)
        axis = tuple(a % inputs.ndim for a in _as_tuple(self.axis))
        if len(set(axis)) != len(axis):
            raise ValueError(f"DenseGeneral: axis must not repeat an axis, got {self.axis}")
        kernel_shape = tuple(inputs.shape[a] for a in axis) + features
        check_logical_axes("DenseGeneral", "kernel_axes", self.kernel_axes, len(kernel_shape))
        check_logical_axes("DenseGeneral", "bias_axes", self.bias_axes, len(features))
        check_logical_axes("DenseGeneral", "input_axes", self.input_axes, inputs.ndim)
        if self.has_variable("params", "kernel"):  # flax's own error names no input
            have = jnp.shape(nn.unbox(self.get_variable("params", "kernel")))
            if tuple(have) != kernel_shape:
                raise ValueError(f"DenseGeneral: inputs must have {list(have[:len(axis)])} on "
                                 f"the contracted axes {list(axis)} (the kernel's "
                                 f"{list(have)}), got shape {list(inputs.shape)}")
        # Initialized as the [in, out] matrix, then reshaped: fan-in is the product of the
        # contracted dims (as flax's DenseGeneral computes it).
        kernel_init, bias_init = dense_inits(self, len(axis))
        kernel = self.param("kernel", kernel_init, kernel_shape, param_dtype)
        bias = self.param("bias", bias_init, features, param_dtype) if self.use_bias else None
        recipe = get_fp8_recipe()
        state = None
        if plan_kind(recipe) == "delayed":
            state = fp8_state(self, recipe)
        quantizer_set = quantizer_set_for("DenseGeneral", recipe, state)
        dtype = compute_dtype_of(inputs, param_dtype)
        x = constrain(inputs.astype(dtype), self.input_axes)
        kernel = constrain(kernel.astype(dtype), self.kernel_axes)
        bias = None if bias is None else constrain(bias.astype(dtype), self.bias_axes)
        contracting = (axis, tuple(range(len(axis))))
        out = dense(x, kernel, bias, contracting_dims=contracting, quantizer_set=quantizer_set,
                    input_axes=self.input_axes or None)
        if self.enable_low_rank_adaptation:
            out = add_lora(out, lora_delta(self, x, axis, features, self.low_rank_adaptation_dim,
                                           self.low_rank_adaptation_alpha, param_dtype))
        return out


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def check_lora(op: str, enabled: bool, dim: Any, alpha: Any) -> None:
    """The LoRA keywords: ``low_rank_adaptation_dim`` a positive int, ``..._alpha`` None or a
    number (checked only when LoRA is on, as they are unused otherwise)."""
    if not enabled:
        return
    check_sizes(op, low_rank_adaptation_dim=dim)
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise TypeError(f"{op}: low_rank_adaptation_alpha must be None or a number, got "
                        f"{alpha!r}")


def lora_delta(module: nn.Module, x: jax.Array, axis: Tuple[int, ...],
               features: Tuple[int, ...], rank: int, alpha: Optional[float], param_dtype,
               prefix: str = "") -> jax.Array:
    """The low-rank update (x @ A @ B) * alpha / rank (1 when alpha is None), in fp32.

    ``<prefix>lora_a_kernel`` is ``(*x.shape[axis], *features[:-1], rank)`` and
    ``<prefix>lora_b_kernel`` ``(*features[:-1], rank, features[-1])``: a kernel with several
    output groups (the fused QKV's (3, N), the gated MLP's (2, F)) gets one pair per group.
    B starts at zeros, so the layer starts as it would without LoRA."""
    lead = tuple(features[:-1])
    a_shape = tuple(x.shape[a] for a in axis) + lead + (rank,)
    b_shape = lead + (rank, features[-1])
    a_init = _as_matrix_init(nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
                             len(axis))
    a = module.param(f"{prefix}lora_a_kernel", a_init, a_shape, param_dtype)
    b = module.param(f"{prefix}lora_b_kernel", nn.initializers.zeros, b_shape, param_dtype)
    # einsum letters: x's axes first, then the output groups, the rank and the last feature.
    x_sub = _LETTERS[:x.ndim]
    lead_sub = _LETTERS[x.ndim:x.ndim + len(lead)]
    r_sub, n_sub = _LETTERS[x.ndim + len(lead)], _LETTERS[x.ndim + len(lead) + 1]
    kept = "".join(c for i, c in enumerate(x_sub) if i not in axis)
    a_sub = "".join(x_sub[i] for i in axis) + lead_sub + r_sub
    spec = f"{x_sub},{a_sub},{lead_sub}{r_sub}{n_sub}->{kept}{lead_sub}{n_sub}"
    f32 = jnp.float32
    delta = jnp.einsum(spec, x.astype(f32), a.astype(f32), b.astype(f32),
                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
    return delta * (1.0 if alpha is None else float(alpha) / rank)


def add_lora(out: jax.Array, delta: jax.Array) -> jax.Array:
    """out + delta, summed in fp32 and returned in out's dtype."""
    return (out.astype(jnp.float32) + delta).astype(out.dtype)


# NVIDIA's low_rank_adaptation_scope values -> LoRA on (the QKV projections, the output
# projection, the MLP).
LORA_SCOPES = {"none": (False, False, False), "all": (True, True, True),
               "qkv_proj": (True, False, False), "output_proj": (False, True, False),
               "mlp": (False, False, True), "exclude_qkv_proj": (False, True, True),
               "exclude_output_proj": (True, False, True),
               "exclude_mlp": (True, True, False)}


def lora_scope(op: str, scope: Any) -> Tuple[bool, bool, bool]:
    """(qkv projections, output projection, MLP) that a low_rank_adaptation_scope covers."""
    key = str(scope).lower()
    if key not in LORA_SCOPES:
        raise ValueError(f"{op}: low_rank_adaptation_scope must be one of {tuple(LORA_SCOPES)}, "
                         f"got {scope!r}")
    return LORA_SCOPES[key]


def default_init(kernel_init: Optional[Initializer]) -> Initializer:
    """A kernel initializer, None meaning the default (NVIDIA's signatures default to None)."""
    return nn.initializers.lecun_normal() if kernel_init is None else kernel_init


def fp8_state(module: nn.Module, recipe, prefix: str = "") -> dict:
    """The delayed-scaling state of one GEMM of ``module``: its ``fp8_metas`` variables
    ``<prefix><role>_scale`` and ``<prefix><role>_amax_history``, as a quantizer-set state."""
    initial = new_fp8_state(recipe)
    state = {}
    for role in ROLES:
        state[role] = {}
        for key in ("scale", "amax_history"):
            name = f"{prefix}{role}_{key}"
            if not module.is_initializing() and not module.has_variable(FP8_COLLECTION, name):
                raise ValueError(
                    f"{type(module).__name__}: the '{FP8_COLLECTION}' collection has no "
                    f"'{name}'; initialize the model (model.init) inside the same fp8_autocast "
                    "as the apply, and pass its 'fp8_metas' collection to apply")
            var = module.variable(FP8_COLLECTION, name, lambda v=initial[role][key]: v)
            state[role][key] = var.value
    return state


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis, over :func:`transformer_engine.jax.layernorm`.

    Parameters: ``scale`` [N] and, for LayerNorm, ``ln_bias`` [N] (N = the input's last axis).

    Attributes:
        epsilon: added to the variance (or mean square).
        layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
        zero_centered_gamma: ``scale`` stores g - 1 (the layer multiplies by 1 + scale).
        scale_init: initializer of ``scale``; default ones, or zeros with
            ``zero_centered_gamma`` (g = 1 either way).
        bias_init: initializer of ``ln_bias``.
        dtype: the dtype of the parameters (NVIDIA's meaning); the output has the input's
            dtype (an integer input is cast to ``dtype``).
        param_dtype: the former name of ``dtype``'s meaning: None, or equal to ``dtype``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from transformer_engine.jax.flax import LayerNorm
        >>> layer = LayerNorm()
        >>> variables = layer.init(jax.random.PRNGKey(0), jnp.ones((4, 8)))
        >>> layer.apply(variables, jnp.ones((4, 8))).shape
        (4, 8)
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Optional[Initializer] = None
    bias_init: Initializer = nn.initializers.zeros
    dtype: Any = jnp.float32
    param_dtype: Optional[Any] = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        check_supported("LayerNorm")
        if self.layernorm_type not in ("layernorm", "rmsnorm"):
            raise ValueError(f"LayerNorm: layernorm_type must be 'layernorm' or 'rmsnorm', got "
                             f"{self.layernorm_type!r}")
        param_dtype = param_dtype_of("LayerNorm", self.dtype, self.param_dtype)
        x = jnp.asarray(x)
        if x.ndim < 1:
            raise ValueError(f"LayerNorm: the input must have rank >= 1, got shape {x.shape}")
        check_input_features(self, "LayerNorm", x, "scale")
        n = x.shape[-1]
        scale_init = self.scale_init
        if scale_init is None:
            scale_init = nn.initializers.zeros if self.zero_centered_gamma else nn.initializers.ones
        scale = self.param("scale", scale_init, (n,), param_dtype)
        bias = None
        if self.layernorm_type == "layernorm":
            bias = self.param("ln_bias", self.bias_init, (n,), param_dtype)
        return layernorm(x.astype(compute_dtype_of(x, param_dtype)), scale, bias,
                         norm_type=self.layernorm_type,
                         zero_centered_gamma=self.zero_centered_gamma, epsilon=self.epsilon)
