"""services.cli.supervisor and `prfaas up`: tiny children killed, brought back, stopped in order."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest
import trio

from mesh.errors import ConfigError
from mesh.hosts import allowed_hosts
from mesh.http import serve_http
from services.cli.procfile import ProcessSpec, parse_procfile
from services.cli.supervisor import ProcessStatus, RestartPolicy, Supervisor
from services.cli.supervisor_api import supervisor_app
from services.contract.access import MESH_SECRET_ENV
from tests.ports import free_port

SLEEPER = (f"exec {shlex.quote(sys.executable)} -c "
           "'import time; print(\"up\", flush=True); time.sleep(600)'")
FAST = RestartPolicy(initial_backoff_s=0.2, max_backoff_s=0.8, healthy_after_s=30.0,
                     stop_timeout_s=5.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        while not check():
            await trio.sleep(0.02)


def test_procfile_parses_names_and_commands() -> None:
    specs = parse_procfile("# comment\n\nweb: exec serve --port 1\nworker-0:  run it\n")
    assert specs == (ProcessSpec("web", "exec serve --port 1"), ProcessSpec("worker-0", "run it"))
    with pytest.raises(ConfigError, match="unique"):
        parse_procfile("a: x\na: y\n")
    with pytest.raises(ConfigError, match="expected 'name: command'"):
        parse_procfile("no colon here\n")


@pytest.mark.trio
async def test_killed_child_comes_back_within_backoff_others_untouched() -> None:
    lines: list[tuple[str, str]] = []
    specs = [ProcessSpec(name, SLEEPER) for name in ("a", "b", "c")]
    supervisor = Supervisor(specs, dict(os.environ), policy=FAST,
                            output=lambda name, line: lines.append((name, line)))
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        await until(lambda: sum(line == "up" for _, line in lines) == 3)
        before = {c.name: c for c in supervisor.statistics().processes}
        killed_at = time.monotonic()
        await supervisor.kill("b")
        await until(lambda: _status(supervisor, "b").pid != before["b"].pid
                    and _status(supervisor, "b").state == "up")
        back_s = time.monotonic() - killed_at
        b = _status(supervisor, "b")
        assert (b.deaths, b.restarts, b.last_exit) == (1, 1, -signal.SIGKILL)
        # It waited its backoff first (a loaded host only adds to that; how soon after the
        # backoff it is up again is the host's speed, not the supervisor's logic).
        assert back_s >= FAST.initial_backoff_s
        for name in ("a", "c"):
            assert _status(supervisor, name) == before[name]
            assert alive(before[name].pid or 0)
        pids = [p.pid or 0 for p in supervisor.statistics().processes]
        await supervisor.stop()
        nursery.cancel_scope.cancel()
    assert not any(alive(pid) for pid in pids)
    assert {p.state for p in supervisor.statistics().processes} == {"stopped"}
    assert ("b", "up") in lines and any("exited with status -9" in line for _, line in lines)


def _status(supervisor: Supervisor, name: str) -> ProcessStatus:
    return supervisor.child(name).status()


@pytest.mark.trio
async def test_crashing_child_backs_off_doubling() -> None:
    supervisor = Supervisor([ProcessSpec("crash", "exit 3")], dict(os.environ), policy=FAST,
                            output=lambda name, line: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        # Starts at about 0, 0.2, 0.6, 1.4 (0.2 doubling to 0.8): 3 or 4 deaths in 1.6 s;
        # without the backoff it would be hundreds.
        await trio.sleep(1.6)
        crash = _status(supervisor, "crash")
        nursery.cancel_scope.cancel()
    assert 2 <= crash.deaths <= 5
    assert crash.last_exit == 3


@pytest.mark.trio
async def test_restart_is_planned_and_immediate() -> None:
    supervisor = Supervisor([ProcessSpec("a", SLEEPER)], dict(os.environ),
                            policy=RestartPolicy(initial_backoff_s=5.0),
                            output=lambda name, line: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        first = _status(supervisor, "a").pid
        await supervisor.restart("a")
        # Quicker than the 5 s backoff a death would wait.
        await until(lambda: _status(supervisor, "a").pid != first, timeout_s=3.0)
        a = _status(supervisor, "a")
        assert (a.restarts, a.deaths, a.state) == (1, 0, "up")
        nursery.cancel_scope.cancel()
    assert not alive(first or 0)


@pytest.mark.trio
async def test_control_api_lists_kills_and_refuses_strangers() -> None:
    supervisor = Supervisor([ProcessSpec("a", SLEEPER)], dict(os.environ), policy=FAST,
                            output=lambda name, line: None)
    app = supervisor_app(supervisor, "s3cret", allowed_hosts("127.0.0.1"))
    auth = {"authorization": "Bearer s3cret"}
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8090") as c:
            assert (await c.get("/processes")).status_code == 401
            wrong = await c.post("/processes/a/kill", headers={"authorization": "Bearer no"})
            assert wrong.status_code == 401
            evil = await c.post("/processes/a/kill", content=b"{}", headers={
                **auth, "origin": "http://evil.example", "content-type": "text/plain"})
            assert evil.status_code == 403
            rebound = await c.post("/processes/a/kill", headers={
                **auth, "host": "evil.example:8090", "origin": "http://evil.example:8090"})
            assert rebound.status_code == 403
            assert _status(supervisor, "a").deaths == 0
            listed = (await c.get("/processes", headers=auth)).json()
            assert [p["name"] for p in listed["processes"]] == ["a"]
            assert listed["processes"][0]["state"] == "up"
            killed = await c.post("/processes/a/kill", headers=auth, json={"signal": "KILL"})
            assert killed.status_code == 200
            await until(lambda: _status(supervisor, "a").deaths == 1)
            assert (await c.post("/processes/nope/restart", headers=auth)).status_code == 404
        nursery.cancel_scope.cancel()


HEALTH_SERVER = """
import http.server, json, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ready"}).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
# Not ready at once: the ready line must wait for /health, not come at start.
time.sleep(1.0)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""



