"""NVIDIA's THD form of ``SequenceDescriptor``: q, k, v ``[batch, seqlen, heads, dim]`` with
several sequences ("segments") a row, padding rows before, between and after them, and a row
of padding only. Each segment's rows must give what that segment alone gives through plain
bshd attention (``no_mask`` for ``padding``, ``causal`` for ``padding_causal``: within a
segment the thd masks are those), values and gradients; the padding rows give 0 (they hold
NaN on the way in, so a leak shows).

Both sides run the core's attention on the same rows of one segment, only as a different
batch, so they agree within the fp32 table entry (bitwise on the CPU reference).

Also: the segment-ids form equals the offsets form; flax ``DotProductAttention`` with a
descriptor, and with our thd's padded offsets (``cu_seqlens_q_padded``, also under context
parallelism on 2 CPU devices, in a subprocess), equals ``fused_attn``; bad descriptors raise
ValueError naming the op, the argument, what was expected and what came.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from te_jax_tests._tolerances import assert_close

from transformer_engine.jax.attention import SequenceDescriptor, fused_attn
from transformer_engine.jax.flax import DotProductAttention

B, SQ, HEADS, GROUPS, DIM = 3, 12, 4, 2, 8
# (offset in the row, length) of each row's segments; row 2 is padding only. Row 0 starts
# with a padding row and has padding between and after its segments; row 1 is full.
Q_ROWS = [[(1, 3), (6, 4)], [(0, 5), (5, 2), (7, 5)], []]
# the keys of cross-attention: 16 rows, row b's k-th segment attended by row b's k-th queries
KV_ROWS = [[(0, 5), (8, 7)], [(2, 3), (5, 1), (9, 6)], []]
SKV = 16
WIDTH = 4  # entries per row of the descriptor, unused ones -1 as NVIDIA pads them


def _seqlens_offsets(layout, width=WIDTH):
    seqlens = np.full((len(layout), width), -1, np.int32)
    offsets = np.full((len(layout), width + 1), -1, np.int32)
    for b, row in enumerate(layout):
        for i, (start, n) in enumerate(row):
            seqlens[b, i], offsets[b, i] = n, start
    return seqlens, offsets


def _segment_ids(layout, rows):
    ids = np.zeros((len(layout), rows), np.int32)
    for b, row in enumerate(layout):
        for i, (start, n) in enumerate(row):
            ids[b, start:start + n] = i + 1
    return ids


def _segment_pos(layout, rows):
    """Each token's position in its segment, as NVIDIA's tests write them (checked, not
    read)."""
    pos = np.zeros((len(layout), rows), np.int32)
    for b, row in enumerate(layout):
        for start, n in row:
            pos[b, start:start + n] = np.arange(n)
    return pos


def _inputs(kv_layout, skv, seed=0):
    """q, k, v with NaN in their padding rows, and the loss's weights (0 there)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q_pad = _segment_ids(Q_ROWS, SQ) == 0
    kv_pad = _segment_ids(kv_layout, skv) == 0
    q = jax.random.normal(keys[0], (B, SQ, HEADS, DIM), jnp.float32)
    k, v = (jax.random.normal(key, (B, skv, GROUPS, DIM), jnp.float32) for key in keys[1:3])
    w = jax.random.normal(keys[3], (B, SQ, HEADS, DIM), jnp.float32)
    nan = jnp.nan
    q = jnp.where(q_pad[..., None, None], nan, q)
    k, v = (jnp.where(kv_pad[..., None, None], nan, t) for t in (k, v))
    return q, k, v, jnp.where(q_pad[..., None, None], 0.0, w)


def _descriptor(kv_layout):
    (q_len, q_off), (kv_len, kv_off) = _seqlens_offsets(Q_ROWS), _seqlens_offsets(kv_layout)
    return SequenceDescriptor.from_seqlens_and_offsets((q_len, kv_len), (q_off, kv_off))


def _thd_grad(q, k, v, w, desc, mask, **kw):
    """(dq, dk, dv), o of sum(o * w), jitted with the descriptor traced."""
    def loss(q, k, v, desc):
        o = fused_attn(q, k, v, qkv_layout="thd", attn_mask_type=mask, sequence_descriptor=desc,
                       **kw)
        return jnp.sum(o * w), o

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, desc)


