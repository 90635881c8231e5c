"""te.GroupedLinear: each row group through its own te.Linear, bit for bit, under every recipe
(per-tensor FP8 with the groups' GEMMs grouped into one core call each); NVIDIA's parameter
names and state_dict keys; its errors."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPES = {"bf16": None, "delayed": recipe.DelayedScaling(), "current":
           recipe.Float8CurrentScaling(), "block": recipe.Float8BlockScaling()}


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Bits, or (high precision: the core's GEMM against torch's F.linear, fp32 sums in
    another order) within 1e-5 of the largest magnitude."""
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=0, atol=1e-5 * max(float(b.abs().max()), 1e-30))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_groups_equal_separate_linears(name):
    """FP8: the bits of separate te.Linear layers (the same quantizations and core GEMMs).
    High precision: the groups' GEMMs are the core's, te.Linear's are torch's F.linear."""
    r = RECIPES[name]
    exact = r is not None
    torch.manual_seed(0)
    grouped = te.GroupedLinear(3, 64, 32, device="cpu")
    singles = []
    for i in range(3):
        lin = te.Linear(64, 32, device="cpu")
        lin.load_state_dict({"weight": getattr(grouped, f"weight{i}").detach(),
                             "bias": getattr(grouped, f"bias{i}").detach()}, strict=False)
        singles.append(lin)
    splits = [40, 0, 24]  # an empty group too
    x = torch.randn(64, 64)
    xg, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        y = grouped(xg, splits)
        ys = torch.cat([m(p) for m, p in zip(singles, torch.split(xs, splits), strict=True)])
    assert _same(y, ys, exact)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    (ys * g).sum().backward()
    assert _same(xg.grad, xs.grad, exact)
    for i, m in enumerate(singles):
        assert _same(getattr(grouped, f"weight{i}").grad, m.weight.grad, exact)
        assert torch.equal(getattr(grouped, f"bias{i}").grad, m.bias.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_high_precision_groups_make_three_grouped_core_calls(dtype, monkeypatch, device):
    """Outside FP8 the groups' forward, dgrad and wgrad are one grouped core call each, equal
    to the core's GEMM of each group alone (bits: the grouped call runs each group as one
    GEMM) and within fp32 / bf16 rounding of torch's products."""
    from transformer_engine.pytorch import grouped_linear_fn

    calls = []
    real = grouped_linear_fn.ops.grouped_gemm
    monkeypatch.setattr(grouped_linear_fn.ops, "grouped_gemm",
                        lambda *a: calls.append(1) or real(*a))
    grouped, _ = _pair(3, 32, 16, dtype, device=device)
    splits = [7, 0, 9]
    x = torch.randn(16, 32, dtype=dtype, device=device, requires_grad=True)
    y = grouped(x, splits)
    y.float().square().sum().backward()
    assert len(calls) == 3
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    row = 0
    for i, m in enumerate(splits):
        w, b = grouped.gemms[i].weight, grouped.gemms[i].bias
        xi = x.detach()[row:row + m].float()
        want = xi @ w.detach().float().t() + b.detach().float()
        assert torch.allclose(y[row:row + m].float(), want, rtol=0,
                              atol=tol * max(float(want.abs().max()) if m else 0.0, 1.0)), i
        dy = 2 * y.detach()[row:row + m].float()
        dw = dy.t() @ xi
        assert torch.allclose(w.grad.float(), dw, rtol=0,
                              atol=tol * max(float(dw.abs().max()) if m else 0.0, 1.0)), i
        row += m


def test_nvidia_state_dict_keys_round_trip():
    a = te.GroupedLinear(2, 16, 8, device="cpu")
    sd = a.state_dict()
    assert {"weight0", "weight1", "bias0", "bias1"} <= set(sd)
    assert not any(k.startswith("gemms.") and k.endswith(("weight", "bias")) for k in sd)
    b = te.GroupedLinear(2, 16, 8, device="cpu")
    b.load_state_dict(sd)
    assert torch.equal(b.weight1, a.weight1) and torch.equal(b.bias0, a.bias0)


def test_return_bias_and_leading_dimensions():
    m = te.GroupedLinear(2, 16, 8, device="cpu", return_bias=True)
    out, biases = m(torch.randn(2, 5, 16), [6, 4])
    assert out.shape == (2, 5, 8) and [b is getattr(m, f"bias{i}") for i, b in
                                       enumerate(biases)] == [True, True]


def test_bad_inputs_name_the_module_and_argument():
    m = te.GroupedLinear(2, 16, 8, device="cpu")
    with pytest.raises(ValueError, match=r"te.GroupedLinear: m_splits must add up to the "
                                         r"input's 10 rows, got \[3, 3\]"):
        m(torch.randn(10, 16), [3, 3])
    with pytest.raises(ValueError, match="m_splits must be 2 non-negative row counts"):
        m(torch.randn(10, 16), [10])
    with pytest.raises(ValueError, match="in_features=16"):
        m(torch.randn(10, 15), [5, 5])
    with pytest.raises(NotImplementedError, match="te.GroupedLinear: tp_size=2"):
        te.GroupedLinear(2, 16, 8, device="cpu", tp_size=2)
    with pytest.raises(ValueError, match="num_gemms"):
        te.GroupedLinear(0, 16, 8, device="cpu")


def _pair(num, k, n, dtype=torch.float32, bias=True, device="cpu"):
    torch.manual_seed(1)
    grouped = te.GroupedLinear(num, k, n, bias=bias, params_dtype=dtype, device=device)
    singles = []
    for i in range(num):
        lin = te.Linear(k, n, bias=bias, params_dtype=dtype, device=device)
        state = {"weight": getattr(grouped, f"weight{i}").detach()}
        if bias:
            state["bias"] = getattr(grouped, f"bias{i}").detach()
        lin.load_state_dict(state, strict=False)
        singles.append(lin)
    return grouped, singles


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", ["delayed", "current", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_fp8_steps_equal_separate_linears_and_make_three_core_calls(name, dtype, bias,
                                                                             monkeypatch,
                                                                             device):
    """Three steps (delayed scaling's state updates included), splits that need padding and
    an empty group; every step makes one grouped core call per GEMM phase and no single one.
    Under delayed and current scaling the groups' casts are batched too: the inputs', the
    weights' and, without a bias gradient to fuse, the gradients' each in one call
    (ops.quantize_delayed_many, ops.quantize_current_many)."""
    from transformer_engine.pytorch import grouped_linear_fn, ops

    calls = {"grouped": 0, "many": 0}
    real = grouped_linear_fn.ops.grouped_gemm_fp8
    real_many = (ops.quantize_current_many if name == "current" else
                 ops.quantize_delayed_many)

    def counting(*args):
        calls["grouped"] += 1
        return real(*args)

    def counting_many(*args):
        calls["many"] += 1
        return real_many(*args)

    monkeypatch.setattr(grouped_linear_fn.ops, "grouped_gemm_fp8", counting)
    monkeypatch.setattr(grouped_linear_fn.ops, real_many.__name__, counting_many)
    r = RECIPES[name]
    grouped, singles = _pair(4, 32, 48, dtype, bias=bias, device=device)
    splits = [21, 16, 0, 35]
    for step in range(3):
        x = torch.randn(72, 32, dtype=dtype, device=device) * (step + 1)
        xg, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=r):
            y = grouped(xg, splits)
        calls_after_forward = calls["grouped"]
        with te.fp8_autocast(fp8_recipe=r):
            ys = torch.cat([m(p) for m, p in zip(singles, torch.split(xs, splits), strict=True)])
        assert torch.equal(y, ys), step
        g = torch.randn_like(y)
        (y.float() * g.float()).sum().backward()
        (ys.float() * g.float()).sum().backward()
        assert torch.equal(xg.grad, xs.grad), step
        for i, m in enumerate(singles):
            gm = grouped.gemms[i]
            assert torch.equal(gm.weight.grad, m.weight.grad), (step, i)
            if bias:
                assert torch.equal(gm.bias.grad, m.bias.grad), (step, i)
            for key, buf in m.named_buffers():
                assert torch.equal(dict(gm.named_buffers())[key], buf), (step, i, key)
            gm.weight.grad = m.weight.grad = None
            if bias:
                gm.bias.grad = m.bias.grad = None
        assert calls_after_forward == 3 * step + 1 and calls["grouped"] == 3 * (step + 1)
    assert ops.grouped_gemm_fp8 is counting
    # per step: the inputs' and the weights' casts, and the gradients' without a bias
    assert calls["many"] == (3 * (2 if bias else 3) if name != "block" else 0)


