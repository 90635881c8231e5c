"""Delayed scaling's state over several steps against a plain-Python model of the recipe,
and how the autocast orchestrates the update: outermost exit, one core call, calibration."""

from __future__ import annotations

import pytest
import torch
from te_torch_tests import _reference as ref

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import fp8, ops


def _as_list(t: torch.Tensor) -> list:
    return t.detach().cpu().tolist()


@pytest.mark.parametrize("algo,margin,fmt", [("max", 0, recipe.Format.HYBRID),
                                             ("most_recent", 2, recipe.Format.E4M3)])
def test_state_sequence_matches_the_recipe_model(algo, margin, fmt, device):
    r = recipe.DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=margin,
                              fp8_format=fmt)
    layer = te.Linear(32, 16, device=device)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    model = ref.DelayedScalingModel(3, fmt.max_fwd, fmt.max_bwd, algo, margin)
    for step in range(5):  # 5 > history length: the history wraps around
        x = torch.randn(16, 32, device=device) * 2.0**step
        g = torch.randn(16, 16, device=device) * 4.0**-step
        amax_w = layer.weight.detach().abs().max().item()
        with te.fp8_autocast(fp8_recipe=r):
            y = layer(x)
        model.forward(x.abs().max().item(), amax_w)
        inv_fwd = model.autocast_exit()
        (y * g).sum().backward()
        inv_bwd = model.backward(g.abs().max().item())
        opt.step()
        opt.zero_grad()
        assert _as_list(layer.amax_history_fwd) == model.history_fwd, step
        assert _as_list(layer.scale_fwd) == model.scale_fwd, step
        assert _as_list(layer.scale_inv_fwd) == inv_fwd, step
        assert _as_list(layer.amax_history_bwd) == model.history_bwd, step
        assert _as_list(layer.scale_bwd) == model.scale_bwd, step
        assert _as_list(layer.scale_inv_bwd) == inv_bwd, step


def test_update_runs_once_at_the_outermost_exit_in_one_call(monkeypatch):
    calls = []
    real = fp8.scale_update  # every delayed-scaling update goes through it

    def spy(histories, scales, scale_invs, fp8_dtype, algo, margin):
        calls.append((len(histories), fp8_dtype))
        return real(histories, scales, scale_invs, fp8_dtype, algo, margin)

    monkeypatch.setattr(fp8, "scale_update", spy)
    layers = [te.Linear(32, 32, device="cpu") for _ in range(3)]
    x = torch.randn(16, 32)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        x = layers[0](x)
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):  # nested: no update here
            x = layers[1](x)
        assert calls == []
        with te.fp8_autocast(enabled=False):  # high precision inside: nothing recorded
            x = layers[2](x)
    assert calls == [(2, "float8_e4m3")]  # one call over both modules that ran in FP8
    assert layers[2].scale_fwd.tolist() == [1.0, 1.0]
    assert layers[0].scale_fwd.ne(1.0).all() and layers[1].scale_fwd.ne(1.0).all()


def test_two_forwards_in_one_autocast_record_the_larger_amax():
    layer = te.Linear(32, 16, device="cpu")
    r = recipe.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent")
    small, large = torch.full((16, 32), 0.5), torch.full((16, 32), 3.0)
    with te.fp8_autocast(fp8_recipe=r):
        layer(large)
        layer(small)
    # the exit rolled the history: the amax written at slot 0 sits at the end
    assert layer.amax_history_fwd[-1, 0].item() == 3.0
    assert layer.scale_fwd[0].item() == pytest.approx(448.0 / 3.0)


def test_calibration_records_amaxes_and_computes_in_high_precision():
    layer = te.Linear(32, 16, device="cpu")
    x = torch.randn(16, 32) * 10
    with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe.DelayedScaling()):
        y = layer(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, layer.weight, layer.bias),
                               rtol=0, atol=0)
    want = [448.0 / x.abs().max().item(), 448.0 / layer.weight.abs().max().item()]
    torch.testing.assert_close(layer.scale_fwd, torch.tensor(want), rtol=1e-6, atol=0)


