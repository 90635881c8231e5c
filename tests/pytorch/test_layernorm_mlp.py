"""te.LayerNormMLP: against norm + nn.Linear + activation + nn.Linear in float64 (high
precision, and FP8 within the carried quantization bound for every recipe), bit for bit
against the unfused te modules in FP8, its options, state, torch.compile and errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from te_torch_tests import _reference as ref
from te_torch_tests._tolerances import (
    COMPILE_RTOL,
    FP8_EPS,
    GEMM_RTOL,
    NORM_RTOL,
    act_error,
    assert_bounded,
    assert_within,
    fp8_error,
    gemm_error,
)

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.module.layernorm_mlp import apply_activation

RECIPES = {
    "delayed": recipe.DelayedScaling(margin=1, amax_history_len=4),
    "current": recipe.Float8CurrentScaling(),
    "block": recipe.Float8BlockScaling(),
}
ACTS = ["gelu", "relu", "silu", "qgelu", "srelu", "geglu", "swiglu", "reglu", "qgeglu",
        "sreglu", "glu"]
# [B, S, H] with 48 tokens; H = 160 leaves a ragged 1x128 block; FFN = 144 a ragged tile.
B, S, H, FFN = 2, 24, 160, 144
NAMES = ["layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight",
         "fc2_bias"]


def _mlp(activation="gelu", normalization="LayerNorm", **kw):
    mlp = te.LayerNormMLP(H, FFN, activation=activation, normalization=normalization,
                          device="cpu", **kw)
    with torch.no_grad():
        mlp.layer_norm_weight.add_(torch.randn(H) * 0.3)
        if mlp.layer_norm_bias is not None:
            mlp.layer_norm_bias.normal_(0.0, 0.3)
    return mlp


def _step(module, x, g, r=None):
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        y = module(x)
    (y * g).sum().backward()
    return y


def _reference(mlp, x, g):
    """float64 (output, grads of input and parameters, ln, fc1_out, act_out)."""
    params = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    out, ln, h, a = ref.mlp64(x64, params["layer_norm_weight"], params.get("layer_norm_bias"),
                              params["fc1_weight"], params["fc1_bias"], params["fc2_weight"],
                              params["fc2_bias"], mlp.cfg.norm, mlp.activation, mlp.cfg.eps)
    grads = torch.autograd.grad((out * g.double()).sum(), [x64, *params.values()])
    return out.detach(), grads, ln.detach(), h.detach(), a.detach()


def _bound(mlp, ln, h, a, fwd_dtype):
    """The forward's error bound: the norm's error, then (when fwd_dtype is an FP8 format)
    each operand's quantization, carried through FC1, the activation and FC2 (_tolerances)."""
    f32 = torch.float32
    gamma, beta = mlp.layer_norm_weight.detach().double(), mlp.layer_norm_bias
    b = torch.zeros_like(gamma) if beta is None else beta.detach().double()
    ln, h, a = ln.reshape(-1, H), h.reshape(-1, h.shape[-1]), a.reshape(-1, FFN)
    w1, w2 = mlp.fc1_weight.detach().double(), mlp.fc2_weight.detach().double()

    def q(v, e):
        return e if fwd_dtype is None else fp8_error(v, e, fwd_dtype)

    e_ln = q(ln, NORM_RTOL[f32] * ((ln - b).abs() + gamma.abs() + b.abs()))
    zero1, zero2 = torch.zeros_like(w1), torch.zeros_like(w2)
    e_h = gemm_error(ln, e_ln, w1, q(w1, zero1), mlp.fc1_bias.detach().double(), f32)
    base = ref.GATED.get(mlp.activation)
    e_a = q(a, act_error(h, e_h, mlp.activation, base))
    return gemm_error(a, e_a, w2, q(w2, zero2), mlp.fc2_bias.detach().double(), f32)


