"""te.optimizers.FusedAdam and FusedSGD (NVIDIA TE's ``transformer_engine.pytorch.optimizers``)
against torch.optim's Adam, AdamW and SGD and float64 formulas, their master weights (bf16, FP8,
16-bit remainders), low-precision states, state dicts, refusals, and NVIDIA's example program
(examples/pytorch/quantized_model_init) on the CPU."""

from __future__ import annotations

import io
import math

import pytest
import torch
from te_torch_tests._train_steps import warm_up_for_capture

import transformer_engine.pytorch as te
from transformer_engine.pytorch.float8_tensor import Float8Tensor
from transformer_engine.pytorch.optimizers import FusedAdam, FusedSGD
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

STEPS = 5
LR = 1e-2
EPS32 = torch.finfo(torch.float32).eps
# Against torch's unfused Adam/AdamW/SGD (the same formula, other roundings): each step may
# round the update (|update| <= about lr) and the new parameter differently by an ulp or two,
# so after STEPS steps they differ by a few ulps of |p| + STEPS * lr; 8 ulps leaves room (the
# measured worst is under 1.5). Against torch's fused kernels, which ours are, results are equal.
FP32_ULPS = 8
# A state kept in a low-precision dtype against the float32 state, after one step: one rounding
# to the dtype's significand, relative to the tensor's absmax (fp16 and FP8 are scaled per
# tensor so that the absmax sits near the top of their range).
STATE_RTOL = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.uint8: 2.0**-4}


def _assert_fp32_close(got: torch.Tensor, want: torch.Tensor, steps: int = STEPS) -> None:
    bound = FP32_ULPS * EPS32 * (want.abs() + steps * LR)
    err = (got.detach() - want.detach()).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


