"""NVIDIA Transformer Engine's module paths (``transformer_engine.pytorch.attention.rope``,
``.transformer``, ``.module.rmsnorm``, ...): programs import from them, so each must import and
give this package's own objects; and what NVIDIA's example programs do through them (RoPE
angles for a length held in a tensor, offsets passed with a bshd batch) must run."""

from __future__ import annotations

import importlib

import pytest
import torch

import transformer_engine.pytorch as te

PATHS = {
    "transformer_engine.pytorch.attention": ["DotProductAttention", "MultiheadAttention",
                                             "InferenceParams", "RotaryPositionEmbedding"],
    "transformer_engine.pytorch.attention.rope": ["RotaryPositionEmbedding",
                                                  "apply_rotary_pos_emb"],
    "transformer_engine.pytorch.attention.inference": ["InferenceParams"],
    "transformer_engine.pytorch.attention.multi_head_attention": ["MultiheadAttention"],
    "transformer_engine.pytorch.attention.dot_product_attention": ["DotProductAttention"],
    "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention":
        ["DotProductAttention"],
    "transformer_engine.pytorch.transformer": ["TransformerLayer"],
    "transformer_engine.pytorch.module.rmsnorm": ["RMSNorm"],
    "transformer_engine.pytorch.module.layernorm": ["LayerNorm"],
    "transformer_engine.pytorch.graph": ["make_graphed_callables"],
    "transformer_engine.pytorch.permutation": ["moe_permute", "moe_permute_with_probs",
                                               "moe_unpermute", "moe_sort_chunks_by_index",
                                               "moe_sort_chunks_by_index_with_probs"],
    "transformer_engine.pytorch.tensor.quantized_tensor": ["QuantizedTensor", "Quantizer"],
    "transformer_engine.pytorch.quantized_tensor": ["QuantizedTensor", "Quantizer"],
    "transformer_engine.pytorch.utils": ["get_device_compute_capability", "get_cudnn_version",
                                         "is_bf16_available"],
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_path_gives_our_objects(path):
    module = importlib.import_module(path)
    for name in PATHS[path]:
        assert getattr(module, name) is getattr(te, name), f"{path}.{name}"
        assert name in module.__all__


def _layer(fmt: str, mask: str) -> te.TransformerLayer:
    """A layer built with the keywords NVIDIA's example model passes."""
    torch.manual_seed(0)
    return te.TransformerLayer(
        hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, layernorm_epsilon=1e-5,
        hidden_dropout=0.0, attention_dropout=0.0, qkv_weight_interleaved=True, layer_number=1,
        layer_type="encoder", self_attn_mask_type=mask, activation="gelu",
        attn_input_format=fmt, seq_length=16, micro_batch_size=2, num_gqa_groups=4,
        fuse_qkv_params=True, params_dtype=torch.float32, window_size=(-1, -1),
        sequence_parallel=False, device="cpu")


def test_rope_angles_for_a_length_in_a_tensor():
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

    rope = RotaryPositionEmbedding(8)
    got = rope(max_seq_len=torch.tensor(12, dtype=torch.int32))
    assert torch.equal(got, rope(max_seq_len=12)) and got.shape == (12, 1, 1, 8)


def test_bshd_batch_with_offsets_runs_as_without():
    """NVIDIA's bshd example passes its batch's cu_seqlens and pad_between_seqs=False with
    no_mask: NVIDIA's attention and RoPE read offsets only for thd or a padding mask, so the
    output is the one without them."""
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

    layer = _layer("bshd", "no_mask")
    x = torch.randn(2, 8, 32)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)  # not the batch's lengths: ignored
    freqs = RotaryPositionEmbedding(8)(max_seq_len=cu[-1])
    got = layer(hidden_states=x, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                pad_between_seqs=False, max_seqlen_q=8, max_seqlen_kv=8)
    assert torch.equal(got, layer(x, rotary_pos_emb=freqs))


def test_apply_rotary_pos_emb_ignores_offsets_outside_thd():
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

    t = torch.randn(6, 2, 3, 8)
    freqs = te.RotaryPositionEmbedding(8)(max_seq_len=6)
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    for fused in (False, True):
        want = apply_rotary_pos_emb(t, freqs, "sbhd", fused=fused)
        assert torch.equal(apply_rotary_pos_emb(t, freqs, "sbhd", fused=fused, cu_seqlens=cu),
                           want)


def test_thd_packing_with_padding_between_sequences_as_nvidia_example():
    """The thd model of NVIDIA's example: sequences of 5 and 7 tokens each padded to 8, RoPE
    angles for the padded length, pad_between_seqs=True; each sequence's rows equal the same
    layer run on that sequence alone (bshd, batch 1)."""
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

    thd, bshd = _layer("thd", "padding"), _layer("bshd", "no_mask")
    bshd.load_state_dict(thd.state_dict())
    x = torch.randn(16, 32)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_padded = torch.tensor([0, 8, 16], dtype=torch.int32)
    freqs = RotaryPositionEmbedding(8)(max_seq_len=cu_padded[-1])
    out = thd(hidden_states=x, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu,
              cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
              pad_between_seqs=True, max_seqlen_q=7, max_seqlen_kv=7)
    for start, length in ((0, 5), (8, 7)):
        alone = bshd(x[start:start + length].unsqueeze(0), rotary_pos_emb=freqs)[0]
        torch.testing.assert_close(out[start:start + length], alone, rtol=1e-5, atol=1e-5)


def test_initializers():
    from transformer_engine.pytorch import utils

    torch.manual_seed(0)
    w = torch.empty(400, 400)
    utils.init_method_normal(0.5)(w)
    assert abs(w.std().item() - 0.5) < 0.01 and abs(w.mean().item()) < 0.01
    utils.scaled_init_method_normal(0.5, 8)(w)
    assert abs(w.std().item() - 0.125) < 0.003
    utils.get_default_init_method()(w)
    assert abs(w.std().item() - 0.023) < 0.001
    utils.init_method_constant(3.0)(w)
    assert torch.equal(w, torch.full_like(w, 3.0))
    assert utils.divide(12, 4) == 3
    with pytest.raises(ValueError, match="divide: 12 is not divisible by 5"):
        utils.divide(12, 5)
    with pytest.raises(ValueError, match="num_layers must be positive"):
        utils.scaled_init_method_normal(0.5, 0)
