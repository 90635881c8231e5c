"""Context parallelism over an 8-device CPU mesh against one device: ``fused_attn`` with the
sequence split (plain and load-balanced order, causal and unmasked, bshd and sbhd, GQA), and
MultiHeadAttention / TransformerLayer training steps under ``MeshResource(cp_resource=...)``
with dp, tp and fsdp beside it. Prints one JSON object on the last line of stdout, as
``_mesh_attention_script.py`` does (whose models, step and comparison it reuses).

``python _mesh_context_script.py [case ...]`` runs the named cases (default: all).
"""

from __future__ import annotations

import json
import sys

import _mesh_attention_script as att  # sets the host device count: imported before jax
import _mesh_script as base
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from transformer_engine.jax.attention import (
    fused_attn,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.flax import TransformerLayer
from transformer_engine.jax.sharding import MeshResource

base.MESHES.update({
    "dp2_tpsp4": ((2, 4), ("dp", "tp"), MeshResource(dp_resource="dp", tpsp_resource="tp")),
    "dp2_cp4": ((2, 4), ("dp", "cp"), MeshResource(dp_resource="dp", cp_resource="cp")),
    "cp2_tp4": ((2, 4), ("cp", "tp"), MeshResource(cp_resource="cp", tp_resource="tp")),
    "fsdp2_cp2_tp2": ((2, 2, 2), ("fsdp", "cp", "tp"),
                      MeshResource(fsdp_resource="fsdp", cp_resource="cp", tp_resource="tp")),
})

class SeqFirstLayer(nn.Module):
    """An encoder TransformerLayer over [seq, batch, hidden] (sbhd)."""

    @nn.compact
    def __call__(self, x):
        layer = TransformerLayer(hidden_size=att.HIDDEN, mlp_hidden_size=320,
                                 num_attention_heads=att.HEADS, hidden_dropout=0.0,
                                 attention_dropout=0.0, intermediate_dropout=0.0,
                                 use_bias=True, transpose_batch_sequence=True,
                                 enable_relative_embedding=False, name="layer")
        return layer(x, deterministic=True)


att.MODELS["layer_sbhd"] = (SeqFirstLayer, ("length", "batch", "embed"))


class SequenceParallelLayer(nn.Module):
    """An encoder TransformerLayer whose residual stream is split along the sequence over
    tpsp (enable_sequence_parallel)."""

    seq_first: bool = False

    @nn.compact
    def __call__(self, x):
        layer = TransformerLayer(hidden_size=att.HIDDEN, mlp_hidden_size=320,
                                 num_attention_heads=att.HEADS, hidden_dropout=0.0,
                                 attention_dropout=0.0, intermediate_dropout=0.0,
                                 use_bias=True, transpose_batch_sequence=self.seq_first,
                                 enable_relative_embedding=False,
                                 enable_sequence_parallel=True, name="layer")
        return layer(x, deterministic=True)


att.MODELS["layer_sp"] = (SequenceParallelLayer, ("batch", "length_tp", "embed"))
att.MODELS["layer_sp_sbhd"] = (lambda: SequenceParallelLayer(seq_first=True),
                               ("length_tp", "batch", "embed"))

MODEL_CASES = [
    "layer_sp-dp2_tpsp4-none-float32",
    "layer_sp-dp2_tpsp4-delayed-bfloat16",
    "layer_sp_sbhd-dp2_tpsp4-current-float32",
    "layer_sbhd-dp2_cp4-none-float32",
    "layer_sbhd-dp2_tp4-delayed-float32",
    "mha-dp2_cp4-none-float32",
    "mha_gqa2-cp2_tp4-delayed-float32",
    "layer-dp2_cp4-none-float32",
    "layer-dp2_cp4-delayed-bfloat16",
    "layer-cp2_tp4-current-float32",
    "layer-fsdp2_cp2_tp2-delayed-float32",
]
att.CASES.update({name: tuple(name.split("-")) for name in MODEL_CASES})

# fused_attn cases: mask-layout-order-groups over dp2 x cp4 (the batch over dp)
ATTENTION_CASES = [
    "causal-bshd-plain-4", "causal-bshd-balanced-4", "causal-sbhd-balanced-2",
    "no_mask-bshd-plain-4", "no_mask-sbhd-balanced-1",
    # the ring strategy
    "causal-bshd-plain-4-ring", "causal-sbhd-balanced-2-ring", "causal-bshd-balanced-4-ring",
    "no_mask-bshd-plain-1-ring",
    # padding masks (the all-gather strategy): the second sequence holds 19 of 32 positions
    "padding-bshd-plain-4", "padding_causal-bshd-plain-4", "padding_causal-sbhd-balanced-2",
    "padding_causal-bshd-balanced-1",
    # and by the ring
    "padding-bshd-plain-4-ring", "padding_causal-bshd-balanced-4-ring",
    "padding_causal-sbhd-plain-2-ring",
]
LENGTHS = (32, 19)  # each sequence's valid positions under a padding mask


def attention_case(name: str) -> dict:
    """One fused_attn training step with q, k, v split over cp = 4 (and the batch over dp =
    2) against the same step on one device: outputs and gradients, and the collectives. The
    name: mask-layout-order-kv heads[-strategy] (default all-gather)."""
    mask, layout, order, groups, *strategy = name.split("-")
    balanced, groups = order == "balanced", int(groups)
    strategy = strategy[0] if strategy else "all_gather"
    batch, seq, heads, dim = 2, 32, 4, 8
    seq_dim = 0 if layout == "sbhd" else 1
    shape = lambda h: (seq, batch, h, dim) if layout == "sbhd" else (batch, seq, h, dim)  # noqa: E731
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    q = jax.random.normal(keys[0], shape(heads), jnp.float32)
    k, v = (jax.random.normal(key, shape(groups), jnp.float32) for key in keys[1:3])
    w = jax.random.normal(keys[3], shape(heads), jnp.float32)  # the loss's weights

    padding = {}
    if mask.startswith("padding"):
        cu = jnp.array([0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]], jnp.int32)
        padding = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)

    def loss(q, k, v, w, balanced):
        o = fused_attn(q, k, v, qkv_layout=layout, attn_mask_type=mask,
                       context_parallel_causal_load_balanced=balanced,
                       context_parallel_strategy=strategy, **padding)
        return jnp.sum(o * w), o

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    ref = jax.jit(grad, static_argnums=4)(q, k, v, w, False)

    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    args = (q, k, v, w)
    if balanced:
        args = tuple(reorder_causal_load_balancing(t, 4, layout) for t in args)
    spec = PartitionSpec("cp", "dp") if layout == "sbhd" else PartitionSpec("dp", "cp")
    with base.te.fp8_autocast(mesh_resource=MeshResource(dp_resource="dp", cp_resource="cp")), \
            jax.set_mesh(mesh):
        split = NamedSharding(mesh, spec)
        args = tuple(jax.device_put(t, split) for t in args)
        # The results stay split as the inputs are: the step's own collectives only.
        step = jax.jit(grad, static_argnums=4, out_shardings=((split,) * 3, split))
        compiled = step.lower(*args, balanced).compile()
        (dq, dk, dv), o = compiled(*args)
        hlo = compiled.as_text()
    got = [o, dq, dk, dv]
    if balanced:
        got = [inverse_reorder_causal_load_balancing(t, 4, layout) for t in got]
    want = [ref[1], *ref[0]]
    out = {}
    for label, a, b in zip(("o", "dq", "dk", "dv"), want, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        out[label] = {"equal": bool(np.array_equal(a, b)),
                      "max_abs_diff": float(np.max(np.abs(a - b))),
                      "ref_max_abs": float(np.max(np.abs(a)))}
    return {"arrays": out, "collectives": base.collectives(hlo), "seq_dim": seq_dim,
            "shapes": {"q": list(q.shape), "k": list(k.shape)}}


def refused() -> dict:
    """The errors of what context parallelism does not do: a bottom-right padding mask,
    dropout, an unknown strategy, and a sequence the axis does not divide."""
    mesh = jax.make_mesh((2, 4), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    x = jnp.ones((2, 32, 4, 8))
    calls = {
        "padding_bottom_right": dict(attn_mask_type="padding_causal_bottom_right",
                                     cu_seqlens_q=jnp.array([0, 32, 64]),
                                     cu_seqlens_kv=jnp.array([0, 32, 64])),
        "dropout": dict(dropout_probability=0.1, dropout_rng=jax.random.PRNGKey(0)),
        "strategy": dict(context_parallel_strategy="ulysses"),
        "indivisible": dict(context_parallel_causal_load_balanced=True),
    }
    errors = {}
    with base.te.fp8_autocast(mesh_resource=MeshResource(cp_resource="cp")), \
            jax.set_mesh(mesh):
        for name, kw in calls.items():
            t = x[:, :28] if name == "indivisible" else x  # 28 is not a multiple of 2 x 4
            try:
                jax.eval_shape(lambda a, kw=kw: fused_attn(a, a, a, **kw), t)
                errors[name] = None
            except (NotImplementedError, ValueError) as e:
                errors[name] = f"{type(e).__name__}: {e}"
    return errors


CHECKS = {"refused": refused}


def main(names) -> None:
    names = names or [*ATTENTION_CASES, *MODEL_CASES, *CHECKS]
    results = {}
    for name in names:
        if name in CHECKS:
            results[name] = CHECKS[name]()
        elif name in ATTENTION_CASES:
            results[name] = attention_case(name)
        else:
            results[name] = att.run_case(name)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
