"""Packed (thd) sequences with padding between them, and their context parallelism, against
the unsplit thd attention of the same sequences back to back.

The mesh runs happen in one subprocess (``_mesh_context_thd_script.py``, 4 CPU devices). What
must be equal, and why the rest may differ:

* the output and dq: each query attends the same keys, in the same order, as in the unsplit
  call (a chunk's keys are its sequence's first ones): bitwise.
* dk and dv: a key's gradient is the sum of its queries' shares, summed per device piece by
  piece and then over the devices (reduce-scatter): the same fp32 terms in another order,
  within 1e-5 of the largest magnitude (the bshd/sbhd tests' bound).
* the padding rows (between sequences and after the last): exactly 0, with NaN in them on the
  way in.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._mesh_compare import run_script

from transformer_engine.jax import context_parallel_thd
from transformer_engine.jax.attention import (
    fused_attn,
    inverse_reorder_thd_load_balancing,
    reorder_thd_load_balancing,
)
from transformer_engine.jax.padded_packing import rows_in, segments

_SCRIPT = Path(__file__).resolve().parent / "_mesh_context_thd_script.py"
_CASES = ["padding_causal-cp4-2", "padding-cp4-4", "padding_causal-cp2-4", "padding-cp2-1",
          "padding_causal-cp2-2-tp2", "causal-cp4-1-ring"]

# as in the script: an empty sequence and one of 13 tokens, both padded 2 * cp rows more than
# needed (row 0 is padding), one shorter than a chunk, one that fills its padding
LENGTHS = (0, 13, 5, 24)


def _padded(cp: int) -> list[int]:
    return [-(-n // (2 * cp)) * 2 * cp + (2 * cp if i < 2 else 0)
            for i, n in enumerate(LENGTHS)]


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _cp_order(padded: list[int], cp: int, rows: int) -> list[int]:
    """The padded packing's row at each row of the context-parallel order, written out: per
    device, chunks r and 2cp-1-r of every sequence, then its share of the rows after them."""
    starts, total = _cu(padded), sum(padded)
    extra = (rows - total) // cp
    out = []
    for r in range(cp):
        for s, n in enumerate(padded):
            c = n // (2 * cp)
            for chunk in (r, 2 * cp - 1 - r):
                out += range(starts[s] + chunk * c, starts[s] + (chunk + 1) * c)
        out += range(total + r * extra, total + (r + 1) * extra)
    return out


# --- the index helpers (one device) -------------------------------------------------------------


def test_segments_and_rows_in_skip_an_empty_segment():
    seg, pos, inside = segments(jnp.array([2, 0, 3], jnp.int32), 7)
    assert np.asarray(seg)[:5].tolist() == [0, 0, 2, 2, 2]
    assert np.asarray(pos)[:5].tolist() == [0, 1, 0, 1, 2]
    assert np.asarray(inside).tolist() == [True] * 5 + [False] * 2
    # segments at rows 0 (2 tokens of 4 rows), 4 (empty), 4 (3 tokens of 4), then 1 spare row
    back, token = rows_in(jnp.array([0, 4, 4], jnp.int32), jnp.array([2, 0, 3], jnp.int32), 9)
    assert np.asarray(token).tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0]
    assert np.asarray(back)[np.asarray(token)].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("cp", [2, 3])
def test_reorder_gives_each_device_its_two_chunks_of_every_sequence(cp):
    padded = _padded(cp)
    rows = sum(padded) + 2 * cp
    cu_padded = jnp.asarray(_cu(padded))
    x = jnp.arange(rows * 2).reshape(rows, 2)
    got = reorder_thd_load_balancing(x, cu_padded, cp)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x)[_cp_order(padded, cp, rows)])
    back = jax.jit(inverse_reorder_thd_load_balancing, static_argnums=2)(got, cu_padded, cp)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    assert reorder_thd_load_balancing(x, cu_padded, 1) is x


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rank", [0, 2])
def test_pieces_are_each_devices_two_chunks_of_every_sequence(rank, causal):
    """Against the chunks written out: each piece's tokens (its rows of the shard, back to
    back) and the keys it reads (its sequence's first ones, as rows of the gathered keys)."""
    cp, q_lengths, kv_lengths = 3, LENGTHS, (0, 13, 6, 24)
    padded = _padded(cp)
    rows = sum(padded) + 2 * cp
    cu_q, cu_kv, cu_padded = _cu(q_lengths), _cu(kv_lengths), _cu(padded)
    order = _cp_order(padded, cp, rows)
    where = {g: i for i, g in enumerate(order)}  # padded row -> row of the gathered keys
    tokens, keys, q_rows, kv_rows = [], [], [], []
    for s, n in enumerate(padded):
        c = n // (2 * cp)
        for j, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            first = chunk * c
            t = min(max(q_lengths[s] - first, 0), c)
            kv = min(first + t, kv_lengths[s]) if causal else kv_lengths[s]
            kv = kv if t else 0
            tokens.append(t)
            keys.append(kv)
            q_rows += range(cu_padded[s] // cp + j * c, cu_padded[s] // cp + j * c + t)
            kv_rows += [where[cu_padded[s] + i] for i in range(kv)]
    p = context_parallel_thd.pieces(rank, cp, *map(jnp.asarray, (cu_q, cu_padded, cu_kv,
                                                                 cu_padded)),
                                    rows // cp, rows // cp, causal)
    assert np.asarray(p.cu_q).tolist() == _cu(tokens).tolist()
    assert np.asarray(p.cu_kv).tolist() == _cu(keys).tolist()
    assert np.asarray(p.q_source)[:len(q_rows)].tolist() == q_rows
    assert int(np.sum(p.q_inside)) == len(q_rows)
    assert np.asarray(p.kv_source)[:len(kv_rows)].tolist() == kv_rows
    assert int(np.sum(p.kv_inside)) == len(kv_rows)
    token = np.zeros(rows // cp, bool)
    token[q_rows] = True
    np.testing.assert_array_equal(np.asarray(p.q_token), token)
    assert np.asarray(p.q_back)[q_rows].tolist() == list(range(len(q_rows)))


# --- padded offsets without context parallelism (one device) --------------------------------


def _qkv(tokens: int, groups: int = 2):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (tokens, 4, 8))
    k, v = (jax.random.normal(key, (tokens, groups, 8)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (tokens, 4, 8))


@pytest.mark.parametrize("sides", ["both", "kv"])
def test_padded_offsets_equal_the_sequences_back_to_back(sides):
    """Under jit (traced offsets): at the tokens' rows the output and gradients of the back-
    to-back call, bitwise (the same rows reach the core); 0 in the padding rows, whose NaNs
    reach nothing."""
    padded = _padded(2)
    rows = sum(padded) + 3
    at = np.concatenate([_cu(padded)[i] + np.arange(n) for i, n in enumerate(LENGTHS)])
    cu, cu_padded = jnp.asarray(_cu(LENGTHS)), jnp.asarray(_cu(padded))
    q, k, v, w = _qkv(sum(LENGTHS))
    spread = lambda t: jnp.full((rows, *t.shape[1:]), jnp.nan).at[at].set(t)  # noqa: E731
    kw = dict(qkv_layout="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
              cu_seqlens_kv=cu, max_seqlen_q=24, max_seqlen_kv=24)

    def loss(q, k, v, w, offsets):
        o = fused_attn(q, k, v, **kw, **offsets)
        return jnp.sum(o * w), o

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (dq, dk, dv), o = grad(q, k, v, w, {})
    q_side = sides == "both"
    offsets = dict(cu_seqlens_kv_padded=cu_padded)
    if q_side:
        offsets["cu_seqlens_q_padded"] = cu_padded
    args = (spread(q) if q_side else q, spread(k), spread(v),
            jnp.nan_to_num(spread(w)) if q_side else w)
    (pdq, pdk, pdv), po = grad(*args, offsets)
    pad = np.ones(rows, bool)
    pad[at] = False
    for want, got, padded_rows in ((o, po, q_side), (dq, pdq, q_side), (dk, pdk, True),
                                   (dv, pdv, True)):
        got = np.asarray(got)
        if padded_rows:
            assert np.all(got[pad] == 0)
            got = got[at]
        np.testing.assert_array_equal(got, np.asarray(want))


# --- errors (one device; the mesh's in the script) -----------------------------------------------


def test_padded_offsets_outside_thd_are_refused():
    x = jnp.ones((1, 8, 2, 4))
    cu = jnp.array([0, 8], jnp.int32)
    with pytest.raises(ValueError, match=r"fused_attn: cu_seqlens_q_padded / "
                                         r"cu_seqlens_kv_padded must be None except for "
                                         r"qkv_layout 'thd' .*got qkv_layout 'bshd'"):
        fused_attn(x, x, x, attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                   cu_seqlens_kv_padded=cu)


@pytest.mark.parametrize("offsets, message", [
    ([0, 4, 9], r"cu_seqlens_q_padded must start at 0, give each sequence at least its length "
                r"in cu_seqlens_q \(\[5, 3\]\) and end within the tensor's 12 rows, got "
                r"\[0, 4, 9\]"),
    ([0, 8, 16], r"cu_seqlens_q_padded must .* end within the tensor's 12 rows, got "
                 r"\[0, 8, 16\]"),
    ([0, 6], r"cu_seqlens_q_padded must have the shape of cu_seqlens_q \(\(3,\)\), got \(2,\)"),
])
def test_bad_padded_offsets_are_refused_by_name(offsets, message):
    x = jnp.ones((12, 2, 4))
    with pytest.raises(ValueError, match="fused_attn: " + message):
        fused_attn(x, x, x, qkv_layout="thd", attn_mask_type="padding",
                   cu_seqlens_q=jnp.array([0, 5, 8]), cu_seqlens_kv=jnp.array([0, 5, 8]),
                   cu_seqlens_q_padded=jnp.array(offsets), max_seqlen_q=5, max_seqlen_kv=5)


def test_context_parallel_offsets_are_checked_by_name():
    check = context_parallel_thd.check_call_offsets
    cu = jnp.array([0, 5, 8], jnp.int32)
    with pytest.raises(ValueError, match=r"op: qkv_layout 'thd' under context parallelism "
                                         r"needs cu_seqlens_kv_padded .*got None"):
        check("op", 2, "cu_seqlens_kv", cu, None, 16)
    with pytest.raises(ValueError, match=r"op: each sequence's padded length "
                                         r"\(cu_seqlens_q_padded\) must be a multiple of 4 "
                                         r".*got lengths \[6, 6\]"):
        check("op", 2, "cu_seqlens_q", cu, jnp.array([0, 6, 12]), 16)
    with pytest.raises(ValueError, match=r"op: under context parallelism the thd tensors' rows "
                                         r"must be a multiple of .* 4 devices, got 18 rows"):
        check("op", 4, "cu_seqlens_q", cu, jnp.array([0, 8, 16]), 18)
    check("op", 2, "cu_seqlens_q", cu, jnp.array([0, 8, 16]), 16)  # fine


def test_reorder_errors_name_the_argument():
    x = jnp.ones((16, 2))
    with pytest.raises(ValueError, match=r"reorder_thd_load_balancing: each sequence's padded "
                                         r"length \(cu_seqlens_padded\) must be a multiple of "
                                         r"4 \(2 \* cp_size\), got lengths \[6, 6\]"):
        reorder_thd_load_balancing(x, jnp.array([0, 6, 12]), 2)
    with pytest.raises(ValueError, match=r"inverse_reorder_thd_load_balancing: the tensor's "
                                         r"rows \(dimension 0\) must be a multiple of cp_size "
                                         r"= 3, got shape \(16, 2\)"):
        inverse_reorder_thd_load_balancing(x, jnp.array([0, 6, 12]), 3)


# --- over the mesh (_mesh_context_thd_script.py) -----------------------------------------------


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_script(_SCRIPT)


@pytest.mark.parametrize("case", _CASES)
def test_split_packed_attention_equals_the_unsplit_call(runs, case):
    arrays = runs[case]["arrays"]
    for name in ("o", "dq"):
        assert arrays[name]["equal"], f"{case} {name}: {arrays[name]}"
    for name in ("o", "dq", "dk", "dv"):
        cmp = arrays[name]
        assert cmp["max_abs_diff"] <= 1e-5 * cmp["ref_max_abs"], f"{case} {name}: {cmp}"
        assert cmp["padding_zero"], f"{case} {name}: a padding row is not 0"


@pytest.mark.parametrize("case", _CASES)
def test_split_packed_attention_gathers_only_keys_and_values(runs, case):
    """Forward and backward each all-gather k and v (every row, this device's kv heads), the
    backward reduce-scatters dk and dv to the shards: no query, output, lse or gradient of
    them moves, and heads split over tp stay split."""
    run = runs[case]
    heads = run["groups"] // run["tp"]
    whole, shard = [run["rows"], heads, 8], [run["rows"] // run["cp"], heads, 8]
    kinds = sorted(kind for kind, _ in run["collectives"])
    assert kinds == ["all-gather"] * 4 + ["reduce-scatter"] * 2, run["collectives"]
    for kind, arrays in run["collectives"]:
        assert arrays == [["f32", whole if kind == "all-gather" else shard]], (kind, arrays)


def test_the_ring_strategy_gathers_thd_with_a_warning(runs):
    assert any("gathers k and v (context_parallel_strategy 'all_gather') instead of 'ring'" in w
               for w in runs["causal-cp4-1-ring"]["warnings"])
    assert not runs["padding-cp4-4"]["warnings"]


def test_bad_context_parallel_thd_calls_are_refused_by_name(runs):
    errors = runs["refused"]
    assert errors["not_multiple"].startswith(
        "ValueError: fused_attn: each sequence's padded length (cu_seqlens_q_padded) must be a "
        "multiple of 4 (2 x the context-parallel axis's 2 devices), got lengths [6, 6]")
    for side in ("q", "kv"):
        assert errors[f"missing_{side}"].startswith(
            f"ValueError: fused_attn: qkv_layout 'thd' under context parallelism needs "
            f"cu_seqlens_{side}_padded"), errors
    assert errors["bottom_right"].startswith(
        "NotImplementedError: fused_attn: context parallelism of packed (thd) sequences takes "
        "attn_mask_type 'padding' or 'padding_causal'")
    assert errors["window"].startswith("NotImplementedError: fused_attn: sliding windows are "
                                       "not implemented under context parallelism")


def test_plain_thd_attention_keeps_its_heads_split(runs):
    """(No context parallelism.) Each device attends its own heads; the lse residual
    [batch, heads, max tokens] splits with them."""
    assert runs["heads_split"] == {"dq": True, "o": True}
