"""The core's CMake configure picks the CUDA or the CPU build and says which in one line.

TE_WITH_CUDA=AUTO must build the CUDA kernels exactly when ON would configure, and fall back
to the CPU path (naming what is missing) otherwise: a machine with nvcc but no cuBLASLt gets
the CPU build, not a failed configure. Configure only (no compile), in a temporary folder.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CMAKE = shutil.which("cmake")
NVCC = shutil.which("nvcc")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CMAKE is None, reason="needs cmake"),
]
LINE = re.compile(r"^-- Transformer Engine core: (.*)$", re.M)


def _configure(build_dir: Path, mode: str, env: dict | None = None) -> tuple[int, str]:
    args = [CMAKE, "-S", str(ROOT / "cpp"), "-B", str(build_dir), f"-DTE_WITH_CUDA={mode}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    return run.returncode, run.stdout + run.stderr


def _choice(output: str) -> str:
    lines = LINE.findall(output)
    assert len(lines) == 1, output
    return lines[0]


def test_off_builds_the_cpu_path(tmp_path):
    rc, out = _configure(tmp_path, "OFF")
    assert rc == 0, out
    assert _choice(out) == "CPU-only build (TE_WITH_CUDA=OFF)"


def test_auto_builds_cuda_exactly_when_on_can(tmp_path):
    rc_on, out_on = _configure(tmp_path / "on", "ON")
    rc, out = _configure(tmp_path / "auto", "AUTO")
    assert rc == 0, out
    if rc_on == 0:
        assert _choice(out_on).startswith("CUDA build (TE_WITH_CUDA=ON)"), out_on
        assert _choice(out).startswith("CUDA build (TE_WITH_CUDA=AUTO)"), out
    else:
        # ON names what is missing and stops; AUTO names the same and builds the CPU path.
        missing = re.search(r"TE_WITH_CUDA=ON, but the CUDA build lacks: (.*?)\n\n",
                            out_on, re.S)
        assert missing, out_on
        lacks = " ".join(missing.group(1).split())
        expected = f"CPU-only build (TE_WITH_CUDA=AUTO, but the CUDA build lacks: {lacks})"
        assert _choice(out) == expected


def _toolkit_major() -> str:
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    return re.search(r"release (\d+)\.", version).group(1)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_cublaslt_from_the_pip_wheel(tmp_path):
    """Where the toolkit has no cuBLASLt, the nvidia-cublas wheel's copy makes a CUDA build."""
    rc, out = _configure(tmp_path / "plain", "AUTO")
    if "lacks" not in _choice(out) or "cuBLASLt" not in _choice(out):
        pytest.skip("the toolkit has cuBLASLt (or lacks more than it)")
    if "nvcc" in _choice(out) or "cudart" in _choice(out):
        pytest.skip("no usable nvcc and CUDA runtime")
    # The wheel's layout (CUDA 13: nvidia/cu13; the file contents do not matter to configure).
    major = _toolkit_major()
    wheel = tmp_path / "site" / "nvidia" / f"cu{major}"
    (wheel / "lib").mkdir(parents=True)
    (wheel / "include").mkdir()
    (wheel / "lib" / f"libcublasLt.so.{major}").write_bytes(b"")
    (wheel / "include" / "cublasLt.h").write_text("/* stand-in */\n")
    (wheel / "include" / "cublas_api.h").write_text("/* stand-in */\n")
    rc, out = _configure(tmp_path / "wheel", "AUTO", {"PYTHONPATH": str(tmp_path / "site")})
    assert rc == 0, out
    choice = _choice(out)
    assert choice.startswith("CUDA build (TE_WITH_CUDA=AUTO)"), out
    assert choice.endswith(f"cuBLASLt {wheel}/lib/libcublasLt.so.{major}"), out
    # Only the cuBLAS headers are copied into the build tree, not the wheel's include/.
    assert (tmp_path / "wheel" / "cublaslt_include" / "cublasLt.h").is_file()
