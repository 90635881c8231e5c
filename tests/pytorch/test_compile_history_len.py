"""torch.compile of a module whose first forward is compiled, under a DelayedScaling recipe with
any amax_history_len: the autocast entered outside the compiled function sizes the unused
delayed-scaling state for the recipe, so the compiled steps equal eager ones bit for bit.
State a forward has used stays as it is until the module's own forward meets another length,
which a compiled forward refuses with a message that says what to do."""

from __future__ import annotations

import copy

import pytest
import torch

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

H = 32  # hidden size


def _linear():
    return te.Linear(H, H, device="cpu")


def _layernorm_linear():
    return te.LayerNormLinear(H, H, device="cpu")


def _layernorm_mlp():
    return te.LayerNormMLP(H, 2 * H, device="cpu")


def _attention():
    return te.DotProductAttention(2, 16, qkv_format="bshd", attn_mask_type="causal",
                                  device="cpu")


def _transformer_layer():
    return te.TransformerLayer(H, 2 * H, 2, hidden_dropout=0.0, attention_dropout=0.0,
                               device="cpu")


def _inputs(kind: str, step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The step's inputs (requiring grad) and the gradient of the module's output."""
    gen = torch.Generator().manual_seed(100 + step)
    if kind == "attention":  # [b, s, h, d]
        shapes, dtype, out = [(2, 16, 2, 16)] * 3, torch.bfloat16, (2, 16, 32)
    elif kind == "transformer_layer":  # [s, b, hidden]
        shapes, dtype, out = [(16, 2, H)], torch.float32, (16, 2, H)
    else:
        shapes, dtype, out = [(16, H)], torch.float32, (16, H)
    xs = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    return xs, torch.randn(out, generator=gen).to(dtype)


MODULES = {"linear": _linear, "layernorm_linear": _layernorm_linear,
           "layernorm_mlp": _layernorm_mlp, "attention": _attention,
           "transformer_layer": _transformer_layer}


def _step(model, kind: str, step: int, r) -> list[torch.Tensor]:
    xs, g = _inputs(kind, step)
    with te.fp8_autocast(fp8_recipe=r):
        out = model(*xs)
    out.backward(g)
    return [out.detach()] + [x.grad for x in xs]


def _assert_steps_match(kind: str, length: int, backend: str, steps: int = 3) -> None:
    torch._dynamo.reset()
    r = recipe.DelayedScaling(amax_history_len=length, fp8_dpa=True)
    eager = MODULES[kind]()
    compiled_model = copy.deepcopy(eager)  # a copy of an unused module is unused too
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    for step in range(steps):
        got = _step(compiled, kind, step, r)  # the first call of all is compiled
        want = _step(eager, kind, step, r)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), f"step {step}: output/input grad {i}"
        pairs = zip(compiled_model.named_parameters(), eager.parameters(), strict=True)
        for (name, a), b in pairs:
            assert torch.equal(a.grad, b.grad), f"step {step}: {name} grad"
            with torch.no_grad():  # the same SGD step on both, in eager
                a.sub_(0.1 * a.grad)
                b.sub_(0.1 * b.grad)
            a.grad = b.grad = None
        buffers = zip(compiled_model.named_buffers(), eager.buffers(), strict=True)
        for (name, a), b in buffers:
            assert torch.equal(a, b), f"step {step}: {name}"
    histories = [b for n, b in eager.named_buffers() if n.endswith("amax_history_fwd")]
    assert histories and all(h.shape[0] == length for h in histories)
    scales = [b for n, b in eager.named_buffers() if n.endswith("scale_fwd")]
    assert any((s != 1).any() for s in scales)  # FP8 ran: its amaxes moved the scales


@pytest.mark.parametrize("length", [1, 4, 1024])
@pytest.mark.parametrize("kind", ["linear", "layernorm_linear", "layernorm_mlp"])
def test_first_step_compiled_matches_eager(kind, length):
    _assert_steps_match(kind, length, "aot_eager")


@pytest.mark.parametrize("length", [1, 4])
@pytest.mark.parametrize("kind", ["attention", "transformer_layer"])
def test_first_step_compiled_matches_eager_attention(kind, length):
    _assert_steps_match(kind, length, "aot_eager")


def test_first_step_compiled_by_inductor_matches_eager():
    _assert_steps_match("linear", 4, "inductor", steps=2)


def test_module_made_inside_the_autocast_starts_at_its_length():
    r = recipe.DelayedScaling(amax_history_len=4)
    with te.fp8_autocast(fp8_recipe=r):
        m = _linear()
        assert m.amax_history_fwd.shape[0] == 4
    with te.fp8_model_init(recipe=recipe.DelayedScaling(amax_history_len=8)):
        assert _linear().amax_history_fwd.shape[0] == 8
    assert _linear().amax_history_fwd.shape[0] == 1024


def test_used_state_is_left_to_the_modules_own_forward():
    """The entry resizes unused state only: a module used under one length keeps its
    histories while an autocast of another length runs other modules, as in eager code."""
    a, b = _linear(), _linear()
    r4, r8 = recipe.DelayedScaling(amax_history_len=4), recipe.DelayedScaling(amax_history_len=8)
    x = torch.randn(16, H)
    with te.fp8_autocast(fp8_recipe=r4):
        a(x)
    kept = [t.clone() for t in a.buffers()]
    assert b.amax_history_fwd.shape[0] == 4  # unused: sized at the entry
    with te.fp8_autocast(fp8_recipe=r8):
        b(x)
    assert all(torch.equal(t, k) for t, k in zip(a.buffers(), kept, strict=True))
    assert b.amax_history_fwd.shape[0] == 8
    with te.fp8_autocast(fp8_recipe=r8):
        a(x)  # its own forward meets the new length: fresh state of 8 steps
    assert a.amax_history_fwd.shape[0] == 8


def test_loaded_state_is_not_resized_at_entry():
    src = _linear()
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        src(torch.randn(16, H))
    m = _linear()
    m.load_state_dict(src.state_dict())
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=2)):
        assert m.amax_history_fwd.shape[0] == 4
        assert torch.equal(m.amax_history_fwd, src.amax_history_fwd)


def test_used_state_of_another_length_is_a_clear_error_when_compiled():
    torch._dynamo.reset()
    m = _linear()
    x = torch.randn(16, H)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4)):
        m(x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=8)):
        with pytest.raises(Exception, match=r"Linear: the fp8_autocast recipe has "
                           r"amax_history_len=8 but this module's delayed-scaling state "
                           r"holds 4 steps.*run one eager forward"):
            compiled(x)
    assert m.amax_history_fwd.shape[0] == 4


def test_autocast_inside_the_compiled_function_is_a_clear_error():
    """Traced there, the entry cannot size the state: the module's forward says so."""
    torch._dynamo.reset()
    m = _linear()
    r = recipe.DelayedScaling(amax_history_len=4)

    def forward(x):
        with te.fp8_autocast(fp8_recipe=r):
            return m(x)

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"amax_history_len=4 but this module's delayed-scaling "
                       r"state holds 1024 steps"):
        compiled(torch.randn(16, H))
    assert m.amax_history_fwd.shape[0] == 1024