@pytest.mark.parametrize("act", ACTS)
def test_high_precision_matches_the_unfused_block(act):
    mlp = _mlp(act, "RMSNorm" if act in ("silu", "swiglu") else "LayerNorm")
    x = torch.randn(B, S, H, requires_grad=True)
    g = torch.randn(B, S, H)
    y = _step(mlp, x, g)
    want, grads, ln, h, a = _reference(mlp, x, g)
    assert_bounded(y.reshape(-1, H), want.reshape(-1, H), _bound(mlp, ln, h, a, None),
                   f"{act} forward")
    # Gradients, relative to the largest element of each: four fp32 stages of sums over at
    # most 2 FFN = 288 terms (2^-24 each of magnitudes within ~10x of that element here),
    # so ~2e-5; 1e-4 leaves room. The kinks of relu-type activations are not met: a float64
    # and an fp32 fc1_out straddle 0 with probability ~1e-6 per element.
    got = [x.grad, *[p.grad for p in mlp.parameters()]]
    for name, a_, b_ in zip(["input", *[n for n, _ in mlp.named_parameters()]], got, grads,
                            strict=True):
        assert_within(a_, b_, b_.abs().max().expand_as(b_), 1e-4, f"{act} grad of {name}")


@pytest.mark.parametrize("name,act", [(n, a) for n in sorted(RECIPES) for a in ("gelu", "swiglu")]
                         + [("current", "srelu"), ("delayed", "reglu")])
def test_fp8_forward_within_the_quantization_bound(name, act):
    r = RECIPES[name]
    mlp = _mlp(act)
    x = torch.randn(B, S, H, requires_grad=True)
    g = torch.randn(B, S, H) * 1e-2
    _step(mlp, x, g, r)  # delayed: the second step quantizes with scales from amaxes
    for p in (x, *mlp.parameters()):
        p.grad = None
    y = _step(mlp, x, g, r)
    want, grads, ln, h, a = _reference(mlp, x, g)
    bound = _bound(mlp, ln, h, a, r.fp8_format.fwd_dtype_name)
    assert_bounded(y.reshape(-1, H), want.reshape(-1, H), bound, f"{name} {act} forward")
    # The bound is the worst case, where every rounding errs its most in one direction; in
    # fact they are independent and cancel, and the error norm sits near FP8_EPS of the
    # output's norm (measured 0.6 to 0.9 of it). A wrong operand (transposed, unscaled, another
    # activation) errs by O(1) of it: 2 FP8_EPS tells them apart.
    rel = ((y.double() - want).norm() / want.norm()).item()
    assert rel < 2 * FP8_EPS[r.fp8_format.fwd_dtype_name], rel
    # Gradients, by the same norm check: each passes through at most two E5M2 (grad_output
    # of FC2 and of FC1) and two E4M3 roundings, 2 * 2^-3 + 2 * 2^-4 = 3 FP8_EPS[e5m2] in
    # all (measured: up to 1.3 FP8_EPS, reglu, whose derivative jumps where FP8 moves fc1_out
    # across 0); a wrong gradient errs by O(1).
    for n, got, exp in zip(["input", *NAMES], [x.grad, *[p.grad for p in mlp.parameters()]],
                           grads, strict=True):
        rel = ((got.double() - exp).norm() / exp.norm()).item()
        assert rel < 3 * FP8_EPS[r.fp8_format.bwd_dtype_name], (n, rel)


class _Unfused(torch.nn.Module):
    """te.LayerNorm, te.Linear, the core's activation, te.Linear: the block op by op."""

    def __init__(self, mlp):
        super().__init__()
        self.act = mlp.activation
        self.norm = te.LayerNorm(H, device="cpu")
        self.fc1 = te.Linear(H, mlp.fc1_weight.shape[0], device="cpu")
        self.fc2 = te.Linear(FFN, H, device="cpu")
        with torch.no_grad():
            for dst, src in ((self.norm.weight, mlp.layer_norm_weight),
                             (self.norm.bias, mlp.layer_norm_bias),
                             (self.fc1.weight, mlp.fc1_weight), (self.fc1.bias, mlp.fc1_bias),
                             (self.fc2.weight, mlp.fc2_weight), (self.fc2.bias, mlp.fc2_bias)):
                dst.copy_(src)

    def forward(self, x):
        return self.fc2(apply_activation(self.fc1(self.norm(x)), self.act))


