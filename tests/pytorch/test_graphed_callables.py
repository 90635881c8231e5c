"""te.make_graphed_callables: per-module CUDA graphs of forward and backward whose replays
give the numbers of eager steps, FP8 scale updates included; refusals on any machine."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe


def test_refuses_what_it_does_not_implement_by_name():
    m = torch.nn.Linear(4, 4)
    x = (torch.randn(2, 4),)
    cases = [({"fp8_weight_caching": True}, "fp8_weight_caching"),
             ({"retain_graph_in_backward": True}, "retain_graph_in_backward"),
             ({"_order": [1, -1]}, "_order")]
    for kwargs, name in cases:
        with pytest.raises(NotImplementedError, match=name):
            te.make_graphed_callables(m, x, **kwargs)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        te.make_graphed_callables(m, x, bogus=1)


def test_checks_its_inputs_before_any_work():
    with pytest.raises(TypeError, match="modules must be torch.nn.Module"):
        te.make_graphed_callables((lambda t: t,), ((torch.randn(2),),))
    with pytest.raises(TypeError, match="one such tuple per module"):
        te.make_graphed_callables((torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)),
                                  (torch.randn(2, 2),))
    with pytest.raises(ValueError, match=r"sample_args\[0\] .* must hold CUDA tensors"):
        te.make_graphed_callables(torch.nn.Linear(2, 2), (torch.randn(2, 2),))


def test_sample_kwargs_are_checked_before_any_work():
    m, x = torch.nn.Linear(2, 2), (torch.randn(2, 2),)
    with pytest.raises(TypeError, match="sample_kwargs must be a dict for one module, or one "
                                        r"dict per module \(2\)"):
        te.make_graphed_callables((m, torch.nn.Linear(2, 2)), (x, x), sample_kwargs=({},))
    with pytest.raises(TypeError, match=r"sample_kwargs\[0\] must be a dict"):
        te.make_graphed_callables(m, x, sample_kwargs=[("mask", None)])
    with pytest.raises(ValueError, match=r"sample_args\[0\] \(and the tensors of "
                                         r"sample_kwargs\) must hold CUDA tensors"):
        te.make_graphed_callables(m, x, sample_kwargs={"mask": torch.ones(2)})


def test_keyword_inputs_split_into_graph_inputs_and_recorded_values():
    """The tensors of the sample keywords become graph inputs after the positional ones (in
    the order of their names); everything else is recorded and must come again unchanged."""
    from transformer_engine.pytorch.graphs import _Keywords

    mask, freqs = torch.ones(2, dtype=torch.bool), torch.zeros(4)
    kw = _Keywords({"rotary_pos_emb": freqs, "attention_mask": mask,
                    "self_attn_mask_type": "padding", "inference_params": None}, 0)
    other_mask, other_freqs = torch.zeros(2, dtype=torch.bool), torch.ones(4)
    call = {"attention_mask": other_mask, "rotary_pos_emb": other_freqs,
            "self_attn_mask_type": "padding", "inference_params": None}
    flat = kw.flatten(call, "here")
    assert flat[0] is other_mask and flat[1] is other_freqs
    rebuilt = kw.rebuild(flat)
    assert rebuilt.keys() == call.keys() and all(rebuilt[k] is call[k] for k in call)
    with pytest.raises(ValueError, match="here: keyword 'self_attn_mask_type' was 'padding' "
                                         "when the graphs were captured .* got 'causal'"):
        kw.flatten({**call, "self_attn_mask_type": "causal"}, "here")
    with pytest.raises(TypeError, match="here: the graphed forward was captured with keywords"):
        kw.flatten({"attention_mask": other_mask}, "here")
    with pytest.raises(TypeError, match="keyword 'rotary_pos_emb' was a tensor"):
        kw.flatten({**call, "rotary_pos_emb": None}, "here")


@pytest.mark.cuda
def test_replays_with_keyword_inputs_equal_eager_steps():
    """A TransformerLayer graphed with keyword inputs (NVIDIA's sample_kwargs, as Megatron-LM
    passes the mask and the rotary angles): new tensors at each call, and the recorded mask
    type; then a call with another mask type is refused."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    eager = _modules("TransformerLayer")
    graphed = copy.deepcopy(eager)
    freqs = te.RotaryPositionEmbedding(128)(64).cuda()

    def mask(lengths):
        pos = torch.arange(64, device="cuda").view(1, 64)
        return (pos >= torch.tensor(lengths, device="cuda").view(-1, 1)).view(2, 1, 1, 64)

    sample = {"attention_mask": mask([64, 40]), "rotary_pos_emb": freqs,
              "self_attn_mask_type": "padding_causal"}
    te.make_graphed_callables(graphed, (_input("TransformerLayer"),), sample_kwargs=sample)
    for lengths in ([64, 64], [17, 50]):
        x = _input("TransformerLayer")
        xg = x.detach().clone().requires_grad_()
        kw = {"attention_mask": mask(lengths), "rotary_pos_emb": freqs * 0.5,
              "self_attn_mask_type": "padding_causal"}
        want = eager(x, **kw)
        want.float().square().mean().backward()
        got = graphed(xg, **kw)
        got.float().square().mean().backward()
        assert torch.equal(got, want), f"lengths {lengths}: output"
        assert torch.equal(xg.grad, x.grad), f"lengths {lengths}: input gradient"
    with pytest.raises(ValueError, match="keyword 'self_attn_mask_type' was 'padding_causal'"):
        graphed(_input("TransformerLayer"), **{**kw, "self_attn_mask_type": "padding"})


