"""te.InferenceParams: incremental decoding through a stack of te.TransformerLayer with RoPE
gives the full forward's outputs (causal: a token's output depends only on the tokens up to
it), in both ways of driving the cache (pre_step, and the sequence_len_offset of Transformer
Engine 1.x), for ragged batches whose sequences start and finish at different steps; and its
argument errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import transformer_engine.pytorch as te

HIDDEN, FFN, HEADS, GROUPS, LAYERS, MAX_LEN = 64, 128, 4, 2, 2, 24
HEAD_DIM = HIDDEN // HEADS
# Decoding runs the same operations as the full forward on fewer rows, so the only difference
# is the order of the reductions (attention over a key prefix, GEMMs of other M): a few fp32
# ulps of values of order 1-3 (measured 2.4e-7). bf16 outputs are rounded to 8 bits: one ulp
# of a value near 4 is 2^-6, and roundings of different intermediates may land on either side.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


class Stack(torch.nn.Module):
    def __init__(self, fmt="bshd", dtype=torch.float32, device="cpu"):
        super().__init__()
        self.fmt = fmt
        self.layers = torch.nn.ModuleList(
            te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0,
                                attention_dropout=0.0, attn_input_format=fmt,
                                layer_number=i + 1, params_dtype=dtype, device=device)
            for i in range(LAYERS))
        self.freqs = te.RotaryPositionEmbedding(HEAD_DIM)(MAX_LEN).to(device)

    def forward(self, x, **kw):
        """x [b, s, hidden] batch first whatever the layers' format."""
        h = x if self.fmt == "bshd" else x.transpose(0, 1)
        for layer in self.layers:
            h = layer(h, rotary_pos_emb=self.freqs, **kw)
        return h if self.fmt == "bshd" else h.transpose(0, 1)


def _tokens(b, s, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, HIDDEN, generator=g).to(device=device, dtype=dtype)


def _decode_with_pre_step(model, x, prompt, **kw):
    """Prompt of `prompt` tokens, then one token per step; the outputs side by side."""
    b, s = x.shape[:2]
    params = te.InferenceParams(b, MAX_LEN, **kw)
    params.pre_step(OrderedDict((i, prompt) for i in range(b)))
    outs = [model(x[:, :prompt], inference_params=params)]
    for t in range(prompt, s):
        params.pre_step(OrderedDict((i, 1) for i in range(b)))
        outs.append(model(x[:, t:t + 1], inference_params=params))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_pre_step_decoding_equals_the_full_forward(fmt):
    model = Stack(fmt)
    x = _tokens(3, 12)
    torch.testing.assert_close(_decode_with_pre_step(model, x, 5), model(x),
                               **TOL[torch.float32])