@pytest.mark.parametrize("name,act,dtype", [
    *[(n, a, torch.float32) for n in sorted(RECIPES) for a in ("gelu", "swiglu")],
    ("block", "swiglu", torch.bfloat16)])
def test_fp8_is_bit_identical_to_the_unfused_te_modules(name, act, dtype):
    """The fused kernels write the FP8 bytes that te.Linear's quantize makes of the unfused
    norm's and activation's outputs (forward) and of the gradients (backward), so outputs,
    gradients and every delayed-scaling history and scale agree bit for bit. Except: the bias
    gradients the fused backward takes from the activation kernel (FC1's; FC2's too under
    delayed scaling) sum in the core's fixed order, torch's sum in its own (fp32, 48 rows:
    within 48 * 2^-24 of sum |grad|); and with bf16 activations the fused kernels of delayed
    and current scaling quantize fp32 values (the norm's under delayed scaling, the
    activation's and its gradient's under both) where the unfused modules quantize them
    rounded to bf16 first (only close then): in bf16 only block scaling, whose kernels write
    high precision, is compared."""
    r = RECIPES[name]
    mlp = _mlp(act)
    unfused = _Unfused(mlp)
    mlp, unfused = mlp.to(dtype), unfused.to(dtype)
    x = torch.randn(B, S, H, dtype=dtype)
    g = (torch.randn(B, S, H) * 1e-2).to(dtype)
    for _ in range(2):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [_step(m, xi, g, r) for m, xi in zip((mlp, unfused), xs, strict=True)]
        assert torch.equal(ys[0], ys[1])
        assert torch.equal(xs[0].grad, xs[1].grad)
        for n, a, b in zip(NAMES, mlp.parameters(), unfused.parameters(), strict=True):
            if n.endswith("_bias") and n != "layer_norm_bias":
                mag = (g if n == "fc2_bias" else b.grad).abs().double().sum() + b.grad.abs()
                assert_within(a.grad, b.grad, mag.double(), 48 * 2.0**-24 + GEMM_RTOL[dtype]
                              * (dtype != torch.float32), n)
            else:
                assert torch.equal(a.grad, b.grad), n
            a.grad = b.grad = None
        fc1, fc2 = unfused.fc1, unfused.fc2
        assert torch.equal(mlp.amax_history_fwd,
                           torch.cat([fc1.amax_history_fwd, fc2.amax_history_fwd], 1))
        assert torch.equal(mlp.scale_fwd, torch.cat([fc1.scale_fwd, fc2.scale_fwd]))
        assert torch.equal(mlp.amax_history_bwd,
                           torch.cat([fc1.amax_history_bwd, fc2.amax_history_bwd], 1))
        assert torch.equal(mlp.scale_bwd, torch.cat([fc1.scale_bwd, fc2.scale_bwd]))


@pytest.mark.parametrize("name,act,bias", [
    ("delayed", "gelu", True), ("delayed", "swiglu", False), ("current", "gelu", True),
    ("block", "swiglu", True)])
def test_memory_lean_backward_is_bit_identical(monkeypatch, name, act, bias):
    """The backward's order for large blocks (FC2's wgrad first, FC1's FP8 gradient written
    row-wise, then transposed; layernorm_mlp_fn.LEAN_BYTES) gives the same bits as the fused
    order over several steps: gradients and FP8 state."""
    _small_and_large_agree(monkeypatch, _mlp(act, bias=bias), RECIPES[name])


