"""One rank of the context-parallel tests (test_parallel_worlds.py): ``python _cp_rank.py
RANK WORLD PORT``. Every rank holds chunks r and 2*WORLD-1-r of the sequence (the
load-balanced layout) and checks its rows of the output and of q's, k's and v's gradients (k's
and v's summed over the ranks by the backward's reduce-scatter) against attention over the
whole sequence; then te.MultiheadAttention with RoPE and te.TransformerLayer the same way.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import copy
import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, HEADS, D = 32, 2, 4, 16  # whole sequence, batch, heads, head dim


def local(t, seq):
    """This rank's chunks r and 2*WORLD-1-r of dimension ``seq``."""
    c = t.shape[seq] // (2 * WORLD)
    return torch.cat([t.narrow(seq, RANK * c, c), t.narrow(seq, (2 * WORLD - 1 - RANK) * c, c)],
                     dim=seq)


def check_attention(layout, mask, r=None):
    seq = 0 if layout == "sbhd" else 1
    shape = (S, B, HEADS, D) if layout == "sbhd" else (B, S, HEADS, D)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*shape, generator=gen) for _ in range(3))
    g = torch.randn(*shape[:2], HEADS * D, generator=gen)
    full = te.DotProductAttention(HEADS, D, qkv_format=layout, attn_mask_type=mask,
                                  device="cpu")
    part = te.DotProductAttention(HEADS, D, qkv_format=layout, attn_mask_type=mask,
                                  device="cpu", cp_group=GROUP, cp_comm_type="p2p")

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
        rms_close(a, local(b, seq), rel, f"{layout} {mask} {r is not None} {name}")


def check_block(kind):
    torch.manual_seed(0)
    if kind == "MultiheadAttention":
        full = te.MultiheadAttention(HEADS * D, HEADS, attention_dropout=0.0,
                                     input_layernorm=True, device="cpu")
    else:
        full = te.TransformerLayer(HEADS * D, 2 * HEADS * D, HEADS, hidden_dropout=0.0,
                                   attention_dropout=0.0, device="cpu")
    part = copy.deepcopy(full)
    part.set_context_parallel_group(GROUP, list(range(WORLD)), None, "all_gather")
    gen = torch.Generator().manual_seed(2)
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
    rms_close(yp, local(y, 0), 1e-5, f"{kind} output")
    rms_close(dxp, local(dx, 0), 1e-5, f"{kind} input gradient")
    for (name, p), q in zip(part.named_parameters(), full.parameters(), strict=True):
        grad = p.grad.contiguous().clone()
        dist.all_reduce(grad, group=GROUP)  # each rank's share of the sequence
        rms_close(grad, q.grad, 1e-5, f"{kind} {name}.grad")


def check_refusals():
    import pytest  # only its raises()

    part = te.DotProductAttention(HEADS, D, qkv_format="sbhd", attn_mask_type="padding",
                                  device="cpu", cp_group=GROUP)
    t = torch.randn(S // WORLD, B, HEADS, D)
    with pytest.raises(NotImplementedError, match="context parallelism supports"):
        part(t, t, t)
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        te.DotProductAttention(HEADS, D, device="cpu", cp_group=GROUP, cp_comm_type="ring")


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for layout in ("sbhd", "bshd"):
        for mask in ("causal", "no_mask"):
            case(check_attention, layout, mask)
    case(check_attention, "sbhd", "causal", recipe.Float8CurrentScaling(fp8_dpa=True))
    case(check_block, "MultiheadAttention")
    case(check_block, "TransformerLayer")
    case(check_refusals)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