def _alone(q, k, v, w, kv_layout, mask):
    """Each segment alone through plain bshd attention, at its rows; 0 elsewhere."""
    plain = "causal" if "causal" in mask else "no_mask"
    o, dq = np.zeros(q.shape, np.float32), np.zeros(q.shape, np.float32)
    dk, dv = np.zeros(k.shape, np.float32), np.zeros(v.shape, np.float32)
    for b in range(B):
        for (qs, qn), (ks, kn) in zip(Q_ROWS[b], kv_layout[b], strict=True):
            def loss(qi, ki, vi, wi):
                out = fused_attn(qi[None], ki[None], vi[None], attn_mask_type=plain)[0]
                return jnp.sum(out * wi), out

            (gq, gk, gv), out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
                q[b, qs:qs + qn], k[b, ks:ks + kn], v[b, ks:ks + kn], w[b, qs:qs + qn])
            o[b, qs:qs + qn], dq[b, qs:qs + qn] = out, gq
            dk[b, ks:ks + kn], dv[b, ks:ks + kn] = gk, gv
    return (dq, dk, dv), o


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_each_segment_as_if_alone(mask, cross):
    kv_layout, skv = (KV_ROWS, SKV) if cross else (Q_ROWS, SQ)
    q, k, v, w = _inputs(kv_layout, skv)
    desc = _descriptor(kv_layout)
    (dq, dk, dv), o = _thd_grad(q, k, v, w, desc, mask)
    (r_dq, r_dk, r_dv), r_o = _alone(q, k, v, w, kv_layout, mask)
    assert o.shape == (B, SQ, HEADS, DIM)
    for got, want in ((o, r_o), (dq, r_dq), (dk, r_dk), (dv, r_dv)):
        assert_close(got, want, "float32")
    q_pad, kv_pad = _segment_ids(Q_ROWS, SQ) == 0, _segment_ids(kv_layout, skv) == 0
    for got, pad in ((o, q_pad), (dq, q_pad), (dk, kv_pad), (dv, kv_pad)):
        assert np.all(np.asarray(got)[pad] == 0)
    eager = fused_attn(q, k, v, qkv_layout="thd", attn_mask_type=mask, sequence_descriptor=desc)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(o))


def test_segment_ids_form_equals_the_offsets_form():
    q, k, v, w = _inputs(KV_ROWS, SKV, seed=1)
    want = _thd_grad(q, k, v, w, _descriptor(KV_ROWS), "padding_causal")
    ids = (_segment_ids(Q_ROWS, SQ), _segment_ids(KV_ROWS, SKV))
    pos = (_segment_pos(Q_ROWS, SQ), _segment_pos(KV_ROWS, SKV))
    # NVIDIA's docstring example also lists where the last segment ends: ignored
    (q_len, q_off), (kv_len, kv_off) = _seqlens_offsets(Q_ROWS), _seqlens_offsets(KV_ROWS)
    q_off[0, 2], kv_off[0, 2] = 10, 15
    ends = SequenceDescriptor.from_seqlens_and_offsets((q_len, kv_len), (q_off, kv_off))
    # unused entries between used ones (as NVIDIA's bincount of absent ids leaves them): skipped
    gaps = [np.insert(a, 1, -1, axis=1)[:, :a.shape[1]]
            for a in (*_seqlens_offsets(Q_ROWS, 5), *_seqlens_offsets(KV_ROWS, 5))]
    gaps = SequenceDescriptor.from_seqlens_and_offsets((gaps[0], gaps[2]), (gaps[1], gaps[3]))
    for desc in (SequenceDescriptor.from_segment_ids_and_pos(ids),
                 SequenceDescriptor.from_segment_ids_and_pos(ids, pos), ends, gaps):
        got = _thd_grad(q, k, v, w, desc, "padding_causal")
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_max_segments_per_seq_keeps_the_first_segments_of_a_row():
    q, k, v, w = _inputs(Q_ROWS, SQ, seed=2)
    desc = _descriptor(Q_ROWS)
    full = fused_attn(q, k, v, qkv_layout="thd", attn_mask_type="padding",
                      sequence_descriptor=desc)
    wide = fused_attn(q, k, v, qkv_layout="thd", attn_mask_type="padding",
                      sequence_descriptor=desc, max_segments_per_seq=6)
    np.testing.assert_array_equal(np.asarray(wide), np.asarray(full))
    # known values: a row with more segments is refused
    with pytest.raises(ValueError, match=r"fused_attn: each row of sequence_descriptor \(q\) "
                       r"must hold at most max_segments_per_seq = 2 segments, got \[2, 3, 0\]"):
        fused_attn(q, k, v, qkv_layout="thd", attn_mask_type="padding",
                   sequence_descriptor=desc, max_segments_per_seq=2)
    # traced: NVIDIA's static capacity, row 1's third segment is dropped (its rows 0)
    cut = jax.jit(lambda d: fused_attn(q, k, v, qkv_layout="thd", attn_mask_type="padding",
                                       sequence_descriptor=d, max_segments_per_seq=2))(desc)
    cut, full = np.asarray(cut), np.asarray(full)
    assert np.all(cut[1, 7:] == 0)
    np.testing.assert_array_equal(cut[:, :7], full[:, :7])
    np.testing.assert_array_equal(cut[0], full[0])