def test_user_callables_run_in_python():
    """amax_compute_algo / scaling_factor_compute_algo callables replace the core's rule."""
    r = recipe.DelayedScaling(
        amax_history_len=2, amax_compute_algo=lambda h: h.amax(dim=0) * 2,
        scaling_factor_compute_algo=lambda amax, scale, fmax, rc: fmax / amax / 2**rc.margin)
    layer = te.Linear(32, 16, device="cpu")
    x = torch.full((16, 32), 4.0, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=r):
        y = layer(x)
    y.backward(torch.ones_like(y))
    assert layer.scale_fwd[0].item() == pytest.approx(448.0 / 8.0)
    assert layer.scale_bwd.item() == pytest.approx(57344.0 / 2.0)


def test_scaling_factor_callable_alone_also_rules_the_backward_update():
    """A string amax_compute_algo with a scaling_factor_compute_algo callable: the backward's
    grad_output scale follows the callable too, not the core's rule."""
    r = recipe.DelayedScaling(
        amax_history_len=2, amax_compute_algo="max",
        scaling_factor_compute_algo=lambda amax, scale, fmax, rc: fmax / amax / 4.0)
    layer = te.Linear(32, 16, device="cpu")
    x = torch.full((16, 32), 4.0, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=r):
        y = layer(x)
    y.backward(torch.ones_like(y))
    assert layer.scale_fwd[0].item() == pytest.approx(448.0 / 4.0 / 4.0)
    assert layer.scale_bwd.item() == pytest.approx(57344.0 / 1.0 / 4.0)


def test_quantize_delayed_raises_its_history_slot_in_place(device):
    """The op behind delayed scaling's quantization: the bytes and scale_inv of ops.quantize
    with scales[index], and max|x| raised into amax_history[0, index] alone (None: no record)."""
    x = torch.randn(16, 32, device=device) * 3
    scales = torch.tensor([0.5, 2.0, 8.0], device=device)
    history = torch.full((4, 3), 0.25, device=device)
    history[0, 1] = 100.0
    want = ops.quantize(x, scales[2:3].clone(), "float8_e5m2", True, True)
    data, col, sinv = ops.quantize_delayed(x, scales, 2, history, "float8_e5m2", True, True)
    for got, expected in zip((data, col, sinv), (want[0], want[1], want[2]), strict=True):
        assert torch.equal(got, expected)
    expected_history = torch.full((4, 3), 0.25, device=device)
    expected_history[0, 1] = 100.0
    expected_history[0, 2] = want[3][0]
    assert torch.equal(history, expected_history)
    ops.quantize_delayed(x, scales, 1, history, "float8_e5m2", True, False)  # 100 > max|x|
    assert torch.equal(history, expected_history)
    ops.quantize_delayed(x * 1e3, scales, 0, None, "float8_e5m2", True, False)
    assert torch.equal(history, expected_history)
    with pytest.raises(ValueError, match="quantize_delayed: amax_history must be .* n > index=3"):
        ops.quantize_delayed(x, torch.ones(4, device=device), 3, history, "float8_e4m3", True,
                             False)


@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_quantize_delayed_many_equals_the_calls_one_by_one(device, rowwise, columnwise):
    """The batched cast of a grouped layer's groups (each with its own scales and history, an
    empty group among them): the bytes, scale_invs and history records of quantize_delayed
    called group by group; lists of different lengths are refused."""
    shapes = [(32, 64), (0, 64), (16, 64), (48, 64)]
    xs = [torch.randn(s, device=device) * (i + 1) for i, s in enumerate(shapes)]
    scales = [torch.tensor([0.5 * (i + 1), 2.0], device=device) for i in range(len(xs))]
    histories = [torch.full((3, 2), 0.5, device=device) for _ in xs]
    expected = [h.clone() for h in histories]
    datas, cols, sinvs = ops.quantize_delayed_many(xs, scales, 0, histories, "float8_e4m3",
                                                   rowwise, columnwise)
    for i, x in enumerate(xs):
        want = ops.quantize_delayed(x, scales[i], 0, expected[i], "float8_e4m3", rowwise,
                                    columnwise)
        for got, w in zip((datas[i], cols[i], sinvs[i]), want, strict=True):
            assert got.shape == w.shape and torch.equal(got, w), i
        assert torch.equal(histories[i], expected[i]), i
    with pytest.raises(ValueError, match="quantize_delayed_many: xs, scales and amax_histories "
                                         "must be as many, got 2, 1 and 2"):
        ops.quantize_delayed_many(xs[:2], scales[:1], 0, histories[:2], "float8_e4m3", True,
                                  False)


