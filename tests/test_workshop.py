"""docs/workshop.md cannot rot: every ```sh block of the guide runs, in order, in a copy of
the repository.

Commands are rewritten only where the machine differs from a participant's: `make demo` runs
its recipe (`prfaas up --procfile Procfile`, checked against the Makefile), every `prfaas up`
gets a copy of its topology on free ports with random-init workers on one torch thread
(tests/ui_fixtures/mesh.py) and a free control port, the well-known ports in the commands
(8000, 8080, 8474, 8090, a dashboard's --port) are moved to match, and `prfaas sim` runs
SIM_SECONDS of virtual time instead of its --duration, and `prfaas bench` is given the
router's --url. A ```sh serve block is started, waited
for, sent one request, and stopped with SIGINT (as Ctrl-C) when the next serve block starts or
the guide ends, and must then exit 0 with no traceback and no line logged twice; ```sh serve
once is stopped at once.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from ui_fixtures.mesh import topology_text

from mesh.topology import Topology, load_topology, parse_topology
from services.cli.serve import DEFAULT_TOPOLOGY_PATH
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "workshop.md"
FENCE = re.compile(r"^```sh(?P<info>[^\n`]*)\n(?P<body>.*?)^```$", re.S | re.M)
HEADING = re.compile(r"^## (?P<title>.+)$", re.M)
INFOS = {(), ("serve",), ("serve", "once")}
# What the copy of the repository holds (the guide edits it: exercise 4 adds a policy).
TREE = ("mesh", "services", "netem", "ui", "data", "Procfile", "Makefile", "pyproject.toml")
DEMO_RECIPE = "exec $(VENV)/bin/prfaas up --procfile Procfile"
SIM_SECONDS = 10
READY_S = 120.0
BLOCK_S = 120.0
SUPERVISOR_PORT = 8090
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


@dataclass(frozen=True)
class Block:
    section: str
    info: tuple[str, ...]
    body: str

    @property
    def serve(self) -> bool:
        return "serve" in self.info


def guide_blocks(text: str) -> list[Block]:
    """The ```sh blocks of `text` in order, each with the title of its `## ` section."""
    headings = [(m.start(), m["title"]) for m in HEADING.finditer(text)]
    blocks = []
    for m in FENCE.finditer(text):
        section = next((t for at, t in reversed(headings) if at < m.start()), "")
        blocks.append(Block(section, tuple(m["info"].split()), m["body"]))
    return blocks



def moved_ports(base: Topology, moved: Topology) -> dict[int, int]:
    """Each HTTP port of `base` (options *_port) to the same option's port in `moved`."""
    ports = {}
    for spec in base.services:
        for key, value in spec.options.items():
            if key.endswith("_port") and isinstance(value, int):
                ports[value] = int(moved.service(spec.name).options[key])
    return ports