def test_lengths_form_is_the_cu_seqlens():
    q = jax.random.normal(jax.random.PRNGKey(4), (2, 6, 2, 8), jnp.float32)
    desc = SequenceDescriptor.from_seqlens(jnp.array([6, 3]))
    got = fused_attn(q, q, q, attn_mask_type="padding", sequence_descriptor=desc)
    want = fused_attn(q, q, q, attn_mask_type="padding", cu_seqlens_q=jnp.array([0, 6, 9]),
                      cu_seqlens_kv=jnp.array([0, 6, 9]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---- flax DotProductAttention -----------------------------------------------------------------

def _dpa(**kw):
    return DotProductAttention(head_dim=DIM, num_attention_heads=HEADS,
                               **{"num_gqa_groups": GROUPS, **kw})


def test_flax_with_a_descriptor_equals_fused_attn():
    q, k, v, _ = _inputs(KV_ROWS, SKV, seed=3)
    desc = _descriptor(KV_ROWS)
    want = np.asarray(fused_attn(q, k, v, qkv_layout="thd", attn_mask_type="padding_causal",
                                 sequence_descriptor=desc))
    dpa = _dpa(qkv_layout="thd_thd_thd", attn_mask_type="padding_causal", max_segments_per_seq=3)
    for got in (dpa.apply({}, q, k, v, desc),  # NVIDIA's newer fourth argument
                dpa.apply({}, q, k, v, sequence_descriptor=desc),
                jax.jit(lambda d: dpa.apply({}, q, k, v, mask=d))(desc)):
        np.testing.assert_array_equal(np.asarray(got), want)
    seq_first = dpa.clone(transpose_batch_sequence=True).apply(
        {}, *(jnp.swapaxes(t, 0, 1) for t in (q, k, v)), desc)
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(seq_first, 0, 1)), want)
    kv = jnp.stack([k, v], axis=2)  # NVIDIA's thd_t2hd: key is [b, s, 2, h, d]
    packed = dpa.clone(qkv_layout="thd_t2hd").apply({}, q, kv, None, desc)
    np.testing.assert_array_equal(np.asarray(packed), want)


def test_flax_thd_takes_the_padded_offsets():
    # sequences of 5 and 4 tokens at rows 0 and 8 of 14 (padding between and after them)
    cu, padded = jnp.array([0, 5, 9], jnp.int32), jnp.array([0, 8, 14], jnp.int32)
    t = jax.random.normal(jax.random.PRNGKey(5), (14, HEADS, DIM), jnp.float32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5,
              cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    want = fused_attn(t, t, t, qkv_layout="thd", attn_mask_type="padding_causal", **kw)
    got = _dpa(num_gqa_groups=None, qkv_layout="thd", attn_mask_type="padding_causal").apply(
        {}, t, t, t, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_CP_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec
import transformer_engine.jax as te
from transformer_engine.jax.attention import (SequenceDescriptor, fused_attn,
                                              reorder_thd_load_balancing)
from transformer_engine.jax.flax import DotProductAttention
from transformer_engine.jax.sharding import MeshResource

# sequences of 5 and 7 tokens, each padded to 8 rows (a multiple of 2 * cp)
cu, padded = jnp.array([0, 5, 12], jnp.int32), jnp.array([0, 8, 16], jnp.int32)
kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
          cu_seqlens_kv_padded=padded, max_seqlen_q=7, max_seqlen_kv=7)
x = reorder_thd_load_balancing(jax.random.normal(jax.random.PRNGKey(0), (16, 2, 8)), padded, 2)
dpa = DotProductAttention(head_dim=8, num_attention_heads=2, qkv_layout="thd_thd_thd",
                          attn_mask_type="padding_causal")
mesh = jax.make_mesh((2,), ("cp",), axis_types=(AxisType.Auto,))
with te.autocast(mesh_resource=MeshResource(cp_resource="cp")), jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("cp")))
    got = jax.jit(lambda t: dpa.apply({}, t, t, t, **kw))(xs)
    want = jax.jit(lambda t: fused_attn(t, t, t, qkv_layout="thd",
                                        attn_mask_type="padding_causal", **kw))(xs)
    # NVIDIA's rows under context parallelism: refused
    rows = jnp.ones((2, 8, 2, 8))
    desc = SequenceDescriptor.from_seqlens_and_offsets(
        jnp.array([[5], [7]]), jnp.array([[0, -1], [1, -1]]))
    try:
        fused_attn(rows, rows, rows, qkv_layout="thd", sequence_descriptor=desc)
        refused = None
    except NotImplementedError as e:
        refused = str(e)
print(json.dumps({"equal": bool(np.array_equal(np.asarray(got), np.asarray(want))),
                  "refused": refused}))
