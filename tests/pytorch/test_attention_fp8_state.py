"""te.DotProductAttention under DelayedScaling(fp8_dpa=True) keeps delayed-scaling state as every
te module does: its amax histories and scales over several steps against a plain-Python model
of the recipe, quantization with the scales of earlier steps, FP8 results that stay close to
bf16 as the scales move, state_dict round trips, te.checkpoint, calibration, torch.compile.
Column layout: module/attention.py (q, k, p, v forward; ds, d_o backward).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from te_torch_tests import _reference as ref
from te_torch_tests.test_attention import _assert_fp8_close, _data

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

# cuDNN's FP8 attention on sm_90 takes head dim 128; the CPU reference is slow at that size.
SHAPES = {"cpu": dict(b=1, s=33, h=2, d=16), "cuda": dict(b=2, s=256, h=8, d=128)}
NAMES = ("amax_history_fwd", "scale_fwd", "scale_inv_fwd", "amax_history_bwd", "scale_bwd",
         "scale_inv_bwd")


class AttentionScalingModel(ref.DelayedScalingModel):
    """The recipe's model over attention's columns: forward q, k, p, v (p never recorded),
    backward ds, d_o (ds never recorded)."""

    def __init__(self, history_len: int, fwd_max: float, bwd_max: float, algo: str,
                 margin: int):
        super().__init__(history_len, fwd_max, bwd_max, algo, margin)
        self.history_fwd = [[0.0] * 4 for _ in range(history_len)]
        self.history_bwd = [[0.0] * 2 for _ in range(history_len)]
        self.scale_fwd, self.scale_bwd = [1.0] * 4, [1.0] * 2

    def forward_qkv(self, amax_q: float, amax_k: float, amax_v: float) -> None:
        row = self.history_fwd[0]
        for column, amax in ((0, amax_q), (1, amax_k), (3, amax_v)):
            row[column] = max(row[column], amax)

    def backward_d_o(self, amax_d_o: float) -> list:
        self.history_bwd[0][1] = max(self.history_bwd[0][1], amax_d_o)
        return self._update(self.history_bwd, self.scale_bwd, self.bwd_max)


def _module(device, mask="causal", shape_of=None, **kw):
    """The module for inputs of device ``shape_of``'s shapes (default: its own device's)."""
    shape = SHAPES[torch.device(shape_of or device).type]
    return te.DotProductAttention(shape["h"], shape["d"], qkv_format="bshd", attn_mask_type=mask,
                                  device=device, **kw)


def _inputs(device, step: int, scales=(1.0, 1.0, 1.0)):
    shape = SHAPES[torch.device(device).type]
    b, s, h, d = shape["b"], shape["s"], shape["h"], shape["d"]
    q, k, v = _data(b, s, s, h, h, d, torch.bfloat16, device, seed=10 + step)
    with torch.no_grad():
        for t, factor in zip((q, k, v), scales, strict=True):
            t.mul_(factor)
    g = torch.randn(b, s, h * d, generator=torch.Generator().manual_seed(50 + step))
    return q, k, v, g.to(device=device, dtype=torch.bfloat16)


def _as_list(t: torch.Tensor) -> list:
    return t.detach().cpu().tolist()


def _amax(t: torch.Tensor) -> float:
    return t.detach().abs().max().float().item()


@pytest.mark.parametrize("algo,margin,fmt", [("max", 0, recipe.Format.HYBRID),
                                             ("most_recent", 1, recipe.Format.E4M3)])
def test_state_sequence_matches_the_recipe_model(algo, margin, fmt, device):
    r = recipe.DelayedScaling(amax_history_len=2, amax_compute_algo=algo, margin=margin,
                              fp8_format=fmt, fp8_dpa=True)
    attn = _module(device)
    model = AttentionScalingModel(2, fmt.max_fwd, fmt.max_bwd, algo, margin)
    for step in range(3):  # 3 > history length: the history wraps around
        q, k, v, g = _inputs(device, step, (2.0**step, 2.0**-step, 4.0**step))
        with te.fp8_autocast(fp8_recipe=r):
            out = attn(q, k, v)
        model.forward_qkv(_amax(q), _amax(k), _amax(v))
        inv_fwd = model.autocast_exit()
        out.backward(g * 4.0**-step)  # d_o is exactly this bf16 tensor
        inv_bwd = model.backward_d_o(_amax(g * 4.0**-step))
        want = (model.history_fwd, model.scale_fwd, inv_fwd, model.history_bwd,
                model.scale_bwd, inv_bwd)
        for name, expected in zip(NAMES, want, strict=True):
            assert _as_list(getattr(attn, name)) == expected, (step, name)


def test_forward_quantizes_with_the_scales_of_earlier_steps(device):
    """v 64 times larger than at the step its scale came from saturates at that step's amax,
    and o, an average of v's rows, stays below it (but for the roundings of p and o to E4M3,
    each 2^-4 at most); current scaling follows v and gives o of the new size."""
    attn = _module(device, mask="no_mask")
    q, k, v, _ = _inputs(device, 0)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        attn(q, k, v)
    amax_v = _amax(v)
    assert attn.scale_fwd[3].item() == pytest.approx(448.0 / amax_v)
    q, k, v, _ = _inputs(device, 1, (1.0, 1.0, 64.0))
    with torch.no_grad():
        want = attn(q, k, v)
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
            delayed = attn(q, k, v)
        state = attn.amax_history_fwd.clone()
        with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling(fp8_dpa=True)):
            fresh = attn(q, k, v)
    assert _amax(delayed) <= amax_v * (1 + 2**-4) ** 2
    assert _amax(want) > 4 * amax_v
    # (The test data has unit scale; ATTENTION_FP8_TOL's atol is for that.)
    _assert_fp8_close(fresh / 64, want / 64, "current scaling")
    assert torch.equal(attn.amax_history_fwd, state)  # current scaling keeps no state


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_outputs_and_grads_stay_close_to_bf16_over_steps(fmt, device):
    attn = _module(device)
    r = recipe.DelayedScaling(fp8_dpa=True, fp8_format=getattr(recipe.Format, fmt))
    for step in range(4):
        q, k, v, g = _inputs(device, step)
        attn(q, k, v).backward(g)
        want = [attn(q, k, v).detach()] + [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        with te.fp8_autocast(fp8_recipe=r):
            out = attn(q, k, v)
        out.backward(g)
        got = [out] + [t.grad for t in (q, k, v)]
        e5m2 = fmt == "HYBRID" and torch.device(device).type == "cuda"
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
            _assert_fp8_close(a, b, f"step {step} {name}", e5m2_written=e5m2 and name != "o")
    assert attn.scale_fwd[0].item() != 1.0 and attn.scale_bwd[1].item() != 1.0


def _first_step(attn, r, q, k, v):
    """Gradients of a first step whose q is far below E4M3's smallest subnormal at the
    initial scale of 1 and whose d_o (a mean loss, times 1e-3) far below E5M2's."""
    for t in (q, k, v):
        t.grad = None
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r):
        out = attn(q, k, v)
    (out.float().mean() * 1e-3).backward()
    return [out.detach()] + [t.grad.clone() for t in (q, k, v)]


