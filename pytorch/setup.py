"""Builds transformer_engine.pytorch._linear_fast, te.Linear's compiled eager FP8 forward
(csrc/linear_fast.cpp, see transformer_engine/pytorch/fast_linear.py), when torch and
transformer-engine-common are installed where the build runs (--no-build-isolation). Without
them the package is pure Python and te.Linear takes its Python path."""

import importlib.util
from pathlib import Path

from setuptools import setup


def _extension():
    common = importlib.util.find_spec("transformer_engine.common")
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        torch = None
    if torch is None or common is None:
        print("transformer-engine-torch: torch or transformer-engine-common is not installed "
              "here, so te.Linear's compiled fast path is not built (the package is pure Python)")
        return [], {}
    root = Path(common.submodule_search_locations[0])
    major, minor = torch.__version__.split(".")[:2]
    ext = CppExtension(
        "transformer_engine.pytorch._linear_fast",
        ["csrc/linear_fast.cpp"],
        include_dirs=[str(root / "include")],
        library_dirs=[str(root / "lib")],
        libraries=["transformer_engine"],
        define_macros=[("TE_TORCH_MAJOR", major), ("TE_TORCH_MINOR", minor)],
        extra_compile_args=["-O2", "-g0"],
        # The core's library sits in the common wheel, beside this package in site-packages.
        extra_link_args=["-Wl,-rpath,$ORIGIN/../common/lib"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extension()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
