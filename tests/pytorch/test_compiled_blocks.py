"""LayerNormLinear's and LayerNormMLP's FP8 step as whole blocks (compiled_blocks.py): one
operator call for the forward, one for the backward.

They are taken where they compute what the Python steps compute, and must then give the same
bits: outputs, gradients and every FP8 buffer, step after step, under delayed and current
scaling, for each set of gradients a step may need.
"""

from __future__ import annotations

import pytest
import torch
from te_torch_tests._train_steps import (
    BLOCKS,
    RECIPES,
    assert_same_bits,
    compiled_against_eager,
    record_steps,
    same_bits_matrix,
)

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import (
    _compiled,
    compiled_blocks,
    compiled_forward,
    compiled_grads,
    layer_block,
)

RECIPES = {**RECIPES,
           "delayed-most-recent": lambda: recipe.DelayedScaling(amax_history_len=3,
                                                                amax_compute_algo="most_recent")}
MODULES = BLOCKS

# Which parameters do not learn (by name); "frozen-all-but-fc2" with an input that needs no
# gradient leaves LayerNormMLP only FC2's backward.
FREEZE = {
    "all": lambda name: False,
    "frozen-weights": lambda name: "weight" in name and "layer_norm" not in name,
    "frozen-norm": lambda name: "layer_norm" in name,
    "frozen-fc1": lambda name: name.startswith("fc1"),
    "frozen-all-but-fc2": lambda name: not name.startswith("fc2"),
}

STEPS = 4


def _path(compiled: bool):
    """The whole blocks on (the Python steps of the other compiled paths off, so that the
    comparison is with the plain Python steps) or everything off."""
    compiled_blocks.enabled = compiled
    compiled_forward.enabled = False
    compiled_grads.enabled = False


@pytest.fixture(autouse=True)
def _restore():
    yield
    compiled_blocks.enabled = compiled_forward.enabled = compiled_grads.enabled = True
    layer_block.enabled = True


def _train(device, compiled: bool, module: str, recipe_name: str, dtype, bias: bool,
           zero_centered: bool, freeze: str = "all", input_grad: bool = True):
    """Every output, gradient and buffer of STEPS training steps, the whole blocks on or off."""
    _path(compiled)
    torch.manual_seed(0)
    m = MODULES[module](dtype, bias, zero_centered, device)
    with torch.no_grad():  # norm parameters away from their initial values
        for name, p in m.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    for name, p in m.named_parameters():
        p.requires_grad_(not FREEZE[freeze](name))
    return record_steps(m, RECIPES[recipe_name](), STEPS, device, dtype, input_grad)


@pytest.fixture
def calls(record_calls):
    """The names of the whole-block operators called, in order."""
    return record_calls(compiled_blocks, "layernorm_linear", "layernorm_mlp")


@same_bits_matrix(RECIPES, MODULES)
def test_same_bits_as_the_python_steps(device, calls, module, recipe_name, bias, dtype,
                                       zero_centered):
    compiled = _train(device, True, module, recipe_name, dtype, bias, zero_centered)
    # A delayed-scaling step whose history no step has written yet (the first) takes the
    # Python steps (first_step.py); current scaling takes the block from the first step.
    steps = STEPS - 1 if recipe_name.startswith("delayed") else STEPS
    name = "layernorm_mlp" if "mlp" in module else "layernorm_linear"
    assert calls == [name] * steps
    python = _train(device, False, module, recipe_name, dtype, bias, zero_centered)
    assert_same_bits(compiled, python)


@pytest.mark.parametrize("input_grad", [True, False], ids=["input-grad", "no-input-grad"])
@pytest.mark.parametrize("freeze", [f for f in FREEZE if f != "all"])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("module", list(MODULES))
def test_same_bits_with_frozen_parameters(device, module, recipe_name, freeze, input_grad):
    """Steps that need some gradients and not others (the operators skip a GEMM or the
    norm's backward, or the Python steps take a step that needs only a bias gradient) give
    the bits of the Python steps."""
    if freeze == "frozen-all-but-fc2" and "mlp" not in module:
        pytest.skip("LayerNormLinear has no FC2: nothing would learn")
    args = (module, recipe_name, torch.bfloat16, True, False, freeze, input_grad)
    assert_same_bits(_train(device, True, *args), _train(device, False, *args))


