"""The constructor arguments of te.Linear, te.LayerNormLinear and te.LayerNormMLP as NVIDIA
Transformer Engine 2.x defines them: the same order (a program's positional arguments mean what
they meant there), NVIDIA's keywords for features not built here accepted at their defaults and
refused otherwise, LayerNormMLP's ``checkpoint`` and ``return_layernorm_output_gathered``."""

import inspect

import pytest
import torch
from te_torch_tests._train_steps import RECIPES, assert_same_bits

import transformer_engine.pytorch as te
from transformer_engine.common import recipe

CPU = "cpu"

# NVIDIA TE 2.x's parameter order of each constructor (its public signatures).
NVIDIA_ORDER = {
    te.Linear: (
        "in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation",
        "tp_group", "tp_size", "get_rng_state_tracker", "rng_tracker_name", "init_method",
        "bias", "return_bias", "params_dtype", "parallel_mode", "parameters_split", "device",
        "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
        "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type",
        "save_original_input", "name"),
    te.LayerNormLinear: (
        "in_features", "out_features", "eps", "sequence_parallel", "fuse_wgrad_accumulation",
        "tp_group", "tp_size", "get_rng_state_tracker", "init_method", "bias", "normalization",
        "return_bias", "params_dtype", "parallel_mode", "return_layernorm_output",
        "return_layernorm_output_gathered", "parameters_split", "zero_centered_gamma",
        "device", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad",
        "ub_bulk_dgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "name"),
    te.LayerNormMLP: (
        "hidden_size", "ffn_hidden_size", "eps", "sequence_parallel", "return_bias",
        "get_rng_state_tracker", "tp_group", "tp_size", "init_method", "bias", "normalization",
        "activation", "activation_params", "output_layer_init_method",
        "fuse_wgrad_accumulation", "params_dtype", "return_layernorm_output",
        "return_layernorm_output_gathered", "seq_length", "micro_batch_size",
        "set_parallel_mode", "zero_centered_gamma", "device", "ub_overlap_ag", "name",
        "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad",
        "delay_wgrad_compute", "symmetric_ar_type", "checkpoint"),
}


@pytest.mark.parametrize("cls", list(NVIDIA_ORDER), ids=lambda c: c.__name__)
def test_parameters_in_nvidias_order(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert tuple(p.name for p in params) == NVIDIA_ORDER[cls]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)


def test_positional_arguments_mean_what_they_mean_in_nvidias_order():
    # te.Linear's third positional argument is sequence_parallel (nn.Linear's is bias): an
    # NVIDIA program's te.Linear(a, b, False) keeps its bias.
    assert te.Linear(16, 32, False, device=CPU).bias is not None
    lin = te.Linear(16, 32, False, False, None, 1, None, None, None, False, True,
                    torch.bfloat16, None, None, CPU)
    assert lin.bias is None and lin.return_bias and lin.weight.dtype == torch.bfloat16
    lnl = te.LayerNormLinear(16, 32, 1e-3, False, False, None, 1, None, None, False, "RMSNorm",
                             False, torch.bfloat16, None, True, False, None, True, CPU)
    assert (lnl.cfg.eps, lnl.normalization, lnl.cfg.return_ln_out,
            lnl.cfg.zero_centered_gamma) == (1e-3, "RMSNorm", True, True)
    assert lnl.bias is None and lnl.weight.dtype == torch.bfloat16
    mlp = te.LayerNormMLP(16, 32, 1e-3, False, True, None, None, 1, None, False, "RMSNorm",
                          "swiglu", None, None, False, torch.bfloat16, False, False, None,
                          None, False, False, CPU)
    assert (mlp.cfg.eps, mlp.return_bias, mlp.normalization, mlp.activation) == (
        1e-3, True, "RMSNorm", "swiglu")
    assert mlp.fc1_weight.shape == (64, 16) and mlp.fc1_weight.dtype == torch.bfloat16
    assert mlp.fc1_bias is None


def _build(cls, **kwargs):
    return cls(16, 32, device=CPU, **kwargs)


# NVIDIA's keywords for features not built here: (module classes, value that is refused).
UNBUILT = {
    "ub_overlap_ag": True, "ub_overlap_rs": True, "ub_overlap_rs_dgrad": True,
    "ub_bulk_dgrad": True, "ub_bulk_wgrad": True, "symmetric_ar_type": "multimem_all_reduce",
}
WHY = {"symmetric_ar_type": "symmetric-memory all-reduce"}


@pytest.mark.parametrize("cls, keyword", [(cls, keyword) for cls in NVIDIA_ORDER
                                          for keyword in UNBUILT],
                         ids=lambda v: getattr(v, "__name__", v))
def test_unbuilt_features_run_at_their_defaults_and_are_refused_otherwise(cls, keyword):
    default = inspect.signature(cls.__init__).parameters[keyword].default
    torch.manual_seed(0)
    plain = _build(cls)
    torch.manual_seed(0)
    given = _build(cls, **{keyword: default})
    x = torch.randn(4, 16)
    assert torch.equal(plain(x), given(x))
    name = {te.Linear: "te.Linear", te.LayerNormLinear: "te.LayerNormLinear",
            te.LayerNormMLP: "te.LayerNormMLP"}[cls]
    value = UNBUILT[keyword]
    with pytest.raises(NotImplementedError) as info:
        _build(cls, **{keyword: value})
    message = str(info.value)
    assert message.startswith(f"{name}: {keyword}={value!r} is not supported here")
    assert WHY.get(keyword, "userbuffers") in message


def test_linear_save_original_input_is_kept_and_names_are_kept():
    # (the values do not change with it: test_megatron_attributes.py)
    assert te.Linear(16, 32, save_original_input=True, device=CPU).save_original_input

    streams = te.CudaRNGStatesTracker()
    streams.add("tp-rng", 7)

    def tracker():  # (its stream "tp-rng" draws the weights: test_megatron_attributes.py)
        return streams

    lin = te.Linear(16, 32, get_rng_state_tracker=tracker, rng_tracker_name="tp-rng",
                    ub_name="qkv", device=CPU)
    assert lin.get_rng_state_tracker is tracker and lin.rng_tracker_name == "tp-rng"
    mlp = te.LayerNormMLP(16, 32, seq_length=128, micro_batch_size=2, device=CPU)
    assert (mlp.seq_length, mlp.micro_batch_size) == (128, 2)


@pytest.mark.parametrize("cls", [te.LayerNormLinear, te.LayerNormMLP], ids=lambda c: c.__name__)
def test_gathered_norm_output_without_sequence_parallelism_is_the_norm_output(cls):
    torch.manual_seed(0)
    plain = _build(cls, return_layernorm_output=True)
    torch.manual_seed(0)
    gathered = _build(cls, return_layernorm_output=True, return_layernorm_output_gathered=True)
    x = torch.randn(4, 16)
    for a, b in zip(plain(x), gathered(x), strict=True):
        assert torch.equal(a, b)


def _mlp_steps(checkpoint: bool, recipe_name, dtype, steps=3):
    """Outputs, gradients and buffers of a LayerNormMLP's steps, and the bytes the autograd
    graph kept between the passes at each step."""
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(64, 128, activation="swiglu", params_dtype=dtype, device=CPU,
                          checkpoint=checkpoint)
    seen, kept = [], []
    for step in range(steps):
        x = (torch.randn(2, 16, 64, dtype=dtype) * (step + 1)).requires_grad_(True)
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with te.fp8_autocast(enabled=recipe_name is not None,
                                 fp8_recipe=RECIPES[recipe_name]() if recipe_name else None):
                y = mlp(x)
        kept.append(sum(saved))
        y.float().square().sum().backward()
        seen += [y.detach(), x.grad] + [p.grad for p in mlp.parameters()]
        seen += [b.clone() for b in mlp.buffers()]
        for p in mlp.parameters():
            p.grad = None
    return seen, kept


@pytest.mark.parametrize("recipe_name, dtype", [(None, torch.float32), (None, torch.bfloat16),
                                                ("delayed", torch.bfloat16),
                                                ("current", torch.bfloat16)])
def test_mlp_checkpoint_recomputes_with_the_same_bits_and_keeps_only_the_input(recipe_name,
                                                                                 dtype):
    """checkpoint=True: the same outputs, gradients and FP8 state as the block that keeps its
    activations, step after step; between the passes only the input (and the parameters'
    references) are kept, where the plain block keeps FC1's output and more."""
    on, kept_on = _mlp_steps(True, recipe_name, dtype)
    off, kept_off = _mlp_steps(False, recipe_name, dtype)
    assert_same_bits(on, off)
    tokens, ffn = 2 * 16, 2 * 128
    for k_on, k_off in zip(kept_on, kept_off, strict=True):
        # FC1's output alone is tokens x 2 ffn values
        assert k_off - k_on >= tokens * ffn * torch.tensor([], dtype=dtype).element_size()


def test_mlp_checkpoint_inside_a_checkpoint_and_without_gradients():
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(64, 128, device=CPU, checkpoint=True)
    x = torch.randn(16, 64, requires_grad=True)
    with torch.no_grad():
        y0 = mlp(x)
    y = te.checkpoint(mlp, x)  # the outer checkpoint recomputes the block
    assert torch.equal(y.detach(), y0)
    y.sum().backward()
    assert x.grad is not None and mlp.fc1_weight.grad is not None


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear], ids=lambda c: c.__name__)
def test_fp8_grad_runs_at_its_default_and_is_refused_otherwise(cls):
    m = _build(cls)
    x = torch.randn(16, 16)
    assert torch.equal(m(x, None, False, False), m(x))
    with pytest.raises(NotImplementedError, match=r"fp8_grad=True \(the input's gradient as "
                                                  r"FP8\) is not implemented"):
        m(x, fp8_grad=True)


