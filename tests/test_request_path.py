"""The files one streamed completion crosses, traced through the live code.

One process runs the router (its real HTTP server on 127.0.0.1), the cache directory, a PrfaaS
prefill worker and a PD prefill and decode worker over the in-memory network, each a random-init
default-size kimi-linear (the router's BPE tokenizer needs its vocabulary). A profiler set on
every thread records each project file as Python first calls into it while one streamed
`/v1/completions` request, long enough for the `prfaas` policy to offload, runs from send to
`[DONE]`. The list, `mesh/` and the test's own files left out, must equal the numbered list of
docs/architecture.md section 10, so that list cannot rot. The model's files are listed but are
not counted: the model is a library the workers call.

No call chain may go back into a file it left. A chain is a call's stack, and a task started
while the request runs (`create_task`, a task group's `start_soon`, `mesh.native.start_soon`)
continues the chain of the code that started it: a callback that a task or mesh/ calls is a
call too. A task the runtime starts for itself (mesh/ starts it: a handler pool's worker, a
connection's session) begins a chain of its own, the receiving service's, as over TCP.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any
from weakref import WeakKeyDictionary

import anyio
import httpx
import pytest

from mesh.topology import Topology, parse_topology
from services.cli.launch import in_process
from tests.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
HEADING = "## 10. Files one request crosses"
SKIPPED = ("mesh/", "tests/", ".venv/")
LIBRARY = "services/model/"
WORKER = ('options = { family = "kimi-linear", size = "default", checkpoint = "none", '
          'threads = 1 }')
SERVICES = ["cachedir", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0", "router"]
# About 80 BPE tokens, past t = 19,400 x 0.001 = 19.4: the policy sends it to PrfaaS.
PROMPT = "a long prompt that the threshold sends to the PrfaaS cluster. " * 4


def topology_text(ports: list[int]) -> str:
    workers = "".join(
        f'[[services]]\nname = "{name}"\nkind = "{kind}"\ncluster = "{name.split("-")[0]}"\n'
        f"port = {port}\n"
        for name, kind, port in (("prfaas-prefill-0", "prefill", ports[3]),
                                 ("pd-prefill-0", "prefill", ports[4]),
                                 ("pd-decode-0", "decode", ports[5])))
    # tick_s: no control tick runs while the request is traced.
    return (f'[[clusters]]\nname = "prfaas"\nkind = "prfaas"\n{WORKER}\n'
            f'[[clusters]]\nname = "pd"\nkind = "pd"\n{WORKER}\n'
            f'[[services]]\nname = "router"\nkind = "router"\nport = {ports[0]}\n'
            f'options = {{ http_port = {ports[1]}, policy = "prfaas", scale = 0.001, '
            f"tick_s = 1000 }}\n"
            f'[[services]]\nname = "cachedir"\nkind = "cachedir"\nport = {ports[2]}\n'
            + workers)


class FileTrace:
    """Project files (those under `root`) in the order of their first call, recorded only
    while `active`, and every call chain that goes back into a file it has left (`returns`).
    A task created while `active` (`task_factory`, set on the loop) carries the chain that
    created it (`_origins`): its calls continue that chain."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self.active = False
        self.files: list[str] = []
        self.returns: set[tuple[str, ...]] = set()
        self._names: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._origins: WeakKeyDictionary[asyncio.Task[Any], tuple[str, ...]] = \
            WeakKeyDictionary()

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any,
                     **options: Any) -> asyncio.Task[Any]:
        """The loop's task factory: a task started while active remembers who started it."""
        task = asyncio.Task(coro, loop=loop, **options)
        starter = sys._getframe(1)
        if self.active and not _started_by_runtime(starter):
            self._origins[task] = self._chain(starter)
        return task

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.active or event != "call":
            return
        name = self._project_file(frame.f_code.co_filename)
        if name is None:
            return
        if name not in self.files:
            # Threads (the workers' compute) record too: first one in wins.
            with self._lock:
                if name not in self.files:
                    self.files.append(name)
        if not name.startswith(LIBRARY):
            chain = self._chain(frame)
            if len(set(chain)) < len(chain):
                self.returns.add(chain)

    def _chain(self, frame: FrameType | None) -> tuple[str, ...]:
        """The counted files of the call chain that ends in `frame`, outermost first, each run
        of calls within one file as one step (mesh/ and the model's frames in between are
        passed over: the runtime and the library calling back are not the project's path)."""
        chain: list[str] = list(self._origin())
        stack: list[str] = []
        while frame is not None:
            name = self._project_file(frame.f_code.co_filename)
            if name is not None and not name.startswith(LIBRARY):
                stack.append(name)
            frame = frame.f_back
        for name in reversed(stack):
            if not chain or chain[-1] != name:
                chain.append(name)
        return tuple(chain)

    def _origin(self) -> tuple[str, ...]:
        """The chain that started the running task (none in a thread without a loop)."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return ()
        return self._origins.get(task, ()) if task is not None else ()

    def _project_file(self, filename: str) -> str | None:
        if filename not in self._names:
            self._names[filename] = _relative(filename, self.root)
        return self._names[filename]


RUNTIME, START_SOON = ROOT / "mesh", ROOT / "mesh" / "native.py"
VENV = ROOT / ".venv"  # make's environment lives in the checkout: its libraries are not ours


def _started_by_runtime(frame: FrameType | None) -> bool:
    """Whether the code that starts a task (`frame` and out, past the libraries and
    `mesh.native.start_soon`, which the project calls too) is mesh/'s own."""
    while frame is not None:
        path = _resolved(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and not path.is_relative_to(VENV) and path != START_SOON:
            return path.is_relative_to(RUNTIME)
        frame = frame.f_back
    return False


@functools.cache
def _resolved(filename: str) -> Path:
    return Path(filename).resolve()


def _relative(filename: str, root: Path) -> str | None:
    """The path under `root` of a project source file outside SKIPPED, else None."""
    path = Path(filename)
    if not path.is_absolute() or path.suffix != ".py":
        return None
    try:
        name = path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None
    return None if name.startswith(SKIPPED) else name


@contextmanager
def profiling(trace: FileTrace) -> Iterator[None]:
    """`trace` set on this thread and on every thread started inside the block."""
    threading.setprofile(trace.profile)
    sys.setprofile(trace.profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


async def wait_for_workers(client: httpx.AsyncClient, url: str, count: int) -> None:
    for _ in range(600):
        if (await client.get(f"{url}/health")).json().get("workers_up", 0) >= count:
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"{count} workers were not up within 30 s")


async def traced_completion(topology: Topology, url: str, trace: FileTrace) -> str:
    """Streams one completion with `trace` active; returns the prefill cluster it names."""
    body = {"model": "prfaas", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    asyncio.get_running_loop().set_task_factory(trace.task_factory)
    async with in_process(topology, SERVICES), httpx.AsyncClient(timeout=60) as client:
        await wait_for_workers(client, url, 3)
        trace.active = True
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        trace.active = False
    assert response.status_code == 200, lines
    assert lines[-1] == "data: [DONE]", lines
    return response.headers["x-prfaas-cluster"]


@functools.cache
def traced() -> FileTrace:
    """One traced completion, shared by the tests of this module."""
    ports = free_ports(6)
    trace = FileTrace()
    with profiling(trace):
        # A fresh asyncio loop: its worker threads start under the profiler.
        cluster = anyio.run(traced_completion, parse_topology(topology_text(ports)),
                            f"http://127.0.0.1:{ports[1]}", trace, backend="asyncio")
    assert cluster == "prfaas"
    return trace


def traced_files() -> list[str]:
    return traced().files


def documented_files() -> list[str]:
    """The numbered list of the doc's section, one file path per item."""
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([^`]+)`", section, flags=re.MULTILINE)


def counted(files: list[str]) -> list[str]:
    return [name for name in files if not name.startswith(LIBRARY)]


def test_the_documented_request_path_is_the_traced_one() -> None:
    traced = traced_files()
    print(f"{len(counted(traced))} files counted, {len(traced)} listed")
    assert documented_files() == traced, "\n".join(
        f"{i}. `{name}`" for i, name in enumerate(traced, 1))


def test_no_call_chain_goes_back_into_a_file_it_left() -> None:
    # One way through: a file calls the next and gets its answer back by return or await, never
    # by a call from further down into a file the chain already passed (a callback, a helper
    # living on the caller's side). Each chain printed is a place a reader goes back and forth.
    trace = traced()
    assert not trace.returns, "\n".join(" -> ".join(c) for c in sorted(trace.returns))


def test_the_doc_states_the_count_of_its_list() -> None:
    files = documented_files()
    section = DOC.read_text().split(HEADING, 1)[1]
    stated = re.search(r"crosses (\d+) files outside\s+`services/model/`", section)
    assert stated is not None and int(stated.group(1)) == len(counted(files))


# A planted request path of two files: `caller.py` hands `lower.py` a task group and a
# callback; `lower.py` starts a task (by the task group, or by mesh/) that calls it.
CALLER = """
import anyio

def done() -> None:
    pass

async def request(lower, callback_up: bool, via_mesh: bool) -> None:
    async with anyio.create_task_group() as group:
        lower.start(group, done if callback_up else lower.stays, via_mesh)
"""
LOWER = """
import anyio
from mesh import native

def stays() -> None:
    pass

def start(group, callback, via_mesh: bool) -> None:
    if via_mesh:
        native.start_soon(group, later, callback)
    else:
        group.start_soon(later, callback)

async def later(callback) -> None:
    await anyio.sleep(0)
    callback()
"""


def _module(path: Path, text: str) -> ModuleType:
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"planted_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planted_returns(root: Path, callback_up: bool, via_mesh: bool) -> set[tuple[str, ...]]:
    caller, lower = _module(root / "caller.py", CALLER), _module(root / "lower.py", LOWER)
    trace = FileTrace(root)

    async def main() -> None:
        asyncio.get_running_loop().set_task_factory(trace.task_factory)
        trace.active = True
        await caller.request(lower, callback_up, via_mesh)
        trace.active = False

    with profiling(trace):
        anyio.run(main, backend="asyncio")
    return trace.returns


@pytest.mark.parametrize("via_mesh", [False, True])
def test_a_callback_up_from_a_task_is_a_return(tmp_path: Path, via_mesh: bool) -> None:
    # The task's own stack is lower.py alone: only the chain it was started from shows the
    # callback going back into caller.py. A callback that stays in lower.py is no return.
    assert planted_returns(tmp_path, callback_up=True, via_mesh=via_mesh) == {
        ("caller.py", "lower.py", "caller.py")}
    assert planted_returns(tmp_path, callback_up=False, via_mesh=via_mesh) == set()
