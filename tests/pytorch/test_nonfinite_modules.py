"""No silent wrong answers in the modules: an infinity in the input of an FP8 layer gives a
non-finite output wherever the bf16 layer gives one, under every recipe that runs here, so
that overflow checks and loss scalers see it. Delayed scaling records the non-finite amax and
keeps the scale it had."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "delayed-e4m3": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.E4M3,
                                                  amax_history_len=4),
    "current": lambda: recipe.Float8CurrentScaling(),
    "block": lambda: recipe.Float8BlockScaling(),
}
MODULES = {
    "Linear": lambda: te.Linear(128, 64, params_dtype=torch.bfloat16, device="cpu"),
    "LayerNormLinear": lambda: te.LayerNormLinear(128, 64, params_dtype=torch.bfloat16,
                                                  device="cpu"),
    "LayerNormMLP": lambda: te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, device="cpu"),
}
M, K = 32, 128


def _input(special: float) -> torch.Tensor:
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    x[5, 17] = special
    return x


def _bad_rows(y: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(y.float()).all(dim=-1)


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("name", RECIPES)
def test_nonfinite_input_gives_nonfinite_output(name, module, special):
    torch.manual_seed(0)
    layer = MODULES[module]()
    x = _input(special)
    with torch.no_grad():
        want = layer(x)
        with te.fp8_autocast(fp8_recipe=RECIPES[name]()):
            got = layer(x)
    assert _bad_rows(want)[5], "the bf16 layer should carry the non-finite row"
    # The same rows are non-finite: the bad row is not hidden, and the finite rows stay finite
    # (with current and block scaling they saturate under the fallback scale, not NaN).
    torch.testing.assert_close(_bad_rows(got), _bad_rows(want))


def test_mxfp8_is_refused_here():
    """MXFP8 has no GEMM on this build (the plan refuses it): nothing to check for it."""
    layer = MODULES["Linear"]()
    with pytest.raises(Exception, match="(?i)mxfp8"):
        with te.fp8_autocast(fp8_recipe=recipe.MXFP8BlockScaling()):
            layer(_input(float("inf")))


@pytest.mark.parametrize("name", RECIPES)
def test_nonfinite_grad_output_gives_nonfinite_grads(name):
    """Backward too: an infinite output gradient (E5M2 keeps it an infinity) reaches dgrad."""
    torch.manual_seed(0)
    layer = MODULES["Linear"]()
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, 64, dtype=torch.bfloat16)
    g[3, 2] = float("inf")
    with te.fp8_autocast(fp8_recipe=RECIPES[name]()):
        y = layer(x)
    y.backward(g)
    assert _bad_rows(x.grad)[3]
    assert torch.isfinite(x.grad.float()[[0, 1, 2, 4]]).all()
    assert not torch.isfinite(layer.weight.grad.float()).all()


def test_delayed_scaling_keeps_the_scale_after_a_nonfinite_step():
    """The Inf step's amax is recorded in the history; the input's scale stays what it was
    (a non-finite amax changes no scale)."""
    torch.manual_seed(0)
    layer = MODULES["Linear"]()
    r = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        layer(torch.randn(M, K, dtype=torch.bfloat16))
    before = layer.scale_fwd.detach().clone()
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        y = layer(_input(float("inf")))
    assert not torch.isfinite(y.float()).all()
    assert not torch.isfinite(layer.amax_history_fwd[:, 0]).all(), "the Inf amax is recorded"
    assert layer.scale_fwd[0].item() == before[0].item()
    assert layer.scale_fwd[1].item() == before[1].item()  # the weight did not change either
    # One more finite step: the history still holds the Inf (max algo), so the scale still
    # does not move, and the layer's output is finite again.
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        y = layer(torch.randn(M, K, dtype=torch.bfloat16))
    assert torch.isfinite(y.float()).all()
    assert layer.scale_fwd[0].item() == before[0].item()
