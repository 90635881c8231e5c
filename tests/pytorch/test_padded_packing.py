"""Packed (thd) sequences with padding between them (cu_seqlens_q_padded /
cu_seqlens_kv_padded / pad_between_seqs, padded_packing.py): the permutation on its own, then
DotProductAttention, te.MultiheadAttention with RoPE and te.TransformerLayer against the same
sequences packed back to back. The attention of the padded layout runs the core on exactly the
back-to-back tensors, so its token rows and their gradients are the packed run's bits; padding
rows give 0 (a NaN there reaches no token), and their gradients are 0."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import padded_packing

LENGTHS = [5, 1, 7]           # each sequence's tokens
PADDED = [8, 4, 8]            # its rows in the padded tensor (a multiple of 4, as for cp=2)
H, D = 2, 8


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def _token_rows(lengths=LENGTHS, padded=PADDED) -> torch.Tensor:
    """The padded tensor's rows that hold tokens, in packing order."""
    starts = _cu(padded)[:-1].tolist()
    return torch.tensor([s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)])


def _spread(packed: torch.Tensor, rows: int, fill: float = 0.0) -> torch.Tensor:
    """The back-to-back tensor laid out with padding (padding rows hold ``fill``)."""
    out = packed.new_full((rows, *packed.shape[1:]), fill)
    out[_token_rows().to(packed.device)] = packed
    return out


@pytest.mark.parametrize("extra", [0, 3], ids=["exact", "rows_past_the_end"])
def test_packing_is_the_permutation_to_back_to_back(extra):
    rows = sum(PADDED) + extra
    p = padded_packing.packing(_cu(LENGTHS), _cu(PADDED), rows)
    tokens = _token_rows()
    assert torch.equal(p.to_packed[tokens], torch.arange(sum(LENGTHS)))
    assert torch.equal(p.from_packed[p.to_packed], torch.arange(rows))
    assert torch.equal(p.token.nonzero().flatten(), tokens)
    # the padding rows follow the tokens in their own order
    pad_rows = (~p.token).nonzero().flatten()
    assert torch.equal(p.to_packed[pad_rows], torch.arange(sum(LENGTHS), rows))
    assert int(p.packed_token.sum()) == sum(LENGTHS)


def _attention(mask="padding_causal", backend=None):
    return te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type=mask,
                                  attention_backend=backend)


def _qkv(total, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, H, D, generator=g).to(device=device, dtype=dtype)
            for _ in range(3)]


def check_attention(device, dtype, mask, backend):
    attn = _attention(mask, backend)
    rows = sum(PADDED)
    packed = [t.requires_grad_() for t in _qkv(sum(LENGTHS), device, dtype)]
    # NaN in the padding rows: nothing of them may reach a token's row or gradient
    spread = [_spread(t.detach(), rows, float("nan")).requires_grad_() for t in packed]
    cu, cu_pad = _cu(LENGTHS, device), _cu(PADDED, device)
    want = attn(*packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(PADDED),
                max_seqlen_kv=max(PADDED))
    got = attn(*spread, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
               cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max(PADDED),
               max_seqlen_kv=max(PADDED))
    assert got.shape == (rows, H * D)
    tokens = _token_rows().to(device)
    assert torch.equal(got[tokens], want)
    assert torch.equal(got, _spread(want, rows))  # padding rows are 0
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    want.backward(grad)
    got.backward(_spread(grad, rows, 1.0))  # a padding row's gradient goes nowhere
    for name, t, s in zip("qkv", packed, spread, strict=True):
        assert torch.equal(s.grad[tokens], t.grad), name
        assert torch.equal(s.grad, _spread(t.grad, rows)), name


@pytest.mark.parametrize("backend", ["cpu", "unfused"])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_attention_equals_the_back_to_back_run_cpu(mask, backend):
    check_attention("cpu", torch.float32, mask, backend)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", [None, "unfused", "cuda_math"])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_cuda_attention_equals_the_back_to_back_run(mask, backend):
    check_attention("cuda", torch.bfloat16, mask, backend)


def test_padded_offsets_equal_to_the_lengths_change_nothing():
    attn = _attention()
    q, k, v = _qkv(sum(LENGTHS), "cpu", torch.float32)
    cu = _cu(LENGTHS)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    want = attn(q, k, v, **kw)
    assert torch.equal(attn(q, k, v, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, **kw), want)
    # pad_between_seqs=False: NVIDIA's "no padding", the padded offsets go unused
    assert torch.equal(attn(q, k, v, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                            pad_between_seqs=False, **kw), want)


