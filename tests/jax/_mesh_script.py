"""Runs the Flax layers over an 8-device CPU mesh and the same layers on one device, and
prints, per case, how the two runs' results compare and which collectives the compiled
sharded step holds (one JSON object on the last line of stdout).

Run by ``test_sharding_mesh.py`` in a process of its own: the host platform's device count
must be set before jax is imported, and the test process already imported it with one
device. ``python _mesh_script.py [case ...]`` runs the named cases (default: all).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import sys  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _mesh_compare import collectives  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

import transformer_engine.jax as te  # noqa: E402
from transformer_engine.common import recipe  # noqa: E402
from transformer_engine.jax.flax import (  # noqa: E402
    DenseGeneral,
    LayerNormDenseGeneral,
    LayerNormMLP,
)
from transformer_engine.jax.sharding import (  # noqa: E402
    MeshResource,
    logical_axis_rules,
    logical_to_mesh_spec,
)

INPUT_AXES = ("batch", "length", "embed")
RECIPES = {"none": None, "delayed": recipe.DelayedScaling(),
           "current": recipe.Float8CurrentScaling()}
MESHES = {  # name -> (shape, axis names, MeshResource)
    "dp2_tp4": ((2, 4), ("dp", "tp"), MeshResource(dp_resource="dp", tp_resource="tp")),
    "dp2_fsdp4": ((2, 4), ("dp", "fsdp"),
                  MeshResource(dp_resource="dp", fsdp_resource="fsdp")),
    "dp2_fsdp2_tp2": ((2, 2, 2), ("dp", "fsdp", "tp"),
                      MeshResource(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp")),
}


def mlp(activations=("gelu",)):
    return LayerNormMLP(intermediate_dim=256, activations=activations, use_bias=True,
                        kernel_axes_1=("embed", "act", "mlp"), kernel_axes_2=("mlp", "embed"),
                        bias_axes_1=("act", "mlp"), bias_axes_2=("embed",),
                        layernorm_input_axes=INPUT_AXES)


class DensePair(nn.Module):
    """Column-parallel DenseGeneral, GELU, row-parallel DenseGeneral (Megatron's MLP)."""

    @nn.compact
    def __call__(self, x):
        h = DenseGeneral(256, kernel_axes=("embed", "mlp"), bias_axes=("mlp",),
                         input_axes=INPUT_AXES, name="fc1")(x)
        return DenseGeneral(64, kernel_axes=("mlp", "embed"), bias_axes=("embed",),
                            name="fc2")(jax.nn.gelu(h))


def layernorm_dense():
    return LayerNormDenseGeneral(features=256, kernel_axes=("embed", "mlp"), use_bias=True,
                                 bias_axes=("mlp",), layernorm_input_axes=INPUT_AXES)


MODELS = {"mlp": mlp, "swiglu_mlp": lambda: mlp(("silu", "linear")), "dense_pair": DensePair,
          "layernorm_dense": layernorm_dense}

# name -> (model, mesh, recipe, input dtype)
CASES = {
    "mlp-dp2_tp4-none-float32": ("mlp", "dp2_tp4", "none", "float32"),
    "mlp-dp2_tp4-none-bfloat16": ("mlp", "dp2_tp4", "none", "bfloat16"),
    "mlp-dp2_tp4-delayed-float32": ("mlp", "dp2_tp4", "delayed", "float32"),
    "mlp-dp2_tp4-current-bfloat16": ("mlp", "dp2_tp4", "current", "bfloat16"),
    "mlp-dp2_fsdp4-none-float32": ("mlp", "dp2_fsdp4", "none", "float32"),
    "mlp-dp2_fsdp4-delayed-bfloat16": ("mlp", "dp2_fsdp4", "delayed", "bfloat16"),
    "mlp-dp2_fsdp4-current-float32": ("mlp", "dp2_fsdp4", "current", "float32"),
    "dense_pair-dp2_tp4-none-float32": ("dense_pair", "dp2_tp4", "none", "float32"),
    "dense_pair-dp2_tp4-delayed-bfloat16": ("dense_pair", "dp2_tp4", "delayed", "bfloat16"),
    "layernorm_dense-dp2_tp4-current-float32": ("layernorm_dense", "dp2_tp4", "current",
                                                "float32"),
    "swiglu_mlp-dp2_tp4-delayed-float32": ("swiglu_mlp", "dp2_tp4", "delayed", "float32"),
    "mlp-dp2_fsdp2_tp2-delayed-bfloat16": ("mlp", "dp2_fsdp2_tp2", "delayed", "bfloat16"),
}

def leaf_diffs(ref, got) -> dict:
    """Per step and leaf of the unsharded (``ref``) and sharded (``got``) steps: equal bits,
    the largest difference, the reference's largest magnitude, the relative norm of the
    difference."""
    leaves = {}
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(r),
                                jax.tree_util.tree_leaves(g), strict=True):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            leaves[f"step{i}{jax.tree_util.keystr(path)}"] = {
                "equal": bool(np.array_equal(a, b)),
                "max_abs_diff": float(np.max(np.abs(a - b))) if a.size else 0.0,
                "ref_max_abs": float(np.max(np.abs(a))) if a.size else 0.0,
                "rel_norm_diff": float(np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)),
            }
    return leaves


