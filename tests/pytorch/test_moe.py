"""Token routing of a mixture-of-experts layer (te.moe_permute and friends, NVIDIA TE's names)
against loops over the experts and tokens; gradients against autograd through the loops."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te

T, H, E, K = 12, 8, 4, 2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _routing(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=gen)
    top = scores.topk(K, dim=1).indices  # [T, K] expert ids
    mask = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(torch.randn(T, E, generator=gen), 1) * mask
    x = torch.randn(T, H, generator=gen)
    return x.to(device), mask.to(device), top.to(device), probs.to(device)


def _expected_rows(mask):
    """(token, expert) of each permuted row of a mask routing: expert by expert, tokens in
    order."""
    return [(t, e) for e in range(mask.shape[1]) for t in range(mask.shape[0]) if mask[t, e]]


@pytest.mark.parametrize("device", DEVICES)
def test_mask_permute_groups_tokens_by_expert_and_unpermute_merges_them(device):
    x, mask, _, probs = _routing(device)
    x = x.requires_grad_()
    out, row_id_map = te.moe_permute(x, mask)
    rows = _expected_rows(mask.cpu())
    assert out.shape == (len(rows), H)
    for i, (t, e) in enumerate(rows):
        assert torch.equal(out[i], x[t]) and int(row_id_map[t, e]) == i
    assert int((row_id_map >= 0).sum()) == len(rows)
    # Each expert doubles its rows; unpermute weights them by the router's probabilities.
    y = (out * 2).requires_grad_()
    merged = te.moe_unpermute(y, row_id_map, merging_probs=probs)
    want = torch.zeros(T, H, device=device)
    for i, (t, e) in enumerate(rows):
        want[t] += probs[t, e] * y[i]
    torch.testing.assert_close(merged, want)
    # Gradients: of the tokens (each copy's gradient summed) and of the probabilities.
    g = torch.randn(T, H, device=device)
    probs = probs.clone().requires_grad_()
    merged = te.moe_unpermute(te.moe_permute(x, mask)[0], row_id_map, merging_probs=probs)
    gx, gp = torch.autograd.grad((merged * g).sum(), (x, probs))
    torch.testing.assert_close(gx, g * (probs * mask).sum(1, keepdim=True))
    torch.testing.assert_close(gp, (g @ x.t()).diagonal().unsqueeze(1) * mask)


@pytest.mark.parametrize("device", DEVICES)
def test_index_routing_and_with_probs_agree_with_the_mask_routing(device):
    x, mask, top, probs = _routing(device)
    out_i, map_i = te.moe_permute(x, top, map_type="index")
    out_m, map_m = te.moe_permute(x, mask)
    # Both group by expert; within an expert both go in token order (top-k picks an expert
    # once per token).
    assert torch.equal(out_i, out_m)
    assert map_i.shape == (T, K) and map_m.shape == (T, E)
    top_probs = probs.gather(1, top)
    torch.testing.assert_close(
        te.moe_unpermute(out_i, map_i, merging_probs=top_probs, map_type="index"),
        te.moe_unpermute(out_m, map_m, merging_probs=probs))
    out_p, permuted_probs, map_p = te.moe_permute_with_probs(x, probs, mask)
    assert torch.equal(out_p, out_m) and torch.equal(map_p, map_m)
    assert torch.equal(permuted_probs,
                       torch.stack([probs[t, e] for t, e in _expected_rows(mask.cpu())]))
    # Without probabilities unpermute sums the copies: every token came K times.
    torch.testing.assert_close(te.moe_unpermute(out_m, map_m), x * K)


def test_num_out_tokens_keeps_the_first_rows():
    x, mask, _, _ = _routing("cpu")
    full, _ = te.moe_permute(x, mask)
    kept, row_id_map = te.moe_permute(x, mask, num_out_tokens=5)
    assert torch.equal(kept, full[:5]) and int((row_id_map >= 0).sum()) == 5
    merged = te.moe_unpermute(kept, row_id_map, restore_shape=torch.Size([T, H]))
    assert merged.shape == (T, H)


def test_sort_chunks_by_index():
    x = torch.arange(10.0).unsqueeze(1).repeat(1, 3)
    probs = torch.arange(10.0)
    sizes, order = torch.tensor([2, 3, 5]), torch.tensor([2, 0, 1])
    out = te.moe_sort_chunks_by_index(x, sizes, order)
    assert out[:, 0].tolist() == [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    out2, p2 = te.moe_sort_chunks_by_index_with_probs(x, probs, sizes, order)
    assert torch.equal(out2, out) and p2.tolist() == out[:, 0].tolist()


@pytest.mark.parametrize("call, message", [
    (lambda x, m: te.moe_permute(x, m, map_type="dense"), "map_type must be one of"),
    (lambda x, m: te.moe_permute(x, m[:3]), r"routing_map must be \[tokens=12, experts\]"),
    (lambda x, m: te.moe_permute(x, m.float(), map_type="index"),
     "an 'index' routing_map holds expert ids"),
    (lambda x, m: te.moe_permute(x, m, num_out_tokens=-2), "num_out_tokens must be an int"),
    (lambda x, m: te.moe_unpermute(x, torch.zeros(3, dtype=torch.int64)),
     "row_id_map must be moe_permute's"),
    (lambda x, m: te.moe_unpermute(*te.moe_permute(x, m), merging_probs=torch.ones(2, 2)),
     r"merging_probs must be \[tokens, slots\] = \[12, 4\]"),
    (lambda x, m: te.moe_sort_chunks_by_index(x, torch.tensor([5, 5]), torch.tensor([0, 0])),
     "sorted_index must order its 2 chunks"),
])
def test_bad_arguments_are_clear_errors(call, message):
    x, mask, _, _ = _routing("cpu")
    with pytest.raises((ValueError, TypeError), match=message):
        call(x, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_permute_and_pad_puts_each_expert_at_an_aligned_row(device):
    """Each expert's rows start at a multiple of align_size and are followed by zero rows;
    unpermuting with pad_offsets gives what the unpadded routing gives, gradients too."""
    x, mask, _, probs = _routing(device)
    counts = mask.sum(0)
    align = 4
    x = x.requires_grad_()
    out, pp, row_id_map, pad_offsets, target = te.moe_permute_and_pad_with_probs(
        x, probs, mask, counts, align)
    ref, ref_probs, ref_map = te.moe_permute_with_probs(x, probs, mask)
    assert torch.equal(row_id_map, ref_map)
    want_target = [-(-int(c) // align) * align for c in counts.tolist()]
    assert target.tolist() == want_target and out.shape == (sum(want_target), H)
    start = pad_start = 0
    for e, (n, padded) in enumerate(zip(counts.tolist(), want_target, strict=True)):
        assert int(pad_offsets[e]) == pad_start - start
        assert torch.equal(out[pad_start:pad_start + n], ref[start:start + n])
        assert torch.equal(pp[pad_start:pad_start + n], ref_probs[start:start + n])
        assert not out[pad_start + n:pad_start + padded].any()
        assert not pp[pad_start + n:pad_start + padded].any()
        start, pad_start = start + n, pad_start + padded
    g = torch.randn(T, H, device=device)
    merged = te.moe_unpermute(out * 3, row_id_map, merging_probs=probs, pad_offsets=pad_offsets)
    (gx,) = torch.autograd.grad((merged * g).sum(), x)
    ref_merged = te.moe_unpermute(ref * 3, ref_map, merging_probs=probs)
    (ref_gx,) = torch.autograd.grad((ref_merged * g).sum(), x)
    assert torch.equal(merged, ref_merged) and torch.equal(gx, ref_gx)
    # Counts already aligned: no padding and no offsets.
    _, _, _, none, same = te.moe_permute_and_pad_with_probs(x, probs, mask, counts, 1)
    assert none is None and torch.equal(same, counts.long())
    with pytest.raises(ValueError, match="align_size must be a positive int"):
        te.moe_permute_and_pad_with_probs(x, probs, mask, counts, 0)
    with pytest.raises(ValueError, match="pad_offsets come with a 'mask' routing"):
        te.moe_unpermute(out, row_id_map, map_type="index", pad_offsets=pad_offsets)