def test_only_the_keys_padded():
    """Cross attention whose keys alone come with padding between the sequences."""
    attn = _attention("padding")
    q, _, _ = _qkv(sum(LENGTHS), "cpu", torch.float32)
    _, k, v = _qkv(sum(LENGTHS), "cpu", torch.float32, seed=2)
    cu = _cu(LENGTHS)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8, max_seqlen_kv=8)
    want = attn(q, k, v, **kw)
    rows = sum(PADDED)
    got = attn(q, _spread(k, rows), _spread(v, rows), cu_seqlens_kv_padded=_cu(PADDED), **kw)
    assert torch.equal(got, want)


def _padded_call(attn, q, k, v, **kw):
    args = dict(cu_seqlens_q=_cu(LENGTHS), cu_seqlens_kv=_cu(LENGTHS),
                cu_seqlens_q_padded=_cu(PADDED), cu_seqlens_kv_padded=_cu(PADDED),
                max_seqlen_q=8, max_seqlen_kv=8)
    args.update(kw)
    return attn(q, k, v, **args)


def test_errors_name_the_argument():
    rows = sum(PADDED)
    q, k, v = _qkv(rows, "cpu", torch.float32)
    attn = _attention()
    with pytest.raises(ValueError, match="DotProductAttention: cu_seqlens_q_padded must start "
                                         "at 0, give each sequence at least its length"):
        _padded_call(attn, q, k, v, cu_seqlens_q_padded=_cu([4, 4, 8]))
    with pytest.raises(ValueError, match="end within the tensor's 20 rows"):
        _padded_call(attn, q, k, v, cu_seqlens_q_padded=_cu([8, 4, 9]))
    with pytest.raises(ValueError, match="cu_seqlens_kv_padded must have the shape of "
                                         "cu_seqlens_kv"):
        _padded_call(attn, q, k, v, cu_seqlens_kv_padded=_cu([8, 12]))
    with pytest.raises(ValueError, match="pad_between_seqs=True needs cu_seqlens_q_padded"):
        _padded_call(attn, q, k, v, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                     pad_between_seqs=True)
    with pytest.raises(ValueError, match="come with cu_seqlens_q and cu_seqlens_kv"):
        _padded_call(attn, q, k, v, cu_seqlens_q=None)
    bshd = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding")
    with pytest.raises(ValueError, match="are for packed sequences .qkv_format 'thd'., got "
                                         "qkv_format 'bshd'"):
        bshd(*(t.view(1, rows, H, D) for t in (q, k, v)), cu_seqlens_q_padded=_cu(PADDED))
    fp8_mha = recipe.DelayedScaling(fp8_dpa=True, fp8_mha=True)
    with te.fp8_autocast(fp8_recipe=fp8_mha):
        with pytest.raises(NotImplementedError, match="with fp8_mha=True is not implemented"):
            _padded_call(attn, q, k, v)


def _layer(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "mha":
        return te.MultiheadAttention(H * D, H, attention_dropout=0.0, qkv_format="thd",
                                     attn_mask_type="padding_causal", input_layernorm=True,
                                     params_dtype=torch.float32, device="cpu")
    return te.TransformerLayer(H * D, 4 * H * D, H, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="padding_causal", attn_input_format="thd",
                               params_dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kind", ["mha", "layer"])
def test_layers_with_rope_match_the_back_to_back_run(kind):
    """RoPE counts each token's position from where its sequence starts in the padded tensor,
    so a token has the angle it has in the back-to-back run. The row-wise parts around
    attention run over more rows there, so within fp32 rounding."""
    layer = _layer(kind)
    rope = te.RotaryPositionEmbedding(D)(max(PADDED))
    x = torch.randn(sum(LENGTHS), H * D, generator=torch.Generator().manual_seed(3))
    x.requires_grad_()
    cu = _cu(LENGTHS)
    kw = dict(rotary_pos_emb=rope, max_seqlen_q=8, max_seqlen_kv=8)
    want = layer(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, **kw)
    xs = _spread(x.detach(), sum(PADDED)).requires_grad_()
    got = layer(xs, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=_cu(PADDED),
                cu_seqlens_kv_padded=_cu(PADDED), **kw)
    tokens = _token_rows()
    torch.testing.assert_close(got[tokens], want, atol=1e-6, rtol=1e-5)
    want.sum().backward()
    got[tokens].sum().backward()
    torch.testing.assert_close(xs.grad[tokens], x.grad, atol=1e-6, rtol=1e-5)


def test_mha_refuses_padding_with_a_kv_cache():
    layer = _layer("mha")
    cache = te.InferenceParams(3, 16, qkv_format="thd")
    with pytest.raises(NotImplementedError, match="te.MultiheadAttention: padding between "
                                                  "packed sequences .* with inference_params"):
        layer(torch.randn(sum(PADDED), H * D), inference_params=cache,
              cu_seqlens_q_padded=_cu(PADDED), cu_seqlens_kv_padded=_cu(PADDED))
