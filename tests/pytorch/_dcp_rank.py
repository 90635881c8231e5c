"""One rank of the distributed-checkpoint tests (test_parallel_worlds.py):
``python _dcp_rank.py RANK WORLD PORT``. An FSDP2-sharded stack of te.TransformerLayer trains a
few steps under delayed scaling, is saved with torch.distributed.checkpoint (each rank writes
its shards) and loaded into a freshly built sharded stack of other initial values. The loaded
stack holds the same shards (FP8 weights byte for byte) and the same FP8 state (amax
histories, scales), and its next step gives the original's outputs and gradients bit for
bit. Two kinds of weights: fp8_model_init's (Float8Tensor shards) and high-precision weights
gathered in FP8 (te.distributed.fp8_all_gather).

A standalone script, like _tp_rank.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import _tp_world  # (beside this script)
import torch
import torch.distributed as dist
from _tp_world import DEVICE, case, exact, generator

import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.pytorch.float8_tensor import Float8Tensor
from transformer_engine.pytorch.module.base import _META, FP8Module

RANK, WORLD, PORT = (int(a) for a in sys.argv[1:4])
S, B, H = 16, 4, 64  # sequence, global batch (split over the ranks), hidden
RECIPE = recipe.DelayedScaling()


def sharded_stack(kind: str, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    with te.fp8_model_init(enabled=kind == "fp8_model_init", recipe=RECIPE):
        model = torch.nn.Sequential(*(te.TransformerLayer(H, 2 * H, 4, hidden_dropout=0.0,
                                                          attention_dropout=0.0, device=DEVICE)
                                      for _ in range(2)))
    if kind == "fp8_all_gather":
        te.distributed.fp8_all_gather(model)
    for layer in model:
        fully_shard(layer, mesh=MESH)
    fully_shard(model, mesh=MESH)
    return model


def step(model, seed: int) -> torch.Tensor:
    x = torch.randn(S, B, H, generator=generator(seed))
    with te.fp8_autocast(fp8_recipe=RECIPE, fp8_group=dist.group.WORLD):
        y = model(x.chunk(WORLD, dim=1)[RANK])
    y.float().square().sum().backward()
    return y.detach()


def shard_parts(p) -> tuple:
    local = p.to_local()
    if isinstance(local, Float8Tensor):
        return local._data, local._scale_inv
    return (getattr(local, "_weight", local).detach(),)  # (FP8AllGatherWeight: its weight)


def check_round_trip(kind: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    original = sharded_stack(kind, seed=0)
    opt = torch.optim.SGD(original.parameters(), lr=0.05)
    for i in range(2):  # the weights and the FP8 state move away from their initial values
        step(original, seed=10 + i)
        opt.step()
        opt.zero_grad()
    path = os.path.join(tempfile.gettempdir(), f"te_dcp_{PORT}_{kind}")
    try:
        dcp.save(get_model_state_dict(original), checkpoint_id=path)
        loaded = sharded_stack(kind, seed=1)
        state = get_model_state_dict(loaded)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(loaded, state)
    finally:
        dist.barrier()  # every rank has read the files
        if RANK == 0:
            shutil.rmtree(path, ignore_errors=True)
    pairs = list(zip(original.named_parameters(), loaded.parameters(), strict=True))
    for (name, p), q in pairs:
        assert type(q.to_local()) is type(p.to_local()), f"{kind} {name}: {type(q.to_local())}"
        for a, b in zip(shard_parts(p), shard_parts(q), strict=True):
            exact(b, a, f"{kind} {name} loaded")
    modules = [(n, m, dict(loaded.named_modules())[n]) for n, m in original.named_modules()
               if isinstance(m, FP8Module)]
    for name, m, m2 in modules:
        for buf in _META:
            exact(getattr(m2, buf), getattr(m, buf), f"{kind} {name}.{buf} loaded")
    exact(step(loaded, seed=20), step(original, seed=20), f"{kind} the next step's output")
    for (name, p), q in pairs:
        exact(q.grad.to_local(), p.grad.to_local(), f"{kind} the next step's {name}.grad")
    for name, m, m2 in modules:
        for buf in _META:
            exact(getattr(m2, buf), getattr(m, buf), f"{kind} {name}.{buf} after the step")


if __name__ == "__main__":
    _tp_world.start(RANK, WORLD, PORT)
    from torch.distributed.device_mesh import init_device_mesh

    MESH = init_device_mesh(DEVICE, (WORLD,))
    case(check_round_trip, "fp8_model_init")
    case(check_round_trip, "fp8_all_gather")
    dist.destroy_process_group()
    _tp_world.finish(RANK)
