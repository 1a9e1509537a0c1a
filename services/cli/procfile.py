"""The Procfile: the list of the demo's processes, one `name: shell command` a line.

The format honcho and foreman read: blank lines and `#` comments are skipped; each other line
is a name ([A-Za-z0-9_.-]), a colon and the command, which runs under /bin/sh.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from mesh.errors import ConfigError

_LINE = re.compile(r"^([A-Za-z0-9_.-]+):\s*(.+)$")


class ProcessSpec(msgspec.Struct, frozen=True):
    name: str
    command: str


def parse_procfile(text: str, source: str = "Procfile") -> tuple[ProcessSpec, ...]:
    specs: list[ProcessSpec] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ConfigError(f"{source}:{number}: expected 'name: command', got {raw!r}")
        specs.append(ProcessSpec(match.group(1), match.group(2)))
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"{source}: process names must be unique, got {names}")
    if not specs:
        raise ConfigError(f"{source}: no processes")
    return tuple(specs)


def load_procfile(path: Path) -> tuple[ProcessSpec, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return parse_procfile(text, str(path))
