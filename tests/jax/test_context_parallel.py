"""Context parallelism (the sequence split over a mesh axis) against one device.

The mesh runs happen in one subprocess (``_mesh_context_script.py``), which sets the host
platform's device count before importing jax. What must be equal, and why the rest may
differ:

* ``fused_attn``'s output and query gradient: each device attends its own queries to the
  same keys, in the same order, as the one-device call does for those rows: bitwise.
* its key and value gradients: each device's queries add their share to every key's
  gradient, and the shares are summed over devices (reduce-scatter): the same terms as the
  one-device sum in another order, fp32, so within 1e-5 of the largest magnitude.
* the layers' steps: as the data- and tensor-parallel steps of ``test_sharding_mesh.py``
  (the weight gradients are psums over the devices' tokens): 1e-5 in fp32, 2e-2 in bf16,
  and bf16 FP8 within the FP8 rounding flips those tests measured (2.5e-1, 1e-1 in norm).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._mesh_compare import assert_matches_one_device, run_script

import transformer_engine.jax as te
from transformer_engine.jax.attention import (
    CPStrategy,
    QKVFormat,
    ReorderStrategy,
    fused_attn,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from transformer_engine.jax.sharding import MeshResource, token_rows

_SCRIPT = Path(__file__).resolve().parent / "_mesh_context_script.py"
_GATHER = ["causal-bshd-plain-4", "causal-bshd-balanced-4", "causal-sbhd-balanced-2",
           "no_mask-bshd-plain-4", "no_mask-sbhd-balanced-1", "padding-bshd-plain-4",
           "padding_causal-bshd-plain-4", "padding_causal-sbhd-balanced-2",
           "padding_causal-bshd-balanced-1"]
_RING = ["causal-bshd-plain-4-ring", "causal-sbhd-balanced-2-ring",
         "causal-bshd-balanced-4-ring", "no_mask-bshd-plain-1-ring",
         "padding-bshd-plain-4-ring", "padding_causal-bshd-balanced-4-ring",
         "padding_causal-sbhd-plain-2-ring"]
_ATTENTION = _GATHER + _RING
_MODELS = ["layer_sbhd-dp2_cp4-none-float32", "layer_sbhd-dp2_tp4-delayed-float32",
           "mha-dp2_cp4-none-float32",
           "mha_gqa2-cp2_tp4-delayed-float32", "layer-dp2_cp4-none-float32",
           "layer-dp2_cp4-delayed-bfloat16", "layer-cp2_tp4-current-float32",
           "layer-fsdp2_cp2_tp2-delayed-float32"]


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_script(_SCRIPT)


# --- the load-balanced order (one device) ------------------------------------------------------


def test_reorder_gives_device_r_chunks_r_and_their_mirror():
    x = jnp.arange(16).reshape(1, 16)  # [batch, seq]: 8 chunks of 2 for cp = 4
    got = reorder_causal_load_balancing(x, 4, QKVFormat.BSHD)
    chunks = np.asarray(got).reshape(4, 2, 2)  # per device, its two chunks
    for r in range(4):
        assert chunks[r, 0].tolist() == [2 * r, 2 * r + 1]
        mirror = 7 - r
        assert chunks[r, 1].tolist() == [2 * mirror, 2 * mirror + 1]
    back = inverse_reorder_causal_load_balancing(got, 4, QKVFormat.BSHD)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_reorder_takes_both_nvidia_signatures_and_the_seq_first_format():
    x = jax.random.normal(jax.random.PRNGKey(0), (12, 2, 3))  # [seq, batch, features]
    a = reorder_causal_load_balancing(x, 3, "sbhd")
    b = reorder_causal_load_balancing(x, ReorderStrategy.DualChunkSwap, 3, 0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        np.asarray(inverse_reorder_causal_load_balancing(b, ReorderStrategy.DualChunkSwap, 3,
                                                         0)), np.asarray(x))
    assert reorder_causal_load_balancing(x, 1, "sbhd") is x  # one device: nothing to move


def test_reorder_errors_name_the_argument():
    x = jnp.ones((2, 10, 4))
    with pytest.raises(ValueError, match=r"reorder_causal_load_balancing: the sequence .*"
                                         r"length 10\) must be a multiple of 2 \* cp_size = 4"):
        reorder_causal_load_balancing(x, 2, "bshd")
    with pytest.raises(ValueError, match="tensor_format must be 'bshd' or 'sbhd'"):
        reorder_causal_load_balancing(x, 2, "thd")
    with pytest.raises(NotImplementedError, match="Striped"):
        reorder_causal_load_balancing(x, ReorderStrategy.Striped, 2, 1)
    with pytest.raises(TypeError, match=r"takes \(tensor, cp_size, tensor_format\)"):
        reorder_causal_load_balancing(x, 2)


def test_without_a_mesh_the_context_parallel_keywords_change_nothing():
    """(Any strategy; the ring needs a mesh too.)"""
    q = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 2, 4))
    plain = fused_attn(q, q, q)
    with te.autocast(mesh_resource=MeshResource(cp_resource="cp")):
        got = fused_attn(q, q, q, context_parallel_strategy=CPStrategy.ALL_GATHER,
                         context_parallel_causal_load_balanced=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))


def test_nvidias_sequence_axis_names_map_to_their_mesh_axes():
    from transformer_engine.jax.sharding import (
        BATCH_AXES,
        HIDDEN_AXES,
        SEQLEN_AXES,
        SEQLEN_CP_AXES,
        SEQLEN_TP_AXES,
        logical_to_mesh_spec,
    )

    resource = MeshResource(dp_resource="dp", cp_resource="cp", tpsp_resource="tp")
    spec = jax.sharding.PartitionSpec
    for seq in (SEQLEN_AXES, SEQLEN_CP_AXES):
        assert logical_to_mesh_spec((BATCH_AXES, seq, HIDDEN_AXES), resource) == \
            spec("dp", "cp", None)
    assert logical_to_mesh_spec((BATCH_AXES, SEQLEN_TP_AXES, HIDDEN_AXES), resource) == \
        spec("dp", "tp", None)


def test_token_rows_is_a_reshape_without_a_mesh():
    x = jnp.arange(2 * 6 * 4.0).reshape(2, 6, 4)
    rows, back = token_rows(x, 2, ("batch", "length"))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(x.reshape(12, 4)))
    np.testing.assert_array_equal(np.asarray(back(rows[:, :3])), np.asarray(x[..., :3]))


# --- over the mesh (_mesh_context_script.py) ----------------------------------------------------


@pytest.mark.parametrize("case", _ATTENTION)
def test_split_sequence_attention_equals_the_one_device_call(runs, case):
    """All-gather: the output and dq bitwise (each device attends its queries to the same
    keys in the same order). Ring: every result within 1e-5 of its largest magnitude (the
    blocks' partial results are merged by their log-sum-exp, and dq, dk, dv summed, in fp32
    in another order)."""
    arrays = runs[case]["arrays"]
    ring = case.endswith("-ring")
    for name in ("o", "dq"):
        if not ring:
            assert arrays[name]["equal"], f"{case} {name}: {arrays[name]}"
    for name in ("o", "dq", "dk", "dv"):
        cmp = arrays[name]
        assert cmp["max_abs_diff"] <= 1e-5 * cmp["ref_max_abs"], f"{case} {name}: {cmp}"


def _without_lengths(case: str, collectives: list, batch: int) -> list:
    """The collectives but those moving the sequences' lengths (int32, one per sequence of a
    device's batch), which a padding mask's call may reshard."""
    if not case.startswith("padding"):
        return collectives
    lengths = [["s32", [batch]]]
    return [(kind, arrays) for kind, arrays in collectives if arrays != lengths]


@pytest.mark.parametrize("case", _RING)
def test_the_ring_only_passes_blocks_to_the_next_device(runs, case):
    """Nothing is gathered: every collective is a collective-permute of one device's shard of
    k or v (or of their gradients), never the whole sequence."""
    run = runs[case]
    seq_dim, k_shape = run["seq_dim"], run["shapes"]["k"]
    shard = list(k_shape)
    shard[1 - seq_dim] //= 2  # the batch over dp = 2
    shard[seq_dim] //= 4  # the sequence over cp = 4
    collectives = _without_lengths(case, run["collectives"], shard[1 - seq_dim])
    assert collectives, "no collective at all"
    for kind, arrays in collectives:
        assert kind == "collective-permute", run["collectives"]
        assert all(shape == shard for _, shape in arrays), (kind, arrays)


@pytest.mark.parametrize("case", _GATHER)
def test_split_sequence_attention_gathers_only_keys_and_values(runs, case):
    """Forward and backward each all-gather k and v along the sequence (this device's batch
    rows, the whole sequence, k's heads), and the backward reduce-scatters dk and dv back to
    the shards: nothing else moves (no query, output or gradient of them). Under a padding
    mask the sequences' lengths (int32, one per sequence of the device's batch) may move
    too."""
    run = runs[case]
    seq_dim, k_shape = run["seq_dim"], run["shapes"]["k"]
    local = list(k_shape)
    local[1 - seq_dim] //= 2  # the batch over dp = 2
    shard = list(local)
    shard[seq_dim] //= 4  # the sequence over cp = 4
    run = {**run, "collectives": _without_lengths(case, run["collectives"],
                                                  local[1 - seq_dim])}
    kinds = sorted(kind for kind, _ in run["collectives"])
    assert kinds == ["all-gather"] * 4 + ["reduce-scatter"] * 2, run["collectives"]
    for kind, arrays in run["collectives"]:
        assert arrays == [["f32", local if kind == "all-gather" else shard]], (kind, arrays)


@pytest.mark.parametrize("case", _MODELS)
def test_context_parallel_layer_step_equals_the_one_device_step(runs, case):
    # the inputs' and kernels' amaxes: maxima over the shards, exact
    assert_matches_one_device(case, runs[case]["leaves"],
                              lambda leaf: "fp8_metas" in leaf and "grad_" not in leaf)


def test_a_seq_first_layer_keeps_its_batch_split_under_data_and_tensor_parallelism(runs):
    """[seq, batch, hidden] with the batch split over dp: the GEMMs take each device's tokens
    as rows (split dims first), so no activation is gathered; tp all-reduces as in bshd."""
    run = runs["layer_sbhd-dp2_tp4-delayed-float32"]
    kinds = {kind for kind, _ in run["collectives"]}
    assert kinds <= {"all-reduce"}, run["collectives"]


@pytest.mark.parametrize("case", [c for c in _MODELS if "cp" in c])
def test_context_parallel_layers_move_no_activation_but_keys_and_values(runs, case):
    """Under cp the token-wise layers (norms, projections, MLP) keep each device's tokens:
    the only activations gathered are the attention's keys and values (4-D, the whole
    sequence), scattered back as their gradients. Under fsdp the kernels are gathered too,
    and under tp with 2 key/value heads on 4 devices the kv heads (as in
    ``test_sharding_mesh.py``); nothing in the shape of a hidden state [.., seq, hidden] is
    gathered."""
    run = runs[case]
    gathered = [shape for kind, arrays in run["collectives"] if kind == "all-gather"
                for dtype, shape in arrays if dtype == "f32"]
    assert gathered and all(len(shape) == 4 for shape in gathered), gathered
    assert not any(kind == "all-to-all" for kind, _ in run["collectives"]), run["collectives"]


def test_what_context_parallelism_does_not_do_is_refused_by_name(runs):
    errors = runs["refused"]
    assert errors["padding_bottom_right"].startswith(
        "NotImplementedError: fused_attn: context parallelism takes attn_mask_type 'no_mask', "
        "a causal mask, 'padding' or 'padding_causal', got 'padding_causal_bottom_right'")
    assert errors["dropout"].startswith("NotImplementedError: fused_attn: attention dropout is "
                                        "not implemented under context parallelism")
    assert errors["strategy"].startswith("ValueError: fused_attn: context_parallel_strategy "
                                         "must be 'default', 'all_gather' or 'ring'")
    assert errors["indivisible"].startswith("ValueError: fused_attn: the query sequence length "
                                            "28 must be a multiple of 8")