def _small_and_large_agree(monkeypatch, mlp, r, grow: float = 1.0) -> None:
    """Three steps of two copies of ``mlp``, one taken as a small block and one as a large
    one (layernorm_mlp_fn.LEAN_BYTES), give the same outputs, gradients and FP8 state;
    ``grow`` multiplies both weights after each step."""
    from transformer_engine.pytorch import layernorm_mlp_fn

    mlps = [mlp, copy.deepcopy(mlp)]
    x = torch.randn(B, S, H)
    g = torch.randn(B, S, H) * 1e-2
    for _ in range(3):
        grads = []
        for m, lean_bytes in zip(mlps, (2**62, 0), strict=True):
            monkeypatch.setattr(layernorm_mlp_fn, "LEAN_BYTES", lean_bytes)
            xi = x.clone().requires_grad_()
            y = _step(m, xi, g, r)
            grads.append([y, xi.grad, *[p.grad for p in m.parameters()]])
            m.zero_grad()
            with torch.no_grad():
                m.fc1_weight.mul_(grow)
                m.fc2_weight.mul_(grow)
        for a, b_ in zip(*grads, strict=True):
            assert torch.equal(a, b_)
        for (n, a), b_ in zip(mlps[0].named_buffers(), mlps[1].buffers(), strict=True):
            assert torch.equal(a, b_), n


@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_late_weight_columns_are_the_forward_copies(monkeypatch, name):
    """A large block's forward quantizes its weights row-wise alone and the backward makes
    their column-wise copies (layernorm_mlp_fn.late_weight_columns): the same bytes as copies
    made in the forward, so the same gradients and FP8 state, over steps whose weights grow
    (delayed scaling's update at the autocast's exit then writes a new scale between the
    forward and its backward: the backward must quantize with the forward's)."""
    from transformer_engine.pytorch import layernorm_mlp_fn

    late = []
    made = layernorm_mlp_fn.late_weight_columns
    monkeypatch.setattr(layernorm_mlp_fn, "late_weight_columns",
                        lambda *a: late.append(a[3]) or made(*a))
    _small_and_large_agree(monkeypatch, _mlp("gelu"), RECIPES[name], grow=1.5)
    assert late == [3, 1] * 3  # FC2's copy, then FC1's, in each backward


@pytest.mark.parametrize("frozen", ["input", "norm_and_input", "fc1", "fc2", "weights"])
def test_late_weight_columns_with_frozen_parts(monkeypatch, frozen):
    """The late column-wise copies where only some gradients are wanted (FC1's copy is made
    only for the input's gradient, FC2's only for what lies before FC2): the bits of copies
    made in the forward, over steps."""
    from transformer_engine.pytorch import layernorm_mlp_fn

    base = _mlp("gelu")
    frozen_names = {"input": (), "norm_and_input": ("layer_norm_weight", "layer_norm_bias"),
                    "fc1": ("fc1_weight", "fc1_bias"), "fc2": ("fc2_weight",),
                    "weights": tuple(NAMES)}[frozen]
    x = torch.randn(B, S, H)
    results = []
    for lean_bytes in (2**62, 0):
        monkeypatch.setattr(layernorm_mlp_fn, "LEAN_BYTES", lean_bytes)
        mlp = copy.deepcopy(base)
        for name in frozen_names:
            getattr(mlp, name).requires_grad_(False)
        xi = x.clone().requires_grad_(frozen not in ("input", "norm_and_input"))
        got = []
        for _ in range(3):
            with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
                y = mlp(xi)
            if y.requires_grad:
                y.square().sum().backward()
            got += [y.detach(), *[p.grad for p in mlp.parameters() if p.grad is not None]]
            if xi.grad is not None:
                got.append(xi.grad)
                xi.grad = None
            mlp.zero_grad()
        results.append(got)
    assert len(results[0]) == len(results[1])
    for a, b_ in zip(*results, strict=True):
        assert torch.equal(a, b_)


