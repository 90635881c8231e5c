"""te.Linear's compiled eager forward (fast_linear.py, pytorch/csrc/eager/).

It must be built where the tests run (noxfile.py builds the pytorch package beside the tested
torch), must be taken exactly where it computes what the Python path computes, and must then
give the same bits: outputs, gradients and every FP8 buffer, step after step.
"""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._train_steps import assert_same_bits

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import fast_linear


@pytest.fixture
def spy(monkeypatch):
    """Counts the forwards that the compiled path computes (from either entry)."""
    calls = []
    run = fast_linear.run

    def counting(*args, **kwargs):
        out = run(*args, **kwargs)
        if out is not None:
            calls.append(1)
        return out

    monkeypatch.setattr(fast_linear, "run", counting)
    return calls


@pytest.fixture
def backward_spy(record_calls):
    """The backwards that the compiled operator computes (from either forward path)."""
    from transformer_engine.pytorch import compiled_grads

    return record_calls(compiled_grads, "linear_grads")


def test_built():
    assert fast_linear.available(), (
        "transformer_engine.pytorch's compiled eager ops are missing or cannot load: build the "
        "pytorch package with --no-build-isolation where torch and transformer-engine-common are "
        "installed (noxfile.py does)")


def _train(device, enabled: bool, *, bias=True, dtype=torch.bfloat16, shape=(2, 32, 64),
           frozen_weight=False, input_grad=True, return_bias=False, steps=4, fp8_recipe=None):
    """Steps of a te.Linear under ``fp8_recipe`` (DelayedScaling with a short history and a
    margin by default) with the fast path on or off: every output, gradient and buffer, in
    order."""
    from transformer_engine.pytorch import compiled_grads

    fast_linear.enabled = compiled_grads.enabled = enabled
    try:
        torch.manual_seed(0)
        m = te.Linear(64, 48, bias=bias, params_dtype=dtype, device=device,
                      return_bias=return_bias)
        m.weight.requires_grad_(not frozen_weight)
        r = fp8_recipe or recipe.DelayedScaling(amax_history_len=4, margin=1)
        seen = []
        for step in range(steps):
            x = (torch.randn(*shape, device=device) * (step + 1)).to(dtype)
            x.requires_grad_(input_grad)
            with te.fp8_autocast(fp8_recipe=r):
                out = m(x)
            y = out[0] if return_bias else out
            if y.requires_grad:
                y.backward(torch.randn_like(y))
            seen += [y.detach(), x.grad]
            seen += [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
            seen += [b.clone() for b in m.buffers()]
        return seen
    finally:
        fast_linear.enabled = compiled_grads.enabled = True


# Of _train's 4 delayed-scaling steps, the compiled path computes the last 3: a first step,
# whose empty history is scaled from the tensors' own amaxes, is the Python path's
# (first_step.py).
FAST_DELAYED_STEPS = 3


def _first_step(m, x, r):
    """A module's first FP8 step (the Python path's), after which the compiled path serves."""
    _forward(m, x.detach(), r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_same_bits_as_python_path(device, spy, backward_spy, dtype, bias):
    fast = _train(device, True, bias=bias, dtype=dtype)
    assert len(spy) == len(backward_spy) == FAST_DELAYED_STEPS
    python = _train(device, False, bias=bias, dtype=dtype)
    assert len(spy) == FAST_DELAYED_STEPS  # the Python path did not take it
    assert_same_bits(fast, python)


@pytest.mark.parametrize("case", [
    dict(frozen_weight=True), dict(input_grad=False), dict(return_bias=True),
    dict(shape=(48, 64)),
], ids=["frozen-weight", "no-input-grad", "return-bias", "2d"])
def test_same_bits_variants(device, spy, backward_spy, case):
    fast = _train(device, True, **case)
    assert len(spy) == len(backward_spy) == FAST_DELAYED_STEPS
    assert_same_bits(fast, _train(device, False, **case))


CURRENT_RECIPES = {
    "current": recipe.Float8CurrentScaling(),
    "current-pow2-eps": recipe.Float8CurrentScaling(power_2_scale=True, amax_epsilon=1e-3),
    "current-e4m3": recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", CURRENT_RECIPES)
def test_same_bits_as_python_path_current_scaling(device, spy, backward_spy, name, dtype):
    """Current scaling: each scale from its tensor's amax in the compiled forward and backward
    too."""
    r = CURRENT_RECIPES[name]
    fast = _train(device, True, dtype=dtype, fp8_recipe=r)
    assert len(spy) == len(backward_spy) == 4
    assert_same_bits(fast, _train(device, False, dtype=dtype, fp8_recipe=r))
    case = dict(frozen_weight=True, fp8_recipe=r)
    assert_same_bits(_train(device, True, **case), _train(device, False, **case))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_no_grad_forward(device, spy, monkeypatch, recipe_name):
    """Without gradients (torch.no_grad, or nothing that requires one) the operator is called
    without the autograd function, and gives the bits of a forward that has one."""
    r = (recipe.DelayedScaling() if recipe_name == "delayed"
         else recipe.Float8CurrentScaling())
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        m(x)  # the first step
    with te.fp8_autocast(fp8_recipe=r):
        want = m(x).detach()  # through the autograd function (the weight requires grad)

    def refused(*args):
        raise AssertionError("the autograd function was applied without gradients")

    monkeypatch.setattr(fast_linear._Fp8Linear, "apply", refused)
    calls = len(spy)
    with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
        y = m(x)
    m.requires_grad_(False)
    with te.fp8_autocast(fp8_recipe=r):
        z = m(x)
    assert len(spy) == calls + 2 and y.grad_fn is None and z.grad_fn is None
    assert torch.equal(y, want) and torch.equal(z, want)


def _forward(m, x, r, **kwargs):
    with te.fp8_autocast(fp8_recipe=r):
        return m(x, **kwargs)


@pytest.mark.parametrize("case", [
    "block", "bias-dtype", "microbatch", "callable-algo", "fp8-output",
    "switched-off",
])
def test_python_path_where_it_differs(spy, case):
    """Where the compiled path would not compute what the Python path does, it is not taken."""
    bf16 = torch.bfloat16
    dtype, params, r, kwargs = bf16, bf16, recipe.DelayedScaling(), {}
    if case == "block":
        r = recipe.Float8BlockScaling()
    elif case == "bias-dtype":
        params = torch.float32  # bf16 input, fp32 bias: the Python path adds it in fp32
    elif case == "microbatch":
        kwargs = dict(is_first_microbatch=True)
    elif case == "callable-algo":
        r = recipe.DelayedScaling(amax_compute_algo=lambda h: h.max(dim=0).values)
    elif case == "fp8-output":
        kwargs = dict(fp8_output=True)
    m = te.Linear(128, 128, params_dtype=params, device="cpu")
    x = torch.randn(16, 128, dtype=dtype, requires_grad=True)
    if case == "switched-off":
        fast_linear.enabled = False
    try:
        _forward(m, x, r, **kwargs)
    finally:
        fast_linear.enabled = True
    assert spy == []


def test_python_path_under_checkpoint_and_a_first_compiled_step(spy):
    """A checkpoint's recompute records no amax: it takes the Python path, and so does the
    checkpoint's first run (torch's checkpoint wants the same saved tensors from both runs). A
    compiled first step under delayed scaling keeps the Python path too (its first-step rule)."""
    m = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    r = recipe.DelayedScaling()
    compiled = torch.compile(lambda t: _forward(m, t, r), fullgraph=True, backend="eager")
    compiled(x)
    assert len(spy) == 0
    with te.fp8_autocast(fp8_recipe=r):
        y = te.checkpoint(m, x)
    y.sum().backward()
    assert len(spy) == 0
    _forward(m, x, r)  # and eager outside both: the compiled path
    assert len(spy) == 1


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_compiled_graph_takes_the_operators_with_eager_bits(recipe_name, bias):
    """torch.compile(fullgraph=True) of a te.Linear step traces the layer as its two custom ops
    (under delayed scaling once a step has written the histories), and three compiled steps
    give the outputs, gradients and FP8 state of three eager ones."""
    from te_torch_tests._train_steps import RECIPES, compiled_against_eager

    torch.manual_seed(0)
    m = te.Linear(64, 32, bias=bias, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    eager, traced, ran = compiled_against_eager(m, RECIPES[recipe_name](), x)
    assert {"transformer_engine::linear_block_forward",
            "transformer_engine::linear_block_backward"} <= ran
    assert "transformer_engine::quantize_delayed" not in ran
    assert_same_bits(traced, eager)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_compiled_steps_trace_one_graph(recipe_name):
    """Compiled steps after an eager first one, in a process whose first FP8 layer is
    compiled (the core's codes not yet looked up: a traced lookup that filled their cache
    made the next step trace a second graph): one graph for them all."""
    from te_torch_tests._train_steps import RECIPES
    from torch._dynamo.utils import counters

    from transformer_engine.pytorch.ops import _backend

    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cpu")
    r = RECIPES[recipe_name]()

    def step(x):
        with te.fp8_autocast(fp8_recipe=r):
            return m(x)

    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    step(x).float().sum().backward()
    _backend._codes.clear()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for _ in range(3):
        compiled(x).float().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("where", ["linear_grads", "linear_backward"])
def test_error_in_backward_is_raised(device, monkeypatch, where):
    """An error in the compiled forward's backward (the compiled operator's, or the Python
    steps' of a first backward, whose history is still empty) reaches the caller as an
    exception, not a crash."""
    from transformer_engine.pytorch import compiled_grads

    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = recipe.DelayedScaling()
    _first_step(m, x, r)
    if where == "linear_grads":  # a backward has written the history: the operator serves
        _forward(m, x, r).sum().backward()
    y = _forward(m, x, r)

    def broken(*args):
        raise ValueError("backward failed on purpose")

    monkeypatch.setattr(compiled_grads if where == "linear_grads" else fast_linear, where, broken)
    with pytest.raises(Exception, match="backward failed on purpose"):
        y.sum().backward()


def test_operators_check_their_inputs(device):
    """The compiled operators refuse what their Python callers would never send, with an error
    naming the operator, before writing anything. They return the error as a status (no C++
    exception crosses into libtorch), which raise_if_failed turns into a RuntimeError."""
    from transformer_engine.pytorch import _compiled

    ops = _compiled.ops
    x = torch.randn(24, 64, device=device)  # M = 24: not a multiple of 16
    w = torch.randn(32, 64, device=device)
    history, scales = torch.zeros(4, 3, device=device), torch.ones(3, device=device)
    e4m3 = fast_linear.dtype_code("float8_e4m3")

    def forward(*args):
        status, *_ = ops.linear_fp8_forward.default(*args)
        _compiled.raise_if_failed(status)

    with pytest.raises(RuntimeError, match="linear_fp8_forward: M, N and K must be multiples"):
        forward(x, w, None, scales, history, _compiled.NO_TENSOR, False, e4m3, False, 0.0, True,
                True, False, 0)
    with pytest.raises(RuntimeError, match="linear_fp8_forward: bias must be"):
        forward(x[:16], w, torch.zeros(5, device=device), scales, history, _compiled.NO_TENSOR,
                False, e4m3, False, 0.0, True, True, False, 0)
    assert torch.equal(history, torch.zeros(4, 3, device=device))
    g = torch.randn(16, 32, device=device)
    status, *_ = ops.linear_fp8_backward.default(
        g, None, 0, scales[:1], scales[:1], torch.empty(0, dtype=torch.uint8),
        torch.empty(64, 31, dtype=torch.uint8), history, scales[:1], scales[:1], 0, True,
        _compiled.NO_TENSOR, False, e4m3, e4m3, False, 0.0, 0, 0, True, False, torch.float32,
        torch.float32, None, 0)
    with pytest.raises(RuntimeError, match="linear_fp8_backward: the column-wise weight"):
        _compiled.raise_if_failed(status)
    assert torch.equal(history, torch.zeros(4, 3, device=device))
    status = ops.delayed_scaling_update.default([history], [scales[:2]], [scales[:1]], e4m3, 0,
                                                0, 0)
    assert status != 0 and "delayed_scaling_update" in ops.last_error.default()


_STATIC_RUNTIME_PROBE = """
import sys, torch
torch.ops.load_library(sys.argv[1])
status, *_ = torch.ops.te_eager.linear_fp8_forward.default(
    torch.randn(24, 64), torch.randn(32, 64), None, torch.ones(3), torch.zeros(4, 3),
    torch.empty(0, dtype=torch.uint8), False, int(sys.argv[2]), False, 0.0, True, True, False, 0)
print(status, torch.ops.te_eager.last_error.default())
"""


def test_errors_survive_a_static_cxx_runtime(tmp_path):
    """Some toolchains link the C++ runtime into a library statically; a C++ exception thrown
    from such a library into libtorch kills the process. The operators return their errors
    instead, with the whole message: built that way here, a bad input gives a status and the
    message, in a process that lives on."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import transformer_engine.common as common

    cxx = shutil.which("g++")
    sources = sorted((Path(__file__).parents[2] / "pytorch" / "csrc" / "eager").glob("*.cpp"))
    if cxx is None or not sources:
        pytest.skip("needs g++ and the source tree")
    torch_dir = Path(torch.__file__).parent
    core_dir = Path(common.__file__).parent
    lib = tmp_path / "eager_ops_static.so"
    subprocess.run([cxx, "-O1", "-fPIC", "-shared", "-std=c++17",
                    "-DTORCH_TARGET_VERSION=0x020b000000000000", f"-I{torch_dir / 'include'}",
                    f"-I{core_dir / 'include'}", *map(str, sources), f"-L{torch_dir / 'lib'}",
                    f"-L{core_dir / 'lib'}", "-ltransformer_engine", "-lc10", "-ltorch",
                    "-ltorch_cpu", "-static-libstdc++", "-static-libgcc",
                    f"-Wl,-rpath,{core_dir / 'lib'}", "-o", str(lib)],
                   check=True, capture_output=True)
    env = {**os.environ, "TE_FAST_LINEAR": "0"}
    run = subprocess.run([sys.executable, "-c", _STATIC_RUNTIME_PROBE, str(lib),
                          str(fast_linear.dtype_code("float8_e4m3"))],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == ("1 te_eager.linear_fp8_forward: M, N and K must be multiples "
                                  "of 16, got M=24 N=32 K=64")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fp8_dtype", ["float8_e4m3", "float8_e5m2"])
def test_compiled_scale_update_equals_the_op(device, algo, fp8_dtype):
    """fp8.scale_update (the compiled operator's core call in eager mode) updates scales and
    histories exactly as the custom op does: columns with an amax, with none (scale kept), with
    an infinite one (scale kept), two groups in one call, a margin."""
    from transformer_engine.pytorch import _compiled, fp8, ops

    def state():
        torch.manual_seed(3)
        h = [torch.rand(5, 3, device=device) * 300, torch.rand(4, 2, device=device)]
        h[0][:, 1] = 0.0
        h[0][0, 2] = float("inf")
        s = [torch.full((3,), 2.0, device=device), torch.full((2,), 0.5, device=device)]
        return h, s, [torch.zeros_like(t) for t in s]

    a, b = state(), state()
    fp8.scale_update(*a, fp8_dtype, algo, 2)
    ops.delayed_scaling_update(*b, fp8_dtype, algo, 2)
    for x, y in zip(sum(a, []), sum(b, []), strict=True):
        assert torch.equal(x, y)
    assert _compiled.ops is not None


def test_exit_update_takes_the_compiled_operator(monkeypatch):
    from types import SimpleNamespace

    from transformer_engine.pytorch import _compiled

    calls = []
    op = _compiled.ops.delayed_scaling_update.default

    def counting(*args):
        calls.append(len(args[0]))
        return op(*args)

    spy = SimpleNamespace(delayed_scaling_update=SimpleNamespace(default=counting))
    monkeypatch.setattr(_compiled, "ops", spy)
    m = te.Linear(32, 32, params_dtype=torch.bfloat16, device="cpu")
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
        m(torch.randn(16, 32, dtype=torch.bfloat16))
    assert calls == [1]


@pytest.mark.parametrize("enabled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("shape", [(16, 64), (2, 8, 64)], ids=["2d", "3d"])
def test_output_takes_in_place_ops(device, enabled, shape):
    """The FP8 output may be modified in place (e.g. nn.ReLU(inplace=True) after the layer):
    neither path returns a view made inside its autograd function, and the gradient is that of
    the in-place op applied to the output."""
    from transformer_engine.pytorch import compiled_grads

    fast_linear.enabled = compiled_grads.enabled = enabled
    try:
        m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            y = m(x)
        y.relu_()
        (y.float() * 2).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        assert m.weight.grad is not None
    finally:
        fast_linear.enabled = compiled_grads.enabled = True


@pytest.fixture
def entries(monkeypatch):
    """Counts the forwards that reach the compiled function from the full forward ("full")
    and straight from steady_forward ("steady")."""
    counts = {"full": 0, "steady": 0}
    full, steady = fast_linear.forward, fast_linear.steady_forward

    def counting_full(*args):
        counts["full"] += 1
        return full(*args)

    def counting_steady(*args):
        out = steady(*args)
        counts["steady"] += out is not None
        return out

    monkeypatch.setattr(fast_linear, "forward", counting_full)
    monkeypatch.setattr(fast_linear, "steady_forward", counting_steady)
    return counts


def test_later_forwards_go_straight_to_the_compiled_function(device, entries):
    """The first forward under a recipe takes the full forward; the next ones start at
    steady_forward, until the recipe object changes."""
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = recipe.DelayedScaling()
    _first_step(m, x, r)
    for _ in range(3):
        _forward(m, x, r).sum().backward()
    assert entries == {"full": 1, "steady": 2}
    _forward(m, x, recipe.DelayedScaling())  # a new recipe object: met by the full forward
    assert entries == {"full": 2, "steady": 2}
    m.load_state_dict(m.state_dict())  # reloaded state: met afresh as well
    _forward(m, x, recipe.DelayedScaling())
    assert entries == {"full": 3, "steady": 2}


@pytest.mark.parametrize("case", ["in-features", "tokens", "int", "bias-dtype", "autocast"])
def test_steady_entry_declines_what_the_full_forward_handles(entries, case):
    """After a compiled forward, a call the compiled function cannot take as it is goes to the
    full forward, which raises the same errors (or computes it) as on a fresh module."""
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cpu")
    r = recipe.DelayedScaling()
    _forward(m, torch.randn(16, 64, dtype=torch.bfloat16), r)
    errors = {"in-features": (ValueError, "in_features=64"),
              "int": (TypeError, "float32, bfloat16 or float16")}
    inputs = {"in-features": torch.randn(16, 48, dtype=torch.bfloat16),
              "tokens": torch.randn(12, 64, dtype=torch.bfloat16),
              "int": torch.ones(16, 64, dtype=torch.int32),
              "bias-dtype": torch.randn(16, 64, dtype=torch.float32),
              "autocast": torch.randn(16, 64, dtype=torch.float32)}
    x = inputs[case]
    if case in errors:
        kind, match = errors[case]
        with pytest.raises(kind, match=match):
            _forward(m, x, r)
    elif case == "tokens":  # not a multiple of 16: the full forward pads the GEMM operands
        assert _forward(m, x, r).shape == (12, 32)
    elif case == "bias-dtype":  # fp32 input, bf16 bias: the full forward's Fp8LinearFunction
        assert _forward(m, x, r).dtype == torch.float32
    else:  # torch.autocast casts the fp32 input to bf16 first
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _forward(m, x, r).dtype == torch.bfloat16
    assert entries["steady"] == 0


def test_steady_entry_not_in_checkpoint_or_with_an_amax_group(entries):
    m = te.Linear(64, 64, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    r = recipe.DelayedScaling()
    _first_step(m, x, r)
    _forward(m, x, r)
    with te.fp8_autocast(fp8_recipe=r):
        y = te.checkpoint(m, x)
    y.sum().backward()
    assert entries == {"full": 1, "steady": 0}

    class Group:  # only read as "a group is given" by the forward
        def size(self):
            return 1

    from transformer_engine.pytorch import fp8

    with te.fp8_autocast(fp8_recipe=r, fp8_group=Group()):
        m(x)
        # The group makes the backward's update the general one: the full forward's path.
        assert entries["steady"] == 0
        fp8.STATE.pending.clear()  # no exit update over the fake group


@pytest.mark.cuda
def test_steady_entry_declines_an_input_on_another_device(entries):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cuda")
    r = recipe.DelayedScaling()
    _first_step(m, torch.randn(16, 64, device="cuda", dtype=torch.bfloat16), r)
    _forward(m, torch.randn(16, 64, device="cuda", dtype=torch.bfloat16), r)
    with pytest.raises(RuntimeError, match=r"input must be on the device .*cuda.*got cpu"):
        _forward(m, torch.randn(16, 64, dtype=torch.bfloat16), r)
    assert entries == {"full": 1, "steady": 0}  # (the full forward raised before its call)


def test_steady_entry_follows_a_parametrized_weight(entries):
    """A weight parametrized after compiled forwards is computed by the full forward."""
    import torch.nn.utils.parametrize as parametrize

    m = te.Linear(64, 32, params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    r = recipe.DelayedScaling()
    _first_step(m, x, r)
    _forward(m, x, r)
    _forward(m, x, r)
    assert entries["steady"] == 1

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    parametrize.register_parametrization(m, "weight", Double())
    _forward(m, x, r)
    assert entries["steady"] == 1


def test_a_fast_path_that_cannot_load_says_why(monkeypatch):
    # Never silently slower: under a torch older than the stable ABI the ops are built for,
    # the warning names both releases.
    from transformer_engine.pytorch import _compiled

    monkeypatch.delenv("TE_FAST_LINEAR", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.10.1")
    mod, why = _compiled._load()
    assert mod is None
    if why != "missing":  # (a pure-Python build has no library to load)
        assert "torch >= 2.11" in why and "torch 2.10.1 is installed" in why, why


def test_the_library_is_built_on_the_stable_abi():
    """One build serves every torch from 2.11 on: the library imports nothing of torch but the
    stable C shim (no C++ symbol of libtorch, whose ABI changes between releases)."""
    import shutil
    import subprocess

    from transformer_engine.pytorch import _compiled

    path, nm = _compiled._library_path(), shutil.which("nm")
    if path is None or nm is None:
        pytest.skip("no compiled library in this build, or no nm on this machine")
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(path)], check=True,
                               capture_output=True, text=True).stdout.split()
    prefixes = tuple(f"_Z{k}{ns}" for k in ("N", "NK") for ns in ("3c10", "2at", "5torch"))
    torch_cxx = [s for s in undefined if s.startswith(prefixes)]
    assert torch_cxx == []
    assert any(s.startswith("aoti_torch_") for s in undefined)


def test_a_build_without_the_fast_path_warns_once(monkeypatch):
    from transformer_engine.pytorch import _compiled

    monkeypatch.setattr(_compiled, "_missing_said", False)
    with pytest.warns(RuntimeWarning, match="not part of this installation"):
        _compiled.warn_if_missing()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compiled.warn_if_missing()  # the second time: nothing