def train_step(model):
    """(loss, output, grads of params, new FP8 state, grad of x) of a mean-square loss."""

    def step(variables, x):
        def loss(params, state, x):
            out = model.apply({**state, "params": params}, x)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.mean(jnp.square(out.astype(jnp.float32))), out

        state = {k: v for k, v in variables.items() if k != "params"}
        (value, out), (d_params, new_state, d_x) = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True)(variables["params"], state, x)
        return {"loss": value, "out": out, "grads": d_params, "state": new_state, "dx": d_x}

    return step


def next_variables(variables, result):
    """The variables of the next step: the same parameters, the new FP8 state."""
    return {**variables, **result["state"]}


def steps_both_ways(step, variables, x, steps: int, fp8, mesh, resource, shardings,
                    input_axes) -> tuple:
    """``steps`` training steps (the FP8 state carried from one to the next) on one device,
    then jitted over ``mesh`` with the parameters placed by ``shardings`` and ``x`` by its
    logical ``input_axes``: (one device's results, the mesh's, the compiled HLO text)."""
    enabled = fp8 is not None
    with te.fp8_autocast(enabled=enabled, fp8_recipe=fp8):
        single = jax.jit(step)
        ref, v = [], variables
        for _ in range(steps):
            ref.append(single(v, x))
            v = next_variables(v, ref[-1])
    with te.fp8_autocast(enabled=enabled, fp8_recipe=fp8, mesh_resource=resource), \
            jax.set_mesh(mesh):
        v = jax.tree_util.tree_map(jax.device_put, variables, shardings)
        xs = jax.device_put(x, NamedSharding(mesh, logical_to_mesh_spec(input_axes, resource)))
        compiled = jax.jit(step).lower(v, xs).compile()
        got = []
        for _ in range(steps):
            got.append(compiled(v, xs))
            v = next_variables(v, got[-1])
    return ref, got, compiled.as_text()


def kernel_shapes(variables) -> dict:
    """The shape of every kernel parameter, by its path."""
    return {jax.tree_util.keystr(p): list(a.shape)
            for p, a in jax.tree_util.tree_leaves_with_path(variables["params"])
            if jax.tree_util.keystr(p).endswith("kernel']")}


def run_case(name: str) -> dict:
    model_name, mesh_name, recipe_name, dtype = CASES[name]
    model = MODELS[model_name]()
    fp8 = RECIPES[recipe_name]
    shape, axis_names, resource = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, axis_names, axis_types=(AxisType.Auto,) * len(shape))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, 64), jnp.float32).astype(dtype)
    with te.fp8_autocast(enabled=fp8 is not None, fp8_recipe=fp8):
        boxed = model.init(jax.random.PRNGKey(0), x)
    variables = nn.unbox(boxed)
    step = train_step(model)
    steps = 2 if recipe_name == "delayed" else 1  # the second step uses the stored scales

    with te.fp8_autocast(enabled=fp8 is not None, fp8_recipe=fp8, mesh_resource=resource), \
            jax.set_mesh(mesh):
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh,
                                                logical_axis_rules(resource))
    ref, got, hlo = steps_both_ways(step, variables, x, steps, fp8, mesh, resource, shardings,
                                    INPUT_AXES)
    leaves = leaf_diffs(ref, got)
    kernels = kernel_shapes(variables)
    return {"leaves": leaves, "collectives": collectives(hlo), "kernels": kernels}


def main(names) -> None:
    print(json.dumps({name: run_case(name) for name in (names or CASES)}))


if __name__ == "__main__":
    main(sys.argv[1:])
