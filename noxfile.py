"""Nox sessions of Transformer Engine (`nox -l` lists them; plain `nox` runs `tests`).

The four wheels are built once into dist/ by one helper (`_wheels`) and every other session
installs them from there, so the sessions test what users install. The helper skips the build
when dist/ already holds wheels of the current sources (a hash kept in dist/.sources.json).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
STAMP = DIST / ".sources.json"
# The wheel projects: the native core, the two framework packages, the meta-package.
PROJECTS = {
    "common": "transformer_engine_common",
    "pytorch": "transformer_engine_torch",
    "jax": "transformer_engine_jax",
    "wheels/transformer-engine": "transformer_engine",
}
# What a rebuild depends on; build trees and caches inside these folders are skipped.
SOURCE_DIRS = ("cpp", *PROJECTS)
_NOT_SOURCES = {"build", "__pycache__", ".pytest_cache"}
VERSION = nox.project.load_toml(ROOT / "wheels/transformer-engine/pyproject.toml")["project"][
    "version"
]
# Which wheels each meta-package extra brings, by wheel name prefix.
_EXTRAS = {
    "": ("transformer_engine_common", "transformer_engine-"),
    "pytorch": ("transformer_engine_common", "transformer_engine-", "transformer_engine_torch"),
    "jax": ("transformer_engine_common", "transformer_engine-", "transformer_engine_jax"),
}
_EXTRAS["all"] = tuple(dict.fromkeys(_EXTRAS["pytorch"] + _EXTRAS["jax"]))
TEST_REQUIREMENTS = {
    "": ("-r", "tests/requirements.txt"),
    "pytorch": ("-r", "tests/requirements.txt", "-r", "tests/requirements-torch.txt"),
    "jax": ("-r", "tests/requirements.txt", "-r", "tests/requirements-jax.txt"),
}
TEST_REQUIREMENTS["all"] = TEST_REQUIREMENTS["pytorch"] + ("-r", "tests/requirements-jax.txt")


def _source_hash() -> str:
    digest = hashlib.sha256()
    for top in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = sorted(
                d for d in dirnames if d not in _NOT_SOURCES and not d.endswith(".egg-info")
            )
            for name in sorted(filenames):
                if name.endswith((".so", ".pyc")):  # in-place development builds
                    continue
                path = Path(dirpath, name)
                digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _build_requirements() -> list[str]:
    requirements: list[str] = []
    for project in PROJECTS:
        build_system = nox.project.load_toml(ROOT / project / "pyproject.toml")["build-system"]
        requirements += [r for r in build_system["requires"] if r not in requirements]
    return requirements


def _built(wanted: dict[str, str]) -> list[Path] | None:
    """The wheels in dist/ if they were built from the current sources in a fitting mode."""
    if not STAMP.is_file():
        return None
    stamp = json.loads(STAMP.read_text())
    # A CUDA build also carries the CPU path, so it serves a session that asked for OFF.
    mode_fits = stamp.get("TE_WITH_CUDA") == wanted["TE_WITH_CUDA"] or (
        wanted["TE_WITH_CUDA"] == "OFF" and stamp.get("TE_WITH_CUDA") in ("AUTO", "ON")
    )
    wheels = [DIST / name for name in stamp.get("wheels", [])]
    if stamp.get("sources") != wanted["sources"] or not mode_fits or len(wheels) != len(PROJECTS):
        return None
    return wheels if all(w.is_file() for w in wheels) else None


def _wheels(session: nox.Session, cuda: str = "OFF") -> list[Path]:
    """Builds the four wheels into dist/ (TE_WITH_CUDA=`cuda`) unless they are up to date.

    The build runs in the session's environment without build isolation, so the CMake tree
    (common/build/<wheel tag>[-cpu]) is reused and a rebuild only compiles what changed.
    """
    wanted = {"sources": _source_hash(), "TE_WITH_CUDA": cuda}
    wheels = _built(wanted)
    if wheels is not None:
        session.log(f"dist/ is up to date with the sources ({len(wheels)} wheels)")
        return wheels
    # torch too: the pytorch wheel compiles te.Linear's fast path against it (pytorch/setup.py),
    # the release the tests pin.
    session.install(*_build_requirements(), "-r", "tests/requirements-torch.txt")
    # The wheels are built into a staging folder that replaces dist/ only once all four are
    # there: a failed build leaves the previous wheels in place.
    staging = ROOT / "build" / "dist-staging"
    shutil.rmtree(staging, ignore_errors=True)
    for project in PROJECTS:  # setuptools would ship files deleted from the sources since
        if project != "common":
            shutil.rmtree(ROOT / project / "build", ignore_errors=True)
    build_dir = "build/{wheel_tag}" + ("" if cuda == "AUTO" else f"-{cuda.lower()}")
    common = ("-C", f"cmake.define.TE_WITH_CUDA={cuda}", "-C", f"build-dir={build_dir}")
    pip_wheel = ("python", "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w")
    # Verbose but captured: of CMake's output only the line saying whether the core was built
    # with CUDA, and why, is shown (all of it when the build fails).
    session.log(f"building the core wheel (TE_WITH_CUDA={cuda}); this can take minutes")
    log = session.run(*pip_wheel, str(staging), "-v", *common, "./common", silent=True)
    for line in (log or "").splitlines():
        if "Transformer Engine core:" in line or "cuDNN fused attention:" in line:
            session.log(line.strip().removeprefix("-- "))
    # The jax wheel's FFI extension and the pytorch wheel's fast path compile against the core's
    # headers and link its library, which they find in the installed common wheel.
    common_wheel = staging.glob("transformer_engine_common-*.whl")
    session.install("--no-deps", "--force-reinstall", *map(str, common_wheel))
    session.run(*pip_wheel, str(staging), *(f"./{p}" for p in PROJECTS if p != "common"))
    names = sorted(w.name for w in staging.glob("*.whl"))
    if len(names) != len(PROJECTS):
        session.error(f"expected {len(PROJECTS)} wheels, found {names}")
    shutil.rmtree(DIST, ignore_errors=True)
    shutil.move(staging, DIST)
    STAMP.write_text(json.dumps({**wanted, "wheels": names}, indent=1))
    return [DIST / name for name in names]


def _install(session: nox.Session, extra: str, *requirements: str) -> None:
    """Installs `transformer-engine[extra]` from dist/ with its dependencies and `requirements`."""
    wheels = _wheels(session)
    target = f"transformer-engine[{extra}]" if extra else "transformer-engine"
    # The version pin keeps pip from taking an unrelated release of the same name from PyPI.
    session.install("--find-links", str(DIST), f"{target}=={VERSION}", *requirements)
    # A rebuild keeps the version number, so pip would keep what it installed before.
    ours = [w for w in wheels if w.name.startswith(_EXTRAS[extra])]
    session.install("--no-deps", "--force-reinstall", *map(str, ours))


def _pytest(session: nox.Session, *paths: str) -> None:
    # Exit code 5 (no test collected) fails the session like any other non-zero code.
    session.run("pytest", *[p for p in paths if (ROOT / p).exists()], *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Build the four wheels into dist/: with the CUDA kernels when nvcc and cuBLASLt are found,
    else the CPU path (TE_WITH_CUDA=AUTO; the log says which and why)."""
    for wheel in _wheels(session, cuda="AUTO"):
        session.log(f"dist/{wheel.name}")