DELAY_RECIPES = {**RECIPES, "block": lambda: recipe.Float8BlockScaling()}


def _delayed_steps(cls, delay: bool, recipe_name, dtype, fuse=False, split=False):
    """Two microbatches' backward passes, then backward_dw() (with delay): every gradient."""
    torch.manual_seed(0)
    kw = dict(parameters_split=("a", "b")) if split else {}
    if cls is te.LayerNormMLP:
        kw["activation"] = "swiglu"
    m = cls(32, 64, bias=True, params_dtype=dtype, device=CPU, delay_wgrad_compute=delay,
            fuse_wgrad_accumulation=fuse, **kw)
    weights = m._gemm_weights()
    if fuse:
        for w in weights:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    seen = []
    for step in range(2):
        x = (torch.randn(2, 16, 32, dtype=dtype) * (step + 1)).requires_grad_(True)
        with te.fp8_autocast(enabled=recipe_name is not None,
                             fp8_recipe=DELAY_RECIPES[recipe_name]() if recipe_name else None):
            y = m(x)
        y.float().square().sum().backward()
        seen += [y.detach(), x.grad]
        if delay:  # nothing reaches the weights until backward_dw
            assert all(w.grad is None for w in weights)
            assert not fuse or all(not w.main_grad.any() for w in weights)
    m.backward_dw()
    m.backward_dw()  # (nothing left to run)
    seen += [w.main_grad if fuse else w.grad for w in weights]
    seen += [p.grad for n, p in m.named_parameters() if "bias" in n or "layer_norm" in n]
    return seen


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear, te.LayerNormMLP],
                         ids=lambda c: c.__name__)