def _modules(kind: str):
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    if kind == "Linear":
        return te.Linear(256, 512, **kw)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(256, 1024, **kw)
    return te.TransformerLayer(256, 1024, 2, hidden_dropout=0.0, attention_dropout=0.0,
                               attn_input_format="bshd", **kw)


def _input(kind: str, scale: float = 1.0) -> torch.Tensor:
    shape = (2, 64, 256) if kind == "TransformerLayer" else (128, 256)
    return (torch.randn(shape, device="cuda") * scale).to(torch.bfloat16).requires_grad_()


@pytest.mark.cuda
@pytest.mark.parametrize("r", [recipe.DelayedScaling(amax_history_len=4),
                               recipe.Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_replays_equal_eager_steps_with_their_scale_updates(kind, r):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(why)
    eager = _modules(kind)
    for m in (eager,):  # one eager step first: real scales, no first-step rule left
        with te.fp8_autocast(fp8_recipe=r):
            y = m(_input(kind))
        y.float().square().mean().backward()
        m.zero_grad(set_to_none=True)
    graphed = copy.deepcopy(eager)
    before = [b.clone() for b in graphed.buffers()]
    te.make_graphed_callables(graphed, (_input(kind),), fp8_enabled=True, fp8_recipe=r)
    for a, b in zip(graphed.buffers(), before, strict=True):
        assert torch.equal(a, b), "the warm-up changed the FP8 state"
    for step, s in enumerate((1.0, 8.0, 0.25, 2.0)):
        x = _input(kind, s)
        xg = x.detach().clone().requires_grad_()
        with te.fp8_autocast(fp8_recipe=r):
            want = eager(x)
        want.float().square().mean().backward()
        got = graphed(xg)
        got.float().square().mean().backward()
        where = f"{kind} step {step}"
        assert torch.equal(got, want), f"{where}: output"
        assert torch.equal(xg.grad, x.grad), f"{where}: input gradient"
        for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), f"{where}: {name}.grad"
            p.grad = q.grad = None
        for a, b in zip(graphed.buffers(), eager.buffers(), strict=True):
            assert torch.equal(a, b), f"{where}: FP8 state (histories, scales)"


@pytest.mark.cuda
def test_modules_graphed_together_follow_train_and_eval():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ok, why = te.is_fp8_available(return_reason=True)
    if not ok:
        pytest.skip(why)
    r = recipe.DelayedScaling()
    a, b = _modules("Linear"), te.Linear(512, 256, params_dtype=torch.bfloat16, device="cuda")
    x = _input("Linear")
    h = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a, b = te.make_graphed_callables((a, b), ((x,), (h,)), fp8_enabled=True, fp8_recipe=r)
    y = b(a(_input("Linear")))
    y.float().sum().backward()
    assert a.weight.grad is not None and b.weight.grad is not None
    b.eval()  # the other mode: the eager forward
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        out = b(torch.randn(8, 512, device="cuda", dtype=torch.bfloat16))
    assert out.shape == (8, 256)
