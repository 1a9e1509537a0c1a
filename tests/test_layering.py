"""The import rules of docs/architecture.md section 2, checked over the source with ast.

Layers, lowest first: mesh; the contract (and services.data); the model, the paper's numbers,
netem and the service harness (services.service); the roles (router, worker, cachedir, link,
bench, ui); the simulation; the CLI. A module may import its own package and any lower layer,
never a higher one, never a sibling role (roles talk over the mesh, through the contract).
`services` never imports `ui`. And no two modules may import each other, directly or round a
cycle, not even for annotations alone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mesh", "services", "netem", "ui")

# (prefix, layer); the longest matching prefix wins.
LAYERS: tuple[tuple[str, int], ...] = (
    ("mesh", 0),
    ("services", 1),  # services/__init__.py
    ("services.contract", 1),
    ("services.data", 1),
    ("services.model", 2),
    ("services.paper", 2),
    ("netem", 2),
    ("services.service", 2),
    ("services.router", 3),
    ("services.worker", 3),
    ("services.cachedir", 3),
    ("services.link", 3),
    ("services.bench", 3),
    ("ui", 3),
    ("services.sim", 4),
    ("services.cli", 5),
    ("services.chaos", 6),  # runs the mesh under services.cli's supervisor
)


def owner(module: str) -> tuple[str, int]:
    """The (group, layer) a module belongs to: its longest matching prefix in LAYERS."""
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, dict(LAYERS)[best]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under `if TYPE_CHECKING:` (annotations only, no runtime edge)."""
    return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for stmt in node.body for inner in ast.walk(stmt)}


def imports(path: Path, runtime_only: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) of every first-party import in the file, lazy ones included; with
    `runtime_only`, without those under `if TYPE_CHECKING:`."""
    package = module_name(path).rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [base]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                yield node.lineno, name


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def violations(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        me = module_name(path)
        group, layer = owner(me)
        for line, target in imports(path):
            their_group, their_layer = owner(target)
            allowed = their_layer < layer or their_group == group
            if me.startswith("services") and target.split(".")[0] == "ui":
                allowed = False
            if not allowed:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                             f"({their_group}, layer {their_layer} from {group}, layer {layer})")
    return found


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    known = {module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        targets = set()
        for _, target in imports(path):
            # `from a.b import c` may name module a.b.c or a name in a.b.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module_name(path):
                targets.add(target)
        graph[module_name(path)] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_only_go_downward() -> None:
    assert violations(sources()) == []


def test_no_import_cycles() -> None:
    """Imports for annotations alone (`if TYPE_CHECKING:`) count too: a reader follows them
    as far as the run-time ones."""
    assert cycles(import_graph(sources())) == []


def test_a_type_only_cycle_is_caught() -> None:
    probes = [ROOT / "services" / "contract" / f"_cycle_probe_{name}.py" for name in "ab"]
    probes[0].write_text("from services.contract._cycle_probe_b import B\n")
    probes[1].write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                         "    from services.contract._cycle_probe_a import A\n")
    try:
        found = cycles(import_graph(probes))
    finally:
        for probe in probes:
            probe.unlink()
    assert found == [["services.contract._cycle_probe_a", "services.contract._cycle_probe_b"]]


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    bad = ROOT / "services" / "contract" / "_layering_probe.py"
    bad.write_text("from services.router.scheduler import Scheduler\nimport ui.hub\n")
    try:
        found = violations([bad])
    finally:
        bad.unlink()
    assert len(found) == 2
    assert "services.router.scheduler" in found[0] and "ui.hub" in found[1]


@pytest.mark.parametrize(("source", "target"), [
    ("services/router/openai.py", "services.worker.prefill"),
    ("services/worker/prefill.py", "services.cachedir.service"),
    ("ui/app.py", "services.router.scheduler"),
    ("mesh/node.py", "services.contract.messages"),
])
def test_sideways_and_upward_imports_are_refused(source: str, target: str) -> None:
    (group, layer), (their_group, their_layer) = owner(source[:-3].replace("/", ".")), \
        owner(target)
    assert not (their_layer < layer or their_group == group)


def test_a_cycle_is_caught() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_sits_flat_in_services() -> None:
    flat = sorted(p.name for p in (ROOT / "services").glob("*.py"))
    assert flat == ["__init__.py", "data.py", "service.py"]
