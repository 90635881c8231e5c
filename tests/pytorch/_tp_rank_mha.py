"""One rank of the tensor-parallel attention tests (test_parallel_worlds.py): ``python
_tp_rank_mha.py RANK WORLD PORT``. Every rank builds te.MultiheadAttention and
te.TransformerLayer split over the group (``set_parallel_mode=True``, with and without
``sequence_parallel``) and the same modules unsplit from the same seed, runs forward and
backward on the same data and checks its output, its input gradient and its parameters'
gradients against the unsplit module's: the rank's slice of a split parameter, the whole of a
replicated one (summed over the ranks first where the parameter is marked
``sequence_parallel``).

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import DEVICE, case, generator, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H, HEADS, GROUPS, FFN = 32, 2, 64, 4, 2, 128
CURRENT = recipe.Float8CurrentScaling()


def build(kind, split, sequence=False, **kw):
    torch.manual_seed(0)
    kw.update(device=DEVICE, params_dtype=torch.float32)
    if split:
        kw.update(tp_group=GROUP, tp_size=WORLD, set_parallel_mode=True,
                  sequence_parallel=sequence)
    if kind in ("MultiheadAttention", "CrossAttention"):
        cross = dict(attention_type="cross", attn_mask_type="no_mask") \
            if kind == "CrossAttention" else {}
        return te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                     input_layernorm=True, **cross, **kw)
    return te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                               attention_dropout=0.0, **kw)


def seq(t):
    n = t.shape[0] // WORLD
    return t[RANK * n:(RANK + 1) * n]


def mine(t, full_shape):
    """This rank's slice of ``t`` where ``full_shape`` (the split parameter's) is smaller."""
    for dim, (a, b) in enumerate(zip(t.shape, full_shape, strict=True)):
        if a != b:
            return t.narrow(dim, RANK * b, b)
    return t


def summed(t):
    t = t.contiguous().clone()
    dist.all_reduce(t, group=GROUP)
    return t


def step(module, x, g, r, memory=None):
    x = x.clone().requires_grad_()
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        y = module(x) if memory is None else module(x, encoder_output=memory)
    (y * g).sum().backward()
    return y.detach(), x.grad


def check(kind, sequence=False, r=None, kw=None):
    kw = kw or {}
    full, par = build(kind, False, **kw), build(kind, True, sequence, **kw)
    gen = generator(1)
    x, g = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    memory = torch.randn(S, B, H, generator=gen) if kind == "CrossAttention" else None
    y, dx = step(full, x, g, r, memory)
    local = seq if sequence else (lambda t: t)
    yp, dxp = step(par, local(x), local(g), r, None if memory is None else local(memory))
    rel = 2e-5 if r is None else 0.12
    what = f"{kind} {kw} sequence={sequence} {'fp8' if r else 'fp32'}"
    rms_close(yp, local(y), rel, f"{what} output")
    rms_close(dxp, local(dx), 2 * rel, f"{what} input gradient")
    scale = max(float(q.grad.norm()) for q in full.parameters())
    for (name, p), q in zip(par.named_parameters(), full.parameters(), strict=True):
        got = summed(p.grad) if getattr(p, "sequence_parallel", False) else p.grad
        want = mine(q.grad, p.shape)
        if float(want.norm()) < 1e-4 * scale:
            # The key bias: softmax ignores a shift of every score of a row, so its gradient
            # is zero but for rounding, in both (no relative comparison of noise).
            assert float(got.norm()) < 1e-3 * scale, (what, name, float(got.norm()), scale)
            continue
        rms_close(got, want, 2 * rel, f"{what} {name}.grad")
    attention = par.self_attention if kind == "TransformerLayer" else par
    assert attention.num_attention_heads_per_partition == HEADS // WORLD, what


def check_dropout_draws_from_the_tracker():
    """A split block's attention dropout runs in the tracker's fork: the default generator
    (the same on every rank) does not move, the rank's own stream does, and the ranks' masks
    differ."""
    tracker = te.distributed.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1000 + RANK)
    torch.manual_seed(0)
    par = te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.5,
                                input_layernorm=True, device=DEVICE, tp_group=GROUP,
                                tp_size=WORLD, set_parallel_mode=True,
                                get_rng_state_tracker=lambda: tracker)
    x = torch.randn(S, B, H, generator=generator(1))
    before, stream = torch.get_rng_state(), tracker.get_states()["model-parallel-rng"]
    par(x)
    assert torch.equal(torch.get_rng_state(), before), "the default generator moved"
    assert not torch.equal(tracker.get_states()["model-parallel-rng"], stream), "no draw"


def check_refusals():
    import pytest  # only its raises()

    with pytest.raises(NotImplementedError, match="needs set_parallel_mode=True"):
        te.MultiheadAttention(H, HEADS, tp_group=GROUP, tp_size=WORLD, device=DEVICE)
    with pytest.raises(ValueError, match=rf"num_gqa_groups must be divisible by "
                                         rf"tp_size={WORLD}"):
        te.MultiheadAttention(H, HEADS, num_gqa_groups=1, tp_group=GROUP, tp_size=WORLD,
                              set_parallel_mode=True, device=DEVICE)
    with pytest.raises(NotImplementedError, match="qkv_weight_interleaved=False"):
        te.MultiheadAttention(H, HEADS, tp_group=GROUP, tp_size=WORLD, set_parallel_mode=True,
                              fuse_qkv_params=True, qkv_weight_interleaved=False, device=DEVICE)


if __name__ == "__main__":
    GROUP = _tp_world.start(RANK, WORLD, PORT)
    for sequence in (False, True):
        case(check, "MultiheadAttention", sequence)
        case(check, "MultiheadAttention", sequence, None, dict(fuse_qkv_params=True))
        case(check, "TransformerLayer", sequence)
    case(check, "CrossAttention", False)
    case(check, "CrossAttention", True, None, dict(fuse_qkv_params=True))
    case(check, "MultiheadAttention", True, CURRENT)
    case(check, "TransformerLayer", True, CURRENT)
    case(check, "TransformerLayer", False, None, dict(fuse_qkv_params=True,
                                                      output_layernorm=True))
    case(check, "TransformerLayer", True, None, dict(output_layernorm=True))
    case(check_dropout_draws_from_the_tracker)
    if WORLD > 1:  # (one rank needs no parallel mode)
        case(check_refusals)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