def test_late_weight_columns_leave_the_forward(monkeypatch):
    """A large block saves its weights rather than their FP8 column-wise copies, and its
    forward makes no column-wise weight copy: quantize is asked for row-wise bytes alone."""
    from transformer_engine.pytorch import layernorm_mlp_fn
    from transformer_engine.pytorch.module import base

    monkeypatch.setattr(layernorm_mlp_fn, "LEAN_BYTES", 0)
    mlp = _mlp("gelu")
    asked = []
    quantize = base.quantize
    monkeypatch.setattr(base, "quantize", lambda plan, role, x, row, col, *a: asked.append(
        (role, row, col)) or quantize(plan, role, x, row, col, *a))
    saved = []
    x = torch.randn(B, S, H, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
            y = mlp(x)
    assert asked == [("weight", True, False)] * 2
    assert any(t is mlp.fc1_weight for t in saved) and any(t is mlp.fc2_weight for t in saved)
    assert not any(t.dtype == torch.uint8 and t.shape in ((FFN, H), (H, FFN)) for t in saved)
    y.sum().backward()
    assert mlp.fc1_weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("act,bias", [("gelu", True), ("swiglu", False)])
def test_chunked_lean_backward_equals_the_one_pass_order(monkeypatch, act, bias, device):
    """Under delayed scaling the lean order makes FC1's FP8 gradient LEAN_CHUNKS row chunks
    at a time (FC2's dgrad of a chunk, then its activation backward): the FP8 bytes, and so
    every gradient and the FP8 state, are those of the one-pass order, over several steps (the
    first of which is not chunked: its scale comes from the whole gradient); only FC1's bias
    gradient adds its column sums chunk by chunk (fp32 rounding). On the GPU cuBLASLt may take
    another kernel for the chunk's FC2 dgrad than for all rows (another order of the sums), so
    an FP8 byte of FC1's gradient may round the other way: the gradients it reaches are
    compared to 1% there, the rest bit for bit."""
    from transformer_engine.pytorch import layernorm_mlp_fn

    r = RECIPES["delayed"]
    monkeypatch.setattr(layernorm_mlp_fn, "LEAN_BYTES", 0)
    monkeypatch.setattr(layernorm_mlp_fn, "LEAN_CHUNKS", 4)
    torch.manual_seed(0)
    mlps = [te.LayerNormMLP(64, 96, activation=act, bias=bias, params_dtype=torch.bfloat16,
                            device=device) for _ in range(2)]
    mlps[1].load_state_dict(mlps[0].state_dict())
    x = torch.randn(4, 128, 64, dtype=torch.bfloat16, device=device)  # 512 rows: 4 chunks
    g = torch.randn(4, 128, 64, dtype=torch.bfloat16, device=device) * 1e-2
    # reached by FC1's FP8 gradient: the input's, the norm's and FC1's gradients
    near = {"x", "layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias"}
    gpu = device.type == "cuda"
    calls = []
    chunked = layernorm_mlp_fn.chunked_fc1_grad
    monkeypatch.setattr(layernorm_mlp_fn, "chunked_fc1_grad",
                        lambda *a, **k: calls.append(1) or chunked(*a, **k))
    for step in range(3):
        grads = []
        for mlp, chunks in zip(mlps, (False, True), strict=True):
            monkeypatch.setattr(layernorm_mlp_fn, "chunkable",
                                lambda plan, history, c=chunks: c and plan.kind == "delayed"
                                and not layernorm_mlp_fn.first_step.waits(history, 0))
            xi = x.clone().requires_grad_()
            y = _step(mlp, xi, g, r)
            grads.append({"out": y, "x": xi.grad, **{n: p.grad for n, p in
                                                     mlp.named_parameters()}})
            mlp.zero_grad()
        for n in grads[0]:
            if gpu and n in near:
                torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-2, atol=1e-5)
            elif n == "fc1_bias":  # bf16: the chunks' fp32 sums round alike or one ulp apart
                torch.testing.assert_close(grads[1][n], grads[0][n], rtol=8e-3, atol=0)
            else:
                assert torch.equal(grads[0][n], grads[1][n]), (step, n)
        for (n, a), b_ in zip(mlps[0].named_buffers(), mlps[1].buffers(), strict=True):
            if gpu and n.endswith("_bwd"):  # FC1's gradient amax and scales (see above)
                torch.testing.assert_close(a, b_, rtol=1e-2, atol=0)
            else:
                assert torch.equal(a, b_), (step, n)
    assert len(calls) == 2  # steps 2 and 3; the first step's scale needs the whole gradient


