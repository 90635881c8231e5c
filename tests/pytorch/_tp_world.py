"""A gloo world of CPU processes for the tensor-parallel tests: one process per rank runs a
rank script, which prints "rank R: ok" when its checks pass."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 120  # a hung collective fails the test instead of stalling the suite


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
