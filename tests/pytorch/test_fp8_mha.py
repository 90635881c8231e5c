"""FP8 between the GEMMs and attention (fp8_mha): te.Linear / te.LayerNormLinear writing their
output in FP8 (``fp8_output=True``) and taking an FP8 input, DotProductAttention taking E4M3
Float8Tensors and giving one back, and te.MultiheadAttention wiring them together.

The exact checks: a GEMM's FP8 output equals the cast of its fp32 result with the module's
output scale (and records that result's amax); attention on Float8Tensors made by the same
current-scaling cast as attention's own gives the same bits; fp8_mha's FP8 o dequantizes to
fp8_dpa's widened o. The rest is held to the FP8 attention tolerances against bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from te_torch_tests._train_steps import warm_up_for_capture
from te_torch_tests.test_attention import _assert_fp8_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import first_step, ops

bf16 = torch.bfloat16
# cuDNN's FP8 attention on sm_90 takes head dim 128; the CPU reference is slow at that size.
SIZES = {"cpu": dict(s=32, b=2, hidden=64, heads=4, groups=2),
         "cuda": dict(s=256, b=2, hidden=1024, heads=8, groups=4)}
RECIPES = {
    "delayed": lambda **kw: recipe.DelayedScaling(fp8_dpa=True, **kw),
    "current": lambda **kw: recipe.Float8CurrentScaling(fp8_dpa=True, **kw),
}


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit on the CPU. On CUDA, cuDNN's attention backward sums dq/dk/dv with atomics
    (the order varies between runs) and writes them in FP8, where a last-bit difference can
    round to the next FP8 value: held to the FP8 attention tolerance there."""
    if got.device.type == "cpu":
        assert torch.equal(got, want), what
    else:
        _assert_fp8_close(got, want, what, against_bf16=False)


def _fp8_of_result(result: torch.Tensor, scale: float) -> torch.Tensor:
    """The E4M3 bytes of ``result * scale`` (round to nearest even, saturating), via torch."""
    scaled = (result.float() * scale).clamp(-448.0, 448.0)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


# ------------------------------------------------------------------ te.Linear in and out


@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_delayed_fp8_output_is_the_cast_of_the_gemm_result(device, module):
    """Delayed scaling casts the GEMM's fp32 result with the output scale in the epilogue: the
    bytes are that cast (up to the GEMM's summation order: a few values one FP8 step apart),
    the output history records the result's amax, and the exit update turns it into the next
    scale."""
    layer = getattr(te, module)(64, 48, params_dtype=bf16, device=device)
    x = torch.randn(32, 64, dtype=bf16, device=device)
    first_step.mark_empty(layer.amax_history_fwd, ())  # no first-step scales: the 1s apply
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        want = layer(x)  # the same FP8 operands as below (scales of 1)
    layer.scale_out.fill_(4.0)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        layer.scale_fwd.fill_(1.0)
        got = layer(x, fp8_output=True)
        amax = layer.amax_history_out[0, 0].item()
    assert isinstance(got, te.Float8Tensor) and got.dtype == bf16 and got.shape == (32, 48)
    assert got._fp8_dtype == "float8_e4m3" and got._scale_inv.item() == 0.25
    expected = _fp8_of_result(want, 4.0)
    differ = (got._data != expected).float().mean().item()
    assert differ < 0.05, f"{differ:.3f} of the bytes differ from the cast of the result"
    torch.testing.assert_close(got.dequantize().float(), want.float(), atol=0.07, rtol=0.07)
    torch.testing.assert_close(torch.tensor(amax), want.float().abs().max().cpu(), rtol=1e-2,
                               atol=0.0)
    # The exit update made the output scale from that amax (margin 0: E4M3 max / amax).
    torch.testing.assert_close(layer.scale_out[0].cpu(), torch.tensor(448.0 / amax),
                               rtol=1e-6, atol=0.0)


def test_current_fp8_output_is_the_current_cast_of_the_output(device):
    """Current scaling: the high-precision output, quantized by its own amax."""
    layer = te.Linear(64, 48, params_dtype=bf16, device=device)
    x = torch.randn(32, 64, dtype=bf16, device=device)
    r = recipe.Float8CurrentScaling()
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        want = layer(x)
        got = layer(x, fp8_output=True)
    data, _, _, scale_inv, _ = ops.quantize_current(want, "float8_e4m3", True, False, False, 0.0)
    assert torch.equal(got._data, data) and torch.equal(got._scale_inv, scale_inv)


