"""services.data: the corpus and the traces are found inside the repository, or where
PRFAAS_DATA_DIR says."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.data import DATA_ENV, corpus_path, data_dir, trace_path


def test_data_ships_in_the_repository() -> None:
    root = Path(__file__).resolve().parents[1]
    assert data_dir() == root / "data"
    assert corpus_path().is_file()
    for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl"):
        assert trace_path(name).is_file()
    assert (trace_path().parent / "LICENSE-APACHE-2.0.txt").is_file()


def test_environment_overrides_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert corpus_path() == tmp_path / "corpus" / "tinyshakespeare.txt"
    assert trace_path("x.jsonl") == tmp_path / "traces" / "x.jsonl"
