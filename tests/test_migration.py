"""Request migration over real processes on 127.0.0.1 (services/router/runner.py).

`prfaas serve` children from a generated topology: router, cache directory, link, a PrfaaS
prefill worker, a PD prefill worker and two PD decode workers, the shipped default-size
checkpoint in float32 (a random model's greedy text repeats one token, which would hide a
token dropped or repeated; float32 so that a re-prefilled prompt gives the logits the decode
steps gave). The router
migrates at most once (`migration_limit = 1`) and bounds KV stalls on the link at 1 s.

- a greedy streamed request whose decode worker is killed (kill -9) after k tokens returns
  exactly the text of the same request unbroken, with its usage counting every token; so
  does a sampled one with a seed (the continuation keeps its place in the seed's stream);
- a request whose KV crosses a link trickling at 1000 bit/s is re-prefilled in the PD cluster
  within the stall bound (plus its compute), and the link takes no new offload for a while;
- a request broken a second time, past the limit, ends with an explicit error naming it;
- a decode worker frozen (SIGSTOP) after k tokens is declared lost within the silence bound
  and the request returns the unbroken text; woken (SIGCONT), the worker rejoins and no
  token of its stale stream reaches a client; a frozen prefill worker's request prefills in
  the other cluster; a partition of the link for 10 s (its control API) leaves nothing hung
  or lost.
The unit-level paths (which breakage migrates where, the seed's stream) are in
tests/test_request_runner.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from services.cli.launch import launch
from tests.polling import wait_until
from tests.ports import free_ports
from tests.topologies import launched_toml

pytestmark = pytest.mark.slow

WORKER = ('family = "kimi-linear", size = "default", checkpoint = "auto", '
          'threads = 1, dtype = "float32"')
SCALE = 0.005  # t = 19,400 x 0.005 = 97 router tokens
LONG_PROMPT = "a long prompt that the threshold sends to the PrfaaS cluster. " * 12
SHORT_PROMPT = "ROMEO: what light through yonder window breaks"
STALL_S = 1.0
SILENCE_S = 2.0
STATUS_TIMEOUT_S = 2.0  # the router's status poll timeout (services/router/control.py)
PARTITION_S = 10.0
DECODERS = ("pd-decode-0", "pd-decode-1")
MAX_TOKENS = 40
KILL_AFTER = 12  # tokens the client has seen when the decode worker is killed


def topology_text(ports: list[int]) -> str:
    router = (f"scale = {SCALE}, tick_s = 0.25, migration_limit = 1, "
              f"kv_stall_s = {STALL_S}, silence_s = {SILENCE_S}")
    return launched_toml(ports, worker=WORKER, router=router, decoders=len(DECODERS))


class Mesh:
    def __init__(self, path: Path, root: Path, ports: list[int], stack: ExitStack) -> None:
        self.path, self.root, self.stack = path, root, stack
        self.url = f"http://127.0.0.1:{ports[1]}"
        self.link_url = f"http://127.0.0.1:{ports[4]}/link"
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, names: list[str]) -> None:
        """Starts `names` (again, once dead: the launcher does not restart its children)."""
        for name in names:
            if name in self.children:
                self.children[name].wait(timeout=10)
        self.children.update(self.stack.enter_context(launch(self.path, names,
                                                              log_dir=self.root)))

    def kill_serving_decoder(self, signum: int = signal.SIGKILL) -> str:
        """kill -9 (or `signum`) of the decode worker holding the one open stream (the
        router's table)."""
        state = httpx.get(f"{self.url}/admin/state", timeout=10).json()
        running = [w["name"] for w in state["workers"]
                   if w["name"] in DECODERS and w["running"] and w["up"]]
        assert len(running) == 1, state["workers"]
        self.children[running[0]].send_signal(signum)
        return str(running[0])

    def workers_up(self) -> int:
        return int(httpx.get(f"{self.url}/health", timeout=10).json().get("workers_up", 0))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    root = tmp_path_factory.mktemp("migration-mesh")
    ports = free_ports(10)
    path = root / "topology.toml"
    path.write_text(topology_text(ports))
    with ExitStack() as stack:
        mesh = Mesh(path, root, ports, stack)
        mesh.start(["cachedir", "link-0", "prfaas-prefill-0", "pd-prefill-0", *DECODERS,
                    "router"])
        wait_until(lambda: mesh.workers_up() == 4, "four workers up")
        yield mesh


class Streamed(NamedTuple):
    text: str
    usage: dict[str, int]
    events: list[dict[str, Any]]


def stream(mesh: Mesh, prompt: str, on_event: Callable[[int], None] = lambda n: None,
           max_tokens: int = MAX_TOKENS, **sampling: object) -> Streamed:
    """A streamed completion, greedy unless `sampling` says otherwise; `on_event(n)` runs
    after the n-th event with text."""
    body = {"model": "prfaas", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0, "stream_options": {"include_usage": True},
            **sampling}
    out = Streamed("", {}, [])
    with httpx.stream("POST", f"{mesh.url}/v1/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            out.events.append(event)
            text = "".join(c.get("text", "") for c in event.get("choices", []))
            out = out._replace(text=out.text + text, usage=event.get("usage") or out.usage)
            if text:
                on_event(sum(1 for e in out.events if e.get("choices")))
    return out


def metric(mesh: Mesh, reason: str) -> float:
    """prfaas_router_migrations{reason} from the router's /metrics."""
    for line in httpx.get(f"{mesh.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'prfaas_router_migrations_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no migration counter for {reason} in /metrics")


def errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if "error" in event]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_decode_worker_killed_after_k_tokens_gives_the_unbroken_text(
        mesh: Mesh, sampling: dict[str, object]) -> None:
    # Seeded: the continuation draws token i as the unbroken run draws token k + i.
    unbroken = stream(mesh, SHORT_PROMPT, **sampling)
    before = metric(mesh, "decode_lost")
    killed: list[str] = []

    def kill(seen: int) -> None:
        if seen == KILL_AFTER:
            killed.append(mesh.kill_serving_decoder())

    migrated = stream(mesh, SHORT_PROMPT, kill, **sampling)
    assert killed, "the stream ended before the kill"
    assert not errors(migrated.events), errors(migrated.events)
    assert len(set(unbroken.text.split())) > 3, unbroken.text  # a text that shows a slip
    assert migrated.text == unbroken.text
    assert migrated.usage["completion_tokens"] == unbroken.usage["completion_tokens"] == MAX_TOKENS
    assert migrated.usage["prompt_tokens"] == unbroken.usage["prompt_tokens"]
    assert metric(mesh, "decode_lost") == before + 1
    mesh.start(killed)


def test_a_stalled_link_falls_back_to_the_pd_cluster_within_the_bound(mesh: Mesh) -> None:
    before = metric(mesh, "kv_stalled")
    httpx.post(mesh.link_url, json={"bandwidth_bps": 1000}, timeout=10).raise_for_status()
    try:
        started = time.monotonic()
        fell_back = stream(mesh, LONG_PROMPT, max_tokens=4)
        took = time.monotonic() - started
    finally:
        httpx.post(f"{mesh.link_url}/reset", timeout=10)
        httpx.post(mesh.link_url, json={"bandwidth_bps": 400e6}, timeout=10).raise_for_status()
    assert not errors(fell_back.events), errors(fell_back.events)
    assert fell_back.usage["completion_tokens"] == 4 and fell_back.text
    assert metric(mesh, "kv_stalled") == before + 1
    # The bound, then a PD prefill of ~270 tokens and 4 decode steps on one thread each.
    assert took < STALL_S + 10.0, took


def test_a_request_broken_past_the_migration_limit_ends_with_an_explicit_error(
        mesh: Mesh) -> None:
    wait_until(lambda: mesh.workers_up() == 4, "four workers up")
    killed: list[str] = []

    def kill_twice(seen: int) -> None:
        # The first kill migrates the request (the limit is 1); the second ends it.
        if seen in (KILL_AFTER, 2 * KILL_AFTER):
            killed.append(mesh.kill_serving_decoder())

    broken = stream(mesh, SHORT_PROMPT, kill_twice, max_tokens=200)
    assert len(killed) == 2, killed
    assert errors(broken.events) == broken.events[-1:], broken.events[-1]
    assert "migration_limit=1" in broken.events[-1]["error"]["message"], broken.events[-1]
    mesh.start(killed)


def test_a_decode_worker_frozen_after_k_tokens_is_lost_and_rejoins_without_a_repeat(
        mesh: Mesh) -> None:
    wait_until(lambda: mesh.workers_up() == 4, "four workers up")
    unbroken = stream(mesh, SHORT_PROMPT)
    before = metric(mesh, "decode_lost")
    frozen: list[tuple[str, float]] = []

    def freeze(seen: int) -> None:
        if seen == KILL_AFTER:
            frozen.append((mesh.kill_serving_decoder(signal.SIGSTOP), time.monotonic()))

    try:
        migrated = stream(mesh, SHORT_PROMPT, freeze)
        took = time.monotonic() - frozen[0][1]
    finally:
        for name, _ in frozen:
            mesh.children[name].send_signal(signal.SIGCONT)
    assert frozen, "the stream ended before the freeze"
    assert not errors(migrated.events), errors(migrated.events)
    assert migrated.text == unbroken.text
    assert migrated.usage["completion_tokens"] == MAX_TOKENS
    assert metric(mesh, "decode_lost") == before + 1
    # A missed poll (a tick, its timeout), the silence bound, then a re-prefill of the prompt
    # and the tokens so far and the remaining decode steps, on one thread each.
    assert took < 0.25 + STATUS_TIMEOUT_S + SILENCE_S + 10.0, took
    # Woken, it answers polls again; its stale stream was aborted, and no token of it
    # reaches the requests that follow (on either decode worker).
    wait_until(lambda: mesh.workers_up() == 4, "the woken worker back")
    for _ in DECODERS:
        again = stream(mesh, SHORT_PROMPT)
        assert not errors(again.events) and again.text == unbroken.text
    assert metric(mesh, "decode_lost") == before + 1


def test_a_frozen_prefill_workers_request_prefills_in_the_other_cluster(mesh: Mesh) -> None:
    wait_until(lambda: mesh.workers_up() == 4, "four workers up")
    unbroken = stream(mesh, SHORT_PROMPT, max_tokens=4)
    before = metric(mesh, "prefill_lost")
    started = time.monotonic()
    # Frozen just before the request: the router has not missed a poll yet and places it there.
    mesh.children["pd-prefill-0"].send_signal(signal.SIGSTOP)
    try:
        moved = stream(mesh, SHORT_PROMPT, max_tokens=4)
        took = time.monotonic() - started
    finally:
        mesh.children["pd-prefill-0"].send_signal(signal.SIGCONT)
    assert not errors(moved.events), errors(moved.events)
    assert moved.text == unbroken.text
    assert metric(mesh, "prefill_lost") == before + 1
    assert took < 0.25 + STATUS_TIMEOUT_S + SILENCE_S + 10.0, took
    wait_until(lambda: mesh.workers_up() == 4, "the woken worker back")


def test_a_partitioned_link_leaves_nothing_hung_or_lost(mesh: Mesh) -> None:
    wait_until(lambda: mesh.workers_up() == 4, "four workers up")
    prompts = [LONG_PROMPT, SHORT_PROMPT, LONG_PROMPT + "again. "]
    httpx.post(mesh.link_url, json={"up": False}, timeout=10).raise_for_status()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            running = [pool.submit(stream, mesh, prompt, max_tokens=4) for prompt in prompts]
            time.sleep(PARTITION_S)
            httpx.post(mesh.link_url, json={"up": True}, timeout=10).raise_for_status()
            answers = [future.result(timeout=60) for future in running]
    finally:
        httpx.post(mesh.link_url, json={"up": True}, timeout=10)
    for answer in answers:
        assert not errors(answer.events), errors(answer.events)
        assert answer.usage["completion_tokens"] == 4 and answer.text
