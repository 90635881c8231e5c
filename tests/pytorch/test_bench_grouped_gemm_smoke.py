"""The grouped GEMM benchmark (bench_grouped_gemm.py --smoke) runs every contender at tiny
shapes on the CPU, and its grouped result agrees with torch's per-expert products."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_grouped_gemm_benchmark_smoke(capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_grouped_gemm as bench
    finally:
        sys.path.remove(str(BENCH))
    saved = (bench.HIDDEN, bench.FFN, dict(bench.GEMMS))
    try:
        bench.smoke()
    finally:
        bench.HIDDEN, bench.FFN, bench.GEMMS = saved[0], saved[1], saved[2]
    assert "smoke ok" in capsys.readouterr().out
    rows = bench.expert_rows(100, 3)
    assert len(rows) == 3 and all(r % 16 == 0 for r in rows)
    assert 100 <= sum(rows) < 100 + 16 * 3  # each expert's draw rounded up to 16
