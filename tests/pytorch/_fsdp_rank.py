"""One rank of the FSDP2 tests (test_parallel_worlds.py): ``python _fsdp_rank.py RANK WORLD PORT``.
A stack of te.TransformerLayer sharded with torch's ``fully_shard`` (each layer, then the
whole) trains on this rank's share of a batch; its gradients (FSDP averages them over the
ranks) are checked against the unsharded stack's on the whole batch, in fp32 and in FP8
(current scaling; delayed scaling with the amaxes reduced over the group).

The FP8 all-gather: fp8_model_init weights (Float8Tensor shards) and high-precision weights
opted in with te.distributed.fp8_all_gather reach the modules as Float8Tensors whose bytes
and scale are exactly those of the whole weight quantized (a deliberately wrong scale fails
that check), an optimizer step on the shards keeps them so, and every all-gather moves uint8,
one byte per weight element where bf16 moves two.

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import copy
import sys

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import case, layer_stack, rms_close

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
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
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


def record_weights(model):
    """Records, for each forward of a te module, the GEMM weights it is handed (after FSDP's
    gather): {module name: {param name: (type, bytes, scale_inv)}}, the last forward's."""
    seen = {}

    def hook(name):
        def record(module, args):
            seen[name] = {n: (type(p), p._data.clone(), p._scale_inv.clone())
                          if isinstance(p, Float8Tensor) else (type(p), None, None)
                          for n, p in module.named_parameters(recurse=False) if p.dim() == 2}
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


def same_weights(seen, want, what):
    assert seen.keys() == want.keys(), f"{what}: modules {sorted(seen)} vs {sorted(want)}"
    for name, params in want.items():
        for n, (data, scale_inv) in params.items():
            kind, got_data, got_scale_inv = seen[name][n]
            assert kind is Float8Tensor, f"{what} {name}.{n}: handed a {kind.__name__}"
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
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
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
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
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
                ref = te.Linear(H, rows, device="cpu")
            model = copy.deepcopy(ref)
            if kind == "fp8_all_gather":
                te.distributed.fp8_all_gather(model)
            fully_shard(model, mesh=MESH)
            seen, handles = record_weights(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
            x = torch.randn(8, H, generator=torch.Generator().manual_seed(2))
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


def check_bytes_moved():
    """Every all-gather of FSDP's forward, with bf16 parameters (mixed precision): the FP8
    gathers (high-precision weights opted in, or fp8_model_init weights) move uint8, one byte
    per weight element where the plain gather moves two; the 1-D parameters stay bf16."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    moved = []
    gathers = {name: getattr(dist, name) for name in ("all_gather_single",
                                                      "all_gather_into_tensor")
               if hasattr(dist, name)}

    def recording(gather):
        def run(out, inp, *args, **kwargs):
            moved.append((inp.dtype, inp.numel() * inp.element_size() * WORLD))
            return gather(out, inp, *args, **kwargs)
        return run

    x = torch.randn(S, B // WORLD, H, dtype=torch.bfloat16)
    weights = sum(p.numel() for p in stack().parameters() if p.dim() == 2) // 2  # per layer
    others = sum(p.numel() for p in stack().parameters() if p.dim() == 1) // 2
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for name, gather in gathers.items():
        setattr(dist, name, recording(gather))
    try:
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
    finally:
        for name, gather in gathers.items():
            setattr(dist, name, gather)


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
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in model:
        layer.reset_parameters()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q), name


if __name__ == "__main__":
    _tp_world.start(RANK, WORLD, PORT)
    from torch.distributed.device_mesh import init_device_mesh

    MESH = init_device_mesh("cpu", (WORLD,))  # one mesh for every check
    case(check, None, 1e-5)
    case(check, recipe.Float8CurrentScaling(), 0.15)
    case(check, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_meta_init)
    case(check_fp8_weights, recipe.Float8CurrentScaling(), 0.15)
    case(check_fp8_weights, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_fp8_all_gather, recipe.Float8CurrentScaling(), 0.15)
    case(check_fp8_all_gather, recipe.DelayedScaling(), 0.15, dist.group.WORLD)
    case(check_fp8_all_gather, recipe.Float8CurrentScaling(), 0.15, None, True)
    case(check_bytes_moved)
    case(check_uneven_shards)
    case(check_bad_inputs)
    dist.destroy_process_group()
    _tp_world.finish(RANK)