@pytest.mark.parametrize("rowwise,columnwise", [(True, True), (True, False), (False, True)])
def test_quantize_current_many_equals_the_calls_one_by_one(device, rowwise, columnwise):
    """The batched current-scaling cast of a grouped layer's groups (an empty group and an
    all-zero one among them): the bytes and scale_invs of quantize_current group by group."""
    shapes = [(32, 64), (0, 64), (16, 64), (48, 64)]
    xs = [torch.randn(s, device=device) * (i + 1) for i, s in enumerate(shapes)]
    xs[2] = torch.zeros(16, 64, device=device)
    datas, cols, sinvs = ops.quantize_current_many(xs, "float8_e5m2", rowwise, columnwise,
                                                   True, 1e-3)
    for i, x in enumerate(xs):
        data, col, _, sinv, _ = ops.quantize_current(x, "float8_e5m2", rowwise, columnwise,
                                                     True, 1e-3)
        for got, w in zip((datas[i], cols[i], sinvs[i]), (data, col, sinv), strict=True):
            assert got.shape == w.shape and torch.equal(got, w), i


def test_quantize_delayed_traces_as_an_op_that_mutates_the_history():
    """Under torch.compile the op is one graph node whose in-place record survives
    functionalization: the compiled call leaves the history as the eager one does."""
    x = torch.randn(16, 32)
    scales = torch.tensor([4.0, 1.0])

    def step(x, scales, history):
        data, _, sinv = ops.quantize_delayed(x, scales, 1, history, "float8_e4m3", True, False)
        return data, sinv

    eager_history, compiled_history = torch.zeros(3, 2), torch.zeros(3, 2)
    want = step(x, scales, eager_history)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, scales, compiled_history)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(compiled_history, eager_history)
    assert compiled_history[0, 1] == x.abs().max()


@pytest.mark.parametrize("op", ["norm_forward_fp8", "activation_forward_fp8",
                                "activation_backward_fp8"])
def test_fused_fp8_ops_raise_their_history_slot_in_place(op, device):
    """The norm and activation ops of the fused modules record delayed scaling's amax as
    quantize_delayed does: the returned amax of the plain call, raised into
    amax_history[0, index] alone (kept when the slot holds more), with the same bytes."""
    x = torch.randn(16, 32, device=device) * 3
    scale = torch.tensor([2.0], device=device)

    def call(*history):
        if op == "norm_forward_fp8":
            out = ops.norm_forward_fp8(x, torch.ones(32, device=device), None, "rmsnorm", 1e-5,
                                       False, scale, "float8_e4m3", True, False, *history)
            return out[1], out[4]
        if op == "activation_forward_fp8":
            out = ops.activation_forward_fp8(x, "gelu", scale, "float8_e4m3", True, True,
                                             *history)
            return out[0], out[3]
        out = ops.activation_backward_fp8(x, x, "identity", scale, "float8_e5m2", True, True,
                                          True, *history)
        return out[0], out[3]

    want_data, want_amax = call()
    history = torch.full((4, 3), 0.25, device=device)
    history[0, 1] = 1e6
    data, amax = call(history, 2)
    assert torch.equal(data, want_data) and amax.numel() == 0
    expected = torch.full((4, 3), 0.25, device=device)
    expected[0, 1] = 1e6
    expected[0, 2] = want_amax[0]
    assert torch.equal(history, expected)
    call(history, 1)  # the slot holds more: unchanged
    assert torch.equal(history, expected)
