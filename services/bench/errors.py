"""The bench client's one exception: a bad option or input, named with its value."""

from __future__ import annotations


class BenchError(ValueError):
    """An unusable bench option, workload or server answer; the message names it."""
