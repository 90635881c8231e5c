"""The top-level package `transformer_engine` (common/transformer_engine/__init__.py): the version
that programs written for NVIDIA's Transformer Engine read, and the framework subpackages as
lazy attributes.

The checks that depend on what a fresh interpreter has imported run in a subprocess.
"""

import importlib.util
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

import transformer_engine
import transformer_engine.common

# Framework subpackage -> (the framework it needs, the meta-package extra that installs it).
FRAMEWORKS = {"pytorch": ("torch", "pytorch"), "jax": ("jax", "jax")}

# Put first on sys.path of a subprocess: makes every import of `blocked` (and of its submodules)
# fail as the import of a module that is not installed does.
BLOCKER = """
import sys

class _Blocker:
    def find_spec(self, fullname, path=None, target=None):
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None

sys.meta_path.insert(0, _Blocker())
"""


def _python(code: str, blocked: str | None = None) -> subprocess.CompletedProcess:
    code = textwrap.dedent(code)
    if blocked is not None:
        code = f"BLOCKED = {blocked!r}\n{BLOCKER}\n{code}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _installed(name: str) -> bool:
    """Whether transformer_engine.<name> and the framework it needs can be imported here."""
    framework = FRAMEWORKS[name][0]
    return (importlib.util.find_spec(f"transformer_engine.{name}") is not None
            and importlib.util.find_spec(framework) is not None)


def test_version_is_the_api_level_with_our_release_as_local_label():
    version = Version(transformer_engine.__version__)
    assert transformer_engine.api_level == "2.8.0"
    assert version.public == transformer_engine.api_level
    assert version.local == f"te{transformer_engine.common.__version__}"
    assert transformer_engine.release == transformer_engine.common.__version__
    # Orders as NVIDIA's 2.8 releases: after 2.8.0 itself, before anything of 2.9.
    assert Version("2.8.0") <= version < Version("2.9.0.dev0")
    assert str(version) == transformer_engine.__version__  # already in PEP 440's normal form


def test_megatron_lookup_sees_the_api_level():
    """Megatron-LM's get_te_version(): `__version__` if the package has one, else the version of
    the `transformer-engine` distribution (ours: 0.1.0, which opens none of its gates)."""
    import importlib.metadata

    def get_te_version():
        import transformer_engine as te

        if hasattr(te, "__version__"):
            return Version(str(te.__version__))
        return Version(importlib.metadata.version("transformer-engine"))

    version = get_te_version()
    # Gates of its default GPT path: GQA, RMSNorm, its TE RNG tracker, fp8 recipes, the router.
    for gate in ("0.11.0", "0.13.0", "1.5.0", "2.2.0.dev0", "2.7.0.dev0", "2.8.0"):
        assert version >= Version(gate), gate
    assert version < Version("2.9.0.dev0")


def test_plain_import_imports_no_framework():
    _python("""
        import sys
        import transformer_engine
        assert transformer_engine.__version__
        for name in ("torch", "jax", "transformer_engine.pytorch", "transformer_engine.jax"):
            assert name not in sys.modules, name
    """)


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_framework_is_a_lazy_attribute(name):
    if not _installed(name):
        pytest.skip(f"transformer_engine.{name} or {FRAMEWORKS[name][0]} is not installed here")
    _python(f"""
        import sys
        import transformer_engine as te
        assert "transformer_engine.{name}" not in sys.modules
        assert "{name}" in dir(te)
        module = te.{name}
        assert module is sys.modules["transformer_engine.{name}"]
        assert te.{name} is module and hasattr(te, "{name}")
        assert module.autocast  # a public name of both framework packages
    """)


def test_common_is_an_attribute():
    _python("""
        import transformer_engine as te
        assert te.common.__version__ == te.release
        assert "common" in dir(te)
    """)


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_missing_framework_package_is_an_attribute_error_naming_the_install(name):
    dist = {"pytorch": "transformer-engine-torch", "jax": "transformer-engine-jax"}[name]
    extra = FRAMEWORKS[name][1]
    result = _python(f"""
        import transformer_engine as te
        assert not hasattr(te, "{name}")
        try:
            te.{name}
        except AttributeError as err:
            assert isinstance(err, te.FrameworkNotInstalledError), type(err)
            assert isinstance(err.__cause__, ModuleNotFoundError)
            print(err)
        else:
            raise AssertionError("no error")
        # The import statement answers as for any missing submodule.
        try:
            from transformer_engine import {name}
        except ImportError:
            pass
        else:
            raise AssertionError("imported")
    """, blocked=f"transformer_engine.{name}")
    message = result.stdout
    assert f'pip install "transformer-engine[{extra}]==' in message
    assert f"=={transformer_engine.release}" in message
    assert dist in message


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_missing_framework_is_an_attribute_error_naming_it(name):
    framework, extra = FRAMEWORKS[name]
    if importlib.util.find_spec(f"transformer_engine.{name}") is None:
        pytest.skip(f"transformer_engine.{name} is not installed here")
    result = _python(f"""
        import transformer_engine as te
        assert not hasattr(te, "{name}")
        try:
            te.{name}
        except te.FrameworkNotInstalledError as err:
            print(err)
    """, blocked=framework)
    assert f"'{framework}'" in result.stdout
    assert f'pip install "transformer-engine[{extra}]==' in result.stdout


def test_a_missing_module_of_ours_is_not_hidden():
    """A framework package that fails on a module of its own is a broken installation: the
    ModuleNotFoundError comes through as it is, not as a missing framework."""
    if not _installed("pytorch"):
        pytest.skip("transformer_engine.pytorch or torch is not installed here")
    _python("""
        import transformer_engine as te
        try:
            te.pytorch
        except ModuleNotFoundError as err:
            assert err.name == "transformer_engine.pytorch.availability", err.name
        else:
            raise AssertionError("no error")
    """, blocked="transformer_engine.pytorch.availability")


def test_unknown_attribute_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing'") as info:
        transformer_engine.no_such_thing  # noqa: B018
    assert not isinstance(info.value, transformer_engine.FrameworkNotInstalledError)
    assert not hasattr(transformer_engine, "no_such_thing")


def test_subpackages_are_found_in_every_sys_path_entry_in_order(tmp_path):
    """As for the namespace package this was: a folder earlier on sys.path (a checkout on
    PYTHONPATH) wins over the installed copy of the same subpackage, even over the one beside
    this __init__.py, and a transformer_engine/ folder anywhere on sys.path contributes its
    subpackages."""
    first, last = tmp_path / "first", tmp_path / "last"
    for root, sub in ((first, "common"), (last, "te_probe_portion")):
        (root / "transformer_engine" / sub).mkdir(parents=True)
        (root / "transformer_engine" / sub / "__init__.py").write_text(
            f"__version__ = '9.9.9'\nWHERE = {str(root)!r}\n")
    _python(f"""
        import os
        import sys
        sys.path.insert(0, {str(first)!r})
        sys.path.append({str(last)!r})
        import transformer_engine as te
        assert te.common.WHERE == {str(first)!r}
        assert te.release == "9.9.9" and te.__version__ == "2.8.0+te9.9.9"
        import transformer_engine.te_probe_portion as probe
        assert probe.WHERE == {str(last)!r}
        assert os.path.dirname(te.__file__) in te.__path__
    """)