@dataclass
class Served:
    """A running ```sh serve block and everything it printed."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines[-60:])


class Session:
    """Runs the guide's blocks in a copy of the repository, rewriting what must move."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.ports: dict[int, int] = {}
        self.topologies: dict[str, Path] = {}
        self.served: Served | None = None
        self.env = {**os.environ, "PYTHONPATH": str(repo),
                    "PRFAAS_ADMIN_TOKEN": "workshop-admin-token",
                    "PRFAAS_MESH_SECRET": "workshop-mesh-secret-2026",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        self.env.pop("PRFAAS_TOPOLOGY", None)

    # -- rewriting -------------------------------------------------------------------------

    def rewrite(self, body: str) -> str:
        body = re.sub(r"^make demo$", self._demo_recipe, body, flags=re.M)
        body = re.sub(r"^prfaas up( .*)?$", self._up, body, flags=re.M)
        body = re.sub(r"--topology (\S+)", self._topology, body)
        body = re.sub(r"^prfaas sim (.*)$", self._sim, body, flags=re.M)
        body = re.sub(r"--port (\d+)", self._port_option, body)
        # `prfaas bench` talks to the router at 127.0.0.1:8000 unless told otherwise.
        body = re.sub(r"^prfaas bench (?!.*--url)", "prfaas bench --url http://127.0.0.1:8000 ",
                      body, flags=re.M)
        return re.sub(r"(?<=:)\d{4,5}\b", lambda m: str(self.ports.get(int(m[0]), m[0])), body)

    def _demo_recipe(self, match: re.Match[str]) -> str:
        makefile = (self.repo / "Makefile").read_text(encoding="utf-8")
        assert f"demo: $(STAMP)\n\t{DEMO_RECIPE}\n" in makefile, "make demo's recipe changed"
        return "prfaas up --procfile Procfile"

    def _up(self, match: re.Match[str]) -> str:
        args = shlex.split(match[1] or "")
        base_name = args[args.index("--topology") + 1] if "--topology" in args else None
        base = load_topology(self.repo / base_name if base_name else None,
                             DEFAULT_TOPOLOGY_PATH.read_text(encoding="utf-8"))
        moved_path = self.repo / f"test-{len(self.topologies)}.toml"
        moved_path.write_text(topology_text(base), encoding="utf-8")
        moved = parse_topology(moved_path.read_text(encoding="utf-8"))
        self.ports = moved_ports(base, moved)
        self.ports[SUPERVISOR_PORT] = free_port()
        self.topologies[base_name or ""] = moved_path
        # `prfaas send` without --topology reads the file `prfaas up` runs, as its children do.
        self.env["PRFAAS_TOPOLOGY"] = str(moved_path)
        if base_name is None:
            args += ["--topology", str(moved_path)]
        return shlex.join(["prfaas", "up", *args, "--control-port",
                           str(self.ports[SUPERVISOR_PORT])])

    def _topology(self, match: re.Match[str]) -> str:
        given = match[1]
        if given in self.topologies:
            return f"--topology {self.topologies[given]}"
        return match[0]

    def _sim(self, match: re.Match[str]) -> str:
        rest = match[1]
        if "--dashboard" in rest or "--help" in rest:
            return match[0]
        assert "--duration" in rest, f"give `prfaas sim {rest}` a --duration the test can cut"
        return "prfaas sim " + re.sub(r"--duration \S+", f"--duration {SIM_SECONDS}", rest) \
            + " --no-progress"

    def _port_option(self, match: re.Match[str]) -> str:
        port = int(match[1])
        self.ports.setdefault(port, free_port())
        return f"--port {self.ports[port]}"

    # -- running ---------------------------------------------------------------------------

    def run(self, block: Block) -> None:
        script = self.rewrite(block.body)
        if block.serve:
            self.serve(script, block, once="once" in block.info)
            return
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.repo,
                              env=self.env, capture_output=True, text=True, timeout=BLOCK_S)
        assert done.returncode == 0, (
            f"[{block.section}] exit {done.returncode}:\n{script}\n--- stdout\n"
            f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")

    def serve(self, script: str, block: Block, once: bool) -> None:
        """Starts a serve block and waits until it answers; a `once` block is then stopped,
        any other stays up (stopping the one before it) until the next or the end."""
        served = Served(subprocess.Popen(
            ["bash", "-c", script], cwd=self.repo, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True))
        if not once:
            self.stop()
            # Held from the start: a block that never gets ready is still killed at teardown.
            self.served = served
        threading.Thread(target=served.read, daemon=True).start()
        try:
            self._ready(script, block, served)
        finally:
            if once:
                stop(served)

    def _ready(self, script: str, block: Block, served: Served) -> None:
        deadline = time.monotonic() + READY_S
        while not self._answers(script, served):
            code = served.process.poll()
            assert code is None, f"[{block.section}] {script} exited {code}:\n{served.output()}"
            assert time.monotonic() < deadline, \
                f"[{block.section}] {script} not ready in {READY_S} s:\n{served.output()}"
            time.sleep(0.25)

    def _answers(self, script: str, served: Served) -> bool:
        """Ready and answering one request: the router's API, or a dashboard's snapshot (the
        compare page's samples)."""
        if "prfaas up" in script:
            if not any(line.startswith("ready: ") for line in served.lines):
                return False
            response = httpx.post(f"http://127.0.0.1:{self.ports[8000]}/v1/completions",
                                  json={"model": "prfaas", "prompt": "ROMEO:", "max_tokens": 4},
                                  timeout=60.0)
            assert response.status_code == 200, response.text
            return True
        port = re.search(r"--port (\d+)", script)
        assert port is not None, f"a serve block needs `prfaas up` or a --port: {script}"
        # The compare page has a hub per deployment, so no snapshot of its own: its samples.
        path = "api/compare" if "--compare" in script else "api/snapshot"
        try:
            response = httpx.get(f"http://127.0.0.1:{port[1]}/{path}", timeout=5.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def stop(self) -> None:
        served, self.served = self.served, None
        if served is not None:
            stop(served)


def stop(served: Served) -> None:
    """Ctrl-C to a served block; it must end by itself, with 0 and no traceback."""
    os.killpg(served.process.pid, signal.SIGINT)
    try:
        code = served.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(served.process.pid, signal.SIGKILL)
        served.process.wait()
        raise AssertionError(f"did not stop on Ctrl-C:\n{served.output()}") from None
    finally:
        if served.process.stdout is not None:
            served.process.stdout.close()
    text = "\n".join(served.lines)
    assert code == 0, f"exit {code} after Ctrl-C:\n{served.output()}"
    assert "Traceback" not in text and "Lifespan" not in text, text[-5000:]
    # One event, one line: the same process never logs the same text at the same instant.
    stamped = Counter(line for line in served.lines if STAMP.search(line))
    assert [line for line, n in stamped.items() if n > 1] == []


def copy_repository(into: Path) -> Path:
    repo = into / "repo"
    repo.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in TREE:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=ignore)
        else:
            (repo / name).write_bytes(source.read_bytes())
    (repo / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return repo


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    repo_session = Session(copy_repository(tmp_path))
    try:
        yield repo_session
    finally:
        served = repo_session.served
        if served is not None and served.process.poll() is None:
            os.killpg(served.process.pid, signal.SIGKILL)
            served.process.wait()


def test_the_guide_has_seven_exercises_with_commands_and_a_question() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    exercises = [s for s in sections if s.startswith("Exercise ")]
    assert [s.split(":")[0] for s in exercises] == [f"Exercise {n}" for n in range(1, 8)]
    for exercise in exercises:
        assert "```sh" in exercise and "**Question.**" in exercise, exercise[:60]
    assert {b.info for b in guide_blocks(text)} <= INFOS
    assert "docs/workshop.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_a_misspelled_flag_fails_its_block(session: Session) -> None:
    with pytest.raises(AssertionError, match="unrecognized arguments: --polcy"):
        session.run(Block("typo", (), "prfaas sim --polcy prfaas --duration 5 --out x\n"))


# 130-170 s measured on the two development cores shared with other jobs (load average 13-16);
# the limit leaves room for such a host.
@pytest.mark.timeout(300)
def test_every_command_of_the_guide_runs(session: Session) -> None:
    timings = []
    for block in guide_blocks(GUIDE.read_text(encoding="utf-8")):
        began = time.monotonic()
        session.run(block)
        timings.append((round(time.monotonic() - began, 1), block.section[:12], block.body[:30]))
        print(timings[-1])
    began = time.monotonic()
    session.stop()
    print("stop", round(time.monotonic() - began, 1))
