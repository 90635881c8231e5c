"""Repository-wide pytest hooks: tests marked ``cuda`` are skipped on machines without a GPU."""

import pytest


def _cuda_available() -> bool:
    # Imported lazily: torch is slow to import and absent from the JAX-only session.
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch is missing or sees none)")
    for item in cuda_items:
        item.add_marker(skip)
