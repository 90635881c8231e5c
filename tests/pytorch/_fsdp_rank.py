"""One rank of the FSDP2 tests (test_parallel_worlds.py): ``python _fsdp_rank.py RANK WORLD PORT``.
A stack of te.TransformerLayer sharded with torch's ``fully_shard`` (each layer, then the
whole) trains on this rank's share of a batch; its gradients (FSDP averages them over the
ranks) are checked against the unsharded stack's on the whole batch, in fp32 and in FP8
(current scaling; delayed scaling with the amaxes reduced over the group).

The FP8 all-gather: fp8_model_init weights (Float8Tensor shards) and high-precision weights
opted in with te.distributed.fp8_all_gather reach the modules as Float8Tensors whose bytes
and scale are exactly those of the whole weight quantized (a deliberately wrong scale fails
that check), an optimizer step on the shards keeps them so, and every all-gather moves uint8,
one byte per weight element where bf16 moves two. Under Float8BlockScaling likewise in
128x128 blocks (te.Linear, te.LayerNormLinear, te.LayerNormMLP): the modules' outputs and
input gradients equal the unsharded modules' bit for bit, the gathers move the bytes and one
fp32 scale per block, shards that cut through blocks still gather the whole weight's bytes
(high-precision weights; dropping the block amax reduction fails that check), and
fp8_model_init weights whose shards would cut through blocks shard in high precision with a
warning.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import DEVICE, case, exact, generator, layer_stack, rms_close

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch import fsdp_fp8
from transformer_engine.pytorch.float8_tensor import Float8Tensor
from transformer_engine.pytorch.module.base import FP8Module

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H = 16, 4, 64  # sequence, global batch (split over the ranks), hidden


def stack(fp8_weights=None):
    """Two layers (_tp_world.layer_stack); ``fp8_weights`` a recipe: under fp8_model_init."""
    return layer_stack(H, fp8_weights)


def shard(model, **kwargs):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer, mesh=MESH, **kwargs)
    fully_shard(model, mesh=MESH, **kwargs)
    return model


def loss_of(model, x, r, group=None):
    with te.fp8_autocast(enabled=r is not None, fp8_recipe=r, fp8_group=group):
        y = model(x)
    return y.float().square().sum() / x.shape[1]  # a mean over the batch: FSDP averages


def check(r, rel, group=None):
    ref = stack()
    model = shard(copy.deepcopy(ref))
    x = torch.randn(S, B, H, generator=generator(1))
    for step in range(2):
        loss_of(ref, x, r).backward()
        loss_of(model, x.chunk(WORLD, dim=1)[RANK], r, group).backward()
        grads_close(model, ref, rel, f"{r} step {step}")
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None


def grads_close(model, ref, rel, what):
    """The sharded model's gradients (whole) against the unsharded one's."""
    scale = max(float(q.grad.norm()) for q in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        got = p.grad.full_tensor()
        if float(q.grad.norm()) < 1e-4 * scale:  # the key bias: zero but for rounding
            assert float(got.norm()) < 1e-3 * scale, f"{what} {name}.grad"
        else:
            rms_close(got, q.grad, rel, f"{what} {name}.grad")


# ---------------------------------------------------------------- the FP8 all-gather


def handed(module):
    """The GEMM weights ``module`` holds now: {param name: (type, bytes, scale_inv, mode)}."""
    return {n: (type(p), p._data.clone(), p._scale_inv.clone(), p._scaling_mode)
            if isinstance(p, Float8Tensor) else (type(p), None, None, None)
            for n, p in module.named_parameters(recurse=False) if p.dim() == 2}


def record_weights(model):
    """Records, for each forward of a te module, the GEMM weights it is handed (after FSDP's
    gather): {module name: {param name: (type, bytes, scale_inv, mode)}}, the last
    forward's."""
    seen = {}

    def hook(name):
        def record(module, args):
            seen[name] = handed(module)
        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in model.named_modules()
               if isinstance(m, FP8Module) and any(True for _ in m.parameters(recurse=False))]
    return seen, handles


