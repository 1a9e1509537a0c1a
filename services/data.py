"""Where the project's data lives: `data/` at the repository root (the training corpus and the
Mooncake traces ship with the repository; nothing is downloaded).

`PRFAAS_DATA_DIR` points elsewhere (an installed package, a bigger trace collection): the
folder must hold the same layout, `corpus/tinyshakespeare.txt` and `traces/*.jsonl`.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "PRFAAS_DATA_DIR"
CORPUS_FILE = "tinyshakespeare.txt"
DEFAULT_TRACE = "conversation_trace.jsonl"


def data_dir() -> Path:
    """`$PRFAAS_DATA_DIR` if set, else <repository>/data (this file is <repository>/services/)."""
    override = os.environ.get(DATA_ENV)
    return Path(override) if override else Path(__file__).resolve().parents[1] / "data"


def corpus_path() -> Path:
    """The training text of the small model (tinyshakespeare)."""
    return data_dir() / "corpus" / CORPUS_FILE


def trace_path(name: str = DEFAULT_TRACE) -> Path:
    """A Mooncake trace by file name (`conversation_trace.jsonl`, `synthetic_trace.jsonl`)."""
    return data_dir() / "traces" / name