def test_gated_activations_double_fc1():
    mlp = te.LayerNormMLP(H, FFN, activation="swiglu", device="cpu", bias=False)
    assert mlp.fc1_weight.shape == (2 * FFN, H) and mlp.fc2_weight.shape == (H, FFN)
    assert mlp.fc1_bias is None and "fc1_bias" not in dict(mlp.named_parameters())


def test_returned_layernorm_output_and_bias():
    mlp = _mlp("gelu", return_layernorm_output=True, return_bias=True)
    x = torch.randn(B, S, H, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=RECIPES["block"]):
        out, bias, ln_out = mlp(x)
    assert bias is mlp.fc2_bias and out.shape == ln_out.shape == x.shape
    want = ref.norm64(x, mlp.layer_norm_weight, mlp.layer_norm_bias, "layernorm", 1e-5)
    torch.testing.assert_close(ln_out.double(), want, rtol=1e-5, atol=1e-5)
    ln_out.sum().backward()  # only through ln_out: the norm's gradient of it
    ln_only = torch.autograd.grad(want.sum(), x)[0]
    torch.testing.assert_close(x.grad.double(), ln_only.double(), rtol=1e-4, atol=1e-5)


def test_zero_centered_gamma():
    mlp = te.LayerNormMLP(H, FFN, zero_centered_gamma=True, device="cpu")
    plain = te.LayerNormMLP(H, FFN, device="cpu")
    plain.load_state_dict(mlp.state_dict())
    with torch.no_grad():
        plain.layer_norm_weight.add_(1.0)
    x = torch.randn(48, H)
    assert torch.equal(mlp.layer_norm_weight, torch.zeros(H))
    with te.fp8_autocast(fp8_recipe=RECIPES["current"]):
        torch.testing.assert_close(mlp(x), plain(x), rtol=0, atol=0)


def test_state_dict_round_trip_into_a_fresh_module():
    mlp = _mlp("swiglu", "RMSNorm")
    for _ in range(2):
        with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
            mlp(torch.randn(48, H)).sum().backward()
    buf = io.BytesIO()
    torch.save(mlp.state_dict(), buf)
    buf.seek(0)
    fresh = te.LayerNormMLP(H, FFN, activation="swiglu", normalization="RMSNorm", device="cpu")
    fresh.load_state_dict(torch.load(buf))
    state = fresh.get_extra_state()
    assert state["amax_history_fwd"].shape == (4, 4) and state["scale_bwd"].shape == (2,)
    for key in ("amax_history_fwd", "scale_fwd", "amax_history_bwd", "scale_bwd"):
        assert torch.equal(getattr(fresh, key), getattr(mlp, key)), key
    for a, b in zip(fresh.parameters(), mlp.parameters(), strict=True):
        assert torch.equal(a, b)
    x = torch.randn(48, H)
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        assert torch.equal(fresh(x), mlp(x))


def test_fp8_model_init_keeps_both_weights_fp8():
    with te.fp8_model_init():
        mlp = te.LayerNormMLP(H, FFN, device="cpu")
    assert type(mlp.fc1_weight) is te.Float8Tensor and type(mlp.fc2_weight) is te.Float8Tensor
    x = torch.randn(48, H, requires_grad=True)
    with te.fp8_autocast():
        mlp(x).sum().backward()
    assert torch.isfinite(x.grad).all() and mlp.fc1_weight.grad is not None