@pytest.mark.parametrize("module", list(MODULES))
def test_inference_takes_one_call(device, calls, module):
    """Under torch.no_grad the forward is the operator alone (no autograd node), with the
    Python steps' output."""
    def run(compiled: bool):
        _path(compiled)
        torch.manual_seed(0)
        m = MODULES[module](torch.bfloat16, True, False, device)
        outs = []
        r = recipe.Float8CurrentScaling()
        for step in range(2):
            x = (torch.randn(2, 16, 64, device=device) * (step + 1)).to(torch.bfloat16)
            with torch.no_grad(), te.fp8_autocast(fp8_recipe=r):
                outs.append(m(x))
        return outs

    a = run(True)
    assert len(calls) == 2 and all(o.grad_fn is None for o in a)
    assert_same_bits(a, run(False))


def test_not_taken_where_the_steps_differ(calls):
    """A returned norm output, a token count that needs padding, block scaling, a
    first-microbatch weight cache, an activation with parameters and an MLP whose FC1 output
    takes the memory-lean backward take the Python steps."""
    cases = [
        (lambda: te.LayerNormLinear(128, 128, return_layernorm_output=True), 32,
         recipe.Float8CurrentScaling(), {}),
        (lambda: te.LayerNormLinear(128, 128), 24, recipe.Float8CurrentScaling(), {}),
        (lambda: te.LayerNormMLP(128, 256), 32, recipe.Float8BlockScaling(), {}),
        (lambda: te.LayerNormMLP(128, 256), 32, recipe.Float8CurrentScaling(),
         dict(is_first_microbatch=True)),
        (lambda: te.LayerNormMLP(128, 256, activation="clamped_swiglu",
                                 activation_params=dict(limit=7.0, alpha=1.702)), 32,
         recipe.Float8CurrentScaling(), {}),
    ]
    for make, tokens, r, kwargs in cases:
        m = make().to(torch.bfloat16)
        x = torch.randn(tokens, 128, dtype=torch.bfloat16, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=r):
            out = m(x, **kwargs)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    assert calls in ([], ["layernorm_mlp"])  # (the activation with parameters declines inside)


def test_lean_mlp_takes_the_python_steps(monkeypatch, record_calls):
    """FC1's output at or above LEAN_BYTES: the Python steps' memory-lean backward."""
    from transformer_engine.pytorch import layernorm_mlp_fn

    monkeypatch.setattr(layernorm_mlp_fn, "LEAN_BYTES", 32 * 256 * 2)
    seen = record_calls(layernorm_mlp_fn.Fp8LayerNormMLPFunction, "apply")
    m = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    with te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
        m(x).float().sum().backward()
    assert seen == ["apply"]


def test_the_operators_check_their_inputs():
    from transformer_engine.pytorch.ops._backend import dtype_code

    ops = _compiled.ops
    e4m3 = dtype_code("float8_e4m3")
    x = torch.randn(32, 64)
    status, *_ = ops.layernorm_mlp_fp8_forward.default(
        x.view(2, 16, 64), torch.ones(64), None, 1, 1e-5, False, torch.randn(128, 64), None, 1,
        torch.randn(64, 128), None, torch.ones(4), torch.zeros(4, 4), _compiled.NO_TENSOR,
        False, e4m3, False, 0.0, True, True, True, True, 0)
    assert status != 0
    assert "layernorm_mlp_fp8_forward: input must be a contiguous float32/bfloat16/float16 " \
        "matrix [M, K] with M > 0" in ops.last_error.default()
    status, *_ = ops.layernorm_linear_fp8_forward.default(
        x, torch.ones(64), None, 1, 1e-5, False, torch.randn(48, 64), None, torch.ones(1),
        torch.zeros(4, 1), _compiled.NO_TENSOR, False, e4m3, False, 0.0, True, True, 0)
    assert status != 0
    assert "layernorm_linear_fp8_forward: the forward state has no column 1" in \
        ops.last_error.default()
    # A step's failure inside the block names the step.
    status, *_ = ops.layernorm_linear_fp8_forward.default(
        x, torch.ones(48), None, 1, 1e-5, False, torch.randn(48, 64), None, torch.ones(3),
        torch.zeros(4, 3), _compiled.NO_TENSOR, False, e4m3, False, 0.0, True, True, 0)
    assert status != 0
    assert "norm_linear_fp8_forward: gamma" in ops.last_error.default()


