"""Context parallelism in one process, in a world of 4 fake ranks (torch's fake process group:
its collectives and point-to-point transfers move no data), enough to see what the ring and the
all-to-all hold, pass on and refuse. The numbers are checked against whole-sequence attention
on real gloo worlds (_cp_rank.py, run by test_parallel_worlds.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import transformer_engine.pytorch as te
from transformer_engine.pytorch import context_parallel, context_parallel_ring, context_parallel_thd

WORLD, S, B, HEADS, D = 4, 64, 2, 4, 8  # fake ranks, whole sequence, batch, heads, head dim
LOCAL = S // WORLD  # a rank's two chunks


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized already in this process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=WORLD)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _inputs(heads=HEADS):
    return [torch.randn(LOCAL, B, heads, D, requires_grad=True) for _ in range(3)]


def test_the_ring_holds_one_block_of_keys_at_a_time(group, monkeypatch):
    """Every block the ring attends (forward and backward) has at most a rank's share of the
    keys, and every tensor it passes on is one rank's block or its gradients: the whole
    sequence's k and v are never put together."""
    keys_seen, sent = [], []
    for name in ("block_forward", "block_backward"):
        real = getattr(context_parallel_ring, name)

        def spy(q, k, *args, _real=real, _name=name, **kwargs):
            keys_seen.append((_name, k.shape[2]))
            return _real(q, k, *args, **kwargs)

        monkeypatch.setattr(context_parallel_ring, name, spy)
    real_exchange = context_parallel_ring.Ring.exchange

    def exchange(self, tensors):
        sent.extend(t.numel() for t in tensors)
        return real_exchange(self, tensors)

    monkeypatch.setattr(context_parallel_ring.Ring, "exchange", exchange)
    attn = te.DotProductAttention(HEADS, D, device="cpu", cp_group=group, cp_comm_type="p2p")
    q, k, v = _inputs()
    attn(q, k, v).sum().backward()
    # rank 1 of 4 under the causal mask: its own block (both query chunks), rank 0's (both
    # see its first chunk), ranks 3's and 2's (the second query chunk sees them whole)
    forward = [n for name, n in keys_seen if name == "block_forward"]
    assert forward == [LOCAL // 2, LOCAL, LOCAL // 2, LOCAL // 2, LOCAL, LOCAL]
    assert max(n for _, n in keys_seen) == LOCAL < S
    assert max(sent) == k.numel() < S * B * HEADS * D


def test_the_ring_and_a2a_attend_with_the_modules_scale_and_dropout(group, monkeypatch):
    seen = []
    for owner, name in ((context_parallel, "ring_attention"), (context_parallel, "a2a_attention")):
        def spy(*args, _name=name):  # (where to, q, k, v, causal, scale, dropout)
            q, _, v, causal, scale, dropout = args[-6:]
            seen.append((_name, causal, scale, dropout))
            return q.new_zeros((*q.shape[:-1], v.shape[-1]))

        monkeypatch.setattr(owner, name, spy)
    for comm in ("p2p", "a2a"):
        attn = te.DotProductAttention(HEADS, D, attention_dropout=0.25, softmax_scale=0.5,
                                      attn_mask_type="no_mask", device="cpu", cp_group=group,
                                      cp_comm_type=comm)
        attn(*_inputs())
        attn.eval()
        attn(*_inputs())
    assert seen == [("ring_attention", False, 0.5, 0.25), ("ring_attention", False, 0.5, 0.0),
                    ("a2a_attention", False, 0.5, 0.25), ("a2a_attention", False, 0.5, 0.0)]


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_fp8_attention_gathers_instead_and_says_so(group, monkeypatch, comm):
    """Under fp8_dpa the ring and the all-to-all (whose blocks run in high precision) give
    way to the all-gather path, which runs the module's FP8 attention, with a warning."""
    from transformer_engine.common import recipe

    def refuse(*args):
        raise AssertionError("ran the high-precision path under fp8_dpa")

    monkeypatch.setattr(context_parallel, "ring_attention", refuse)
    monkeypatch.setattr(context_parallel, "a2a_attention", refuse)
    monkeypatch.setattr(context_parallel, "_WARNED_FP8", set())
    gathered = []
    real = context_parallel._attend_gathered
    monkeypatch.setattr(context_parallel, "_attend_gathered",
                        lambda *a: gathered.append(1) or real(*a))
    attn = te.DotProductAttention(HEADS, D, attn_mask_type="no_mask", device="cpu",
                                  cp_group=group, cp_comm_type=comm)
    with pytest.warns(UserWarning, match=f"FP8 attention \\(fp8_dpa\\) under context "
                                         f"parallelism gathers k and v .* instead of "
                                         f"cp_comm_type '{comm}'"):
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling(fp8_dpa=True)):
            attn(*_inputs())
    assert gathered == [1]


