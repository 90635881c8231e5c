"""Benchmark harness: CUDA-event timing with warm-up and medians, L2-defeating input
rotation, and one JSON result file per benchmark under ``benchmarks/results/``.

A benchmark never asserts; it measures the project and its peers side by side in one
process and records what it saw, with the device, the versions and the shapes.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Measured device-to-device copy of this H200 (BASELINES.md): the ceiling that bandwidth
# figures are reported against. Each run also measures its own copy, recorded beside it.
H200_COPY_TBPS = 4.24


def _summary(per_call: list[float], batch: int) -> dict:
    """Milliseconds per call over the timed batches: median, min, max, and how they were made."""
    return {
        "median_ms": statistics.median(per_call),
        "min_ms": min(per_call),
        "max_ms": max(per_call),
        "batches": len(per_call),
        "calls_per_batch": batch,
    }


def _event_timed(run_batch: Callable[[int], object], repeats: int, batch: int) -> list[float]:
    """Milliseconds per call of ``repeats`` batches, each ``run_batch(r)`` timed between two
    CUDA events on the current stream."""
    per_call = []
    for r in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run_batch(r)
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / batch)
    return per_call


def time_cuda(
    fn: Callable[[int], object],
    *,
    batch: int = 10,
    repeats: int = 15,
    warmup: int = 3,
) -> dict:
    """Times ``fn(i)`` on the current CUDA stream and returns milliseconds per call.

    ``fn`` receives the call index so that it can rotate through several input sets (more
    bytes than the L2 holds), so no call reads what the previous one left in the cache.
    Calls are timed in batches between two CUDA events, so host-side launch overhead
    overlaps the GPU work as it does in a training step; the result is the median (and
    min/max) over ``repeats`` batches.
    """
    run_batch = _launch_batch(fn, batch, warmup)
    torch.cuda.synchronize()
    return _summary(_event_timed(run_batch, repeats, batch), batch)


def time_cuda_graph(
    fn: Callable[[int], object],
    *,
    batch: int = 10,
    repeats: int = 15,
    warmup: int = 3,
) -> dict:
    """Like :func:`time_cuda`, but ``batch`` calls are captured once in a CUDA graph and the
    graph is replayed: the result is GPU time alone, with no host launch cost in it.

    ``fn`` must launch its work on torch's *current* stream at call time (capture runs on a
    side stream), and must allocate nothing it frees between calls.
    """
    run_batch = _graph_batch(fn, batch, warmup)
    torch.cuda.synchronize()
    per_call = _event_timed(run_batch, repeats, batch)
    return {**_summary(per_call, batch), "timing": "cuda_graph_replay"}


def time_host(fn: Callable[[int], object], repeats: int = 5) -> dict:
    """Milliseconds per call by wall clock, for what CUDA events cannot time: the CPU smoke
    runs, and JAX (whose fn synchronizes with block_until_ready)."""
    fn(0)
    per_call = []
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r)
        per_call.append((time.perf_counter() - t0) * 1e3)
    return _summary(per_call, 1)


def time_cuda_interleaved(
    fns: dict,
    *,
    graph: bool = False,
    batch: int = 10,
    repeats: int = 15,
    warmup: int = 3,
) -> dict:
    """Times every ``fns[key](i)`` as :func:`time_cuda` (or, with ``graph``,
    :func:`time_cuda_graph`) does, but in rounds: each round times one batch of every
    contender, in an order that rotates from round to round. The GPU's clock drifts with its
    power draw and temperature over seconds; timing contenders one after another would hand
    that drift to whichever ran in a hot stretch, rounds hand it to all alike.

    Returns ``{key: summary}``; a contender that raises RuntimeError in its warm-up (a peer
    this device or build cannot run) gets ``{"error": message}`` and leaves the rounds.
    """
    runs, out = {}, {}
    for key, fn in fns.items():
        try:
            runs[key] = _graph_batch(fn, batch, warmup) if graph else _launch_batch(fn, batch,
                                                                                    warmup)
        except RuntimeError as err:
            out[key] = {"error": str(err)}
    torch.cuda.synchronize()
    keys = list(runs)
    per_call: dict = {key: [] for key in keys}
    for r in range(repeats):
        shift = r % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            per_call[key] += _event_timed(lambda _, run=runs[key], r=r: run(r), 1, batch)
    for key in keys:
        out[key] = _summary(per_call[key], batch)
        if graph:
            out[key]["timing"] = "cuda_graph_replay"
    return out


def _launch_batch(fn, batch: int, warmup: int):
    """Warms ``fn`` up and returns run(r): batch r of ``batch`` calls, launched."""
    for i in range(warmup * batch):
        fn(i)

    def run(r: int) -> None:
        for i in range(batch):
            fn(r * batch + i)
    return run


def _graph_batch(fn, batch: int, warmup: int):
    """Warms ``fn`` up on a side stream, captures ``batch`` calls in a CUDA graph and returns
    run(r): one replay of it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(warmup):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(batch):
            fn(i)
    for _ in range(warmup):
        graph.replay()
    return lambda r: graph.replay()


def measure_copy_tbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (read + write counted), the reference ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda i: dst.copy_(src), batch=5, repeats=10, warmup=2)
    return 2 * nbytes / (t["median_ms"] * 1e-3) / 1e12


def _git_commit() -> str | None:
    # A copy of the tree on another machine may carry stale git metadata: the caller can say
    # which commit it is.
    if os.environ.get("TE_GIT_COMMIT"):
        return os.environ["TE_GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Device, driver-visible versions and date of this run."""
    import transformer_engine.common as te_common

    cuda = torch.cuda.is_available()
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # (a CPU run, for the host-time probes: the CPU's model name where Linux gives it)
        "device": torch.cuda.get_device_name() if cuda else f"cpu: {_cpu_name()}",
        "compute_capability": (".".join(map(str, torch.cuda.get_device_capability())) if cuda
                               else None),
        "torch": torch.__version__,
        "cuda_runtime_of_torch": torch.version.cuda,
        "transformer_engine": te_common.__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
    }
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except ImportError:
        pass
    return env


def write_result(name: str, payload: dict) -> Path:
    """Writes ``payload`` (plus the environment) to ``benchmarks/results/<name>.json``.

    The directory may be redirected with ``TE_BENCH_RESULTS`` (for runs whose output is
    collected elsewhere); this only moves files, it never changes what is measured.
    """
    out_dir = Path(os.environ.get("TE_BENCH_RESULTS", RESULTS_DIR))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    data = {"benchmark": name, "environment": environment(), **payload}
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def rotating(make: Callable[[], Sequence[torch.Tensor]], min_bytes: int = 400 << 20) -> list:
    """Builds enough input sets (each from ``make()``) to exceed ``min_bytes`` in total."""
    sets = [make()]
    per_set = sum(t.numel() * t.element_size() for t in sets[0])
    while len(sets) * per_set < min_bytes:
        sets.append(make())
    return sets