@pytest.mark.parametrize("recipe_name, dtype", [(None, torch.float32), (None, torch.bfloat16),
                                                ("delayed", torch.bfloat16),
                                                ("current", torch.bfloat16),
                                                ("block", torch.bfloat16)])
def test_delay_wgrad_compute_gives_the_same_gradients_after_backward_dw(cls, recipe_name, dtype):
    """The backward computes the input's, bias's and norm's gradients; backward_dw() then
    adds the weights': the same bits as the layer without the switch, over two microbatches."""
    assert_same_bits(_delayed_steps(cls, True, recipe_name, dtype),
                     _delayed_steps(cls, False, recipe_name, dtype))


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear, te.LayerNormMLP],
                         ids=lambda c: c.__name__)
def test_delay_wgrad_compute_into_main_grad_and_split_weights(cls):
    splits = (False,) if cls is te.LayerNormMLP else (False, True)
    for kw in [dict(fuse=fuse, split=split) for split in splits for fuse in (False, True)
               if fuse or split]:
        for recipe_name in (None, "delayed"):
            assert_same_bits(_delayed_steps(cls, True, recipe_name, torch.bfloat16, **kw),
                             _delayed_steps(cls, False, recipe_name, torch.bfloat16, **kw))



@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear, te.LayerNormMLP],
                         ids=lambda c: c.__name__)
def test_delay_wgrad_compute_under_torch_compile_runs_the_layer_eagerly(cls):
    """A traced backward would put its GEMMs on the list while tracing only; torch.compile
    (with AOT autograd) does not trace a backward that writes to a list from outside it (it
    breaks the graph there and runs the layer eagerly), so backward_dw() gives the eager
    gradients."""
    def grads(compiled: bool):
        torch.manual_seed(0)
        m = cls(32, 64, params_dtype=torch.bfloat16, device=CPU, delay_wgrad_compute=True)
        r = recipe.DelayedScaling()

        def step(x):
            with te.fp8_autocast(fp8_recipe=r):
                return m(x)

        f = torch.compile(step, backend="aot_eager") if compiled else step
        for i in range(2):
            x = torch.randn(16, 32, dtype=torch.bfloat16) * (i + 1)
            f(x).float().square().sum().backward()
        m.backward_dw()
        return [w.grad for w in m._gemm_weights()]

    torch._dynamo.reset()
    assert_same_bits(grads(True), grads(False))