def test_a2a_refuses_heads_not_divisible_by_the_group(group):
    attn = te.DotProductAttention(6, D, device="cpu", cp_group=group, cp_comm_type="a2a")
    with pytest.raises(ValueError, match=r"cp_comm_type 'a2a' splits the heads over the 4 "
                                         r"ranks .* divisible by 4, got 6 and 6"):
        attn(*_inputs(6))


def test_a2a_p2p_takes_a_pair_of_groups_and_only_it_does(group):
    with pytest.raises(ValueError, match="list of two process groups .* got ProcessGroup"):
        te.DotProductAttention(HEADS, D, device="cpu", cp_group=group, cp_comm_type="a2a+p2p")
    with pytest.raises(ValueError, match="list of two process groups .* got list with 'p2p'"):
        te.DotProductAttention(HEADS, D, device="cpu", cp_group=[group, group])
    with pytest.raises(ValueError, match=r"\[all-to-all group, ring group\], got 3 groups"):
        te.DotProductAttention(HEADS, D, device="cpu", cp_group=[group] * 3,
                               cp_comm_type="a2a+p2p")


@pytest.mark.parametrize("diagonal", [False, True])
def test_a_blocks_gradients_match_autograd(diagonal):
    """One block alone (its own lse is the whole one): block_backward's gradients, with a
    dropout mask and grouped kv heads, against autograd through block_forward."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 10, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    keep = torch.rand(2, 4, 6, 10, generator=gen) >= 0.3
    o, lse = context_parallel_ring.block_forward(q, k, v, 0.3, diagonal, keep, 0.3)
    d_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(o, (q, k, v), d_o)
    delta = (d_o * o).sum(-1)
    got = context_parallel_ring.block_backward(q, k, v, d_o, lse, delta, 0.3, diagonal, keep,
                                               0.3)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_packed_gather_index_puts_every_rank_chunk_in_its_place():
    """Packed (thd) sequences: row g of the global padded packing comes from the rank that
    holds its chunk (chunks r and 2cp-1-r of every sequence), at that chunk's local row;
    sequences of no rows (an empty one) are passed over."""
    cp, padded = 2, [8, 0, 4, 12]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])
    local_rows = sum(padded) // cp
    want = []
    for s, n in enumerate(padded):
        c = n // (2 * cp)
        for chunk in range(2 * cp):
            rank = chunk if chunk < cp else 2 * cp - 1 - chunk
            local = int(cu[s]) // cp + (c if chunk >= cp else 0)
            want += [rank * local_rows + local + w for w in range(c)]
    index = context_parallel_thd.gather_index(cu, cp, local_rows)
    assert index.tolist() == want
    assert sorted(want) == list(range(sum(padded)))


def test_packed_pieces_attend_up_to_their_last_token():
    """A rank's pieces (chunks r and 2cp-1-r of each sequence): their tokens, and under a
    causal mask the keys up to each piece's last token (all of the sequence's otherwise; none
    for a piece without tokens)."""
    cp, rank = 2, 1
    cu = torch.tensor([0, 7, 10])         # lengths 7 and 3
    cu_padded = torch.tensor([0, 8, 12])  # 8 and 4 rows: chunks of 2 and 1 rows
    p = context_parallel_thd.pieces(cp, rank, cu, cu_padded, cu, cu_padded, 6, causal=True)
    # rank 1 holds chunks 1 and 2: sequence 0 positions 2-3 and 4-5; sequence 1 positions 1, 2
    assert torch.diff(p.cu_q).tolist() == [2, 2, 1, 1]
    assert torch.diff(p.cu_q_padded).tolist() == [2, 2, 1, 1]
    assert torch.diff(p.cu_kv).tolist() == [4, 6, 2, 3]
    assert torch.diff(p.cu_kv_padded).tolist() == [8, 8, 4, 4]
    p = context_parallel_thd.pieces(cp, rank, cu, cu_padded, cu, cu_padded, 6, causal=False)
    assert torch.diff(p.cu_kv).tolist() == [7, 7, 3, 3]
    p = context_parallel_thd.pieces(cp, rank, torch.tensor([0, 7, 8]), cu_padded,
                                    torch.tensor([0, 7, 8]), cu_padded, 6, causal=True)
    assert torch.diff(p.cu_q).tolist() == [2, 2, 0, 0]  # sequence 1 has one token, chunk 0's
    assert torch.diff(p.cu_kv).tolist() == [4, 6, 0, 0]
