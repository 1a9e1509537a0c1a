"""docs/architecture.md names only what exists: each file, folder, class and method it quotes.

Quoted (in backticks) and checked: a path with a slash (`services/worker/kv_out.py`, `docs/`)
must exist from the repository's root; a bare file or folder name (`prefill.py`, `profiles/`)
must exist somewhere in the repository; a capitalised name (`KVInbox`) must be a class or an
assigned name of the project's Python (or a file such as `Procfile`); `Class.member` must be
a class with that method or field; `name(...)` must be a function or method. Other quoted
words (config keys, metric names, policy names) are not code names and are not checked.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SKIPPED = frozenset({".venv", ".git", "node_modules", "__pycache__"})
FILE = re.compile(r"[\w./-]+\.(py|md|toml|json|jsonl|js|txt|yml|yaml|html|css|png)")
FOLDER = re.compile(r"[\w./-]+/")
CLASS = re.compile(r"[A-Z][a-z0-9]+\w*|[A-Z]{2,}[a-z]\w*")
MEMBER = re.compile(r"([A-Z]\w*)\.(\w+)(\(.*\))?")
CALL = re.compile(r"([a-z_]\w*)\(.*\)")


@dataclass
class Definitions:
    """What the project's Python defines, read with ast (nothing is imported)."""

    functions: set[str] = field(default_factory=set)
    classes: dict[str, set[str]] = field(default_factory=dict)  # class -> its members
    names: set[str] = field(default_factory=set)  # assigned names (type aliases, constants)

    def add(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, set()).update(_members(node))
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.names.update(t.id for t in targets if isinstance(t, ast.Name))


def _members(node: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out.add(item.target.id)
        elif isinstance(item, ast.Assign):
            out.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return out


def _tree(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if not SKIPPED & set(p.relative_to(root).parts)]


@functools.cache
def project(root: Path = ROOT) -> tuple[Definitions, frozenset[str], frozenset[str]]:
    """The definitions of every Python file under `root`, and its file and folder names."""
    paths = _tree(root)
    defs = Definitions()
    for path in paths:
        if path.suffix == ".py":
            defs.add(ast.parse(path.read_text(), str(path)))
    files = frozenset(p.name for p in paths if p.is_file())
    folders = frozenset(p.name for p in paths if p.is_dir())
    return defs, files, folders


def missing(text: str, root: Path = ROOT) -> list[str]:
    """The quoted names of `text` (module docstring) that `root` does not have."""
    defs, files, folders = project(root)
    out = []
    for name in dict.fromkeys(re.findall(r"`([^`\n]+)`", text)):
        if FILE.fullmatch(name):
            found = (root / name).is_file() if "/" in name else name in files
        elif FOLDER.fullmatch(name):
            found = (root / name).is_dir() if "/" in name[:-1] else name[:-1] in folders
        elif CLASS.fullmatch(name):
            # A file without a suffix (`Procfile`, `Makefile`) is spelled like a class.
            found = name in defs.classes or name in defs.names or name in files
        elif match := MEMBER.fullmatch(name):
            found = match[2] in defs.classes.get(match[1], set())
        elif match := CALL.fullmatch(name):
            found = match[1] in defs.functions
        else:
            continue
        if not found:
            out.append(name)
    return out


def test_every_file_class_and_function_the_architecture_names_exists() -> None:
    assert missing(DOC.read_text()) == []


def test_a_name_that_does_not_exist_is_reported(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "real.py").write_text(
        "class Real:\n    size: int = 0\n\n    def go(self) -> None: ...\n\n\n"
        "def helper() -> None: ...\n\nAlias = Real\n")
    text = ("`pkg/real.py` `real.py` `pkg/` `Real` `Alias` `Real.go` `Real.size` `helper()` "
            "`max_inflight` `prfaas send` "
            "`pkg/workers.py` `workers.py` `gone/` `Unreal` `Real.stop` `Gone.go` `vanished()`")
    assert missing(text, tmp_path) == ["pkg/workers.py", "workers.py", "gone/", "Unreal",
                                       "Real.stop", "Gone.go", "vanished()"]