def _grads(shapes, steps=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _params(dtype=torch.float32, shapes=((16, 8), (8,))):
    gen = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _adamw(params):
    """torch's AdamW with FusedAdam's defaults (torch's weight_decay default is 0.01)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)


def _run(opt, params, grads, attr="grad"):
    for step in grads:
        for p, g in zip(params, step, strict=True):
            setattr(p, attr, g.to(p.dtype) if attr == "grad" else g.clone())
        opt.step()


# ------------------------------------------------------------ FusedAdam against torch


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch(adam_w_mode, weight_decay):
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    grads = _grads([(16, 8), (8,)])
    ours, fused, plain = _params(), _params(), _params()
    kw = dict(lr=LR, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    _run(FusedAdam(ours, adam_w_mode=adam_w_mode, **kw), ours, grads)
    _run(ref_cls(fused, fused=True, **kw), fused, grads)
    _run(ref_cls(plain, foreach=False, **kw), plain, grads)
    for p, f, q in zip(ours, fused, plain, strict=True):
        assert torch.equal(p, f)
        _assert_fp32_close(p, q)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_adam_without_bias_correction(adam_w_mode):
    beta1, beta2, eps, wd = 0.9, 0.99, 1e-8, 0.05
    grads = _grads([(32,)])
    ours = _params(shapes=[(32,)])
    p = ours[0].detach().double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    _run(FusedAdam(ours, lr=LR, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                   adam_w_mode=adam_w_mode, bias_correction=False), ours, grads)
    for (g,) in grads:  # NVIDIA's formula, in float64
        g = g.double() + (0.0 if adam_w_mode else wd * p)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - LR * (m / (v.sqrt() + eps) + (wd * p if adam_w_mode else 0.0))
    _assert_fp32_close(ours[0], p.float())


def test_params_without_grad_are_left_alone():
    params = _params()
    before = params[1].detach().clone()
    opt = FusedAdam(params, lr=LR)
    params[0].grad = torch.randn(16, 8)
    opt.step()
    assert torch.equal(params[1], before)
    assert not torch.equal(params[0], _params()[0])
    assert opt.state[params[1]]["exp_avg"].abs().sum() == 0  # states exist, as NVIDIA's


def test_decoupled_grad():
    grads = _grads([(16, 8), (8,)])
    ours, ref = _params(torch.bfloat16), _params()
    for p in ours:
        p.grad = torch.full(p.shape, 1e3, dtype=p.dtype)  # must be ignored
    opt = FusedAdam(ours, lr=LR, master_weights=True, use_decoupled_grad=True)
    _run(opt, ours, grads, attr="decoupled_grad")
    for r in ref:
        r.data.copy_(r.bfloat16().float())  # the same start as the bf16 parameters
    _run(_adamw(ref), ref, grads)
    for p, r in zip(ours, ref, strict=True):
        assert torch.equal(opt.state[p]["master_param"], r)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in ours)


# ------------------------------------------------------------ master weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_master_weights(dtype):
    # (Float32 parameters are updated directly; their master copy is kept equal.)
    grads = _grads([(16, 8), (8,)])
    ours, ref = _params(dtype), _params()
    for r, p in zip(ref, ours, strict=True):
        r.data.copy_(p.float())
    opt = FusedAdam(ours, lr=LR, weight_decay=0.01, master_weights=True)
    _run(opt, ours, [[g.to(dtype) for g in step] for step in grads])
    _run(torch.optim.AdamW(ref, lr=LR, weight_decay=0.01, fused=True), ref,
         [[g.to(dtype).float() for g in step] for step in grads])
    for p, r in zip(ours, ref, strict=True):
        assert torch.equal(opt.state[p]["master_param"], r)
        assert torch.equal(p, r.to(dtype))


def test_low_precision_params_without_master_weights():
    # NVIDIA's kernel updates in float32 and rounds the parameter back every step.
    grads = _grads([(16, 8), (8,)])
    ours, shadow = _params(torch.bfloat16), _params()
    opt_ref = _adamw(shadow)
    opt = FusedAdam(ours, lr=LR)
    for step in grads:
        for p, s, g in zip(ours, shadow, step, strict=True):
            p.grad, s.grad = g.bfloat16(), g.bfloat16().float()
            s.data.copy_(p.float())
        opt.step()
        opt_ref.step()
        for p, s in zip(ours, shadow, strict=True):
            assert torch.equal(p, s.bfloat16())


def _fp32_from_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """NVIDIA's layout: the bf16 bits are the master's upper half rounded up where the lower
    half (the int16 remainder) has its top bit set."""
    high = param.view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    high = (high - (low >= 0x8000).to(torch.int64)) & 0xFFFF
    return (high * 65536 + low).to(torch.int32).view(torch.float32)


def test_store_param_remainders():
    grads = _grads([(64, 16)])
    ours, ref = _params(torch.bfloat16, [(64, 16)]), _params(shapes=[(64, 16)])
    ref[0].data.copy_(ours[0].float())
    opt = FusedAdam(ours, lr=LR, master_weights=True, store_param_remainders=True,
                    use_decoupled_grad=True)
    _run(opt, ours, grads, attr="decoupled_grad")
    _run(_adamw(ref), ref, grads)
    remainder = opt.state[ours[0]]["master_param"]
    assert remainder.dtype == torch.int16
    assert torch.equal(_fp32_from_remainder(ours[0], remainder), ref[0].detach())
    # The parameter is the master rounded to nearest (ties, where RNE may differ, excluded).
    ties = (ref[0].detach().view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(ours[0][~ties], ref[0].detach().bfloat16()[~ties])


def test_float8_params_under_quantized_model_init():
    with te.quantized_model_init(enabled=True):
        layer = te.Linear(32, 16, bias=False, params_dtype=torch.bfloat16, device="cpu")
    weight = layer.weight
    assert isinstance(weight, Float8Tensor)
    ref = torch.nn.Parameter(weight.dequantize(torch.float32))
    grads = _grads([(16, 32)])
    opt = FusedAdam([weight], lr=LR, master_weights=True, use_decoupled_grad=True)
    _run(opt, [weight], grads, attr="decoupled_grad")
    _run(_adamw([ref]), [ref], grads)
    master = opt.state[weight]["master_param"]
    assert torch.equal(master, ref.detach())
    assert layer.weight is weight and isinstance(weight, Float8Tensor)
    want = Float8Tensor.quantize(master.to(weight.dtype), weight._fp8_dtype)
    assert torch.equal(weight._scale_inv, want._scale_inv)
    assert torch.equal(weight.dequantize(), want.dequantize())


# ------------------------------------------------------------ optimizer states


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.uint8])
def test_low_precision_states(dtype):
    grads = _grads([(16, 8)], steps=1)
    ours, ref = _params(shapes=[(16, 8)]), _params(shapes=[(16, 8)])
    opt = FusedAdam(ours, lr=LR, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
    opt_ref = FusedAdam(ref, lr=LR)
    _run(opt, ours, grads)
    _run(opt_ref, ref, grads)
    for name in ("exp_avg", "exp_avg_sq"):
        want = opt_ref.state[ref[0]][name]
        stored = opt.state[ours[0]][name]
        if dtype == torch.bfloat16:
            assert torch.equal(stored, want.bfloat16())
        elif dtype == torch.uint8:  # FP8 E4M3 with the current scale of the values
            assert isinstance(stored, Float8Tensor) and stored._fp8_dtype == "float8_e4m3"
            assert torch.equal(stored.dequantize(), Float8Tensor.quantize(want).dequantize())
        else:  # the absmax maps to half of fp16's largest value
            assert stored.dtype == torch.float16
            top = torch.finfo(torch.float16).max / 2
            assert abs(stored.float().abs().max().item() - top) <= top * 2.0**-11
        got = opt.get_unscaled_state(ours[0], name)
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= STATE_RTOL[dtype] * want.abs().max()


CONFIGS = {
    "fp32": (torch.float32, {}),
    "bf16-master": (torch.bfloat16, dict(master_weights=True)),
    "bf16-remainders": (torch.bfloat16, dict(master_weights=True, store_param_remainders=True)),
    "fp16-master-fp16": (torch.float16, dict(master_weights=True,
                                             master_weight_dtype=torch.float16)),
    "low-states": (torch.bfloat16, dict(master_weights=True, exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.uint8)),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_dict_round_trip(config):
    dtype, kw = CONFIGS[config]
    grads = _grads([(16, 8), (8,)], steps=4)
    params = _params(dtype)
    opt = FusedAdam(params, lr=LR, **kw)
    _run(opt, params, grads[:2])
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    for state in opt.state_dict()["state"].values():
        for value in state.values():
            assert value.dtype in (torch.float32, torch.int16)
    buffer.seek(0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = FusedAdam(twins, lr=LR, **kw)
    twin.load_state_dict(torch.load(buffer))
    assert twin.param_groups[0]["step"] == 2
    for p, t in zip(params, twins, strict=True):
        for name in opt.state[p]:
            # Scaled states are scaled afresh from their float32 values, which maps their
            # absmax back to the same top value: the stored values come back as they were.
            assert opt.state[p][name].dtype == twin.state[t][name].dtype
            assert torch.equal(opt.get_unscaled_state(p, name), twin.get_unscaled_state(t, name))
    _run(opt, params, grads[2:])
    _run(twin, twins, grads[2:])
    for p, t in zip(params, twins, strict=True):
        assert torch.equal(p, t)


# ------------------------------------------------------------ capturable


def test_capturable_matches_eager_and_skips_on_inf():
    grads = _grads([(16, 8), (8,)], steps=STEPS + 1)
    ours, ref, twins = _params(), _params(), _params()
    opt = FusedAdam(ours, lr=LR, capturable=True)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    _run(opt, ours, grads[:STEPS])
    _run(FusedAdam(ref, lr=LR), ref, grads[:STEPS])
    for p, r in zip(ours, ref, strict=True):
        _assert_fp32_close(p, r)  # torch's CPU kernel reads a tensor lr as float32, not double
    assert opt.param_groups[0]["step"].item() == STEPS
    # A GradScaler passes itself to step(): the scaled gradients are unscaled (exactly: the
    # scale is a power of 2), and a step with an inf gradient changes nothing, its count
    # included. So ours ends where STEPS + 1 plain steps end.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for bad in (False, True):
        before = [p.detach().clone() for p in ours]
        opt.zero_grad()
        scaler.scale(sum((p * g).sum() for p, g in zip(ours, grads[STEPS], strict=True))
                     ).backward()
        if bad:
            ours[1].grad[0] = math.inf
        with pytest.warns(FutureWarning):  # torch's notice about passing itself
            scaler.step(opt)
        scaler.update()
        assert opt.param_groups[0]["step"].item() == STEPS + 1
        assert all(torch.equal(p, b) for p, b in zip(ours, before, strict=True)) == bad
    _run(FusedAdam(twins, lr=LR, capturable=True), twins, grads)
    for p, t in zip(ours, twins, strict=True):
        assert torch.equal(p, t)


@pytest.mark.cuda
def test_capturable_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, opt_eager = FusedAdam(params, lr=LR, capturable=True), FusedAdam(eager, lr=LR)
    grads = [[g.cuda() for g in step] for step in _grads([(16, 8), (8,)])]
    static = [torch.zeros_like(p) for p in params]
    for p, s in zip(params, static, strict=True):
        p.grad = s
    for s, g in zip(static, grads[0], strict=True):
        s.copy_(g)
    warm_up_for_capture(opt.step, times=1)  # (makes the states outside the graph)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step in grads[1:]:
        for s, g in zip(static, step, strict=True):
            s.copy_(g)
        graph.replay()
    _run(opt_eager, eager, grads)
    for p, e in zip(params, eager, strict=True):
        assert torch.equal(p, e)


# ------------------------------------------------------------ FusedSGD


@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay", [
    (0.0, 0.0, False, 0.0), (0.9, 0.0, False, 0.0), (0.9, 0.1, False, 0.01),
    (0.9, 0.0, True, 0.01)])
def test_sgd_matches_torch(momentum, dampening, nesterov, weight_decay):
    grads = _grads([(16, 8), (8,)])
    ours, fused, plain = _params(), _params(), _params()
    kw = dict(lr=LR, momentum=momentum, dampening=dampening, nesterov=nesterov,
              weight_decay=weight_decay)
    _run(FusedSGD(ours, **kw), ours, grads)
    _run(torch.optim.SGD(fused, fused=True, **kw), fused, grads)
    _run(torch.optim.SGD(plain, foreach=False, **kw), plain, grads)
    for p, f, q in zip(ours, fused, plain, strict=True):
        assert torch.equal(p, f)
        _assert_fp32_close(p, q)


def test_sgd_weight_decay_after_momentum():
    momentum, wd = 0.9, 0.05
    grads = _grads([(32,)])
    ours = _params(shapes=[(32,)])
    p, buf = ours[0].detach().double().clone(), None
    _run(FusedSGD(ours, lr=LR, momentum=momentum, weight_decay=wd, wd_after_momentum=True),
         ours, grads)
    for (g,) in grads:  # NVIDIA's kernel, in float64
        buf = g.double() if buf is None else momentum * buf + g.double()
        p = p - LR * (buf + wd * p)
    _assert_fp32_close(ours[0], p.float())


def test_sgd_bf16_params():
    # Updated in float32 with a bf16 momentum buffer, both rounded back every step.
    grads = _grads([(16, 8)])
    ours, shadow = _params(torch.bfloat16, [(16, 8)]), _params(shapes=[(16, 8)])
    opt, opt_ref = FusedSGD(ours, lr=LR, momentum=0.9), torch.optim.SGD(shadow, lr=LR,
                                                                         momentum=0.9)
    start = ours[0].detach().clone()
    for (g,) in grads:
        ours[0].grad, shadow[0].grad = g.bfloat16(), g.bfloat16().float()
        shadow[0].data.copy_(ours[0].float())
        opt.step()
        opt_ref.step()
        buffer = opt_ref.state[shadow[0]]["momentum_buffer"]
        buffer.copy_(buffer.bfloat16().float())
        assert torch.equal(ours[0], shadow[0].bfloat16())
        assert torch.equal(opt.state[ours[0]]["momentum_buffer"], buffer.bfloat16())
    assert not torch.equal(ours[0], start)


# ------------------------------------------------------------ NVIDIA's example program


def test_quantized_model_init_example_flow():
    """examples/pytorch/quantized_model_init/main.py, smaller and on the CPU: FP8 weights,
    float32 main_grad buffers given to FusedAdam as decoupled_grad, float32 master weights."""
    with te.quantized_model_init(enabled=True):
        model = te.TransformerLayer(64, 128, 4, fuse_wgrad_accumulation=True,
                                    fuse_qkv_params=True, params_dtype=torch.bfloat16,
                                    hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    fp8 = [p for p in model.parameters() if isinstance(p, QuantizedTensor)]
    assert fp8
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True,
                                  master_weight_dtype=torch.float32, use_decoupled_grad=True)
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    target = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.main_grad.zero_()
        with te.autocast(enabled=True):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                p.main_grad.copy_(p.grad)
                p.grad = None
            p.decoupled_grad = p.main_grad
        opt.step()
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True)), losses
    for p in model.parameters():
        state = opt.state[p]
        master = state["master_param"]
        assert master.dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == \
            torch.float32
        assert p.main_grad.dtype == torch.float32
        if isinstance(p, Float8Tensor):
            want = Float8Tensor.quantize(master.to(p.dtype), p._fp8_dtype)
            assert torch.equal(p.dequantize(), want.dequantize())
        else:
            assert torch.equal(p, master.to(p.dtype))
    assert all(isinstance(p, Float8Tensor) for p in fp8)


# ------------------------------------------------------------ refusals


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(amsgrad=True), NotImplementedError, ["amsgrad", "False", "True"]),
    (dict(exp_avg_dtype=torch.float64), ValueError,
     ["exp_avg_dtype", "torch.uint8 (FP8)", "torch.float64"]),
    (dict(exp_avg_sq_dtype=torch.int8), ValueError, ["exp_avg_sq_dtype", "torch.int8"]),
    (dict(master_weights=True, master_weight_dtype=torch.bfloat16), ValueError,
     ["master_weight_dtype", "torch.float16", "torch.bfloat16"]),
    (dict(capturable=True, exp_avg_dtype=torch.float16), ValueError,
     ["exp_avg_dtype", "capturable", "torch.float16"]),
    (dict(capturable=True, master_weights=True, store_param_remainders=True), ValueError,
     ["store_param_remainders", "capturable"]),
    (dict(betas=(0.9, 1.0)), ValueError, ["betas[1]", "[0, 1)", "1.0"]),
])
def test_adam_refusals(kwargs, error, words):
    with pytest.raises(error) as info:
        FusedAdam(_params(), **kwargs)
    assert str(info.value).startswith("FusedAdam: ")
    for word in words:
        assert word in str(info.value)
    if kwargs.get("amsgrad"):
        assert isinstance(info.value, RuntimeError)  # the type NVIDIA's raises


def test_adam_step_refusals_change_nothing():
    with te.quantized_model_init(enabled=True):
        layer = te.Linear(32, 16, params_dtype=torch.bfloat16, device="cpu")
    params = list(layer.parameters())
    before = [p.detach().clone() for p in params]
    for p in params:
        p.decoupled_grad = torch.ones(p.shape)
    opt = FusedAdam(params, use_decoupled_grad=True)
    with pytest.raises(ValueError, match="FusedAdam: master_weights must be True for FP8"):
        opt.step()
    assert len(opt.state) == 0 and "step" not in opt.param_groups[0]
    assert all(torch.equal(p.dequantize() if isinstance(p, Float8Tensor) else p, b)
               for p, b in zip(params, before, strict=True))
    wide = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    wide.grad = torch.ones(4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"FusedAdam: parameters must be .* got torch.float64"):
        FusedAdam([wide]).step()


def test_sgd_refusals():
    with te.quantized_model_init(enabled=True):
        layer = te.Linear(32, 16, bias=False, device="cpu")
    layer.weight.grad = torch.ones(16, 32)
    with pytest.raises(TypeError, match="FusedSGD: parameters must be .* Float8Tensor"):
        FusedSGD(layer.parameters(), lr=0.1).step()
    with pytest.raises(ValueError, match="FusedSGD: nesterov=True needs momentum > 0"):
        FusedSGD(_params(), lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(_params())


def test_set_grad_none_is_deprecated():
    params = _params()
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt = FusedAdam(params, set_grad_none=False)
    for p in params:
        p.grad = torch.ones(p.shape)
    opt.zero_grad()
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in params)
    with pytest.raises(ValueError, match="set_to_none must match"):
        opt.zero_grad(set_to_none=True)
