"""What Megatron-LM reads and sets on te modules beyond their arguments: NVIDIA's attribute
names (``use_bias``, ``eps``, ``zero_centered_gamma``, ``ub_name``, ``save_original_input``),
its own ``_tp_group`` on a subclass (which must not clash with ours), and a one-rank expert
group given to te.GroupedLinear."""

from __future__ import annotations

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling


def test_attributes_megatron_reads():
    lin = te.Linear(16, 32, bias=False, ub_name="proj", device="cpu")
    assert lin.use_bias is False and lin.ub_name == "proj" and lin.save_original_input is False
    lnl = te.LayerNormLinear(16, 32, eps=1e-6, zero_centered_gamma=True, ub_name="qkv",
                             device="cpu")
    assert lnl.use_bias is True and lnl.eps == 1e-6 and lnl.zero_centered_gamma is True
    assert lnl.ub_name == "qkv"
    # Megatron's extra_repr reads them: printing a subclass must work
    assert "in_features=16" in repr(lin)


class _MegatronStyleLinear(te.Linear):
    """Megatron's TELinear keeps its own process group in ``self._tp_group``."""

    def __init__(self, *args, **kwargs):
        self._tp_group = object()  # set before te.Linear's __init__, as Megatron's does
        super().__init__(*args, **kwargs)
        self._tp_group = object()


def test_subclass_private_tp_group_does_not_clash():
    layer = _MegatronStyleLinear(16, 16, device="cpu")
    assert layer.tp_group is None  # ours, untouched by the subclass's attribute
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_save_original_input_gives_the_same_values():
    """Accepted (Megatron sets it for non-delayed recipes); the backward keeps the FP8 copy,
    whose bytes are those the original quantized again would give."""
    torch.manual_seed(0)
    a = te.Linear(32, 32, device="cpu")
    b = te.Linear(32, 32, device="cpu", save_original_input=True)
    b.load_state_dict(a.state_dict())
    b.save_original_input = True
    x = torch.randn(16, 32)
    grads = []
    for layer in (a, b):
        inp = x.clone().requires_grad_(True)
        with te.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
            y = layer(inp)
        y.sum().backward()
        grads.append((y.detach(), inp.grad, layer.weight.grad))
    for u, v in zip(*grads, strict=True):
        assert torch.equal(u, v)


class _OneRankGroup:
    def size(self) -> int:
        return 1


def test_grouped_linear_takes_a_one_rank_group():
    layer = te.GroupedLinear(2, 16, 16, tp_group=_OneRankGroup(), device="cpu")
    assert layer(torch.randn(8, 16), [3, 5]).shape == (8, 16)
    with pytest.raises(NotImplementedError, match="tp_size=2 is not supported here"):
        te.GroupedLinear(2, 16, 16, tp_size=2, device="cpu")


def test_te_ops_names_megatron_evaluates():
    """megatron-core annotates with te.ops.FusibleOperation and builds its activation ops
    with cache_quantized_input and its linears with userbuffers_options."""
    assert issubclass(te.ops.BasicOperation, te.ops.FusibleOperation)
    linear = te.ops.BasicLinear(16, 16, device="cpu", userbuffers_options=None)
    act = te.ops.SwiGLU(cache_quantized_input=False)
    for op in (linear, act, te.ops.Bias(16, device="cpu"), te.ops.RMSNorm(16, device="cpu")):
        assert isinstance(op, te.ops.FusibleOperation), type(op).__name__
    assert not isinstance(te.ops.Sequential(), te.ops.FusibleOperation)
    with pytest.raises(NotImplementedError, match=r"te\.ops\.GELU: cache_quantized_input=True"):
        te.ops.GELU(cache_quantized_input=True)
    with pytest.raises(NotImplementedError, match="userbuffers_options"):
        te.ops.Linear(16, 16, device="cpu", userbuffers_options={"comm_name": "qkv"})


def _tracker(seed: int) -> te.CudaRNGStatesTracker:
    tracker = te.CudaRNGStatesTracker()
    tracker.add("expert-parallel-rng", seed)
    return tracker


@pytest.mark.parametrize("build", [
    lambda **kw: te.GroupedLinear(2, 16, 16, device="cpu", **kw),
    lambda **kw: te.Linear(16, 16, device="cpu", **kw),
], ids=["GroupedLinear", "Linear"])
def test_expert_weights_drawn_on_the_named_tracker_stream(build):
    """Megatron-LM builds expert layers with its tracker and rng_tracker_name
    "expert-parallel-rng", seeded per expert-parallel rank: two ranks' experts must differ
    (drawn from torch's generator, seeded alike on every rank, they were equal), the same
    seed gives the same weights, and torch's generator is left where it was."""
    def weights(seed, name="expert-parallel-rng"):
        torch.manual_seed(0)
        tracker = _tracker(seed)
        layer = build(get_rng_state_tracker=lambda: tracker, rng_tracker_name=name)
        return [p.detach().clone() for p in layer.parameters()], torch.randn(3)

    rank0, after0 = weights(1000)
    rank1, after1 = weights(2000)
    again, _ = weights(1000)
    assert all(torch.equal(a, b) for a, b in zip(rank0, again, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))
    assert torch.equal(after0, after1)  # the default generator did not move
    # Without a stream name the default generator draws: the tracker's seed does not matter.
    plain0, _ = weights(1000, name=None)
    plain1, _ = weights(2000, name=None)
    assert all(torch.equal(a, b) for a, b in zip(plain0, plain1, strict=True))
