"""A world of processes for the distributed tests: one process per rank runs a rank script,
which prints "rank R: ok" when its checks pass. CPU processes over gloo; with
``TE_WORLD_DEVICE=cuda`` in the environment, one GPU per rank over NCCL (the rank scripts make
their modules and tensors on ``DEVICE`` and draw from ``generator``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

TIMEOUT_S = 120  # a hung collective fails the test instead of stalling the suite
DEVICE = os.environ.get("TE_WORLD_DEVICE", "cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(script: Path, world: int) -> None:
    """Runs ``script RANK WORLD PORT`` in ``world`` processes; fails with every failed rank's
    error output, or when a rank does not finish within TIMEOUT_S."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(world), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    errors = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=TIMEOUT_S)
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}")
            else:
                assert out.strip().endswith(f"rank {rank}: ok"), out
    finally:
        for proc in procs:  # after a timeout (or a failed rank), the others may wait forever
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not errors, "\n".join(errors)


# ---------------------------------------------------------------- inside a rank script

# The failed checks of this rank, each with its traceback (the script prints them and exits 1).
failures: list[str] = []


def start(rank: int, world: int, port: int):
    """Joins the world of this rank script (gloo on the CPU; NCCL on GPU ``rank`` under
    TE_WORLD_DEVICE=cuda, where new tensors then go by default); returns a group of all its
    ranks."""
    import datetime

    backend = "gloo"
    if DEVICE == "cuda":
        backend = "nccl"
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    return dist.new_group(list(range(world)))


def generator(seed: int) -> torch.Generator:
    """A generator on this world's device, seeded: the same draws on every rank."""
    return torch.Generator(DEVICE).manual_seed(seed)


def fp8_state_same_on_ranks(module, world: int, group) -> list:
    """For each delayed-scaling state buffer of ``module`` (histories, scales, scale_invs of
    the forward and the backward), whether every rank holds the same values."""
    names = ("amax_history_fwd", "scale_fwd", "scale_inv_fwd", "amax_history_bwd",
             "scale_bwd", "scale_inv_bwd")
    same = []
    for name in names:
        copies = gathered(getattr(module, name).detach(), world, group)
        same.append(all(torch.equal(c, copies[0]) for c in copies))
    return same


def finish(rank: int) -> None:
    """Ends a rank script: its failures on stderr and exit status 1, else "rank R: ok". The
    process ends here without the interpreter's teardown, where the threads of torch's
    distributed and FSDP machinery were seen to abort the process now and then (after every
    check had passed) on a loaded machine."""
    import os

    if failures:
        print("\n".join(failures), file=sys.stderr)
    else:
        print(f"rank {rank}: ok")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failures else 0)


def case(fn, *args):
    """Runs a check now; a failure is recorded with its traceback and the next runs."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 (every failure is reported, the others still run)
        rank = sys.argv[1] if len(sys.argv) > 1 else "?"
        failures.append(f"rank {rank} {fn.__name__}{args}:\n{traceback.format_exc()}")


def exact(got, want, what):
    assert torch.equal(got, want), f"{what}: not bit-exact, max diff {(got - want).abs().max()}"


def within(got, want, bound, what):
    """|got - want| <= bound elementwise."""
    err = (got.double() - want.double()).abs()
    worst = (err / (bound.double() + 1e-30)).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.3g}x the bound"


def rms_close(got, want, rel, what):
    """The error's norm within ``rel`` of the reference's: what a missing or doubled sum, a
    wrong slice or a bias added per rank would all exceed by far."""
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err <= rel, f"{what}: relative rms error {err:.3g} > {rel}"


def gathered(t, world: int, group):
    """Every rank's ``t``, in rank order."""
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


class SizedGroup:
    """Stands in for a ProcessGroup where only its size is read (the argument checks made
    before any collective)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def layer_stack(hidden: int, fp8_weights=None) -> torch.nn.Sequential:
    """Two te.TransformerLayers (ffn 2 x hidden, 4 heads, no dropout) on the CPU, from seed 0;
    ``fp8_weights`` a recipe: built under fp8_model_init with it. The same on every rank."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    with te.fp8_model_init(enabled=fp8_weights is not None, recipe=fp8_weights):
        return torch.nn.Sequential(*(te.TransformerLayer(hidden, 2 * hidden, 4,
                                                         hidden_dropout=0.0,
                                                         attention_dropout=0.0, device=DEVICE)
                                     for _ in range(2)))