def test_grouped_fp8_return_bias_frozen_weights_and_first_microbatch():
    r = recipe.Float8CurrentScaling()
    grouped, singles = _pair(2, 16, 16)
    for m in (grouped, *grouped.gemms, *singles):
        m.return_bias = True
    for m in (*grouped.gemms, *singles):
        m.weight.requires_grad_(False)
    x = torch.randn(20, 16, requires_grad=True)
    xs = x.detach().clone().requires_grad_()
    with te.fp8_autocast(fp8_recipe=r):
        y, biases = grouped(x, [12, 8], is_first_microbatch=True)
        y2, _ = grouped(x, [12, 8], is_first_microbatch=False)  # the kept weight copies
        ys = torch.cat([m(p)[0] for m, p in zip(singles, torch.split(xs, [12, 8]),
                                                 strict=True)])
    assert torch.equal(y, y2) and torch.equal(y, ys)
    assert [b is grouped.gemms[i].bias for i, b in enumerate(biases)] == [True, True]
    y.sum().backward()
    assert x.grad is not None and grouped.gemms[0].weight.grad is None


class _QuantizeKeepingGrad(torch.autograd.Function):
    """The tokens as a per-tensor Float8Tensor (current scaling), the gradient passed through
    (as a layer that hands on FP8 activations does)."""

    @staticmethod
    def forward(ctx, x):
        from transformer_engine.pytorch.float8_tensor import Float8Tensor

        return Float8Tensor.quantize(x, "float8_e4m3")

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_fp8_dispatch_tokens_permuted_as_bytes_into_the_grouped_experts(name, monkeypatch):
    """The tokens quantized once, permuted by moe_permute as FP8 bytes (one byte per element
    moved), and taken as they are by the grouped experts: the same bits as each expert's
    te.Linear taking its FP8 rows, and the same gradients."""
    from transformer_engine.pytorch import grouped_linear_fn
    from transformer_engine.pytorch.float8_tensor import Float8Tensor

    calls = []
    real = grouped_linear_fn.ops.grouped_gemm_fp8
    monkeypatch.setattr(grouped_linear_fn.ops, "grouped_gemm_fp8",
                        lambda *a: calls.append(1) or real(*a))
    r = RECIPES[name]
    grouped, singles = _pair(4, 32, 48)
    torch.manual_seed(5)
    tokens, top_k = 20, 2
    routing = torch.stack([torch.randperm(4)[:top_k] for _ in range(tokens)])
    splits = [int((routing == e).sum()) for e in range(4)]
    x = torch.randn(tokens, 32)
    outs, grads = [], []
    for run in ("grouped", "singles"):
        inp = x.clone().requires_grad_()
        x8 = _QuantizeKeepingGrad.apply(inp)
        permuted, row_map = te.moe_permute(x8, routing, map_type="index")
        assert isinstance(permuted, Float8Tensor) and permuted._data.dtype == torch.uint8
        # each (token, slot)'s permuted row holds the token's bytes
        assert torch.equal(permuted._data[row_map.reshape(-1)],
                           x8._data.repeat_interleave(top_k, 0))
        with te.fp8_autocast(fp8_recipe=r):
            if run == "grouped":
                y = grouped(permuted, splits)
            else:  # each expert's layer on its FP8 rows (leaves, to read their gradients)
                parts = [Float8Tensor(d, permuted._scale_inv, permuted._fp8_dtype,
                                      permuted.dtype, requires_grad=True)
                         for d in torch.split(permuted._data, splits)]
                y = torch.cat([m(p) for m, p in zip(singles, parts, strict=True)])
        back = te.moe_unpermute(y, row_map, map_type="index")
        back.square().sum().backward()
        outs.append(back.detach())
        if run == "grouped":
            grads.append(inp.grad)
        else:  # the parts' gradients summed over each token's copies
            d_rows = torch.cat([p.grad for p in parts])
            grads.append(d_rows[row_map.reshape(-1)].view(tokens, top_k, -1).sum(1))
    assert torch.equal(outs[0], outs[1])
    for i, m in enumerate(singles):
        assert torch.equal(grouped.gemms[i].weight.grad, m.weight.grad), i
    assert torch.allclose(grads[0], grads[1], rtol=1e-6, atol=1e-6)  # (a sum's order)
    assert len(calls) == 3  # the FP8 tokens took the grouped path: forward, dgrad, wgrad