def expected_weights(model):
    """What the modules must be handed: each whole weight quantized at once (current scaling of
    the whole weight); a Float8Tensor weight (gathered from its shards) as it is."""
    want = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Module):
            for n, p in m.named_parameters(recurse=False):
                if p.dim() == 2:
                    full = p.full_tensor() if hasattr(p, "full_tensor") else p
                    q = full if isinstance(full, Float8Tensor) else Float8Tensor.quantize(full)
                    want.setdefault(name, {})[n] = (q._data, q._scale_inv)
    return want


def same_weights(seen, want, what, mode="tensor"):
    assert seen.keys() == want.keys(), f"{what}: modules {sorted(seen)} vs {sorted(want)}"
    for name, params in want.items():
        for n, (data, scale_inv) in params.items():
            kind, got_data, got_scale_inv, got_mode = seen[name][n]
            assert kind is Float8Tensor, f"{what} {name}.{n}: handed a {kind.__name__}"
            assert got_mode == mode, f"{what} {name}.{n}: handed {got_mode}, not {mode}"
            assert torch.equal(got_scale_inv, scale_inv), \
                f"{what} {name}.{n}: scale_inv {got_scale_inv} vs {scale_inv}"
            assert torch.equal(got_data, data), f"{what} {name}.{n}: not the same bytes"


def step_both(model, ref, opt, ref_opt) -> None:
    """One optimizer step of the sharded model and of the whole reference with the same
    update: the reference takes the sharded model's gradients."""
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        q.grad = p.grad.full_tensor()
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()


def check_fp8_weights(r, rel, group=None):
    """fp8_model_init weights: sharded as Float8Tensors, gathered as their bytes; an SGD step
    on the shards (each quantized back with the whole weight's amax) leaves the bytes the
    unsharded weights get from the same update."""
    ref = stack(fp8_weights=r)
    model = shard(copy.deepcopy(ref))
    for p in model.parameters():
        if p.dim() == 2:
            assert type(p.to_local()) is Float8Tensor, "a shard of an FP8 weight is not FP8"
    seen, handles = record_weights(model)
    # foreach: the optimizers' default for DTensor parameters on GPUs (one op over the list).
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    x = torch.randn(S, B, H, generator=generator(1))
    for step in range(2):
        loss_of(ref, x, r).backward()
        want = expected_weights(ref)
        loss_of(model, x.chunk(WORLD, dim=1)[RANK], r, group).backward()
        same_weights(seen, want, f"{r} step {step}")
        grads_close(model, ref, rel, f"{r} step {step}")
        step_both(model, ref, opt, ref_opt)
    for h in handles:
        h.remove()


def check_fp8_all_gather(r, rel, group=None, broken=False):
    """High-precision weights under te.distributed.fp8_all_gather: the modules are handed the
    whole weights quantized at once, and train as the unsharded stack does. ``broken``: the
    shared scale is doubled, which the bytes check must catch."""
    ref = stack()
    model = copy.deepcopy(ref)
    te.distributed.fp8_all_gather(model)
    shard(model)
    seen, handles = record_weights(model)
    want = expected_weights(model)
    x = torch.randn(S, B, H, generator=generator(1))
    good_scale = fsdp_fp8.scale_from_amax
    if broken:
        fsdp_fp8.scale_from_amax = lambda amax, fp8_dtype: 2 * good_scale(amax, fp8_dtype)
    try:
        loss_of(model, x.chunk(WORLD, dim=1)[RANK], r, group).backward()
    finally:
        fsdp_fp8.scale_from_amax = good_scale
        for h in handles:
            h.remove()
    if broken:
        try:
            same_weights(seen, want, "doubled scale")
        except AssertionError:
            return
        raise AssertionError("a doubled scale passed the bytes check")
    same_weights(seen, want, str(r))
    loss_of(ref, x, r).backward()
    grads_close(model, ref, rel, str(r))


