"""Every repository path that README.md and the docs name exists.

A moved or renamed example otherwise leaves the docs pointing at nothing, which only a reader
notices. Paths are recognised by their first folder (`examples/...`, `jax/examples/...`,
`benchmarks/...`, ...) and read from the repository root, which is how the docs write them;
the READMEs that the docs pull in with `{include}` are read too, since their text lands there.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = (
    "benchmarks", "common", "cpp", "docs", "examples", "jax", "pytorch", "scripts", "tests",
    "wheels",
)
# A path starts after whitespace, a quote, a backtick or a bracket (not inside a longer path or
# a URL) and runs over path characters; trailing dots or slashes are punctuation.
PATH = re.compile(
    r"(?<![\w./-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w./*-]*[\w*])"
)
# Outputs of builds and runs, named by the docs but not in a checkout.
GENERATED = ("docs/_build/", "common/build/")
INCLUDE = re.compile(r"```\{(?:literal)?include\}\s+(\S+)")


def _documents() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for doc in list(docs):
        for target in INCLUDE.findall(doc.read_text()):
            path = (doc.parent / target).resolve()
            if path.suffix == ".md" and path not in docs:
                docs.append(path)
    return docs


def _named_paths(text: str) -> list[str]:
    return [m.group(1) for m in PATH.finditer(text)]


def _exists(path: str) -> bool:
    if any((path + "/").startswith(g) for g in GENERATED):
        return True
    if "*" in path:  # a pattern such as benchmarks/bench_*.py names at least one file
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_the_scan_finds_paths_and_misses_urls():
    text = "see `examples/train_gpt.py`, (jax/examples/x.py) and https://host/examples/y.py."
    assert _named_paths(text) == ["examples/train_gpt.py", "jax/examples/x.py"]
    assert not _exists("examples/no_such_example.py")


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_paths_exist(doc):
    text = doc.read_text()
    missing = sorted({p for p in _named_paths(text) if not _exists(p)})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_included_files_exist(doc):
    for target in INCLUDE.findall(doc.read_text()):
        assert (doc.parent / target).is_file(), f"{doc.name} includes {target}, which is missing"
