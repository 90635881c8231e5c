"""Builds transformer_engine.pytorch's compiled eager ops (csrc/eager/, see
transformer_engine/pytorch/_compiled.py) when torch and transformer-engine-common are installed
where the build runs (--no-build-isolation). Without them the package is pure Python and
te.Linear takes its Python path.

The ops use only the LibTorch stable ABI, targeted at the oldest torch release the package
supports (OLDEST_TORCH): the one binary loads under that release and every later one, whichever
torch it was built beside."""

import importlib.util
from pathlib import Path

from setuptools import setup

OLDEST_TORCH = (2, 11)  # the stable ABI the library targets (_compiled.py checks it too)
HERE = Path(__file__).parent


def _extension():
    try:
        common = importlib.util.find_spec("transformer_engine.common")
    except ModuleNotFoundError:  # no transformer_engine at all on this path
        common = None
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        torch = None
    if torch is None or common is None:
        print("transformer-engine-torch: torch or transformer-engine-common is not installed "
              "here, so the compiled eager ops are not built (the package is pure Python)")
        return [], {}
    root = Path(common.submodule_search_locations[0])
    major, minor = OLDEST_TORCH
    target = f"0x{major:02x}{minor:02x}000000000000"
    ext = CppExtension(
        "transformer_engine.pytorch._eager_ops",
        sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc" / "eager").glob("*.cpp")),
        include_dirs=[str(root / "include")],
        library_dirs=[str(root / "lib")],
        libraries=["transformer_engine"],
        define_macros=[("TORCH_TARGET_VERSION", target)],
        extra_compile_args=["-O2", "-g0", "-std=c++17"],
        # No Python symbols: torch.ops.load_library loads it (_compiled.py).
        py_limited_api=True,
        # The core's library sits in the common wheel, beside this package in site-packages.
        extra_link_args=["-Wl,-rpath,$ORIGIN/../common/lib"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