@nox.session
def tests(session: nox.Session) -> None:
    """Everything that runs on a CPU: the C++ tests (ctest), then pytest over tests/."""
    _install(session, "all", *TEST_REQUIREMENTS["all"])
    session.install("cmake>=3.24", "ninja")
    configure = ("-DTE_BUILD_TESTS=ON", "-DTE_WITH_CUDA=OFF", "-G", "Ninja")
    session.run("cmake", "-S", "cpp", "-B", "build/ctest", *configure)
    session.run("cmake", "--build", "build/ctest")
    session.run("ctest", "--test-dir", "build/ctest", "--output-on-failure", "--no-tests=error")
    _pytest(session, "tests")


@nox.session
def tests_torch(session: nox.Session) -> None:
    """pytest over tests/common and tests/pytorch, with torch only."""
    _install(session, "pytorch", *TEST_REQUIREMENTS["pytorch"])
    _pytest(session, "tests/common", "tests/pytorch")


@nox.session(default=False)
def tests_torch_release(session: nox.Session) -> None:
    """The pytorch package, built beside the tests' torch pin, under another torch release.

    `nox -s tests_torch_release` (torch 2.11.0, the oldest release the compiled eager ops are
    built for), or `-- 2.12.1` for another. It checks that the ops' one binary (LibTorch stable
    ABI, pytorch/setup.py) loads there with its fast path on, then runs te.Linear's tests. Not
    in the default run: PyPI has no CPU-only build of those releases, and theirs pull several GB
    of CUDA libraries.
    """
    release = session.posargs[0] if session.posargs else "2.11.0"
    _install(session, "pytorch", f"torch=={release}", "-r", "tests/requirements.txt")
    session.run("python", "-c", (
        "import torch; from transformer_engine.pytorch import fast_linear; "
        f"assert torch.__version__.split('+')[0] == {release!r}, torch.__version__; "
        "assert fast_linear.available(), 'the compiled eager ops did not load'; "
        "print('torch', torch.__version__, ': compiled eager ops loaded')"))
    session.run("pytest", "-q", "tests/pytorch/test_fast_linear.py", "tests/pytorch/test_linear.py")


