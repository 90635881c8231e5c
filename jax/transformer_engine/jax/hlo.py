"""Counting custom calls in compiled HLO text: which GEMMs of a program run in FP8.

Used by the tests, the benchmark and :func:`seed_example_uses_fp8_gemm`.
"""

from __future__ import annotations

import re
from collections import Counter

from transformer_engine.jax._native import TARGETS

__all__ = ["custom_calls", "count_fp8_gemms", "count_cublas_fp8_gemms"]

_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_FP8 = re.compile(r"\bf8e(4m3fn|5m2)\[")


def custom_calls(hlo_text: str) -> list[tuple[str, str]]:
    """(target, operands text) of every custom call in ``hlo_text``.

    The operands text is the line after ``custom-call(`` up to the metadata: it holds the
    operand types (inline before optimization, in ``operand_layout_constraints`` after),
    never the result type.
    """
    calls = []
    for line in hlo_text.splitlines():
        m = _TARGET.search(line)
        start = line.find("custom-call(")
        if m is None or start < 0:
            continue
        operands = line[start:].split(" metadata=")[0].split(" backend_config=")[0]
        calls.append((m.group("target"), operands))
    return calls


def target_counts(hlo_text: str) -> Counter:
    """How many custom calls of each target ``hlo_text`` holds."""
    return Counter(t for t, _ in custom_calls(hlo_text))


def count_fp8_gemms(hlo_text: str) -> int:
    """Calls of this package's GEMM target whose operands are FP8."""
    return sum(1 for t, ops in custom_calls(hlo_text)
               if t == TARGETS["gemm"] and _FP8.search(ops))


def count_cublas_fp8_gemms(hlo_text: str) -> int:
    """XLA's own cuBLAS(Lt) GEMM custom calls with FP8 operands (what flax's fp8_ops become)."""
    return sum(1 for t, ops in custom_calls(hlo_text)
               if t.startswith("__cublas") and ("f8" in t or _FP8.search(ops)))
