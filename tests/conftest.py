"""Shared test settings: kept small and generic (fixtures used by many test modules)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from mesh.transport import MemoryHub

# The 2-vCPU host is shared and noisy (docs/engineering-notes.md G12): per-example wall-clock
# deadlines flake.
settings.register_profile("shared-host", deadline=None)
settings.load_profile("shared-host")


@pytest.fixture
def memory_hub() -> MemoryHub:
    """A fresh in-process network for one test."""
    return MemoryHub()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for a module of tiny models: they gain nothing from a second
    thread, and OpenMP spin-waits burn the shared cores; restores the setting after."""
    # Imported here: most test modules never load torch.
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
