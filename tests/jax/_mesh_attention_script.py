"""Runs MultiHeadAttention and TransformerLayer over an 8-device CPU mesh and on one device,
and prints, per case, how the two runs compare and which collectives the compiled sharded
step holds (one JSON object on the last line of stdout), as ``_mesh_script.py`` does for
the dense layers (whose step, comparison and HLO reading it reuses).

``python _mesh_attention_script.py [case ...]`` runs the named cases (default: all).
"""

from __future__ import annotations

import json
import sys

import _mesh_script as base  # sets the host device count: imported before jax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding

import transformer_engine.jax as te
from transformer_engine.jax.flax import (
    MultiHeadAttention,
    TransformerLayer,
    TransformerLayerType,
)
from transformer_engine.jax.sharding import (
    logical_axis_rules,
)

HIDDEN, HEADS, HEAD_DIM, BATCH, SEQ = 64, 8, 8, 8, 24


class SelfAttention(nn.Module):
    """MultiHeadAttention over [batch, seq, hidden], fused QKV (or query + fused KV with
    GQA). Batch first: a split batch stays split when the GEMMs flatten the tokens."""

    groups: int = HEADS

    @nn.compact
    def __call__(self, x):
        out, _ = MultiHeadAttention(head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                    num_gqa_groups=self.groups, use_bias=True,
                                    attn_mask_type="causal", transpose_batch_sequence=False,
                                    name="attention")(x, x)
        return out


class Layer(nn.Module):
    """An encoder TransformerLayer, or a decoder one attending over half its input as the
    encoder's output (self-attention, cross-attention and the MLP)."""

    decoder: bool = False
    relative_embedding: bool = False  # T5's biases: the attention runs in jnp

    @nn.compact
    def __call__(self, x):
        kind = TransformerLayerType.DECODER if self.decoder else TransformerLayerType.ENCODER
        layer = TransformerLayer(hidden_size=HIDDEN, mlp_hidden_size=320,
                                 num_attention_heads=HEADS, hidden_dropout=0.0,
                                 attention_dropout=0.0, intermediate_dropout=0.0,
                                 enable_relative_embedding=self.relative_embedding,
                                 use_bias=True, layer_type=kind, name="layer")
        encoded = 0.5 * x if self.decoder else None
        return layer(x, encoded, deterministic=True)


MODELS = {  # name -> (model, the input's logical axes)
    "mha": (SelfAttention, ("batch", "length", "embed")),
    "mha_gqa4": (lambda: SelfAttention(groups=4), ("batch", "length", "embed")),
    "mha_gqa2": (lambda: SelfAttention(groups=2), ("batch", "length", "embed")),
    "layer": (Layer, ("batch", "length", "embed")),
    "decoder": (lambda: Layer(decoder=True), ("batch", "length", "embed")),
    "layer_relpos": (lambda: Layer(relative_embedding=True), ("batch", "length", "embed")),
}

CASES = {name: tuple(name.split("-")) for name in (
    "mha-dp2_tp4-none-float32",
    "mha-dp2_tp4-delayed-bfloat16",
    "mha-dp2_fsdp4-current-float32",
    "mha_gqa4-dp2_tp4-delayed-float32",
    "mha_gqa2-dp2_tp4-current-float32",
    "layer-dp2_tp4-current-bfloat16",
    "layer-dp2_tp4-delayed-float32",
    "layer-dp2_fsdp4-delayed-bfloat16",
    "layer-dp2_fsdp4-none-float32",
    "decoder-dp2_tp4-current-float32",
    "layer_relpos-dp2_tp4-none-float32",
)}


def attention_dropout() -> dict:
    """fused_attn with dropout, q, k, v split on the batch over all 8 devices (the heads
    whole), against one device: each shard's random numbers are those of its rows in the
    unsharded call, so the outputs and gradients match bit for bit."""
    from transformer_engine.jax.attention import fused_attn

    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k, v = (jax.random.normal(key, (BATCH, SEQ, 4, 16), jnp.float32) for key in keys)

    def loss(q, k, v):
        o = fused_attn(q, k, v, dropout_probability=0.3, dropout_rng=jax.random.PRNGKey(4))
        return jnp.sum(o * o), o

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    ref = step(q, k, v)
    mesh = jax.make_mesh((2, 4), ("dp", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        split = NamedSharding(mesh, jax.sharding.PartitionSpec(("dp", "fsdp")))
        got = step(*(jax.device_put(t, split) for t in (q, k, v)))
    return {"equal": [bool(np.array_equal(a, b)) for a, b in
                      zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got),
                          strict=True)]}


def indivisible_heads() -> dict:
    """The error of a MultiHeadAttention whose 6 heads do not split over tp = 4."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    model = MultiHeadAttention(head_dim=8, num_attention_heads=6,
                               transpose_batch_sequence=False)
    x = jnp.ones((BATCH, SEQ, 48))
    try:
        with te.fp8_autocast(mesh_resource=base.MESHES["dp2_tp4"][2]), jax.set_mesh(mesh):
            jax.eval_shape(model.init, jax.random.PRNGKey(0), x, x)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


CHECKS = {"attention_dropout": attention_dropout, "indivisible_heads": indivisible_heads}


def run_case(name: str) -> dict:
    model_name, mesh_name, recipe_name, dtype = CASES[name]
    make, input_axes = MODELS[model_name]
    model = make()
    fp8 = base.RECIPES[recipe_name]
    shape, axis_names, resource = base.MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axis_names, axis_types=(AxisType.Auto,) * len(shape))
    x_shape = (SEQ, BATCH, HIDDEN) if input_axes[0].startswith("length") else (BATCH, SEQ, HIDDEN)
    x = jax.random.normal(jax.random.PRNGKey(1), x_shape, jnp.float32).astype(dtype)
    step = base.train_step(model)
    steps = 2 if recipe_name == "delayed" else 1  # the second step uses the stored scales
    enabled = fp8 is not None

    with te.fp8_autocast(enabled=enabled, fp8_recipe=fp8):
        variables = nn.unbox(model.init(jax.random.PRNGKey(0), x))
    with te.fp8_autocast(enabled=enabled, fp8_recipe=fp8, mesh_resource=resource), \
            jax.set_mesh(mesh):
        # initialized under the mesh: the parameters carry their logical axes
        boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), x)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh,
                                                logical_axis_rules(resource))
    ref, got, hlo = base.steps_both_ways(step, variables, x, steps, fp8, mesh, resource,
                                         shardings, input_axes)
    specs = {jax.tree_util.keystr(p): str(s.spec) for p, s in
             jax.tree_util.tree_leaves_with_path(shardings["params"])}
    leaves = base.leaf_diffs(ref, got)
    kernels = base.kernel_shapes(variables)
    return {"leaves": leaves, "collectives": base.collectives(hlo), "kernels": kernels,
            "specs": specs}


def main(names) -> None:
    names = names or [*CASES, *CHECKS]
    print(json.dumps({name: CHECKS[name]() if name in CHECKS else run_case(name)
                      for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
