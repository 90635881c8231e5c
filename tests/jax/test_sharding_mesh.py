"""The Flax layers under ``jax.jit`` over an 8-device mesh (dp x tp, dp x fsdp) against the
same layers on one device, and the collectives of the compiled sharded step.

The mesh runs happen in one subprocess (``_mesh_script.py``): the host platform's device
count must be set before jax is imported, and this process already has jax with one device.

What must be bitwise equal, and why the rest may differ:

* the FP8 state of the ``x`` and ``kernel`` roles (amax histories, scales): every amax is
  max-reduced over the mesh axes its tensor is split on, and a max is exact;
* an output that no sharded contraction sums (FSDP's forward; a column-parallel layer's);
* elsewhere a sum over a split dimension is computed as partial sums plus a psum: fp32
  results differ in the last bits (tolerance 1e-5 of the tensor's largest magnitude); in
  bf16 each partial sum is rounded before the psum, one bf16 ulp (2^-8 relative) of the
  partials (tolerance 2e-2); with FP8 after a bf16 psum, the next tensor's FP8 rounding can
  flip to the neighbouring FP8 value, one E5M2 step (25% of that element, a few percent of
  the tensor's largest magnitude: tolerance 1e-1). The ``grad`` role's amax then follows the
  gradient it measures (same tolerances).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._mesh_compare import assert_matches_one_device, run_script

import transformer_engine.jax as te
from transformer_engine.common import recipe
from transformer_engine.jax.flax import (
    DenseGeneral,
    LayerNormMLP,
    TransformerLayer,
)
from transformer_engine.jax.sharding import (
    MeshResource,
    logical_axis_rules,
    logical_to_mesh_spec,
)

_SCRIPT = Path(__file__).resolve().parent / "_mesh_script.py"
_CASES = [
    "mlp-dp2_tp4-none-float32", "mlp-dp2_tp4-none-bfloat16", "mlp-dp2_tp4-delayed-float32",
    "mlp-dp2_tp4-current-bfloat16", "mlp-dp2_fsdp4-none-float32",
    "mlp-dp2_fsdp4-delayed-bfloat16", "mlp-dp2_fsdp4-current-float32",
    "dense_pair-dp2_tp4-none-float32", "dense_pair-dp2_tp4-delayed-bfloat16",
    "layernorm_dense-dp2_tp4-current-float32", "swiglu_mlp-dp2_tp4-delayed-float32",
    "mlp-dp2_fsdp2_tp2-delayed-bfloat16",
]


@pytest.fixture(scope="module")
def mesh_runs() -> dict:
    return run_script(_SCRIPT, *_CASES)


def _tolerance(case: str) -> float:
    _, _, fp8, dtype = case.split("-")
    if dtype == "float32":
        return 1e-5
    return 2e-2 if fp8 == "none" else 1e-1


def _bitwise(case: str, leaf: str) -> bool:
    """Whether the leaf must be bitwise equal to the one-device run (see the module doc)."""
    model, mesh, _, _ = case.split("-")
    if "fp8_metas" in leaf and "grad_" not in leaf:
        return True
    if "tp" not in mesh:  # the batch split: only the token sums (gradients) differ
        return leaf.endswith(("['out']", "['dx']")) or "fp8_metas" in leaf
    # tp: the output of a column-parallel layer is summed over no split dimension
    return model == "layernorm_dense" and leaf.endswith("['out']")


@pytest.mark.parametrize("case", _CASES)
def test_sharded_step_equals_the_one_device_step(mesh_runs, case):
    run = mesh_runs[case]
    tolerance = _tolerance(case)
    assert any("fp8_metas" in leaf for leaf in run["leaves"]) == ("delayed" in case)
    for leaf, cmp in run["leaves"].items():
        if _bitwise(case, leaf):
            assert cmp["equal"], f"{case} {leaf}: not bitwise equal ({cmp})"
        else:
            bound = tolerance * max(cmp["ref_max_abs"], 1e-30)
            assert cmp["max_abs_diff"] <= bound, f"{case} {leaf}: {cmp} beyond {tolerance}"


def _numel(shape) -> int:
    return int(np.prod(shape)) if shape else 1


def _weight_sized(run, kinds, tp: int = 1):
    """The arrays of weight size (a whole kernel's element count, or its slice over ``tp``
    devices) that collectives of ``kinds`` move."""
    sizes = {_numel(s) // tp for s in run["kernels"].values()}
    return [(kind, dtype, shape) for kind, arrays in run["collectives"] if kind in kinds
            for dtype, shape in arrays if _numel(shape) in sizes]


@pytest.mark.parametrize("case", [c for c in _CASES if "dp2_tp4" in c and "swiglu" not in c])
def test_tensor_parallel_moves_no_weight(mesh_runs, case):
    """Column and row parallel layers keep their weight slices: nothing gathers, and no
    collective carries a whole weight (the weight gradients are reduced over dp per slice)."""
    run = mesh_runs[case]
    kinds = [kind for kind, _ in run["collectives"]]
    assert "all-gather" not in kinds, run["collectives"]
    assert not _weight_sized(run, ("all-gather", "all-reduce", "reduce-scatter", "all-to-all"))
    if case.startswith("layernorm_dense"):
        return  # column parallel alone: its forward sums nothing over tp
    # the row-parallel GEMM's partial products are summed over tp: a [tokens / dp, N] array
    assert any(kind == "all-reduce" and len(arrays) == 1 and arrays[0][1] == [64, 64]
               for kind, arrays in run["collectives"]), run["collectives"]


@pytest.mark.parametrize("case", [c for c in _CASES if "fsdp" in c])
def test_fsdp_gathers_weights_once_per_gemm_and_scatters_their_gradients(mesh_runs, case):
    run = mesh_runs[case]
    tp = 2 if "tp2" in case else 1  # with tensor parallelism too, each tp slice is gathered
    gathered = _weight_sized(run, ("all-gather",), tp)
    # each kernel is gathered before its GEMMs: in FP8 its column-wise copy for the forward
    # and its row-wise copy for the dgrad; in high precision XLA gathers it once for both
    expected = len(run["kernels"]) * (1 if "-none-" in case else 2)
    assert len(gathered) == expected, gathered
    if "-none-" not in case:
        # the FP8 copies travel, not the kernels: XLA:CPU carries FP8 as f16 in collectives
        assert all(dtype in ("f8e4m3fn", "f8e5m2", "f16") for _, dtype, _ in gathered), gathered
    # the weight gradients are reduce-scattered to the shards, never all-reduced whole
    assert not _weight_sized(run, ("all-reduce",), tp)
    assert sum(kind == "reduce-scatter" for kind, _ in run["collectives"]) == len(run["kernels"])


def test_logical_axes_map_to_the_mesh_resource_axes():
    both = MeshResource(dp_resource="data", tp_resource="model", fsdp_resource="fsdp")
    P = jax.sharding.PartitionSpec
    assert logical_to_mesh_spec(("embed", "mlp"), both) == P("fsdp", "model")
    assert logical_to_mesh_spec(("mlp", "embed"), both) == P("model", "fsdp")
    # the batch takes the FSDP axis first, so an activation's "embed" stays whole
    assert logical_to_mesh_spec(("batch", "length", "embed"), both) == P(("data", "fsdp"),
                                                                         None, None)
    assert logical_to_mesh_spec(("embed", "unknown", None), both) == P("fsdp", None, None)
    assert logical_to_mesh_spec(("embed", "mlp"), MeshResource()) == P(None, None)
    assert dict(logical_axis_rules(both))["batch"] == ("data", "fsdp")


def test_a_mesh_resource_without_a_mesh_changes_no_bit():
    """With axis names but no mesh in context (one device), the ops take their partitioned
    form, which lowers to the plain custom calls: the same bits as without names."""
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 32), jnp.bfloat16)
    model = LayerNormMLP(intermediate_dim=64, kernel_axes_1=("embed", "act", "mlp"),
                         kernel_axes_2=("mlp", "embed"))
    r = recipe.Float8CurrentScaling()
    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        variables = nn.unbox(model.init(jax.random.PRNGKey(1), x))

    def grads(v, x):
        return jax.grad(lambda v, x: jnp.sum(model.apply(v, x)[0].astype(jnp.float32)),
                        argnums=(0, 1))(v, x)

    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        expected = jax.jit(grads)(variables, x)
    resource = MeshResource(dp_resource="data", tp_resource="model", fsdp_resource="fsdp")
    with te.fp8_autocast(enabled=True, fp8_recipe=r, mesh_resource=resource):
        got = jax.jit(grads)(variables, x)
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_mesh_resource_without_a_mesh_changes_no_bit_of_a_transformer_layer():
    """Under a MeshResource but no mesh (one device) the layer annotates its parameters and
    its attention takes the partitioned form, which lowers to the plain calls: the same bits
    as without the resource, and the same parameter tree once unboxed."""
    layer = TransformerLayer(hidden_size=64, mlp_hidden_size=128, num_attention_heads=4,
                             num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                             intermediate_dropout=0.0, enable_relative_embedding=False)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 64), jnp.bfloat16)
    r = recipe.Float8CurrentScaling()
    resource = MeshResource(dp_resource="data", tp_resource="model", fsdp_resource="fsdp")

    def grads(v, x):
        return jax.grad(lambda v, x: jnp.sum(layer.apply(v, x).astype(jnp.float32)),
                        argnums=(0, 1))(v, x)

    with te.fp8_autocast(enabled=True, fp8_recipe=r):
        variables = nn.unbox(layer.init(jax.random.PRNGKey(1), x))
        expected = jax.jit(grads)(variables, x)
    with te.fp8_autocast(enabled=True, fp8_recipe=r, mesh_resource=resource):
        boxed = layer.init(jax.random.PRNGKey(1), x)
        got = jax.jit(grads)(variables, x)
    specs = nn.get_partition_spec(boxed)["params"]
    P = jax.sharding.PartitionSpec
    assert specs["attention"]["query"]["kernel"] == P("embed", "joined_kv")
    assert specs["attention"]["kv"]["kernel"] == P("embed", "joined", None)  # tp unknown
    assert specs["attention"]["out"]["kernel"] == P("joined_kv", "embed")
    assert specs["mlp"]["wi_kernel"] == P("embed", "act", "mlp")
    for a, b in zip(jax.tree_util.tree_leaves(nn.unbox(boxed)),
                    jax.tree_util.tree_leaves(variables), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_an_explicit_mesh_is_refused_by_name():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    layer = DenseGeneral(features=16)
    x = jnp.ones((4, 16))
    variables = layer.init(jax.random.PRNGKey(0), x)
    with te.autocast(mesh_resource=MeshResource(dp_resource="data")), jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"^DenseGeneral: the mesh in context must have "
                                             r"Auto axes.*\['data'\]"):
            layer.apply(variables, x)


def test_a_mesh_resource_naming_axes_the_mesh_lacks_is_refused():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    layer = DenseGeneral(features=16, kernel_axes=("embed", "mlp"))
    x = jnp.ones((4, 16))
    variables = layer.init(jax.random.PRNGKey(0), x)
    with te.autocast(mesh_resource=MeshResource(tp_resource="model")), jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"mesh axes \['model'\].*\['data'\]"):
            jax.jit(layer.apply)(variables, x)


# --- MultiHeadAttention and TransformerLayer (_mesh_attention_script.py) ---------------------

_ATTENTION_SCRIPT = Path(__file__).resolve().parent / "_mesh_attention_script.py"
_ATTENTION_CASES = [
    "mha-dp2_tp4-none-float32", "mha-dp2_tp4-delayed-bfloat16", "mha-dp2_fsdp4-current-float32",
    "mha_gqa4-dp2_tp4-delayed-float32", "mha_gqa2-dp2_tp4-current-float32",
    "layer-dp2_tp4-current-bfloat16", "layer-dp2_tp4-delayed-float32",
    "layer-dp2_fsdp4-delayed-bfloat16", "layer-dp2_fsdp4-none-float32",
    "decoder-dp2_tp4-current-float32", "layer_relpos-dp2_tp4-none-float32",
]


@pytest.fixture(scope="module")
def attention_runs() -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, str(_ATTENTION_SCRIPT)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=_ATTENTION_SCRIPT.parent)
    assert done.returncode == 0, f"the attention mesh script failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _attention_bitwise(case: str, leaf: str) -> bool:
    """The FP8 state of the inputs and kernels (maxima over the shards); under FSDP each
    token's output and input gradient (no split dimension is summed: the heads and the
    batch rows are each device's own, the weights gathered whole)."""
    mesh = case.split("-")[1]
    if "fp8_metas" in leaf and "grad_" not in leaf:
        return True
    return "tp" not in mesh and leaf.endswith(("['out']", "['dx']"))


