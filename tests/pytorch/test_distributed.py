"""reduce_amax over an fp8_group: two CPU processes (gloo) that see different data end the
step with the same scales, those of the larger amax; without a group each keeps its own."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

# Run as `python -c` in each rank's process: a self-contained script, so the processes need
# nothing from the test's module (which pytest imports under a name they could not import).
_RANK_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
group = dist.new_group([0, 1])
results = {}
for name, fp8_group in (("fp8_group", group), ("no_group", None)):
    torch.manual_seed(0)  # the same weights on both ranks
    layer = te.Linear(32, 16, device="cpu")
    x = torch.full((16, 32), float(rank + 1), requires_grad=True)  # amax 1 and 2
    with te.fp8_autocast(fp8_recipe=recipe.DelayedScaling(amax_history_len=4),
                         fp8_group=fp8_group):
        y = layer(x)
    y.backward(torch.full_like(y, float(rank + 1)))
    results[name] = [layer.scale_fwd[0].item(), layer.scale_bwd[0].item()]
dist.destroy_process_group()
print(json.dumps(results))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_amaxes_are_reduced_over_the_group():
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(rank), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    e4m3, e5m2 = 448.0, 57344.0
    for rank in (0, 1):  # with the group: both ranks use the larger amax (2)
        assert results[rank]["fp8_group"] == pytest.approx([e4m3 / 2, e5m2 / 2])
    assert results[0]["no_group"] == pytest.approx([e4m3, e5m2])  # each its own amax
    assert results[1]["no_group"] == pytest.approx([e4m3 / 2, e5m2 / 2])