@pytest.mark.parametrize("name", ["bf16", "current", "block"])
def test_delay_wgrad_compute_puts_the_weight_gemms_aside_until_backward_dw(name):
    """The backward gives the input's and biases' gradients and no weight gradient;
    backward_dw() then adds the same weight gradients the undelayed module gets, for two
    backward passes in a row (accumulated)."""
    r = RECIPES[name]
    torch.manual_seed(2)
    delayed = te.GroupedLinear(3, 32, 16, delay_wgrad_compute=True, device="cpu")
    plain = te.GroupedLinear(3, 32, 16, device="cpu")
    plain.load_state_dict(delayed.state_dict())
    for _ in range(2):
        x = torch.randn(24, 32)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        for m, inp in ((delayed, xa), (plain, xb)):
            with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
                m(inp, [10, 0, 14]).square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
    assert all(g.weight.grad is None for g in delayed.gemms)
    delayed.backward_dw()
    for a, b in zip(delayed.gemms, plain.gemms, strict=True):
        assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad)
    delayed.backward_dw()  # nothing left: no change
    assert torch.equal(delayed.gemms[0].weight.grad, plain.gemms[0].weight.grad)


def test_grouped_fp8_compiles_whole_and_matches_eager():
    """torch.compile(fullgraph=True) of a delayed-scaling step, after an eager one: the
    compiled graph casts the groups one by one (quantize_many batches only in eager mode)
    and gives eager's output and input gradient."""
    torch.manual_seed(0)
    grouped = te.GroupedLinear(4, 32, 32, bias=False, params_dtype=torch.bfloat16)
    r = RECIPES["delayed"]
    splits = [16, 32, 0, 16]

    def step(x):
        with te.fp8_autocast(fp8_recipe=r):
            return grouped(x, splits)

    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    step(x).float().sum().backward()  # the first step (its own rule) in eager mode
    state = copy.deepcopy(grouped.state_dict())
    eager = step(x)
    eager_grad, = torch.autograd.grad(eager.float().sum(), x)
    grouped.load_state_dict(state)
    compiled = torch.compile(step, fullgraph=True)(x)
    compiled_grad, = torch.autograd.grad(compiled.float().sum(), x)
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled_grad, eager_grad)


@pytest.mark.parametrize("mode", ["column", "row"])
def test_parallel_mode_on_one_rank_is_the_whole_layer(mode):
    """Megatron-LM builds its experts as column- and row-parallel grouped layers with an expert
    tensor-parallel group of one rank: nothing is split, so the layer is the plain one (same
    weights from the same seed, same output); split over more ranks it is refused by name."""
    torch.manual_seed(0)
    plain = te.GroupedLinear(2, 16, 8, device="cpu")
    torch.manual_seed(0)
    one_rank = te.GroupedLinear(2, 16, 8, device="cpu", parallel_mode=mode, tp_size=1)
    assert one_rank.parallel_mode == mode
    x = torch.randn(6, 16)
    torch.testing.assert_close(one_rank(x, [2, 4]), plain(x, [2, 4]), rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="tp_size=2"):
        te.GroupedLinear(2, 16, 8, device="cpu", parallel_mode=mode, tp_size=2)
    with pytest.raises(ValueError, match="parallel_mode must be None, 'column' or 'row'"):
        te.GroupedLinear(2, 16, 8, device="cpu", parallel_mode="diagonal")