def test_paged_cache_decoding_equals_the_full_forward():
    model = Stack()
    x = _tokens(2, 11)
    pages = dict(is_paged=True, page_size=4, total_num_pages=2 * MAX_LEN // 4)
    torch.testing.assert_close(_decode_with_pre_step(model, x, 6, **pages), model(x),
                               **TOL[torch.float32])
    params = te.InferenceParams(2, MAX_LEN, **pages)
    params.pre_step(OrderedDict([("s", 5)]))
    model(x[:1, :5], inference_params=params)
    k_pages, _ = params.cache[1]
    assert k_pages.shape == (2 * MAX_LEN // 4, 4, GROUPS, HEAD_DIM)
    assert params.page_table.shape == (2, MAX_LEN // 4)
    k, v = params.convert_paged_to_nonpaged(1)
    assert k.shape == v.shape == (1, MAX_LEN, GROUPS, HEAD_DIM)
    assert k[0, :5].abs().sum() > 0 and not k[0, 5:].any()


@pytest.mark.parametrize("fmt", ["bshd", "sbhd"])
def test_sequence_len_offset_decoding_equals_the_full_forward(fmt):
    """Transformer Engine 1.x: no pre_step; the caller advances sequence_len_offset."""
    model = Stack(fmt)
    x = _tokens(2, 10)
    params = te.InferenceParams(4, MAX_LEN)
    outs = []
    for start, end in [(0, 4), (4, 5), (5, 8), (8, 9), (9, 10)]:
        outs.append(model(x[:, start:end], inference_params=params))
        params.sequence_len_offset += end - start
    torch.testing.assert_close(torch.cat(outs, dim=1), model(x), **TOL[torch.float32])


def test_ragged_sequences_join_and_finish_between_steps():
    """Sequences of different prompt lengths, one finishing and a new one taking its cache
    row: each sequence's outputs are those of its own full forward."""
    model = Stack()
    seqs = {name: _tokens(1, 12, seed=i)[0] for i, name in enumerate("abc")}
    full = {name: model(t[None])[0] for name, t in seqs.items()}
    done = dict.fromkeys(seqs, 0)
    params = te.InferenceParams(2, MAX_LEN)
    # (sequence: new tokens) per step; "a" finishes after step 2 and "c" takes its row.
    steps = [{"a": 3, "b": 6}, {"a": 1, "b": 1}, {"b": 2, "c": 4}, {"b": 1, "c": 1}]
    for step in steps:
        params.pre_step(OrderedDict(step))
        width = max(step.values())
        x = torch.zeros(len(step), width, HIDDEN)
        for row, (name, n) in enumerate(step.items()):
            x[row, :n] = seqs[name][done[name]:done[name] + n]
        out = model(x, inference_params=params)
        for row, (name, n) in enumerate(step.items()):
            want = full[name][done[name]:done[name] + n]
            torch.testing.assert_close(out[row, :n], want, **TOL[torch.float32],
                                       msg=lambda m, name=name: f"{name}: {m}")
            done[name] += n
    assert params.sequences == OrderedDict(b=10, c=5)


def _run_packed(model, x, lens, **kw):
    """The thd stack's layers on packed tokens x [tokens, hidden] of sequences of ``lens``."""
    h = x
    for layer in model.layers:
        h = layer(h, rotary_pos_emb=model.freqs, **kw)
    return h


def test_packed_thd_decoding_equals_each_sequences_full_forward():
    """attn_input_format="thd": every step's input is the sequences' new tokens packed one
    after the other (ragged steps, a sequence finishing and another taking its row); each
    sequence's outputs are those of its own full (packed) forward."""
    model = Stack("thd")
    seqs = {name: _tokens(1, 12, seed=i)[0] for i, name in enumerate("abc")}

    def full(t):
        n = t.shape[0]
        cu = torch.tensor([0, n], dtype=torch.int32)
        return _run_packed(model, t, [n], cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                           max_seqlen_kv=n)

    want = {name: full(t) for name, t in seqs.items()}
    done = dict.fromkeys(seqs, 0)
    params = te.InferenceParams(2, MAX_LEN, qkv_format="thd", max_ctx_len=8)
    steps = [{"a": 3, "b": 6}, {"a": 1, "b": 1}, {"b": 2, "c": 4}, {"b": 1, "c": 1}]
    for step in steps:
        params.pre_step(OrderedDict(step))
        x = torch.cat([seqs[name][done[name]:done[name] + n] for name, n in step.items()])
        out = _run_packed(model, x, list(step.values()), inference_params=params)
        assert out.shape == x.shape
        start = 0
        for name, n in step.items():
            torch.testing.assert_close(out[start:start + n],
                                       want[name][done[name]:done[name] + n],
                                       **TOL[torch.float32],
                                       msg=lambda m, name=name: f"{name}: {m}")
            start += n
            done[name] += n
    with pytest.raises(ValueError, match=r"packed \(thd\) input must hold the 2 new tokens of "
                                         r"pre_step \(\[1, 1\]\), got 3"):
        params.pre_step(OrderedDict([("b", 1), ("c", 1)]))
        _run_packed(model, torch.randn(3, HIDDEN), [1, 1], inference_params=params)


def test_bf16_decoding_is_close_to_the_full_forward():
    model = Stack(dtype=torch.bfloat16)
    x = _tokens(2, 10, torch.bfloat16)
    torch.testing.assert_close(_decode_with_pre_step(model, x, 6).float(), model(x).float(),
                               **TOL[torch.bfloat16])


@pytest.mark.cuda
def test_decoding_on_the_gpu_equals_the_full_forward():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = Stack(dtype=torch.bfloat16, device="cuda")
    x = _tokens(4, 16, torch.bfloat16, device="cuda")
    torch.testing.assert_close(_decode_with_pre_step(model, x, 9).float(), model(x).float(),
                               **TOL[torch.bfloat16])


def test_cache_is_allocated_lazily_per_layer():
    model = Stack()
    params = te.InferenceParams(3, MAX_LEN)
    assert params.cache == {}
    params.pre_step(OrderedDict([(7, 4)]))
    model(_tokens(1, 4), inference_params=params)
    assert sorted(params.cache) == [1, 2]
    k, v = params.cache[1]
    assert k.shape == v.shape == (3, MAX_LEN, GROUPS, HEAD_DIM) and k.dtype == torch.float32
    assert params.get_seqlens_pre_step().tolist() == [0]
    given = te.InferenceParams(3, MAX_LEN, num_heads_kv=GROUPS, head_dim_k=HEAD_DIM,
                               dtype=torch.bfloat16)
    given.allocate_memory(5, device="cpu")
    assert given.cache[5][0].shape == (3, MAX_LEN, GROUPS, HEAD_DIM)
    assert given.cache[5][0].dtype == torch.bfloat16


def test_cross_attention_decoder_decodes():
    """A decoder layer: self-attention cached, cross attention recomputed from the memory."""
    layer = te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                layer_type="decoder", attn_input_format="bshd", layer_number=1,
                                device="cpu")
    x, memory = _tokens(2, 6), _tokens(2, 5, seed=1)
    params = te.InferenceParams(2, MAX_LEN)
    outs = []
    for t in range(6):
        params.pre_step(OrderedDict((i, 1) for i in range(2)))
        outs.append(layer(x[:, t:t + 1], encoder_output=memory, inference_params=params))
    torch.testing.assert_close(torch.cat(outs, dim=1), layer(x, encoder_output=memory),
                               **TOL[torch.float32])


@pytest.mark.parametrize("kw, error, words", [
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(max_sequence_length=2.5), ValueError, "max_sequence_length"),
    (dict(is_paged=True, page_size=3, total_num_pages=6), ValueError, "page_size"),
    (dict(is_paged=True, page_size=4, total_num_pages=8), ValueError, "total_num_pages"),
    (dict(qkv_format="hsbd"), ValueError, "qkv_format"),
    (dict(dtype=torch.int8), TypeError, "dtype"),
    (dict(custom_cache_manager=object()), NotImplementedError, "custom_cache_manager"),
])
def test_bad_constructor_arguments_are_refused(kw, error, words):
    args = dict(max_batch_size=2, max_sequence_length=8) | kw
    with pytest.raises(error, match=words):
        te.InferenceParams(**args)


def test_bad_steps_are_refused():
    params = te.InferenceParams(2, 8)
    with pytest.raises(ValueError, match="step_dict"):
        params.pre_step({})
    with pytest.raises(ValueError, match="max_batch_size"):
        params.pre_step(OrderedDict((i, 1) for i in range(3)))
    with pytest.raises(ValueError, match="max_sequence_length"):
        params.pre_step(OrderedDict([(0, 9)]))
    with pytest.raises(ValueError, match="positive int"):
        params.pre_step(OrderedDict([(0, 0)]))
    with pytest.raises(ValueError, match="allocate_memory: needs"):
        params.allocate_memory(1)
    model = Stack()
    params.pre_step(OrderedDict([(0, 3), (1, 3)]))
    with pytest.raises(ValueError, match="2 sequences of pre_step"):
        model(_tokens(1, 3), inference_params=params)
    offsets = te.InferenceParams(2, 8)
    offsets.sequence_len_offset = 6
    with pytest.raises(ValueError, match="sequence_len_offset"):
        model(_tokens(2, 3), inference_params=offsets)


def test_two_layers_with_one_layer_number_are_refused():
    layers = [te.TransformerLayer(HIDDEN, FFN, HEADS, attn_input_format="bshd", device="cpu")
              for _ in range(2)]  # layer_number left at its default
    params = te.InferenceParams(1, 8)
    params.pre_step(OrderedDict([(0, 2)]))
    h = layers[0](_tokens(1, 2), inference_params=params)
    with pytest.raises(ValueError, match="distinct layer_number"):
        layers[1](h, inference_params=params)
