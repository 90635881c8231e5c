"""reduce_amax over an fp8_group: two CPU processes (gloo) that see different data end the
step with the same scales, those of the larger amax; without a group each keeps its own."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import transformer_engine.pytorch as te
from transformer_engine.common import recipe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        group = dist.new_group([0, 1])
        for name, fp8_group in (("fp8_group", group), ("no_group", None)):
            torch.manual_seed(0)  # the same weights on both ranks
            layer = te.Linear(32, 16, device="cpu")
            x = torch.full((16, 32), float(rank + 1), requires_grad=True)  # amax 1 and 2
            with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4),
                                 fp8_group=fp8_group):
                y = layer(x)
            y.backward(torch.full_like(y, float(rank + 1)))
            results[(name, rank)] = (layer.scale_fwd[0].item(), layer.scale_bwd[0].item())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_amaxes_are_reduced_over_the_group():
    # One pair of processes for both cases: starting them is most of the test's time.
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), shared), nprocs=2,
                           start_method="spawn")
        results = dict(shared)
    e4m3, e5m2 = 448.0, 57344.0
    for rank in (0, 1):  # with the group: both ranks use the larger amax (2)
        assert results[("fp8_group", rank)] == pytest.approx((e4m3 / 2, e5m2 / 2))
    assert results[("no_group", 0)] == pytest.approx((e4m3, e5m2))  # each its own amax
    assert results[("no_group", 1)] == pytest.approx((e4m3 / 2, e5m2 / 2))