"""


def test_flax_thd_under_context_parallelism_equals_fused_attn():
    """(and a packed descriptor there is refused)"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", _CP_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["equal"]
    assert result["refused"].startswith("fused_attn: a packed sequence_descriptor under context "
                                        "parallelism is not implemented")


# ---- refusals -----------------------------------------------------------------------------

def test_bad_descriptors_are_refused():
    lengths, offsets = _seqlens_offsets(Q_ROWS)
    build = SequenceDescriptor.from_seqlens_and_offsets
    with pytest.raises(ValueError, match=r"SequenceDescriptor.from_seqlens_and_offsets: "
                       r"seq_offsets \(q\) must be \[batch, n \+ 1\] = \(3, 5\) for seqlens of "
                       r"shape \(3, 4\), got \(3, 4\)"):
        build(lengths, offsets[:, :4])
    with pytest.raises(ValueError, match=r"from_seqlens_and_offsets: seqlens \(q\) must be "
                       r"\[batch, n\], got shape \(4,\)"):
        build(lengths[0], offsets[0])
    with pytest.raises(ValueError, match="from_seqlens_and_offsets: seqlens must have one "
                       "batch for q and kv, got 3 and 2"):
        build((lengths, lengths[:2]), (offsets, offsets[:2]))
    ids = _segment_ids(Q_ROWS, SQ)
    with pytest.raises(ValueError, match=r"from_segment_ids_and_pos: segment_ids must have one "
                       r"batch for q and kv, got 3 and 1"):
        SequenceDescriptor.from_segment_ids_and_pos((ids, ids[:1]))
    with pytest.raises(ValueError, match=r"from_segment_ids_and_pos: segment_pos \(q\) must "
                       r"have the shape of segment_ids \(3, 12\), got \(3, 11\)"):
        SequenceDescriptor.from_segment_ids_and_pos(ids, ids[:, :11])
    with pytest.raises(ValueError, match="SequenceDescriptor.cu_seqlens: the descriptor must "
                       "be of from_seqlens"):
        build(lengths, offsets).cu_seqlens()


def test_bad_calls_are_refused():
    q, k, v, _ = _inputs(Q_ROWS, SQ)
    desc = _descriptor(Q_ROWS)
    thd = dict(qkv_layout="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"fused_attn: sequence_descriptor's seqlens \(q\) must "
                       r"have q's batch 2, got shape \(3, 4\)"):
        fused_attn(q[:2], k[:2], v[:2], sequence_descriptor=desc, **thd)
    by_ids = SequenceDescriptor.from_segment_ids_and_pos(_segment_ids(Q_ROWS, SQ))
    with pytest.raises(ValueError, match=r"fused_attn: sequence_descriptor's segment ids \(kv\) "
                       r"must be \[batch, seqlen\] = \(3, 10\) as kv's rows, got \(3, 12\)"):
        fused_attn(q, k[:, :10], v[:, :10], sequence_descriptor=by_ids, **thd)
    with pytest.raises(ValueError, match="fused_attn: a sequence_descriptor with offsets or "
                       "segment ids .* needs qkv_layout 'thd', got 'bshd'"):
        fused_attn(q, k, v, attn_mask_type="padding", sequence_descriptor=desc)
    with pytest.raises(ValueError, match=r"fused_attn: q must be \[batch, seqlen, heads, dim\] "
                       r"with a packed sequence_descriptor, got shape \(36, 4, 8\)"):
        fused_attn(q.reshape(-1, HEADS, DIM), k, v, sequence_descriptor=desc, **thd)
    with pytest.raises(ValueError, match="fused_attn: sequence_descriptor describes the "
                       "sequences in place of cu_seqlens_q"):
        fused_attn(q, k, v, sequence_descriptor=desc, cu_seqlens_q=jnp.zeros(4, jnp.int32),
                   **thd)
    lengths, offsets = _seqlens_offsets(Q_ROWS)
    offsets[0, 1] = 2  # row 0's second segment starts inside its first
    with pytest.raises(ValueError, match=r"fused_attn: the segments of sequence_descriptor "
                       r"\(q\) must lie within their row of 12 rows, one after the other"):
        fused_attn(q, k, v, sequence_descriptor=SequenceDescriptor.from_seqlens_and_offsets(
            lengths, offsets), **thd)
    with pytest.raises(ValueError, match="DotProductAttention: a SequenceDescriptor with "
                       "offsets or segment ids .* needs a thd qkv_layout .* got 'bshd'"):
        _dpa(attn_mask_type="padding").apply({}, q, k, v, desc)
    with pytest.raises(ValueError, match="DotProductAttention: mask and sequence_descriptor "
                       "must not both be given"):
        _dpa(qkv_layout="thd_thd_thd").apply({}, q, k, v, jnp.zeros((B, 1, SQ, SQ), bool),
                                             sequence_descriptor=desc)