@pytest.mark.parametrize("case", _ATTENTION_CASES)
def test_sharded_attention_step_equals_the_one_device_step(attention_runs, case):
    """Tolerances: _mesh_compare.layer_step_tolerance."""
    assert_matches_one_device(case, attention_runs[case]["leaves"],
                              lambda leaf: _attention_bitwise(case, leaf))


def _kernel_shaped(run, kinds, skip=()):
    """The arrays that collectives of ``kinds`` move in the shape of a whole kernel (as
    stored, or flattened to the GEMM's [K, N] or [N, K]); the case's sizes are chosen so that
    no activation or kernel slice has such a shape."""
    shapes = set()
    for name, shape in run["kernels"].items():
        if any(s in name for s in skip):
            continue
        k, n = shape[0], int(np.prod(shape[1:]))
        shapes.update({tuple(shape), (k, n), (n, k)})
    return [(kind, dtype, shape) for kind, arrays in run["collectives"] if kind in kinds
            for dtype, shape in arrays if tuple(shape) in shapes]


@pytest.mark.parametrize("case", [c for c in _ATTENTION_CASES if "tp4" in c])
def test_tensor_parallel_attention_moves_no_weight(attention_runs, case):
    """QKV column parallel over the heads, the attention on each device's heads, the output
    projection row parallel: no collective moves a whole kernel, nothing float is gathered
    (the cross-attention gathers its int32 sequence lengths), and the head-split kernels keep
    their slices. With 2 key/value heads on tp = 4 the KV kernel is whole on every device, so
    its gradient is all-reduced over tp, and its k and v are gathered from the devices that
    computed them before they are repeated up to the query heads."""
    run = attention_runs[case]
    gqa2 = case.startswith("mha_gqa2")
    assert not _kernel_shaped(run, ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                                    "collective-permute"), skip=("['kv']",) if gqa2 else ())
    gathered = [[dtype, shape] for kind, arrays in run["collectives"] if kind == "all-gather"
                for dtype, shape in arrays]
    if gqa2:
        assert gathered == [["f32", [4, 24, 2, 8]]] * 2, gathered
    else:
        assert all(dtype == "s32" for dtype, _ in gathered), gathered
    for name, spec in run["specs"].items():
        if name.endswith(("['qkv']['kernel']", "['wi_kernel']")):
            assert spec == "P(None, None, 'tp')", (name, spec)
        elif name.endswith(("['out']['kernel']", "['wo_kernel']")):
            assert spec == "P('tp', None)", (name, spec)
        elif name.endswith("['kv']['kernel']"):
            assert spec == ("P(None, None, None)" if gqa2 else "P(None, None, 'tp')"), (name, spec)


