"""A one-line progress bar for the training examples, on plain stdout (no dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    """A bar with the step, the loss and a rate (``unit``/s since the start).

    On a terminal the line is redrawn in place; elsewhere (a log, a pipe) it prints one line
    per 10 % of the steps, so logs stay short.
    """

    def __init__(self, label: str, total: int, unit: str = "samples", width: int = 28):
        self.label, self.total, self.unit, self.width = label, total, unit, width
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, loss: float, done: int) -> None:
        """Shows ``step`` of ``total`` with ``loss``; ``done`` units so far give the rate."""
        if not self.tty and step % max(self.total // 10, 1) and step != self.total:
            return
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        line = (f"{self.label:>14} [{bar}] {step:4d}/{self.total}  loss {loss:.5f}  "
                f"{rate:9.0f} {self.unit}/s")
        print("\r" + line if self.tty else line, end="" if self.tty else "\n", flush=True)

    def close(self) -> float:
        """Ends the line; returns the seconds since the bar was made."""
        if self.tty:
            print()
        return time.perf_counter() - self.start