@pytest.mark.slow
def test_prfaas_up_prints_ready_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """The CLI end to end: the ready line once /health says ready; SIGTERM stops all, exit 0."""
    port = free_port()
    server = tmp_path / "health.py"
    server.write_text(HEALTH_SERVER)
    python = shlex.quote(sys.executable)
    procfile = tmp_path / "Procfile"
    procfile.write_text(f"sleeper: {SLEEPER}\nrouter: exec {python} {server} {port}\n")
    topology = tmp_path / "topology.toml"
    topology.write_text(f'[[services]]\nname = "router"\nkind = "router"\nport = 1\n'
                        f'options = {{ http_port = {port} }}\n')
    child = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "up", "--procfile", str(procfile),
         "--topology", str(topology), "--control-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PRFAAS_ADMIN_TOKEN": "an-admin-token-of-32-characters."},
        cwd=tmp_path)
    try:
        seen = lines_until_ready(child, 50)
        assert seen[-1].strip() == (f"ready: dashboard http://127.0.0.1:8080/ "
                                    f"API http://127.0.0.1:{port}/v1"), seen
        assert any(line.startswith("sleeper") and "| up" in line for line in seen), seen
        child.send_signal(signal.SIGTERM)
        rest = child.communicate(timeout=30)[0]
        assert child.returncode == 0, rest
        assert "stopping every process" in rest
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


MEMBER_PROBE = """
import os, sys, anyio, http.server
from mesh.node import Node
from mesh.topology import load_topology
from mesh.transport import TcpTransport
from mesh.wire import Codec
from services.contract.access import service_secret
from services.contract.messages import CODEC_MESSAGES, Echo

topology = load_topology(os.environ["PRFAAS_TOPOLOGY"], "")

async def call(secret):
    async with Node("probe", Codec(CODEC_MESSAGES), TcpTransport(), topology.address,
                    secret=secret) as node:
        with anyio.fail_after(20):
            while True:
                try:
                    return await node.call("echo", Echo(text="hi", hops=0), timeout=5)
                except ConnectionRefusedError:
                    # The echo service is still starting.
                    await anyio.sleep(0.2)

assert anyio.run(call, service_secret(topology)) == Echo(text="hi", hops=1)
try:
    anyio.run(call, None)
except Exception as exc:
    print("refused without the secret:", type(exc).__name__, flush=True)
else:
    sys.exit("the echo service answered a peer without the secret")
""" + HEALTH_SERVER.replace("time.sleep(1.0)", "")


