"""The helpers of NVIDIA's ``transformer_engine.pytorch.graph`` and ``.utils`` that Megatron-LM's
CUDA-graph manager imports: saving and restoring the FP8 state around warm-up steps, the
capture flag, the base-module class, the recompute query and weak tensor references."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import first_step, graph, utils
from transformer_engine.pytorch.distributed import (
    activation_recompute_forward,
    is_fp8_activation_recompute_enabled,
)
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

H = 32


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        te.Linear(H, H), te.LayerNormMLP(H, 2 * H),
        te.TransformerLayer(H, 2 * H, 4, hidden_dropout=0.0, attention_dropout=0.0))


def _step(model, x, rcp) -> torch.Tensor:
    with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        y = model(x)
    y.float().square().mean().backward()
    return y.detach()


def _state(model) -> dict:
    return {(i, name): b for i, m in enumerate(model.modules())
            if isinstance(m, TransformerEngineBaseModule) for name, b in m._buffers.items()}


@pytest.mark.parametrize("eager_first", [False, True])
def test_restore_undoes_warmup_in_place(eager_first):
    rcp = recipe.DelayedScaling(amax_history_len=4)
    x = torch.randn(8, 2, H)
    model = _model()
    if eager_first:  # real state (and no first-step marks left) before the warm-up
        _step(model, x, rcp)
    twin = copy.deepcopy(model)  # never runs the warm-up
    saved = graph.save_fp8_tensors([model], rcp)
    before = {k: (b.data_ptr(), b.clone()) for k, b in _state(model).items()}
    assert len(before) == 9 * 6  # Linear, LayerNormMLP, QKV, proj, MLP, DPA: 9 buffers each
    for _ in range(3):
        _step(model, torch.randn(8, 2, H) * 100.0, rcp)
    after_warmup = _state(model)
    assert any(not torch.equal(after_warmup[k], v) for k, (_, v) in before.items())
    graph.restore_fp8_tensors([model], saved)
    assert saved == []  # consumed, as NVIDIA's
    for k, b in _state(model).items():
        assert b.data_ptr() == before[k][0], k
        assert torch.equal(b, before[k][1]), k
    model.zero_grad()
    twin.zero_grad()
    assert torch.equal(_step(model, x, rcp), _step(twin, x, rcp))
    for (k, b), (_, t) in zip(_state(model).items(), _state(twin).items(), strict=True):
        assert torch.equal(b, t), k
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_save_fits_history_length_and_ignores_other_recipes():
    m = te.Linear(H, H)
    assert m.amax_history_fwd.shape[0] != 7
    saved = graph.save_fp8_tensors([m], recipe.DelayedScaling(amax_history_len=7))
    assert m.amax_history_fwd.shape[0] == 7 and m.amax_history_bwd.shape[0] == 7
    assert saved[0]["values"]["amax_history_fwd"].shape[0] == 7
    assert first_step.has_empty(m.amax_history_fwd)  # a fresh module keeps its first step
    assert graph.save_fp8_tensors([m], recipe.Float8CurrentScaling()) is None
    graph.restore_fp8_tensors([m], None)  # nothing to do


def test_restore_checks_its_modules():
    rcp = recipe.DelayedScaling()
    saved = graph.save_fp8_tensors([te.Linear(H, H)], rcp)
    with pytest.raises(RuntimeError, match="same modules"):
        graph.restore_fp8_tensors([torch.nn.Sequential(te.Linear(H, H), te.Linear(H, H))],
                                  saved)
    m = te.Linear(H, H)
    saved = graph.save_fp8_tensors([m], rcp)
    _step(m, torch.randn(4, H), recipe.DelayedScaling(amax_history_len=3))
    with pytest.raises(RuntimeError, match="amax_history_len"):
        graph.restore_fp8_tensors([m], saved)


def test_capture_flag():
    assert not graph.is_graph_capturing()
    graph.set_capture_start()
    try:
        assert graph.is_graph_capturing()
    finally:
        graph.set_capture_end()
    assert not graph.is_graph_capturing()


def test_no_first_step_rule_while_capturing():
    x = torch.randn(4, H)
    rcp = recipe.DelayedScaling()
    a = te.Linear(H, H)
    b = copy.deepcopy(a)
    graph.set_capture_start()
    try:
        _step(a, x, rcp)
    finally:
        graph.set_capture_end()
    assert not first_step.has_empty(a.amax_history_fwd)  # the capture took the marks
    _step(b, x, rcp)  # eager: the first step scales from the tensors' own amaxes
    assert not torch.equal(a.scale_fwd, torch.ones_like(a.scale_fwd))
    assert torch.equal(a.amax_history_fwd, b.amax_history_fwd)
    # the same amaxes, but a's step quantized with the initial scales of 1: another weight grad
    assert not torch.equal(a.weight.grad, b.weight.grad)


def test_base_module_class_is_nvidias():
    base = TransformerEngineBaseModule
    for m in (te.Linear(H, H), te.LayerNormLinear(H, H), te.LayerNormMLP(H, 2 * H),
              te.DotProductAttention(4, 8)):
        assert isinstance(m, base), type(m).__name__
    for m in (te.MultiheadAttention(H, 4), te.TransformerLayer(H, 2 * H, 4),
              te.GroupedLinear(2, H, H), te.LayerNorm(H), torch.nn.Linear(H, H)):
        assert not isinstance(m, base), type(m).__name__
    assert all(isinstance(g, base) for g in te.GroupedLinear(2, H, H).gemms)


def test_fp8_activation_recompute_query():
    rcp = recipe.DelayedScaling()
    assert not is_fp8_activation_recompute_enabled()
    with activation_recompute_forward(activation_recompute=True):  # FP8 off: NVIDIA's False
        assert not is_fp8_activation_recompute_enabled()
    with te.fp8_autocast(enabled=True, fp8_recipe=rcp):
        assert not is_fp8_activation_recompute_enabled()
        with activation_recompute_forward(activation_recompute=True):
            assert is_fp8_activation_recompute_enabled()
        with activation_recompute_forward(activation_recompute=False):
            assert not is_fp8_activation_recompute_enabled()
        with activation_recompute_forward(activation_recompute=True, recompute_phase=True):
            assert not is_fp8_activation_recompute_enabled()
    assert not is_fp8_activation_recompute_enabled()


def test_make_weak_ref_passes_cpu_values_through():
    t = torch.randn(3)
    nested = (t, [t, None, 2, 1.5, True], {"k": t})
    out = utils.make_weak_ref(nested)
    assert out[0] is t and out[1][0] is t and out[1][1:] == [None, 2, 1.5, True]
    assert out[2]["k"] is t and isinstance(out[1], list) and isinstance(out, tuple)
    with pytest.raises(TypeError, match="make_weak_ref"):
        utils.make_weak_ref("text")


@pytest.mark.cuda
def test_make_weak_ref_shares_cuda_memory():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    base = torch.arange(24, dtype=torch.bfloat16, device="cuda").reshape(4, 6)
    for t in (base, base[1:, ::2], base.t(), torch.zeros(0, 3, device="cuda")):
        ref = utils.make_weak_ref(t)
        assert ref.is_cuda and ref.dtype == t.dtype and ref.shape == t.shape
        assert ref.stride() == t.stride()
        if t.numel():
            assert ref.data_ptr() == t.data_ptr()
            assert torch.equal(ref, t)
    ref = utils.make_weak_ref(base)
    ref.requires_grad = True  # as Megatron-LM sets it
    base[0, 0] = 100.0
    assert float(ref[0, 0]) == 100.0
    x = torch.ones(1 << 20, device="cuda")
    ref = utils.make_weak_ref(x)
    import sys
    refs = sys.getrefcount(x)
    del ref
    assert sys.getrefcount(x) == refs  # the reference held nothing of x
