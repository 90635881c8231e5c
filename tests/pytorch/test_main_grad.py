"""fuse_wgrad_accumulation (Megatron-LM's gradient buffers): every GEMM weight's gradient
goes into ``weight.main_grad``, NVIDIA TE's contract (module/_main_grad.py): the sums of
the gradients an unfused module gets in ``.grad``, a dummy ``.grad`` where the weight has
``grad_added_to_main_grad`` (zeros with ``zero_out_wgrad``), no ``.grad`` otherwise."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPES = {"bf16": None, "current": recipe.Float8CurrentScaling(),
           "delayed": recipe.DelayedScaling()}


def _gemm_weights(module):
    return [p for m in module.modules() if hasattr(m, "_gemm_weights")
            for p in m._gemm_weights()]


def _pair(make):
    torch.manual_seed(0)
    fused = make(True)
    torch.manual_seed(0)
    plain = make(False)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


MODULES = {
    "Linear": lambda f: te.Linear(32, 48, fuse_wgrad_accumulation=f, device="cpu"),
    "LayerNormLinear": lambda f: te.LayerNormLinear(32, 48, fuse_wgrad_accumulation=f,
                                                    device="cpu"),
    "LayerNormMLP": lambda f: te.LayerNormMLP(32, 64, fuse_wgrad_accumulation=f,
                                              device="cpu"),
    "TransformerLayer": lambda f: te.TransformerLayer(
        32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0, fuse_wgrad_accumulation=f,
        params_dtype=torch.float32, device="cpu"),
}


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("r", sorted(RECIPES))
def test_main_grad_holds_the_sum_of_the_unfused_gradients(name, r):
    fused, plain = _pair(MODULES[name])
    weights = _gemm_weights(fused)
    assert weights and all(w.requires_grad for w in weights)
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
        w.grad_added_to_main_grad = False
    shape = (16, 2, 32) if name == "TransformerLayer" else (16, 32)
    for _ in range(2):  # two microbatches: the sums accumulate
        x = torch.randn(*shape)
        for m in (fused, plain):
            with te.fp8_autocast(enabled=RECIPES[r] is not None, fp8_recipe=RECIPES[r]):
                out = m(x)
            (out[0] if isinstance(out, tuple) else out).square().sum().backward()
    by_name = dict(plain.named_parameters())
    for n, p in fused.named_parameters():
        if any(p is w for w in weights):
            assert torch.equal(p.main_grad, by_name[n].grad.float()), n
            assert p.grad_added_to_main_grad and p.grad.shape == p.shape, n
        else:  # norms and biases keep their gradients
            assert torch.equal(p.grad, by_name[n].grad), n


def test_grouped_experts_weights_go_into_main_grad_too():
    fused = te.GroupedLinear(3, 32, 16, fuse_wgrad_accumulation=True, device="cpu")
    plain = te.GroupedLinear(3, 32, 16, device="cpu")
    plain.load_state_dict(fused.state_dict())
    for w in _gemm_weights(fused):
        w.main_grad = torch.zeros(w.shape)
    x = torch.randn(20, 32)
    for m in (fused, plain):
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
            m(x, [5, 0, 15]).square().sum().backward()
    for i in range(3):
        w, ref = fused.gemms[i].weight, plain.gemms[i].weight
        assert torch.equal(w.main_grad, ref.grad) and w.grad is None, i  # no attribute


def test_zero_out_wgrad_gives_zeros_and_a_missing_main_grad_is_named():
    layer = te.Linear(16, 16, fuse_wgrad_accumulation=True, device="cpu")
    layer.weight.main_grad = torch.zeros(16, 16)
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = True
    layer(torch.randn(4, 16)).sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros(16, 16))
    assert layer.weight.main_grad.abs().sum() > 0
    bare = te.Linear(16, 16, fuse_wgrad_accumulation=True, device="cpu")
    with pytest.raises(RuntimeError, match=r"fuse_wgrad_accumulation: the weight of shape "
                                           r"\[16, 16\] needs a main_grad"):
        bare(torch.randn(4, 16)).sum().backward()


def test_parameters_made_after_construction_are_hooked_at_their_first_forward():
    """Deferred initialization makes the parameters at reset_parameters(): the forward hooks
    them then."""
    layer = te.Linear(16, 8, fuse_wgrad_accumulation=True, device="meta")
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    layer.weight.main_grad = torch.zeros(8, 16)
    layer(torch.randn(4, 16)).sum().backward()
    assert layer.weight.main_grad.abs().sum() > 0 and layer.weight.grad is None
