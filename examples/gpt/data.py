"""The training text: the Python standard library's own source, as bytes (a 256-token vocabulary).

Every machine with Python has it, so the demo needs no download. The files are read in sorted
order up to a fixed byte budget, so the same Python version gives the same corpus everywhere.
Whole files are held out for validation (the next file whenever validation holds less than
1/20 of the bytes read), so validation text is unseen code of the same kind.
Batches are windows at random offsets drawn from a seeded NumPy generator, as NumPy arrays that
both frameworks take.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 256  # byte-level: a token is a byte
_VALID_SHARE = 20  # validation keeps about 1/20 of the bytes
# Folders of the stdlib path that hold installed packages rather than the stdlib itself.
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 [n]
    valid: np.ndarray  # uint8 [m]
    files: int
    sha256: str  # of train + valid, to tell corpora apart in results

    def describe(self) -> str:
        return (f"{self.files} stdlib .py files, {self.train.size / 2**20:.1f} MiB train + "
                f"{self.valid.size / 2**20:.2f} MiB validation (sha256 {self.sha256[:12]})")


def stdlib_sources(root: str | None = None) -> list[Path]:
    """The .py files under the stdlib folder, sorted by their path relative to it."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _NOT_STDLIB]
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def load_corpus(budget: int, root: str | None = None) -> Corpus:
    """Reads whole files in order until ``budget`` bytes (the last file cut to fit)."""
    if budget < 4096:
        raise ValueError(f"load_corpus: budget must be >= 4096 bytes, got {budget}")
    train, valid, total, valid_total, files = [], [], 0, 0, 0
    for path in stdlib_sources(root):
        if total >= budget:
            break
        text = path.read_bytes()[: budget - total]
        if valid_total * _VALID_SHARE < total:
            valid.append(text)
            valid_total += len(text)
        else:
            train.append(text)
        total, files = total + len(text), files + 1
    if total < budget:
        raise RuntimeError(f"load_corpus: the stdlib at {root or sysconfig.get_paths()['stdlib']} "
                           f"holds {total} bytes of .py files, fewer than the {budget} asked for")
    train_bytes, valid_bytes = b"".join(train), b"".join(valid)
    digest = hashlib.sha256(train_bytes + valid_bytes).hexdigest()
    return Corpus(np.frombuffer(train_bytes, np.uint8), np.frombuffer(valid_bytes, np.uint8),
                  files, digest)


def windows(text: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` windows of ``seq + 1`` tokens at random offsets: int32 [batch, seq + 1]
    (inputs are ``[:, :-1]``, targets ``[:, 1:]``)."""
    if text.size < seq + 2:
        raise ValueError(f"windows: the text must hold more than seq + 1 = {seq + 1} bytes, "
                         f"got {text.size}")
    starts = rng.integers(0, text.size - seq - 1, size=batch)
    return text[starts[:, None] + np.arange(seq + 1)].astype(np.int32)


def train_batches(corpus: Corpus, steps: int, batch: int, seq: int, seed: int) -> list:
    """The batch of every step, drawn up front so that both runs see the very same data."""
    rng = np.random.default_rng(seed)
    return [windows(corpus.train, batch, seq, rng) for _ in range(steps)]


def valid_batches(corpus: Corpus, count: int, batch: int, seq: int, seed: int) -> list:
    """Fixed validation batches (their own generator, so they do not depend on ``steps``)."""
    rng = np.random.default_rng([seed, 1])
    return [windows(corpus.valid, batch, seq, rng) for _ in range(count)]


def prompts(corpus: Corpus, starts=(b"def ", b"class ", b"    for "), length: int = 24):
    """Sampling prompts of equal length (one batch): for each of ``starts``, the first line of
    the validation text that begins with it, cut to ``length`` bytes. uint8 [len(starts), length].
    """
    text = corpus.valid.tobytes()
    rows = []
    for start in starts:
        at = text.find(b"\n" + start)
        at = 0 if at < 0 else at + 1
        rows.append(np.frombuffer(text[at:at + length], np.uint8))
    return np.stack(rows).astype(np.int32)


def decode(tokens) -> str:
    """Bytes to text for printing (invalid UTF-8 shown as replacement characters)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