@pytest.mark.slow
@pytest.mark.parametrize("here", [False, True], ids=["generated", "here"])
def test_prfaas_up_hands_every_service_the_mesh_secret(tmp_path: Path, here: bool) -> None:
    """The echo service (`prfaas serve`) and a probe get the run's secret from `prfaas up`
    (a fresh one, or with --here the one given): the probe reaches echo with it and is
    refused without it, then says ready. --here starts the named processes only."""
    port = free_port()
    probe = tmp_path / "probe.py"
    probe.write_text(MEMBER_PROBE)
    python = shlex.quote(sys.executable)
    procfile = tmp_path / "Procfile"
    procfile.write_text(f"echo: exec {python} -m services.cli.main serve echo\n"
                        f"router: exec {python} {probe} {port}\n"
                        f"elsewhere: echo started elsewhere\n")
    topology = tmp_path / "topology.toml"
    topology.write_text(f'[[services]]\nname = "router"\nkind = "router"\nport = 1\n'
                        f'options = {{ http_port = {port} }}\n'
                        f'[[services]]\nname = "echo"\nkind = "echo"\nport = {free_port()}\n')
    env = {k: v for k, v in os.environ.items() if k != MESH_SECRET_ENV}
    # This checkout's code, in the supervisor and its children alike.
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    if here:
        env[MESH_SECRET_ENV] = "the secret every machine is given"
    only = ["--here", "echo,router"] if here else []
    child = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "up", "--procfile", str(procfile),
         "--topology", str(topology), "--control-port", "0", *only],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**env, "PRFAAS_ADMIN_TOKEN": "an-admin-token-of-32-characters."}, cwd=tmp_path)
    try:
        seen = lines_until_ready(child, 80)
        assert seen[-1].startswith("ready:"), seen
        assert any("refused without the secret" in line for line in seen), seen
        child.send_signal(signal.SIGTERM)
        rest = child.communicate(timeout=30)[0]
        assert child.returncode == 0, rest
        assert here != any("started elsewhere" in line for line in [*seen, rest]), rest
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def lines_until_ready(child: subprocess.Popen[str], most: int) -> list[str]:
    """`prfaas up`'s output lines up to its "ready:" line, or its first `most` + 1 lines."""
    assert child.stdout is not None
    seen: list[str] = []
    for line in child.stdout:
        seen.append(line)
        if line.startswith("ready:") or len(seen) > most:
            break
    return seen


def socket_inodes(pid: int | str) -> set[str]:
    """The sockets a process holds open, as "socket:[inode]"."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:"):
                found.add(target)
    return found


def listening_inode(port: int) -> str:
    """The inode of the TCP socket listening on 127.0.0.1:port (/proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":
                return f"socket:[{fields[9]}]"
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def test_a_child_does_not_inherit_the_supervisors_listening_socket() -> None:
    """As `prfaas up` runs (asyncio with uvloop): its control API's socket stays its own, so
    a supervisor that dies leaves no child holding its port."""

    async def main() -> tuple[str, set[str], set[str]]:
        supervisor = Supervisor([ProcessSpec("a", SLEEPER)], dict(os.environ), policy=FAST,
                                output=lambda name, line: None)
        app = supervisor_app(supervisor, None)
        async with anyio.create_task_group() as tg:
            _, port = await tg.start(serve_http, app, "127.0.0.1", 0)
            # Once it answers, hypercorn has made its sockets (inheritable, by its default).
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{port}/processes")
                assert answer.status_code == 200
            await tg.start(supervisor.run)
            pid = _status(supervisor, "a").pid
            assert pid is not None
            listening = listening_inode(port)
            mine, child = socket_inodes(os.getpid()), socket_inodes(pid)
            tg.cancel_scope.cancel()
        return listening, mine, child

    listening, mine, child = anyio.run(main, backend="asyncio",
                                       backend_options={"use_uvloop": True})
    assert listening in mine
    assert listening not in child, child