def test_first_step_scales_q_k_v_and_d_o_from_their_own_amaxes(device):
    # first_step.py: an empty history column takes its tensor's own amax, so a first step
    # learns; without the rule (marks taken) q reads as zeros and d_o underflows.
    r = recipe.DelayedScaling(fp8_dpa=True)
    q, k, v, _ = _inputs(device, 0, (1e-4, 1.0, 1.0))
    want = _first_step(_module(device), None, q, k, v)
    got = _first_step(_module(device), r, q, k, v)
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want, strict=True):
        assert float(a.abs().max()) > 0, name
        rel = float((a.float() - b.float()).abs().max() / b.float().abs().max())
        assert rel < 0.15, f"{name}: relative error {rel:.3f}"
    from transformer_engine.pytorch import first_step

    plain = _module(device)
    first_step.written_elsewhere_all(plain.amax_history_fwd)
    first_step.written_elsewhere_all(plain.amax_history_bwd)
    without = _first_step(plain, r, q, k, v)
    assert float(without[3].abs().max()) == 0.0  # dv: d_o underflowed at scale 1


def test_attention_marks_only_the_columns_it_writes():
    from transformer_engine.pytorch import first_step

    attn = _module("cpu")
    q, k, v, g = _inputs("cpu", 0)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        out = attn(q, k, v)
    out.backward(g)
    # p's column (forward 2) and ds's (backward 0) are never written: nothing waits any more
    assert not first_step.has_empty(attn.amax_history_fwd)
    assert not first_step.has_empty(attn.amax_history_bwd)
    fresh = _module("cpu")
    fresh.load_state_dict(attn.state_dict())
    assert not first_step.has_empty(fresh.amax_history_fwd)
    assert not first_step.has_empty(fresh.amax_history_bwd)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _step(attn, step: int, r, checkpoint: bool = False):
    q, k, v, g = _inputs("cpu", step)
    with te.fp8_autocast(fp8_recipe=r):
        out = te.checkpoint(attn, q, k, v) if checkpoint else attn(q, k, v)
    out.backward(g)
    return [out.detach()] + [t.grad for t in (q, k, v)]


