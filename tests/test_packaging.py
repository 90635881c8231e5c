"""The four wheels fit together: one package spread over them, one version, exact pins between
them."""

import importlib
import importlib.metadata
import importlib.util
import re
import zipfile
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


def test_only_the_common_wheel_ships_the_top_package():
    """`transformer_engine` spans the wheels: transformer-engine-common ships its __init__.py,
    the -torch and -jax wheels only their subpackage (their own __init__.py would replace the
    common wheel's file on installation, and in a checkout stop the search at their folder)."""
    assert (ROOT / "common/transformer_engine/__init__.py").is_file()
    for folder in ("pytorch", "jax"):
        assert (ROOT / folder / "transformer_engine" / folder / "__init__.py").is_file()
        assert not (ROOT / folder / "transformer_engine/__init__.py").exists(), folder
    # The torch wheel: setuptools' namespace-aware discovery with pyproject.toml's filter.
    setuptools = pytest.importorskip("setuptools")
    tomllib = pytest.importorskip("tomllib")
    find = tomllib.loads((ROOT / "pytorch/pyproject.toml").read_text())["tool"]["setuptools"]
    packages = setuptools.find_namespace_packages(
        str(ROOT / "pytorch"), include=find["packages"]["find"]["include"])
    assert "transformer_engine.pytorch" in packages
    assert "transformer_engine" not in packages
    # The jax wheel: scikit-build-core copies jax/transformer_engine/ as it is (checked above),
    # and CMake installs only into the subpackage.
    destinations = re.findall(r"DESTINATION\s+(\S+)", (ROOT / "jax/CMakeLists.txt").read_text())
    assert destinations
    assert all(d.startswith("transformer_engine/jax") for d in destinations), destinations


def test_installed_top_package_is_the_common_wheels():
    import transformer_engine

    # Found as a regular package, in the folder of the common wheel; no other portion of its
    # __path__ (a framework wheel's, or a checkout's pytorch/ and jax/) has an __init__.py.
    init = Path(transformer_engine.__file__)
    assert init.name == "__init__.py" and (init.parent / "common/__init__.py").is_file()
    for folder in map(Path, transformer_engine.__path__):
        ships_common = (folder / "common/__init__.py").is_file()
        assert (folder / "__init__.py").exists() == ships_common, folder
    # Its version: NVIDIA's API level, with the wheels' own release as the local label.
    release = _pyproject("common")["version"]
    assert transformer_engine.release == release
    assert transformer_engine.__version__ == f"{transformer_engine.api_level}+te{release}"


def test_built_wheels_hold_the_top_package_only_in_common():
    """The wheels in dist/ (nox builds them there before its test sessions)."""
    version = _pyproject("common")["version"]
    wheels = sorted((ROOT / "dist").glob(f"transformer_engine*-{version}-*.whl"))
    if not wheels:
        pytest.skip("no wheels of this version in dist/")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            names = archive.namelist()
        has_init = "transformer_engine/__init__.py" in names
        assert has_init == wheel.name.startswith("transformer_engine_common-"), wheel.name


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