def test_fp8_output_without_fp8_or_under_block_scaling_is_high_precision(device):
    layer = te.Linear(128, 128, params_dtype=bf16, device=device)
    x = torch.randn(128, 128, dtype=bf16, device=device)
    assert not isinstance(layer(x, fp8_output=True), te.Float8Tensor)
    with te.fp8_autocast(fp8_recipe=recipe.Float8BlockScaling()):
        assert not isinstance(layer(x, fp8_output=True), te.Float8Tensor)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("kind", ["delayed", "current"])
def test_linear_takes_an_fp8_input_and_gradients_cross_it(device, kind):
    """An FP8 output feeding the next te.Linear: the second GEMM reads the bytes. A training
    step through both, with FP8 between them or not, stays as close to high precision as FP8
    GEMMs do (E5M2 gradients: a few percent of the norm), and the gradients reach the first
    layer."""
    first = te.Linear(64, 64, params_dtype=bf16, device=device)
    second = te.Linear(64, 32, params_dtype=bf16, device=device)
    x = torch.randn(32, 64, dtype=bf16, device=device, requires_grad=True)
    results = []
    for mode in ("fp8 between", "fp8", "high precision"):
        for t in (x, first.weight, second.weight):
            t.grad = None
        with te.fp8_autocast(enabled=mode != "high precision", fp8_recipe=RECIPES[kind]()):
            h = first(x, fp8_output=mode == "fp8 between")
            assert isinstance(h, te.Float8Tensor) == (mode == "fp8 between")
            y = second(h)
        assert not isinstance(y, te.Float8Tensor)
        y.float().pow(2).sum().backward()
        results.append([y.detach(), x.grad, first.weight.grad, second.weight.grad])
    between, plain, want = results
    for name, got_between, got_plain, w in zip(("output", "dx", "dw1", "dw2"), between, plain,
                                               want, strict=True):
        assert got_between is not None, name
        error, baseline = _relative_error(got_between, w), _relative_error(got_plain, w)
        assert error < max(0.1, 1.5 * baseline), f"{name}: {error:.3f} (without: {baseline:.3f})"


def test_an_fp8_input_outside_fp8_is_dequantized(device):
    layer = te.Linear(64, 32, params_dtype=bf16, device=device)
    x = te.Float8Tensor.quantize(torch.randn(16, 64, dtype=bf16, device=device))
    torch.testing.assert_close(layer(x), layer(x.dequantize()))


# ------------------------------------------------------------------ attention in and out


def _qkv(device, b=1, s=33, h=2, d=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=g).to(device=device, dtype=bf16)
            for _ in range(3)]


@pytest.mark.parametrize("fp8_mha", [False, True])
def test_attention_on_float8_tensors_gives_the_same_bits(device, fp8_mha):
    """Current scaling quantizes q, k, v by their own amax; Float8Tensors made by that same
    cast are used as they are, so the FP8 attention sees the same bytes; under fp8_mha o
    comes back as a Float8Tensor whose values are fp8_dpa's widened o."""
    d = 128 if device.type == "cuda" else 16
    q, k, v = _qkv(device, b=2 if device.type == "cuda" else 1,
                   s=128 if device.type == "cuda" else 33, d=d)
    attn = te.DotProductAttention(2, d, qkv_format="bshd", device=device)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=RECIPES["current"]()):
        want = attn(q, k, v)
    q8, k8, v8 = (te.Float8Tensor.quantize(t) for t in (q, k, v))
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=RECIPES["current"](fp8_mha=fp8_mha)):
        got = attn(q8, k8, v8)
    assert isinstance(got, te.Float8Tensor) == fp8_mha
    assert got.shape == want.shape
    got = got.dequantize() if fp8_mha else got
    assert torch.equal(got, want)


def test_attention_fp8_output_backward_matches_fp8_dpa(device):
    """The gradients through a Float8Tensor o equal those through the widened o (the same
    backward on the same saved bytes)."""
    d = 128 if device.type == "cuda" else 16
    s = 128 if device.type == "cuda" else 33
    q, k, v = (t.requires_grad_() for t in _qkv(device, s=s, d=d))
    attn = te.DotProductAttention(2, d, qkv_format="bshd", device=device)
    grads = []
    for fp8_mha in (False, True):
        for t in (q, k, v):
            t.grad = None
        with te.fp8_autocast(fp8_recipe=RECIPES["current"](fp8_mha=fp8_mha)):
            o = attn(q, k, v)
        o.backward(torch.ones(o.shape, dtype=bf16, device=device))
        grads.append([t.grad.clone() for t in (q, k, v)])
    for name, got, want in zip("qkv", *grads, strict=True):
        _assert_same(got, want, f"d{name}")


