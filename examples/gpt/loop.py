"""The training loop both frameworks share: schedule, steps, timing, evaluation and sampling.

A framework supplies a *runner* for one model in one precision (see ``Runner``); ``run`` drives
it over the given batches and returns what the report prints.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from progress import Progress

# The mean of the last steps' losses is the "final" training loss: one step's loss is noisy.
FINAL_LOSS_STEPS = 10
# Both runners clip the gradients' global norm to this before the optimizer step.
CLIP_NORM = 1.0


def learning_rate(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then a cosine down to ``floor * peak``
    at step ``total`` (steps count from 1)."""
    if step <= warmup:
        return peak * step / max(warmup, 1)
    done = min((step - warmup) / max(total - warmup, 1), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done)))


class Runner(Protocol):
    """One model in one precision, with its optimizer (a framework's implementation)."""

    def step(self, batch: np.ndarray, lr: float):
        """One optimizer step on ``batch`` (int32 [b, s + 1]); returns the step's loss and the
        gradients' global norm before clipping (float32 [2]), which may stay on the device
        until ``read`` reads them."""

    def read(self, handles: list) -> np.ndarray:
        """The steps' [loss, gradient norm] rows: float [len(handles), 2]."""

    def sync(self) -> None:
        """Waits for the device's queued work (for timing)."""

    def evaluate(self, batches: list) -> float:
        """The mean loss over ``batches`` without updating anything."""

    def sample(self, prompts: np.ndarray, new_tokens: int, temperature: float,
               seed: int) -> np.ndarray:
        """Continues every prompt by ``new_tokens`` through the KV cache: int [b, new_tokens]."""

    def peak_memory(self) -> tuple[int | None, str]:
        """Peak bytes of this run and what they measure."""


@dataclass
class RunResult:
    label: str
    losses: list[float]
    valid_loss: float
    tokens_per_s: float
    seconds: float
    peak_memory: int | None
    memory_note: str
    samples: list[np.ndarray] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping

    @property
    def first_loss(self) -> float:
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        return float(np.mean(self.losses[-FINAL_LOSS_STEPS:]))

    @property
    def clipped(self) -> float:
        """The fraction of steps whose gradients were clipped (their norm above CLIP_NORM):
        clipping shortens those steps, so two runs that clip differently also step
        differently."""
        return float(np.mean(np.asarray(self.grad_norms) > CLIP_NORM)) if self.grad_norms else 0.0


def run(label: str, runner: Runner, batches: list, valid: list, peak_lr: float, warmup: int,
        prompts: np.ndarray, new_tokens: int, temperature: float, seed: int) -> RunResult:
    steps = len(batches)
    tokens = batches[0].shape[0] * (batches[0].shape[1] - 1)
    # Throughput leaves out the first steps, which compile, autotune and allocate.
    untimed = min(5, steps // 4)
    progress = Progress(label, steps, unit="tokens")
    handles, timed_from = [], None
    for step, batch in enumerate(batches, start=1):
        if step == untimed + 1:
            runner.sync()
            timed_from = time.perf_counter()
        handles.append(runner.step(batch, learning_rate(step, steps, peak_lr, warmup)))
        if step % 10 == 0 or step == steps:
            progress.update(step, float(runner.read(handles[-1:])[0, 0]), step * tokens)
    runner.sync()
    timed = time.perf_counter() - timed_from
    seconds = progress.close()
    peak, note = runner.peak_memory()
    samples = []
    if new_tokens:
        samples = runner.sample(prompts, new_tokens, temperature, seed)
    stats = runner.read(handles)
    return RunResult(label, [float(v) for v in stats[:, 0]], runner.evaluate(valid),
                     (steps - untimed) * tokens / timed, seconds, peak, note, list(samples),
                     [float(v) for v in stats[:, 1]])