@nox.session
def tests_jax(session: nox.Session) -> None:
    """pytest over tests/common and tests/jax, with jax and flax only."""
    _install(session, "jax", *TEST_REQUIREMENTS["jax"])
    _pytest(session, "tests/common", "tests/jax")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over every Python file (rules in ruff.toml)."""
    session.install("ruff>=0.6,<1")
    session.run("ruff", "check", *session.posargs, ".")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation into docs/_build/html (warnings are errors)."""
    _install(session, "", "sphinx>=7,<10", "myst-parser>=3,<6")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")


def _demo_framework(args: list[str]) -> str:
    """The --framework that train_gpt.py will see in `args` (its default: torch)."""
    framework = "torch"
    for i, arg in enumerate(args):
        if arg == "--framework" and i + 1 < len(args):
            framework = args[i + 1]
        elif arg.startswith("--framework="):
            framework = arg.split("=", 1)[1]
    return framework


@nox.session
def demo(session: nox.Session) -> None:
    """The training demo: a small GPT of TransformerLayer trained in FP8 and high precision.

    Both runs start from the same weights and see the same batches; the demo compares their
    losses, tokens/s and memory and samples text from each.

    Runs on the CPU (FP8 emulated by the core) unless a GPU is there; arguments after `--` go
    to examples/train_gpt.py (e.g. `nox -s demo -- --recipe block`, `-- --framework jax`,
    `-- --quick`). The MLP demo is examples/train_mlp_fp8.py.
    """
    if _demo_framework(session.posargs) == "jax":
        _install(session, "jax", "-r", "tests/requirements-jax.txt", "-r",
                 "examples/requirements.txt", "-r", "examples/requirements-jax.txt")
    else:
        # The tests' torch pin: the CPU build where pip is set up for it.
        _install(session, "pytorch", "-r", "tests/requirements-torch.txt", "-r",
                 "examples/requirements.txt")
    session.run("python", "examples/train_gpt.py", *session.posargs)


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """On a GPU machine, offline: build with CUDA, ctest, `pytest -m cuda`, memcheck, benchmarks.

    Uses the machine's Python and packages (no environment is created) and runs
    scripts/gpu_check.sh: the project is installed with --no-build-isolation --no-deps and the
    core built with TE_WITH_CUDA=ON. Logs go to build/gpu-check, benchmark results to
    benchmarks/results. Arguments after `--` go to pytest.
    """
    session.run("python", "-c", "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'")
    results = ROOT / "benchmarks/results"
    session.run("bash", "scripts/gpu_check.sh", "build/gpu-check", *session.posargs,
                env={"TE_BENCH_RESULTS": str(results)})
    if importlib.util.find_spec("matplotlib") is not None:
        for result in sorted(results.glob("*.json")):
            session.run("python", "benchmarks/plot.py", str(result.relative_to(ROOT)))