def _block():
    return torch.nn.Sequential(te.LayerNormLinear(32, 64, device="cpu"),
                               te.LayerNormMLP(64, 48, activation="swiglu", device="cpu"))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_compiled_training_step_matches_eager(name):
    """fullgraph=True: a graph break raises. aot_eager traces through dynamo and AOT autograd
    (the custom ops by their fake implementations, the in-place updates of the FP8 buffers
    functionalized) without inductor's C++ compile: ~15 s more per recipe on a 2-core CPU;
    test_compile.py runs inductor on te.Linear, whose graph holds the same kinds of nodes."""
    torch._dynamo.reset()
    r = recipe.DelayedScaling() if name == "delayed" else RECIPES[name]
    eager = _block()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    for _ in range(2 if name == "delayed" else 1):  # delayed: a step with updated scales
        x = torch.randn(2, 16, 32)
        losses = []
        for model in (eager, compiled):
            with te.fp8_autocast(fp8_recipe=r):
                loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=COMPILE_RTOL, atol=0)
        for a, b in zip(compiled_model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=COMPILE_RTOL, atol=1e-7)
            a.grad = b.grad = None
        for a, b in zip(compiled_model.buffers(), eager.buffers(), strict=True):
            assert torch.equal(a, b)


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="te.LayerNormMLP: activation must be one of"):
        te.LayerNormMLP(H, FFN, activation="tanh")
    mlp = te.LayerNormMLP(H, 40, device="cpu")
    with pytest.raises(ValueError, match="te.LayerNormMLP: input must have 160 features"):
        mlp(torch.randn(4, 8))
    with te.fp8_autocast(), pytest.raises(ValueError, match="out_features must be a multiple"):
        mlp(torch.randn(16, H))


@pytest.mark.parametrize("trainable", [("fc2_weight", "fc2_bias"), ("fc1_bias",),
                                       ("layer_norm_weight", "fc1_weight")])
@pytest.mark.parametrize("name", ["delayed", "block"])
def test_frozen_parameters_get_the_same_gradients(name, trainable):
    """With parts of the block frozen (and an input that needs no gradient) the backward
    skips their GEMMs; what it computes is what the full backward computes."""
    r = RECIPES[name]
    full = _mlp("swiglu")
    part = copy.deepcopy(full)
    for n, p in part.named_parameters():
        p.requires_grad_(n in trainable)
    x = torch.randn(B, S, H)
    g = torch.randn(B, S, H) * 1e-2
    _step(full, x.clone().requires_grad_(), g, r)
    _step(part, x, g, r)
    for n, p in part.named_parameters():
        if n in trainable:
            assert torch.equal(p.grad, dict(full.named_parameters())[n].grad), n
        else:
            assert p.grad is None, n


@pytest.mark.parametrize("first_microbatch", [None, True])
def test_forward_drops_fresh_weight_copies_after_their_gemms(monkeypatch, first_microbatch):
    """The Python path's forward frees the weights' row-wise FP8 copies once their GEMM has run
    when they were made for this forward alone (they would sit in the forward's peak); copies
    kept for later microbatches stay. Either way the step's numbers are those of the other."""
    from transformer_engine.pytorch import layernorm_mlp_fn

    monkeypatch.setattr(layernorm_mlp_fn, "LEAN_BYTES", 0)  # (the Python path)
    released = []
    original = layernorm_mlp_fn.release
    monkeypatch.setattr(layernorm_mlp_fn, "release",
                        lambda *ts: released.append([tuple(t.shape) for t in ts if t is not None])
                        or original(*ts))
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(64, 96, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=RECIPES["delayed"]):
        y = mlp(x, is_first_microbatch=first_microbatch)
    forward_released = [s for call in released for s in call]
    rows = [(96, 64), (64, 96)]  # FC1's and FC2's weights, row-wise
    if first_microbatch is None:
        assert all(r in forward_released for r in rows), forward_released
    else:
        assert not any(r in forward_released for r in rows), forward_released
    y.float().square().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in mlp.parameters())
