"""The four wheels fit together: one shared namespace, one version, exact pins between them."""

import importlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Distribution name -> (its pyproject.toml, the package whose __version__ it must match).
WHEELS = {
    "transformer-engine-common": ("common", "transformer_engine.common"),
    "transformer-engine-torch": ("pytorch", "transformer_engine.pytorch"),
    "transformer-engine-jax": ("jax", "transformer_engine.jax"),
    "transformer-engine": ("wheels/transformer-engine", None),
}


def _pyproject(folder: str) -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]


def test_transformer_engine_is_a_namespace_package():
    import transformer_engine

    # A transformer_engine/__init__.py in any wheel would hide the other wheels' subpackages.
    assert transformer_engine.__spec__.origin in (None, "namespace")
    for folder in transformer_engine.__path__:
        assert not (Path(folder) / "__init__.py").exists(), folder


@pytest.mark.parametrize("dist", sorted(WHEELS))
def test_installed_version_matches_the_package(dist):
    folder, package = WHEELS[dist]
    expected = _pyproject(folder)["version"]
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{dist} is not installed in this session")
    assert installed == expected
    if package is not None:
        assert importlib.import_module(package).__version__ == expected


def test_wheels_pin_each_other_exactly():
    version = _pyproject("common")["version"]
    for folder, _ in WHEELS.values():
        project = _pyproject(folder)
        assert project["version"] == version, folder
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        for req in requirements:
            name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
            if name.startswith("transformer-engine"):
                assert req == f"{name}=={version}", (folder, req)


def _native_libraries() -> list[Path]:
    import transformer_engine.common as common

    folder = Path(common.__file__).parent
    found = sorted(folder.glob("lib/libtransformer_engine.so*")) + sorted(folder.glob("_core*.so"))
    jax_spec = importlib.util.find_spec("transformer_engine.jax")
    if jax_spec is not None and jax_spec.submodule_search_locations:
        for path in jax_spec.submodule_search_locations:
            found += sorted(Path(path).glob("_te_jax*.so"))
    return found


def test_native_libraries_export_no_cpp_runtime():
    """A static copy of the C++ runtime inside our libraries must stay private: exported, its
    symbols mix with the process's libstdc++.so.6 (loaded by torch, jaxlib, cuDNN) and
    iostreams break (a number formatted into a stream came out empty, or crashed)."""
    import shutil
    import subprocess

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    libraries = _native_libraries()
    assert libraries, "no native library of transformer_engine found"
    # std::ostream::_M_insert<long>: defined only inside the C++ runtime itself.
    runtime_symbol = "_ZNSo9_M_insertIlEERSoT_"
    for lib in libraries:
        symbols = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True,
                                 text=True, check=True).stdout
        assert runtime_symbol not in symbols, f"{lib.name} exports the C++ runtime's symbols"