@pytest.mark.parametrize("case", [c for c in _ATTENTION_CASES if "fsdp" in c])
def test_fsdp_attention_gathers_fp8_weights_and_scatters_their_gradients(attention_runs, case):
    """Every kernel (the fused QKV one included) is gathered just before its GEMMs, as its
    two FP8 copies (one gather in high precision), and its gradient reduce-scattered."""
    run = attention_runs[case]
    gathered = _kernel_shaped(run, ("all-gather",))
    fp8 = "-none-" not in case
    assert len(gathered) == len(run["kernels"]) * (2 if fp8 else 1), gathered
    if fp8:  # XLA:CPU carries FP8 as f16 in collectives
        assert all(dtype in ("f8e4m3fn", "f8e5m2", "f16") for _, dtype, _ in gathered), gathered
    assert not _kernel_shaped(run, ("all-reduce",))
    assert sum(kind == "reduce-scatter" for kind, _ in run["collectives"]) == len(run["kernels"])


def test_attention_dropout_split_over_the_batch_draws_the_unsharded_mask(attention_runs):
    assert all(attention_runs["attention_dropout"]["equal"])


def test_heads_that_do_not_split_over_tp_are_refused_by_name(attention_runs):
    error = attention_runs["indivisible_heads"]["error"]
    assert error is not None and error.startswith(
        "MultiHeadAttention: num_attention_heads (6) must be a multiple of the tensor-parallel "
        "size (4"), error
