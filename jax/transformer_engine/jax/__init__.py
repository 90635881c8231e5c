"""Transformer Engine for JAX: FP8 dense layers over the core's XLA FFI custom calls.

Importing this package loads the native extension and registers its custom-call targets
for the CPU and CUDA platforms.

* :func:`fp8_autocast` / :func:`autocast`: the recipe in effect while a model is traced.
* :func:`dense`: a linear layer (``jax.custom_vjp``) in FP8 or the inputs' dtype;
  :func:`grouped_dense` the experts' layers of a mixture-of-experts block (group sizes on the
  device).
* :func:`layernorm`: LayerNorm / RMSNorm over the last axis (``jax.custom_vjp``).
* :func:`layernorm_dense`, :func:`layernorm_mlp`: the norm fused with a dense layer, or with
  the whole MLP block (two dense layers around an activation); in FP8 each kernel writes
  the next GEMM's FP8 operand itself.
* :func:`fused_attn`: dot-product attention (``jax.custom_vjp``) on cuDNN or the core's paths.
* :func:`apply_rotary_pos_emb`, :func:`rotary_freqs`: rotary position embedding
  (``jax.custom_vjp`` over the core's fused kernels) and its angles.
* :class:`QuantizerSet`, :func:`make_quantizer_set`, :func:`new_fp8_state`: the recipe and
  FP8 state that ``dense`` quantizes with; :func:`update_collections` merges the new state.
* :mod:`transformer_engine.jax.flax`: the ``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral``
  and ``LayerNormMLP`` linen modules.
* :mod:`transformer_engine.jax.permutation`: a mixture-of-experts block's token movement
  (``token_dispatch``, ``token_combine``, ``sort_chunks_by_index``) and
  :mod:`transformer_engine.jax.router` its router (``fused_topk_with_score_function``,
  ``fused_moe_aux_loss``); NVIDIA's paths.
* :mod:`transformer_engine.jax.ops`: the custom calls themselves.
* NVIDIA's module paths: :mod:`~transformer_engine.jax.sharding` (``MeshResource``,
  ``global_shard_guard``), :mod:`~transformer_engine.jax.quantize` (``ScalingMode``,
  ``is_fp8_available``), :mod:`~transformer_engine.jax.activation` (``activation``),
  NVIDIA's enums in :mod:`~transformer_engine.jax.attention`, and
  :func:`get_device_compute_capability`, :func:`get_cudnn_version` (also in
  ``cpp_extensions.misc``); ``NVTE_FP8_COLLECTION_NAME`` is :data:`FP8_COLLECTION`.
"""

# Importing ops loads the extension and registers its targets (a clear ImportError if absent);
# activation, cpp_extensions, quantize and sharding are NVIDIA's module paths.
from transformer_engine.jax import activation, cpp_extensions, ops, quantize, sharding
from transformer_engine.jax._version import __version__
from transformer_engine.jax.attention import fused_attn
from transformer_engine.jax.autocast import (
    MeshResource,
    autocast,
    fp8_autocast,
    get_fp8_recipe,
    get_mesh_resource,
    is_fp8_enabled,
)
from transformer_engine.jax.cpp_extensions.misc import (
    get_cudnn_version,
    get_device_compute_capability,
)
from transformer_engine.jax.dense import dense, grouped_dense
from transformer_engine.jax.layernorm import layernorm
from transformer_engine.jax.layernorm_dense import layernorm_dense, layernorm_dense_fp8_operands
from transformer_engine.jax.layernorm_mlp import layernorm_mlp, layernorm_mlp_fp8_operands
from transformer_engine.jax.quantizer import (
    FP8_COLLECTION,
    QuantizerSet,
    make_quantizer_set,
    new_fp8_state,
    update_collections,
)
from transformer_engine.jax.rope import apply_rotary_pos_emb, rotary_freqs

NVTE_FP8_COLLECTION_NAME = FP8_COLLECTION  # NVIDIA's name of the FP8 state's collection

__all__ = ["__version__", "MeshResource", "fp8_autocast", "autocast", "get_fp8_recipe",
           "get_mesh_resource", "is_fp8_enabled", "dense", "grouped_dense", "fused_attn",
           "layernorm",
           "layernorm_dense", "layernorm_dense_fp8_operands", "layernorm_mlp",
           "layernorm_mlp_fp8_operands", "QuantizerSet", "make_quantizer_set", "new_fp8_state",
           "update_collections", "FP8_COLLECTION", "ops", "apply_rotary_pos_emb",
           "rotary_freqs", "NVTE_FP8_COLLECTION_NAME", "get_cudnn_version",
           "get_device_compute_capability", "activation", "cpp_extensions", "quantize",
           "sharding"]
