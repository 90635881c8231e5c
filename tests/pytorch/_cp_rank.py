"""One rank of the context-parallel tests (test_parallel_worlds.py): ``python _cp_rank.py
RANK WORLD PORT``. Every rank holds chunks r and 2*WORLD-1-r of the sequence (the
load-balanced layout) and checks its rows of the output and of q's, k's and v's gradients
against attention over the whole sequence, under each cp_comm_type (all_gather, the p2p ring,
a2a; on 4 ranks a2a+p2p too, as two all-to-all groups of 2 on a ring of 2); then
te.MultiheadAttention with RoPE and te.TransformerLayer the same way, and the ring's dropout
against its own directional derivative. Packed (thd) sequences with padding between them:
each rank holds chunks r and 2*WORLD-1-r of every sequence, and its rows are checked against
the unsplit module on the whole padded packing.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import copy
import sys
import warnings

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import DEVICE, case, generator, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.context_parallel_ring import Ring, ring_attention

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, HEADS, D = 32, 2, 4, 16  # whole sequence, batch, heads, head dim
COMM_TYPES = ("all_gather", "p2p", "a2a") + (("a2a+p2p",) if WORLD == 4 else ())


def cp_group(comm):
    """The cp_group argument of ``comm``: [all-to-all group, ring group] for a2a+p2p."""
    return HIERARCHY if comm == "a2a+p2p" else GROUP


def hierarchy():
    """This rank's all-to-all group (ranks 0, 1 or 2, 3) and ring group (0, 2 or 1, 3); every
    rank makes every group, in one order."""
    a2a = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    ring = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    return [a2a[RANK // 2], ring[RANK % 2]]


def local(t, seq):
    """This rank's chunks r and 2*WORLD-1-r of dimension ``seq``."""
    c = t.shape[seq] // (2 * WORLD)
    return torch.cat([t.narrow(seq, RANK * c, c), t.narrow(seq, (2 * WORLD - 1 - RANK) * c, c)],
                     dim=seq)


def check_attention(comm, layout, mask, r=None, groups=HEADS):
    seq = 0 if layout == "sbhd" else 1
    shape = (S, B, HEADS, D) if layout == "sbhd" else (B, S, HEADS, D)
    kv_shape = shape[:2] + (groups, D)
    gen = generator(1)
    q = torch.randn(*shape, generator=gen)
    k, v = (torch.randn(*kv_shape, generator=gen) for _ in range(2))
    g = torch.randn(*shape[:2], HEADS * D, generator=gen)
    kw = dict(num_gqa_groups=groups, qkv_format=layout, attn_mask_type=mask, device=DEVICE)
    full = te.DotProductAttention(HEADS, D, **kw)
    part = te.DotProductAttention(HEADS, D, **kw, cp_group=cp_group(comm), cp_comm_type=comm)

    def run(module, q, k, v, g):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            o = module(q, k, v)
        (o * g).sum().backward()
        return o.detach(), q.grad, k.grad, v.grad

    want = run(full, q, k, v, g)
    got = run(part, local(q, seq), local(k, seq), local(v, seq), local(g, seq))
    # FP8: each side quantizes with its own scales (a chunk's amax is not the sequence's),
    # so the two differ by up to twice one side's rounding (as in _tp_rank.py's FP8_RMS).
    rel = 1e-5 if r is None else 0.2
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        rms_close(a, local(b, seq), rel, f"{comm} {layout} {mask} {r is not None} {name}")


