"""The scripts under benchmarks/, loaded as modules for their tests (not a test module)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CHECKOUT = Path(__file__).resolve().parent.parent


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/`name`.py as the module `name` (registered, as the script sees itself)."""
    spec = importlib.util.spec_from_file_location(name, CHECKOUT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