# (keywords, whether the whole blocks serve: a residual taken after the norm needs the norm's
# output returned, which they do not return)
LAYERS = {
    "layernorm-gelu": (dict(), True),
    "rmsnorm-swiglu-no-bias": (dict(normalization="RMSNorm", activation="swiglu", bias=False),
                               True),
    "fused-qkv-gqa": (dict(fuse_qkv_params=True, num_gqa_groups=1), True),
    "post-layernorm-residual": (dict(apply_residual_connection_post_layernorm=True), False),
}


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_transformer_layer_same_bits_with_whole_blocks(device, record_calls, layer, recipe_name):
    """A TransformerLayer (its attention's QKV a LayerNormLinear, its MLP a LayerNormMLP) over
    several steps: the same outputs, gradients and FP8 state with the whole blocks on and
    off, wherever its configuration lets them serve. (The layer's step as one node, which
    calls the blocks' operators itself, is off: test_layer_block.py compares it.)"""
    seen = record_calls(compiled_blocks, "layernorm_linear", "layernorm_mlp")
    layer_block.enabled = False

    def train(on: bool):
        _path(on)
        torch.manual_seed(0)
        m = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                self_attn_mask_type="causal", params_dtype=torch.bfloat16,
                                device=device, **LAYERS[layer][0])
        return record_steps(m, RECIPES[recipe_name](), STEPS, device, torch.bfloat16)

    on = train(True)
    assert {"layernorm_linear", "layernorm_mlp"} <= set(seen) or not LAYERS[layer][1]
    assert ("layernorm_mlp" in seen) == LAYERS[layer][1]
    assert_same_bits(on, train(False))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("module", ["layernorm_linear", "layernorm_mlp"])
def test_compiled_graph_takes_the_block_ops_with_eager_bits(module, recipe_name):
    """torch.compile(fullgraph=True) of a step traces each block as its two custom ops (under
    delayed scaling once a step has written the histories), and three compiled steps give the
    outputs, gradients and FP8 state of three eager ones."""
    torch.manual_seed(0)
    m = MODULES[module](torch.bfloat16, True, False, "cpu")
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    eager, traced, ran = compiled_against_eager(m, RECIPES[recipe_name](), x)
    name = module + "_block"
    assert {f"transformer_engine::{name}_forward", f"transformer_engine::{name}_backward"} <= ran
    assert_same_bits(traced, eager)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
@pytest.mark.parametrize("module", ["layernorm_linear", "layernorm_mlp"])
def test_fp32_parameters_under_autocast_take_the_blocks(device, calls, module, recipe_name):
    """torch.autocast to bf16 over fp32 parameters (an fp32 bias beside bf16 activations):
    the blocks add the bias in bf16, as the Python steps' GEMM epilogue does, and give the
    bias its fp32 gradient; the same bits as the Python steps over several steps."""
    def train(on: bool):
        _path(on)
        torch.manual_seed(0)
        m = MODULES[module](torch.float32, True, False, device)
        seen = []
        for step in range(STEPS):
            x = (torch.randn(2, 16, 64, device=device) * (step + 1)).requires_grad_(True)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                with te.fp8_autocast(fp8_recipe=RECIPES[recipe_name]()):
                    y = m(x)
            assert y.dtype == torch.bfloat16
            y.float().square().sum().backward()
            seen += [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]
            seen += [b.clone() for b in m.buffers()]
            for p in m.parameters():
                p.grad = None
        return seen

    on = train(True)
    assert len(calls) >= STEPS - 1
    assert_same_bits(on, train(False))