def check_uneven_shards():
    """Weights whose rows do not split evenly (FSDP pads the last shards; with 3 rows on 4 ranks
    one shard is empty): the modules are still handed the whole weight's bytes, also after an
    SGD step on the shards. Run in high precision (the modules dequantize the FP8 weight), as
    FP8 GEMMs take no such shapes."""
    from torch.distributed.fsdp import fully_shard

    for rows in (30, 3):
        for kind in ("fp8_model_init", "fp8_all_gather"):
            torch.manual_seed(0)
            with te.fp8_model_init(enabled=kind == "fp8_model_init"):
                ref = te.Linear(H, rows, device=DEVICE)
            model = copy.deepcopy(ref)
            if kind == "fp8_all_gather":
                te.distributed.fp8_all_gather(model)
            fully_shard(model, mesh=MESH)
            seen, handles = record_weights(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            x = torch.randn(8, H, generator=generator(2))
            for step in range(2):
                want = {"": {"weight": expected_weights(ref)[""]["weight"]}}
                model(x).square().sum().backward()
                ref(x).square().sum().backward()
                same_weights(seen, want, f"{kind} {rows} rows step {step}")
                step_both(model, ref, opt, ref_opt)
            for h in handles:
                h.remove()


def check_bad_inputs():
    """fp8_all_gather refuses, by name, a model already sharded, one without te modules and an
    unknown FP8 format."""
    import pytest

    with pytest.raises(ValueError, match=r"fp8_all_gather: .*weight is a DTensor already"):
        te.distributed.fp8_all_gather(shard(stack()))
    with pytest.raises(ValueError, match="fp8_all_gather: model must hold te modules"):
        te.distributed.fp8_all_gather(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="fp8_all_gather: fp8_dtype must be one of"):
        te.distributed.fp8_all_gather(stack(), fp8_dtype="int8")


@contextlib.contextmanager
def recorded_gathers():
    """A list that gets (dtype, bytes gathered) for every all-gather while inside."""
    moved = []
    gathers = {name: getattr(dist, name) for name in ("all_gather_single",
                                                      "all_gather_into_tensor")
               if hasattr(dist, name)}

    def recording(gather):
        def run(out, inp, *args, **kwargs):
            moved.append((inp.dtype, inp.numel() * inp.element_size() * WORLD))
            return gather(out, inp, *args, **kwargs)
        return run

    for name, gather in gathers.items():
        setattr(dist, name, recording(gather))
    try:
        yield moved
    finally:
        for name, gather in gathers.items():
            setattr(dist, name, gather)


def check_bytes_moved():
    """Every all-gather of FSDP's forward, with bf16 parameters (mixed precision): the FP8
    gathers (high-precision weights opted in, or fp8_model_init weights) move uint8, one byte
    per weight element where the plain gather moves two; the 1-D parameters stay bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    x = torch.randn(S, B // WORLD, H, dtype=torch.bfloat16)
    weights = sum(p.numel() for p in stack().parameters() if p.dim() == 2) // 2  # per layer
    others = sum(p.numel() for p in stack().parameters() if p.dim() == 1) // 2
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with recorded_gathers() as moved:
        for kind in ("bf16", "fp8_all_gather", "fp8_model_init"):
            model = stack(recipe.Float8CurrentScaling() if kind == "fp8_model_init" else None)
            if kind == "fp8_all_gather":
                te.distributed.fp8_all_gather(model)
            shard(model, mp_policy=mp)
            moved.clear()
            with torch.no_grad(), te.fp8_autocast(fp8_recipe=recipe.Float8CurrentScaling()):
                model(x)
            per_element = 2 if kind == "bf16" else 1
            want = [(torch.bfloat16 if kind == "bf16" else torch.uint8,
                     weights * per_element + others * 2)] * 2  # one gather per layer
            assert moved == want, f"{kind}: gathered {moved}, want {want}"


# ---------------------------------------------------------------- 128x128 blocks

BLOCKS = recipe.Float8BlockScaling()


def block_module(name, kind):
    """A te module whose GEMM weights have 512 rows (shards of whole 128-row blocks on 2 and 4
    ranks), from seed 0; ``kind`` "fp8_model_init": its weights are built as FP8 blocks."""
    torch.manual_seed(0)
    with te.fp8_model_init(enabled=kind == "fp8_model_init", recipe=BLOCKS):
        if name == "Linear":
            return te.Linear(128, 512, device=DEVICE)
        if name == "LayerNormLinear":
            return te.LayerNormLinear(128, 512, device=DEVICE)
        return te.LayerNormMLP(512, 512, device=DEVICE)


def block_expected(module):
    """{"": {param name: (bytes, scale_inv)}}: the whole GEMM weights of the unsharded
    ``module`` quantized in 128x128 blocks as the recipe quantizes weights (a Float8Tensor
    weight: its own bytes)."""
    from transformer_engine.pytorch import ops
    from transformer_engine.pytorch.quantization import plan_of

    plan = plan_of(BLOCKS)
    want = {}
    for n, p in module.named_parameters(recurse=False):
        if p.dim() != 2:
            continue
        if not isinstance(p, Float8Tensor):
            data, sinv, _, _ = ops.quantize_block(p.detach(), plan.fwd_dtype, plan.weight_mode,
                                                  True, False, plan.force_pow2_scales,
                                                  plan.amax_epsilon)
            p = Float8Tensor(data, sinv, plan.fwd_dtype, p.dtype, plan.weight_mode)
        want[n] = (p._data, p._scale_inv)
    return {"": want}


@contextlib.contextmanager
def recorded_block_quantizations():
    """A list that gets the row count of every matrix quantized in 128x128 blocks while
    inside."""
    from transformer_engine.pytorch import ops

    rows, real = [], ops.quantize_block

    def recording(x, fp8_dtype, mode, *args):
        if mode == "block_128x128":
            rows.append(x.shape[0])
        return real(x, fp8_dtype, mode, *args)

    ops.quantize_block = recording
    try:
        yield rows
    finally:
        ops.quantize_block = real


def check_block_scaling(name, kind):
    """Float8BlockScaling, the module sharded (in a sharded Sequential, so that FSDP gathers
    it again for the backward, outside fp8_autocast): each forward is handed the whole
    weights' FP8 blocks exactly (fp8_model_init weights, or high-precision ones under
    fp8_all_gather), and uses them as they are; the outputs and input gradients of this
    rank's tokens equal the unsharded module's bit for bit (the same bytes, and per-token
    1x128 blocks of activations and gradients); the weight gradients agree within FP8's
    rounding (the wgrad GEMM's 1x128 blocks run over tokens); after an SGD step on the shards
    with the same update as the unsharded module's, all again."""
    from torch.distributed.fsdp import fully_shard

    ref = block_module(name, kind)
    model = torch.nn.Sequential(copy.deepcopy(ref))
    if kind == "fp8_all_gather":
        te.distributed.fp8_all_gather(model)
    fully_shard(model[0], mesh=MESH)
    fully_shard(model, mesh=MESH)
    for n, p in model.named_parameters():
        if p.dim() == 2 and kind == "fp8_model_init":
            assert type(p.to_local()) is Float8Tensor, f"{n}: a shard of an FP8 weight is not FP8"
    seen, handles = record_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    width = 128 if name != "LayerNormMLP" else 512
    x = torch.randn(64, width, generator=generator(3))
    g = torch.randn(64, 512, generator=generator(4))  # d loss / d output
    rows = slice(RANK * 64 // WORLD, (RANK + 1) * 64 // WORLD)
    for step in range(2):
        what = f"{name} {kind} step {step}"
        mine, whole = x[rows].clone().requires_grad_(), x.clone().requires_grad_()
        want = {"0": block_expected(ref)[""]}
        with recorded_block_quantizations() as quantized:
            with te.fp8_autocast(fp8_recipe=BLOCKS):
                y = model(mine)
            y.backward(g[rows])
        # The modules use the gathered bytes as they are, and their transpose for the
        # backward: nothing quantizes a whole weight in 128x128 blocks; fp8_all_gather
        # quantizes the shards, in the forward and again (as blocks still) for the backward.
        shards = [512 // WORLD] * 2 * (1 if name != "LayerNormMLP" else 2)
        assert quantized == (shards if kind == "fp8_all_gather" else []), \
            f"{what}: quantized {quantized} rows in 128x128 blocks"
        with te.fp8_autocast(fp8_recipe=BLOCKS):
            y_ref = ref(whole)
        y_ref.backward(g)
        same_weights(seen, want, what, "block_128x128")
        exact(y, y_ref[rows], f"{what} output")
        exact(mine.grad, whole.grad[rows], f"{what} input grad")
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            # FSDP averages the ranks' gradients: the whole batch's sum over WORLD.
            rms_close(p.grad.full_tensor(), q.grad / WORLD, 0.01, f"{what} {n}.grad")
        step_both(model, ref, opt, ref_opt)
    for h in handles:
        h.remove()


def check_block_bytes_moved():
    """Float8BlockScaling, bf16 parameters: the one all-gather of a te.Linear [512, 128] (even
    shards of whole blocks) moves uint8: the weight's bytes, one fp32 scale per 128x128 block
    (4) and its bf16 bias; nothing else is gathered or reduced."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x = torch.randn(16, 128, dtype=torch.bfloat16)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    want = [(torch.uint8, 512 * 128 + 4 * 4 + 512 * 2)]
    for kind in ("fp8_all_gather", "fp8_model_init"):
        model = block_module("Linear", kind)
        if kind == "fp8_all_gather":
            te.distributed.fp8_all_gather(model)
        fully_shard(model, mesh=MESH, mp_policy=mp)
        reduce = dist.all_reduce
        dist.all_reduce = None  # (any all-reduce would fail)
        try:
            with recorded_gathers() as moved, torch.no_grad(), \
                    te.fp8_autocast(fp8_recipe=BLOCKS):
                model(x)
        finally:
            dist.all_reduce = reduce
        assert moved == want, f"{kind}: gathered {moved}, want {want}"


def check_block_cut_shards():
    """Float8BlockScaling with shards that are not of whole blocks (200, 201 and 3 rows) or of
    uneven size (511, 201, 3 rows: FSDP pads the last shards, and with 3 rows on 4 ranks one
    is empty). High-precision weights under fp8_all_gather still gather the whole weight's
    blocks exactly: the blocks the shard boundaries cut take their amax over the shards (half
    the rows are 64 times larger, so that a cut block differs on each side; without that
    all-reduce the check fails), also after SGD steps. fp8_model_init weights whose shards
    hold whole blocks (511 rows) stay FP8, the scale rows of the uneven shards gathered apart;
    those whose shards would cut through blocks shard in high precision, with a warning (once
    per shape) that says why, and the module is handed the weight's values. Checked on the
    weight FSDP hands the module (``unshard`` under fp8_autocast); the steps run in high
    precision (FP8 GEMMs take no such shapes), outside fp8_autocast: the gathers there keep
    the last gather's block scaling."""
    from torch.distributed.fsdp import fully_shard

    for rows in (511, 200, 201, 3):
        # (one rank's shard is the whole weight: no block is cut)
        whole_blocks = WORLD == 1 or -(-rows // WORLD) % 128 == 0
        for kind in ("fp8_all_gather", "fp8_model_init"):
            what = f"{kind} {rows} rows"
            torch.manual_seed(0)
            with te.fp8_model_init(enabled=kind == "fp8_model_init", recipe=BLOCKS):
                ref = te.Linear(192, rows, device=DEVICE)
            if kind == "fp8_all_gather":
                with torch.no_grad():
                    ref.weight[:rows // 2] *= 64
            model = copy.deepcopy(ref)
            if kind == "fp8_all_gather":
                te.distributed.fp8_all_gather(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fully_shard(model, mesh=MESH)
                fully_shard(copy.deepcopy(ref), mesh=MESH)  # the same shape: no second warning
            cut = [w for w in caught if "do not all start at a multiple of 128 rows" in
                   str(w.message)]
            fp8 = kind == "fp8_all_gather" or whole_blocks
            assert len(cut) == (not fp8), f"{what}: {len(cut)} warnings"
            if kind == "fp8_model_init":
                local = type(model.weight.to_local())
                assert (local is Float8Tensor) == fp8, f"{what}: a {local.__name__} shard"
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            x = torch.randn(8, 192, generator=generator(2))
            for step in range(2):
                with te.fp8_autocast(fp8_recipe=BLOCKS):
                    model.unshard()
                got = handed(model)
                model.reshard()
                if fp8:
                    same_weights({"": got}, block_expected(ref), f"{what} step {step}",
                                 "block_128x128")
                elif step == 0:  # (then the shards take high-precision updates: the warning)
                    kind_got, values = got["weight"][0], model.weight.full_tensor()
                    assert not issubclass(kind_got, Float8Tensor), f"{what}: handed FP8"
                    assert torch.equal(values, ref.weight.dequantize()), f"{what}: values"
                model(x).square().sum().backward()
                ref(x).square().sum().backward()
                step_both(model, ref, opt, ref_opt)
            if kind == "fp8_all_gather" and not whole_blocks:
                check_without_block_amax(model, ref, what)


def check_without_block_amax(model, ref, what):
    """The gather of ``model`` with the block amax all-reduce skipped must not pass the bytes
    check (each rank would scale a cut block from its own rows)."""
    reduce = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: None
    try:
        with te.fp8_autocast(fp8_recipe=BLOCKS):
            model.unshard()
    finally:
        dist.all_reduce = reduce
    got = handed(model)
    model.reshard()
    try:
        same_weights({"": got}, block_expected(ref), what, "block_128x128")
    except AssertionError:
        return
    raise AssertionError(f"{what}: gathered without the block amax all-reduce, the bytes "
                         f"still passed the check")


def check_meta_init():
    """Built on the meta device, sharded, moved with to_empty and reset: the sharded stack
    holds the values of one built on the CPU (reset_parameters fills each rank's shard)."""
    from torch.distributed.fsdp import fully_shard

    ref = stack()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(te.TransformerLayer(H, 2 * H, 4, hidden_dropout=0.0,
                                                      attention_dropout=0.0, device="meta")
                                  for _ in range(2)))
    for layer in model:
        fully_shard(layer, mesh=MESH)
    model.to_empty(device=DEVICE)
    torch.manual_seed(0)
    for layer in model:
        layer.reset_parameters()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q), name


if __name__ == "__main__":
    _tp_world.start(RANK, WORLD, PORT)
    from torch.distributed.device_mesh import init_device_mesh

    MESH = init_device_mesh(DEVICE, (WORLD,))  # one mesh for every check
    case(check, None, 1e-5)
    case(check, recipe.Float8CurrentScaling(), 0.15)
    case(check, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_meta_init)
    case(check_fp8_weights, recipe.Float8CurrentScaling(), 0.15)
    case(check_fp8_weights, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_fp8_all_gather, recipe.Float8CurrentScaling(), 0.15)
    case(check_fp8_all_gather, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_fp8_all_gather, recipe.Float8CurrentScaling(), 0.15, None, True)
    case(check_uneven_shards)
    case(check_bad_inputs)
    for module_name in ("Linear", "LayerNormLinear", "LayerNormMLP"):
        for weights in ("fp8_model_init", "fp8_all_gather"):
            case(check_block_scaling, module_name, weights)
    if WORLD > 1:  # (FSDP gathers nothing on one rank)
        case(check_bytes_moved)
        case(check_block_bytes_moved)
    case(check_block_cut_shards)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