def test_state_dict_round_trip_resumes_bit_identical():
    r = recipe.DelayedScaling(amax_history_len=4, fp8_dpa=True)
    attn = _module("cpu")
    for step in range(3):
        _step(attn, step, r)
    state = _roundtrip(attn.state_dict())
    assert state["_extra_state"]["recipe"]["fp8_dpa"] is True
    resumed = _module("cpu")
    resumed.load_state_dict(state)
    for step in (3, 4):
        for a, b in zip(_step(resumed, step, r), _step(attn, step, r), strict=True):
            assert torch.equal(a, b), step
    for name in NAMES:
        assert torch.equal(getattr(resumed, name), getattr(attn, name)), name


def test_checkpoint_without_fp8_state_loads():
    """A DotProductAttention saved before it kept FP8 state has an empty state dict."""
    attn = _module("cpu")
    attn.load_state_dict({})
    assert _as_list(attn.scale_fwd) == [1.0] * 4 and _as_list(attn.scale_bwd) == [1.0] * 2


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_te_checkpoint_gives_the_gradients_of_no_recompute(dropout):
    r = recipe.DelayedScaling(amax_history_len=3, fp8_dpa=True)
    plain, recomputed = (_module("cpu", attention_dropout=dropout) for _ in range(2))
    for step in range(3):
        torch.manual_seed(step)
        want = _step(plain, step, r)
        torch.manual_seed(step)
        got = _step(recomputed, step, r, checkpoint=True)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), step
        for name in NAMES:  # the recompute recorded nothing and moved no scale
            assert torch.equal(getattr(recomputed, name), getattr(plain, name)), (step, name)


def test_calibration_records_the_amaxes_of_q_k_v():
    attn = _module("cpu")
    q, k, v, _ = _inputs("cpu", 0, (3.0, 0.5, 2.0))
    r = recipe.DelayedScaling(fp8_dpa=True)
    with torch.no_grad():
        want = attn(q, k, v)
        with te.fp8_autocast(enabled=False, calibrating=True, fp8_recipe=r):
            got = attn(q, k, v)
    assert torch.equal(got, want)  # computed in high precision
    expected = [448.0 / _amax(q), 448.0 / _amax(k), 1.0, 448.0 / _amax(v)]
    torch.testing.assert_close(attn.scale_fwd, torch.tensor(expected), rtol=1e-6, atol=0)


def test_compiled_steps_match_eager_and_keep_the_state():
    # aot_eager traces forward and backward (inductor's C++ compile would only add minutes);
    # fullgraph=True raises on a graph break.
    torch._dynamo.reset()
    # The default history length (other lengths: test_compile_history_len.py).
    r = recipe.DelayedScaling(fp8_dpa=True)
    eager = _module("cpu")
    compiled_module = copy.deepcopy(eager)
    compiled = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    for step in range(3):
        for a, b in zip(_step(compiled, step, r), _step(eager, step, r), strict=True):
            assert torch.equal(a, b), step
        for name in NAMES:
            assert torch.equal(getattr(compiled_module, name), getattr(eager, name)), name


@pytest.mark.cuda
def test_state_on_another_device_is_an_error():
    attn = _module("cpu", shape_of="cuda")  # state on the CPU, sized for the CUDA inputs
    q, k, v, _ = _inputs("cuda", 0)
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(fp8_dpa=True)):
        with pytest.raises(RuntimeError, match="query must be on the device of the module's"):
            attn(q, k, v)