def test_attention_without_fp8_dequantizes_float8_inputs(device):
    q, k, v = _qkv(device)
    attn = te.DotProductAttention(2, 16, qkv_format="bshd", device=device,
                                  attention_backend="cpu" if device.type == "cpu" else None)
    q8, k8, v8 = (te.Float8Tensor.quantize(t) for t in (q, k, v))
    want = attn(q8.dequantize(), k8.dequantize(), v8.dequantize())
    torch.testing.assert_close(attn(q8, k8, v8), want)


# ------------------------------------------------------------------ te.MultiheadAttention


def _mha(device, **kw):
    z = SIZES[device.type]
    kw.setdefault("num_gqa_groups", z["groups"])
    # One QKV weight laid out [q | k | v], which the reference below splits.
    kw.setdefault("fuse_qkv_params", True)
    kw.setdefault("qkv_weight_interleaved", False)
    return te.MultiheadAttention(z["hidden"], z["heads"], attention_dropout=0.0,
                                 params_dtype=bf16, device=device, **kw)


def _hidden(device, seed=0, requires_grad=True):
    z = SIZES[device.type]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(z["s"], z["b"], z["hidden"], generator=g).to(device=device, dtype=bf16)
    return x.requires_grad_(requires_grad)


def _reference_mha(mha: te.MultiheadAttention, x: torch.Tensor, memory=None) -> torch.Tensor:
    """The block from torch ops in fp32 (sbhd, causal)."""
    h, g, d = mha.num_attention_heads, mha.num_gqa_groups, mha.head_dim
    x = x.float()
    self_attention = mha.attention_type == "self"
    if mha.input_layernorm:
        first = mha.layernorm_qkv if self_attention else mha.layernorm_query
        x_in = F.layer_norm(x, (x.shape[-1],), first.layer_norm_weight.float(),
                            first.layer_norm_bias.float(), first.cfg.eps)
    else:
        first, x_in = (mha.qkv if self_attention else mha.query_layer), x
    projected = F.linear(x_in, first.weight.float(), first.bias.float())
    if mha.attention_type == "self":
        q, k, v = projected.split([h * d, g * d, g * d], dim=-1)
    else:
        q = projected
        k, v = F.linear(memory.float(), mha.key_value.weight.float(),
                        mha.key_value.bias.float()).split([g * d, g * d], dim=-1)
    s, b = x.shape[:2]
    q, k, v = (t.reshape(t.shape[0], b, -1, d).permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = o.permute(2, 0, 1, 3).reshape(s, b, h * d)
    return F.linear(o, mha.proj.weight.float(), mha.proj.bias.float())


@pytest.mark.parametrize("input_layernorm", [False, True])
@pytest.mark.parametrize("attention_type", ["self", "cross"])
def test_mha_in_high_precision_is_the_block(device, input_layernorm, attention_type):
    mha = _mha(device, input_layernorm=input_layernorm, attention_type=attention_type,
               attn_mask_type="causal")
    x = _hidden(device)
    memory = _hidden(device, seed=1) if attention_type == "cross" else None
    got = mha(x, encoder_output=memory)
    want = _reference_mha(mha, x, memory)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def _grad_of(y: torch.Tensor) -> torch.Tensor:
    """A fixed output gradient of order 1 (a mean over the output would make gradients too
    small for E5M2 at the scale of 1 that delayed scaling starts from: they would flush to 0)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(y.shape, generator=g).to(y.device)


def _train(mha, x, fp8_recipe, steps=3):
    """A few steps (the delayed scales settle); the last step's output and gradients."""
    for _ in range(steps):
        for p in list(mha.parameters()) + [x]:
            p.grad = None
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            y = mha(x)
        y.float().mul(_grad_of(y)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in mha.parameters()]


@pytest.mark.parametrize("kind", ["delayed", "current"])
@pytest.mark.parametrize("input_layernorm", [False, True])
def test_mha_fp8_mha_trains_like_bf16(device, kind, input_layernorm):
    """fp8_mha and fp8_dpa alone both stay within FP8 attention's tolerances of bf16 for the
    output and the input gradient, and the parameter gradients (sums over every token of
    products of E5M2 gradients) within 20% of bf16's norm."""
    mha = _mha(device, input_layernorm=input_layernorm)
    x = _hidden(device)
    want = _train(mha, x, None, steps=1)
    for fp8_mha in (False, True):
        got = _train(mha, x, RECIPES[kind](fp8_mha=fp8_mha))
        names = ["output", "dx"] + [n for n, _ in mha.named_parameters()]
        for name, g, w in zip(names, got, want, strict=True):
            assert g is not None and torch.isfinite(g).all(), name
            if name in ("output", "dx"):
                _assert_fp8_close(g, w, f"fp8_mha={fp8_mha} {name}")
            else:
                error = _relative_error(g, w)
                assert error < 0.2, f"fp8_mha={fp8_mha} {name}: {error:.3f} of the norm"


def test_mha_fp8_mha_hands_fp8_between_its_steps(device, monkeypatch):
    """Under fp8_mha the QKV projection writes FP8, attention gets Float8Tensors and the
    output projection gets one: nothing between them is cast to or from FP8."""
    mha = _mha(device)
    seen = {}

    def spy(name, module):
        forward = module.forward

        def wrapped(*args, **kwargs):
            out = forward(*args, **kwargs)
            seen[name] = (args, kwargs, out)
            return out

        monkeypatch.setattr(module, "forward", wrapped)

    spy("qkv", mha.qkv)
    spy("attention", mha.core_attention)
    spy("proj", mha.proj)
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed"](fp8_mha=True)):
        mha(_hidden(device))
    assert seen["qkv"][1]["fp8_output"] is True
    assert isinstance(seen["qkv"][2], te.Float8Tensor)
    assert all(isinstance(t, te.Float8Tensor) for t in seen["attention"][0][:3])
    assert isinstance(seen["attention"][2], te.Float8Tensor)
    assert isinstance(seen["proj"][0][0], te.Float8Tensor)
    # Attention recorded no amax of its own for q, k, v: they came quantized.
    assert mha.core_attention.amax_history_fwd.abs().sum() == 0
    assert mha.qkv.amax_history_out[0, 0] == 0 and mha.qkv.scale_out[0] != 1.0  # updated


def test_mha_state_dict_round_trip_keeps_the_output_scales(device):
    mha = _mha(device)
    x = _hidden(device)
    _train(mha, x, RECIPES["delayed"](fp8_mha=True), steps=2)
    fresh = _mha(device)
    fresh.load_state_dict(mha.state_dict())
    assert torch.equal(fresh.qkv.scale_out, mha.qkv.scale_out)
    assert torch.equal(fresh.qkv.amax_history_out, mha.qkv.amax_history_out)
    # A checkpoint from before the output scales existed loads with fresh ones.
    old = mha.qkv.get_extra_state()
    for name in ("amax_history_out", "scale_out", "scale_inv_out"):
        del old[name]
    fresh.qkv.set_extra_state(old)
    assert torch.equal(fresh.qkv.scale_out, torch.ones_like(fresh.qkv.scale_out))
    assert fresh.qkv.amax_history_out.shape == mha.qkv.amax_history_out.shape


def test_mha_checkpoint_recomputes_with_the_same_scales(device):
    """te.checkpoint over the block under fp8_mha: the recompute casts the QKV output with
    the forward's scale, so the gradients equal those without recompute."""
    r = RECIPES["delayed"](fp8_mha=True)
    mha = _mha(device)
    x = _hidden(device)
    _train(mha, x, r, steps=2)  # scales away from 1
    state = {k: v.clone() for k, v in mha.state_dict().items() if torch.is_tensor(v)}
    extra = {n: m.get_extra_state() for n, m in mha.named_modules() if isinstance(m, te.Linear)}
    grads = []
    for recompute in (False, True):
        mha.load_state_dict(state, strict=False)
        for n, m in mha.named_modules():
            if n in extra:
                m.set_extra_state(extra[n])
        for p in list(mha.parameters()) + [x]:
            p.grad = None
        with te.fp8_autocast(fp8_recipe=r):
            y = te.checkpoint(mha, x) if recompute else mha(x)
        y.float().mul(_grad_of(y)).sum().backward()
        grads.append([x.grad] + [p.grad for p in mha.parameters()])
    names = ["dx"] + [n for n, _ in mha.named_parameters()]
    for name, got, want in zip(names, *grads, strict=True):
        _assert_same(got, want, name)


def test_mha_errors(device):
    with pytest.raises(ValueError, match="hidden_size=64 as its last dimension"):
        te.MultiheadAttention(64, 4, device=device)(torch.randn(4, 2, 32, device=device))
    with pytest.raises(ValueError, match="cross attention needs encoder_output"):
        te.MultiheadAttention(64, 4, attention_type="cross", device=device)(
            torch.randn(4, 2, 64, device=device))
    with pytest.raises(ValueError, match="return_layernorm_output needs input_layernorm"):
        te.MultiheadAttention(64, 4, return_layernorm_output=True, device=device)
    with pytest.raises(ValueError, match="attention_type must be 'self' or 'cross'"):
        te.MultiheadAttention(64, 4, attention_type="both", device=device)
    with pytest.raises(ValueError, match="must be a multiple of num_attention_heads"):
        te.MultiheadAttention(66, 4, device=device)


def test_mha_fp8_mha_compiles_without_graph_breaks(device):
    """torch.compile(fullgraph=True) of the block's forward under fp8_mha (the backward runs
    compiled by AOTAutograd): the FP8 hand-offs are custom ops and Float8Tensors, which
    trace; two training steps match eager bit for bit."""
    import copy

    eager = _mha(device)
    compiled_mha = copy.deepcopy(eager)
    x = _hidden(device)
    r = RECIPES["delayed"](fp8_mha=True)

    def forward(module, x):
        with te.fp8_autocast(fp8_recipe=r):
            return module(x)

    compiled = torch.compile(forward, fullgraph=True)
    for _ in range(2):
        results = []
        for module, fn in ((eager, forward), (compiled_mha, compiled)):
            for p in list(module.parameters()) + [x]:
                p.grad = None
            y = fn(module, x)
            y.float().mul(_grad_of(y)).sum().backward()
            results.append([y.detach(), x.grad.clone()] + [p.grad for p in module.parameters()])
        names = ["output", "dx"] + [n for n, _ in eager.named_parameters()]
        for name, got, want in zip(names, results[1], results[0], strict=True):
            if device.type == "cpu":
                assert torch.equal(got, want), name
            else:
                # On CUDA, Inductor's kernels compute the fp32 scale arithmetic around the
                # custom ops to within an ulp, not bit for bit (its division is not IEEE), and
                # an ulp moves an E5M2 rounding now and then; atomics in cuDNN's backward too.
                error = _relative_error(got, want)
                assert error < 0.05, f"{name}: {error:.4f} of the norm"


@pytest.mark.cuda
def test_mha_fp8_mha_step_replays_in_a_cuda_graph():
    """A training step of the block under fp8_mha (exit update included), captured once and
    replayed on new data, gives what eager steps give: no host sync anywhere on the FP8 path."""
    import copy

    from transformer_engine.common import core

    if not torch.cuda.is_available() or not core().built_with_cuda():
        pytest.skip("needs CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    r = RECIPES["delayed"](fp8_mha=True)
    mha = _mha(device)
    x = _hidden(device)
    g = torch.randn(x.shape, dtype=bf16, device=device)

    def step(module, inp):
        with te.fp8_autocast(fp8_recipe=r):
            y = module(inp)
        y.backward(g)
        return y

    warm_up_for_capture(step, mha, x)
    twin = copy.deepcopy(mha)
    for p in (*mha.parameters(), *twin.parameters(), x):
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step(mha, x)
    x_grad = x.grad
    for i in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x) * (i + 1))
            g.copy_(torch.randn_like(g))
        graph.replay()
        x_twin = x.detach().clone().requires_grad_()
        for p in twin.parameters():
            p.grad = None
        y_eager = step(twin, x_twin)
        torch.cuda.synchronize()
        _assert_same(y_static, y_eager, "output")
        _assert_same(x_grad, x_twin.grad, "dx")
        # The forward's delayed-scaling state moved the same way (amaxes are exact maxima;
        # the backward's follow gradients that cuDNN sums in a varying order).
        for (name, a), b in zip(mha.named_buffers(), twin.buffers(), strict=True):
            if not name.endswith("_bwd"):
                assert torch.equal(a, b), f"{name} after replay {i}"
