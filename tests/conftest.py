"""Shared test settings: kept small and generic (fixtures used by many test modules)."""

from __future__ import annotations

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
