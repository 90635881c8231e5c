"""The four wheels fit together: one shared namespace, one version, exact pins between them."""

import importlib
import importlib.metadata
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