def check_ring_dropout():
    """The ring's gradients (fp64, dropout 0.3) against its own directional derivative: the
    backward replays each block's dropout mask (seeded from torch's generator, reset here
    before each forward)."""
    ring_of_all = Ring(GROUP, [(r, 2 * WORLD - 1 - r) for r in range(WORLD)])
    gen = generator(3)
    local_shape = (B, HEADS, S // WORLD, D)
    q, k, v, dq, dk, dv, g = (torch.randn(*local_shape, generator=gen, dtype=torch.float64)
                              for _ in range(7))

    def ring(q, k, v, dropout=0.3):
        torch.manual_seed(7)
        return ring_attention(ring_of_all, q, k, v, True, 0.25, dropout)

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = ring(q, k, v)
    (o * g).sum().backward()
    assert not torch.allclose(o, ring(q, k, v, 0.0)), "dropout 0.3 dropped nothing"
    eps = 1e-6
    with torch.no_grad():
        plus = (ring(q + eps * dq, k + eps * dk, v + eps * dv) * g).sum()
        minus = (ring(q - eps * dq, k - eps * dk, v - eps * dv) * g).sum()
    numeric = (plus - minus) / (2 * eps)
    analytic = (q.grad * dq).sum() + (k.grad * dk).sum() + (v.grad * dv).sum()
    # each rank's share of the sequence: the sum over the ranks is the whole derivative
    total = torch.stack([numeric, analytic])
    dist.all_reduce(total, group=GROUP)
    assert abs(total[0] - total[1]) <= 1e-6 * abs(total[1]), f"directional derivative {total}"


def check_block(kind, comm):
    torch.manual_seed(0)
    if kind == "MultiheadAttention":
        full = te.MultiheadAttention(HEADS * D, HEADS, attention_dropout=0.0,
                                     input_layernorm=True, device=DEVICE)
    else:
        full = te.TransformerLayer(HEADS * D, 2 * HEADS * D, HEADS, hidden_dropout=0.0,
                                   attention_dropout=0.0, device=DEVICE)
    part = copy.deepcopy(full)
    part.set_context_parallel_group(cp_group(comm), list(range(WORLD)), None, comm)
    gen = generator(2)
    x = torch.randn(S, B, HEADS * D, generator=gen)
    g = torch.randn(S, B, HEADS * D, generator=gen)
    freqs = te.RotaryPositionEmbedding(D)(S)  # the whole sequence's angles

    def run(module, x, g):
        x = x.clone().requires_grad_()
        y = module(x, rotary_pos_emb=freqs)
        (y * g).sum().backward()
        return y.detach(), x.grad

    y, dx = run(full, x, g)
    yp, dxp = run(part, local(x, 0), local(g, 0))
    rms_close(yp, local(y, 0), 1e-5, f"{kind} {comm} output")
    rms_close(dxp, local(dx, 0), 1e-5, f"{kind} {comm} input gradient")
    for (name, p), q in zip(part.named_parameters(), full.parameters(), strict=True):
        grad = p.grad.contiguous().clone()
        dist.all_reduce(grad, group=GROUP)  # each rank's share of the sequence
        rms_close(grad, q.grad, 1e-5, f"{kind} {comm} {name}.grad")


# Packed (thd) sequences: each padded to a multiple of 2 * WORLD rows (one more than needed,
# and an empty one), as Megatron-LM packs them for context parallelism.
LENGTHS = [13, 0, 5, 2 * WORLD * 3]


def _padded_lengths():
    return [-(-n // (2 * WORLD)) * 2 * WORLD + (2 * WORLD if i == 0 else 0)
            for i, n in enumerate(LENGTHS)]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def local_thd(t):
    """This rank's chunks r and 2*WORLD-1-r of every sequence of the padded packing."""
    out, start = [], 0
    for n in _padded_lengths():
        c = n // (2 * WORLD)
        out += [t[start + RANK * c:start + (RANK + 1) * c],
                t[start + (2 * WORLD - 1 - RANK) * c:start + (2 * WORLD - RANK) * c]]
        start += n
    return torch.cat(out)


def _thd_args():
    return dict(cu_seqlens_q=_cu(LENGTHS), cu_seqlens_kv=_cu(LENGTHS),
                cu_seqlens_q_padded=_cu(_padded_lengths()),
                cu_seqlens_kv_padded=_cu(_padded_lengths()), max_seqlen_q=max(_padded_lengths()),
                max_seqlen_kv=max(_padded_lengths()))


def check_packed_attention(comm, mask, r=None):
    rows = sum(_padded_lengths())
    gen = generator(4)
    q, k, v = (torch.randn(rows, HEADS, D, generator=gen) for _ in range(3))
    g = torch.randn(rows, HEADS * D, generator=gen)
    kw = dict(qkv_format="thd", attn_mask_type=mask, device=DEVICE)
    full = te.DotProductAttention(HEADS, D, **kw)
    part = te.DotProductAttention(HEADS, D, **kw, cp_group=cp_group(comm), cp_comm_type=comm)

    def run(module, q, k, v, g):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            o = module(q, k, v, **_thd_args())
        (o * g).sum().backward()
        return o.detach(), q.grad, k.grad, v.grad

    want = run(full, q, k, v, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the other comm types gather k and v for thd
        got = run(part, local_thd(q), local_thd(k), local_thd(v), local_thd(g))
    rel = 1e-5 if r is None else 0.2  # FP8: each side's own scales (see check_attention)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        rms_close(a, local_thd(b), rel, f"thd {comm} {mask} {r is not None} {name}")


def check_packed_block(kind):
    torch.manual_seed(0)
    if kind == "MultiheadAttention":
        full = te.MultiheadAttention(HEADS * D, HEADS, attention_dropout=0.0, qkv_format="thd",
                                     attn_mask_type="padding_causal", input_layernorm=True,
                                     device=DEVICE)
    else:
        full = te.TransformerLayer(HEADS * D, 2 * HEADS * D, HEADS, hidden_dropout=0.0,
                                   attention_dropout=0.0, attn_input_format="thd",
                                   self_attn_mask_type="padding_causal", device=DEVICE)
    part = copy.deepcopy(full)
    part.set_context_parallel_group(GROUP, list(range(WORLD)), None, "all_gather")
    rows = sum(_padded_lengths())
    gen = generator(5)
    x = torch.randn(rows, HEADS * D, generator=gen)
    g = torch.randn(rows, HEADS * D, generator=gen)
    freqs = te.RotaryPositionEmbedding(D)(max(_padded_lengths()))

    def run(module, x, g):
        x = x.clone().requires_grad_()
        y = module(x, rotary_pos_emb=freqs, **_thd_args())
        (y * g).sum().backward()
        return y.detach(), x.grad

    y, dx = run(full, x, g)
    yp, dxp = run(part, local_thd(x), local_thd(g))
    rms_close(yp, local_thd(y), 1e-5, f"thd {kind} output")
    rms_close(dxp, local_thd(dx), 1e-5, f"thd {kind} input gradient")
    for (name, p), q in zip(part.named_parameters(), full.parameters(), strict=True):
        grad = p.grad.contiguous().clone()
        dist.all_reduce(grad, group=GROUP)  # each rank's share of the sequences
        rms_close(grad, q.grad, 1e-5, f"thd {kind} {name}.grad")


def check_refusals():
    import pytest  # only its raises()

    part = te.DotProductAttention(HEADS, D, qkv_format="sbhd", attn_mask_type="padding",
                                  device=DEVICE, cp_group=GROUP)
    t = torch.randn(S // WORLD, B, HEADS, D)
    if WORLD > 1:  # (one rank's attention is the whole sequence's: no context parallelism)
        with pytest.raises(NotImplementedError, match="context parallelism supports"):
            part(t, t, t)
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        te.DotProductAttention(HEADS, D, device=DEVICE, cp_group=GROUP, cp_comm_type="ring")


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    HIERARCHY = hierarchy() if WORLD == 4 else None
    for comm in COMM_TYPES:
        for layout in ("sbhd", "bshd"):
            for mask in ("causal", "no_mask"):
                case(check_attention, comm, layout, mask)
        case(check_attention, comm, "sbhd", "causal", recipe.Float8CurrentScaling(fp8_dpa=True))
        # GQA: 2 kv heads (a2a on 4 ranks splits the heads 4 ways: there, 4 kv heads)
        kv_heads = 4 if (comm, WORLD) == ("a2a", 4) else 2
        case(check_attention, comm, "bshd", "causal", None, kv_heads)
        case(check_block, "MultiheadAttention", comm)
        case(check_block, "TransformerLayer", comm)
        for mask in ("padding_causal", "padding"):
            case(check_packed_attention, comm, mask)
    case(check_packed_attention, "all_gather", "padding_causal",
         recipe.Float8CurrentScaling(fp8_dpa=True))
    case(check_packed_block, "MultiheadAttention")
    case(check_packed_block, "TransformerLayer")
    case(check_attention, "p2p", "sbhd", "causal", None, 1)  # one kv head
    case(check_ring_dropout)
    case(check_refusals)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
