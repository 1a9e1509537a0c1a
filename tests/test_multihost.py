"""services/cli/multihost.py and netem/netns.py: the mesh across network namespaces.

The namespace tests make their own namespaces (named with the test process's pid, addresses
in 198.18.0.0/15) and remove them, also on failure; they skip, saying why, where this process
may not make namespaces. `prfaas multihost` runs the smallest mesh (random-init models) as a
subprocess: a streamed completion crosses the namespaces, a long one's KV crosses the shaped
veth, and Ctrl-C leaves no namespace or link behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest

from mesh.topology import Topology, load_topology, parse_topology, topology_toml
from netem.netns import (
    BENCHMARK_NETWORK,
    Impairment,
    NetLab,
    NetnsError,
    Veth,
    check_address,
    netem_probe_args,
    owned_names,
    remove_stale,
    shaping_args,
    tbf_args,
)
from netem.params import LinkParams
from services.cli import multihost as multihost_cli
from services.cli.multihost import (
    EXIT_NO_NETNS,
    MULTIHOST_HOSTS,
    ROOT_VETHS,
    impaired_by_lab,
    impairment_note,
    lab_for,
    multihost_main,
    multihost_topology,
    shares,
)
from services.cli.procfile import ProcessSpec
from services.link.service import link_params
from services.service import KVPath, resolve_from
from tests.netns_probe import (
    NETEM_REFUSED,
    NETNS_REFUSED,
    NetworkState,
    needs_netns,
    network_state,
)
from tests.polling import wait_until
from tests.ports import free_port
from tests.test_tracing import collector_at

HERE = Path(__file__).parent / "multihost"
ROOT = Path(__file__).parent.parent
RATE_BPS = 200e6






def test_every_service_is_placed_on_its_namespace_address() -> None:
    topology = multihost_topology(load_topology(HERE / "topology.toml", ""), "direct")
    for service in topology.services:
        check_address(service.host)
        assert service.bind_host == service.host
    assert topology.service("prfaas-prefill-0").host == MULTIHOST_HOSTS["prfaas"]
    assert topology.service("link-0").host == MULTIHOST_HOSTS["prfaas"]
    assert topology.service("router").host == MULTIHOST_HOSTS["pd"]
    split = shares(topology, [ProcessSpec(s.name, "x") for s in topology.services])
    assert split == {"prfaas": ["prfaas-prefill-0", "link-0"],
                     "pd": ["router", "cachedir", "pd-prefill-0", "pd-decode-0", "ui"]}
    # kv = "direct": the PrfaaS worker dials the decode worker itself, not the link's proxy.
    assert resolve_from(topology, "prfaas")("pd-decode-0").host == MULTIHOST_HOSTS["pd"]
    emulated = multihost_topology(load_topology(HERE / "topology.toml", ""), "emulator")
    assert resolve_from(emulated, "prfaas")("pd-decode-0").port == 17201


def test_addresses_outside_the_benchmark_range_are_refused() -> None:
    assert str(BENCHMARK_NETWORK) == "198.18.0.0/15"
    check_address("198.19.255.254")
    for address in ("10.0.0.1", "198.20.0.1", "127.0.0.1", "nope"):
        with pytest.raises(NetnsError, match=r"198\.18\.0\.0/15|not an IP"):
            Veth(None, "pd", address, "198.18.0.2")


def test_not_root_is_told_and_makes_nothing(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    before = network_state() if not NETNS_REFUSED else None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code = multihost_main(["--procfile", str(HERE / "Procfile"),
                           "--topology", str(HERE / "topology.toml")])
    assert code == EXIT_NO_NETNS
    assert "need root" in capsys.readouterr().err
    if before is not None:
        assert network_state() == before


IMPAIRED = Veth("prfaas", "pd", "198.18.0.1", "198.18.0.2", 200e6,
               Impairment(delay_s=0.005, jitter_s=0.001, loss_rate=0.005))


def test_with_netem_the_tc_lines_put_netem_at_the_root_and_tbf_under_it() -> None:
    assert shaping_args("v0a", IMPAIRED, netem=True) == [
        ["qdisc", "add", "dev", "v0a", "root", "handle", "1:", "netem", "limit", "1000",
         "delay", "5000us", "1000us", "loss", "0.5%"],
        ["qdisc", "add", "dev", "v0a", "parent", "1:1", "handle", "2:", "tbf",
         "rate", "200000000bit", "burst", "262144", "latency", "100ms"],
    ]
    # netem's queue holds the delay's worth: 10 Gbit/s for 50 ms is 62.5 MB, 2 x 41667 frames.
    fast = Veth(None, "pd", "198.18.1.1", "198.18.1.2", 10e9, Impairment(delay_s=0.05))
    assert shaping_args("v1b", fast, netem=True)[0][8:12] == ["limit", "83334",
                                                               "delay", "50000us"]
    # Delay alone, no rate: netem with no child.
    bare = Veth(None, "pd", "198.18.1.1", "198.18.1.2", 0.0, Impairment(delay_s=0.02))
    assert shaping_args("v1b", bare, netem=True) == [
        ["qdisc", "add", "dev", "v1b", "root", "handle", "1:", "netem", "limit", "1000",
         "delay", "20000us"]]


def test_without_netem_or_an_impairment_the_tc_lines_are_tbf_alone() -> None:
    tbf = ["qdisc", "add", "dev", "v0a", "root", "tbf", "rate", "200000000bit", "burst",
           "262144", "latency", "100ms"]
    assert shaping_args("v0a", IMPAIRED, netem=False) == [tbf] == [tbf_args("v0a", 200e6)]
    plain = Veth("prfaas", "pd", "198.18.0.1", "198.18.0.2", 200e6)
    assert shaping_args("v0a", plain, netem=True) == [tbf]
    assert shaping_args("v0a", Veth(None, "pd", "198.18.1.1", "198.18.1.2"), netem=True) == []
    assert netem_probe_args() == ["qdisc", "add", "dev", "lo", "root", "netem", "delay", "0us"]
    with pytest.raises(NetnsError, match="loss_rate must be in"):
        Impairment(loss_rate=1.5)
    with pytest.raises(NetnsError, match="jitter_s must be >= 0"):
        Impairment(jitter_s=-0.001)


def _impaired_topology(kv: KVPath = "emulator") -> Topology:
    text = (HERE / "topology.toml").read_text("utf-8").replace(
        "delay_s = 0.005", "delay_s = 0.005\njitter_s = 0.001\nloss_rate = 0.005")
    return multihost_topology(parse_topology(text), kv)


def test_the_cross_veth_asks_for_the_links_impairment_and_the_kernel_takes_it_over() -> None:
    topology = _impaired_topology()
    lab = lab_for(topology, owner=1)
    cross, *roots = lab.veths
    assert cross.impairment == Impairment(0.005, 0.001, 0.005) and cross.rate_bps == RATE_BPS
    assert all(not veth.impairment.asked and not veth.rate_bps for veth in roots)
    # netem present: the children's topology has the kernel add them, the emulator none.
    lab.netem_refusal = ""
    kernel = impaired_by_lab(topology, lab)
    assert link_params(kernel.links[0]).delay_s == 0.0
    assert link_params(kernel.links[0]).bandwidth_bps == RATE_BPS
    note = impairment_note(kernel, lab)
    assert note is not None and "the kernel's netem adds link-0's delay 5 ms, jitter 1 ms" in note
    # netem absent: the emulator keeps them, and the note says why, once.
    lab.netem_refusal = "tc qdisc add ...: Error: Specified qdisc kind is unknown."
    assert impaired_by_lab(topology, lab) == topology
    assert link_params(topology.links[0]).delay_s == 0.005
    note = impairment_note(topology, lab)
    assert note is not None and note.startswith("multihost: this kernel has no netem qdisc (")
    assert "stay with the project's link emulator" in note and "kv direct" not in note
    direct = impairment_note(_impaired_topology("direct"), lab)
    assert direct is not None and "KV crosses without them" in direct
    # Nothing asked: nothing probed, nothing said.
    lab.netem_refusal = None
    assert impairment_note(topology, lab) is None


@needs_netns
def test_a_dead_runs_namespaces_are_removed_and_a_live_runs_kept() -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale = NetLab(("pd",), [Veth(None, "pd", "198.18.3.1", "198.18.3.2")],
                   owner=int(dead.stdout))
    with NetLab(("pd",), [Veth(None, "pd", "198.18.4.1", "198.18.4.2")]) as live:
        try:
            stale.create()
            removed = remove_stale()
            namespaces, _ = owned_names()
        finally:
            stale.remove()
        assert stale.namespace("pd") in removed
        assert live.namespace("pd") in namespaces and stale.namespace("pd") not in namespaces


@contextmanager
def listening_in_pd(lab: NetLab, script: str) -> Iterator[IO[str]]:
    """The Python `script` run in namespace pd with pd's address, once it printed
    "listening"; its output for the rest; killed at the end."""
    with subprocess.Popen(
            [*lab.exec_prefix("pd"), sys.executable, "-c", script, MULTIHOST_HOSTS["pd"]],
            stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "listening"
            yield server.stdout
        finally:
            server.kill()


def _transfer_rate(lab: NetLab, nbytes: int) -> float:
    """Bits per second of `nbytes` sent from namespace prfaas to pd over the shaped veth,
    timed by the receiver from its first byte to its last."""
    with listening_in_pd(lab, RECEIVER) as receiver:
        subprocess.run([*lab.exec_prefix("prfaas"), sys.executable, "-c", SENDER,
                        MULTIHOST_HOSTS["pd"], str(nbytes)], check=True, timeout=60)
        received, seconds = json.loads(receiver.readline())
    assert received == nbytes
    return float(received * 8 / seconds)


RECEIVER = """
import json, socket, sys, time
with socket.create_server((sys.argv[1], 9700)) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    view, total, first = memoryview(bytearray(1 << 20)), 0, None
    while (n := conn.recv_into(view)):
        if first is None:
            first, head = time.monotonic(), n
        total += n
        last = time.monotonic()
    print(json.dumps([total, (last - first) * (total / (total - head))]), flush=True)
"""
SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], 9700)) as conn:
    conn.sendall(bytes(int(sys.argv[2])))
"""


@needs_netns
def test_kv_over_the_tbf_shaped_veth_arrives_at_the_set_rate() -> None:
    """The cross-cluster veth of `prfaas multihost`, shaped to 200 Mbit/s: 40 MB of KV-sized
    traffic arrives at that rate within 5%."""
    topology = multihost_topology(load_topology(HERE / "topology.toml", ""), "direct")
    before = network_state()
    with lab_for(topology) as lab:
        rate = _transfer_rate(lab, 40_000_000)
    assert rate == pytest.approx(RATE_BPS, rel=0.05)
    assert topology.links[0].bandwidth_bps == RATE_BPS
    assert network_state() == before


def _qdiscs(lab: NetLab, role: str, device: str) -> str:
    return subprocess.run(["tc", "-n", lab.namespace(role), "qdisc", "show", "dev", device],
                          capture_output=True, text=True, check=True, timeout=10).stdout


@needs_netns
@pytest.mark.skipif(not NETEM_REFUSED, reason="this kernel has the netem qdisc: the run does "
                                              "not fall back")
def test_without_netem_the_run_keeps_tbf_and_says_the_emulator_adds_the_delay(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """`prfaas multihost` up to its shares (replaced by a look at the lab they would get):
    the probe finds no netem, the cross veth has tbf alone, the shares' topology leaves the
    link's delay, jitter and loss to the emulator, and one line says so."""
    seen: dict[str, object] = {}

    async def look(argvs: dict[str, list[str]], *_: object) -> int:
        prfaas = argvs["prfaas"]
        seen["topology"] = load_topology(prfaas[prfaas.index("--topology") + 1], "")
        seen["qdiscs"] = subprocess.run(
            ["tc", "-n", prfaas[3], "qdisc", "show"], capture_output=True, text=True,
            check=True, timeout=10).stdout
        return 0

    path = tmp_path / "topology.toml"
    path.write_text((HERE / "topology.toml").read_text("utf-8").replace(
        "delay_s = 0.005", "delay_s = 0.005\njitter_s = 0.001\nloss_rate = 0.005"), "utf-8")
    monkeypatch.setattr(multihost_cli, "_run", look)
    before = network_state()
    code = multihost_main(["--procfile", str(HERE / "Procfile"), "--topology", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    notes = [line for line in out.splitlines() if "netem" in line]
    assert len(notes) == 1 and notes[0].startswith("multihost: this kernel has no netem qdisc (")
    assert ("link-0's delay 5 ms, jitter 1 ms, loss 0.500% stay with the project's link "
            "emulator") in notes[0]
    assert "tbf" in str(seen["qdiscs"]) and "netem" not in str(seen["qdiscs"])
    shares_topology = seen["topology"]
    assert isinstance(shares_topology, Topology)
    assert link_params(shares_topology.links[0]) == LinkParams(
        bandwidth_bps=RATE_BPS, delay_s=0.005, jitter_s=0.001, loss_rate=0.005)
    assert network_state() == before


ECHO = """
import socket, sys
with socket.create_server((sys.argv[1], 9701)) as server:
    print("listening", flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (data := conn.recv(64)):
        conn.sendall(data)
"""
PINGER = """
import json, socket, sys, time
with socket.create_connection((sys.argv[1], 9701)) as conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(20):
        start = time.monotonic()
        conn.sendall(b"x")
        conn.recv(64)
        rtts.append(time.monotonic() - start)
print(json.dumps(rtts), flush=True)
"""


@needs_netns
@pytest.mark.skipif(bool(NETEM_REFUSED), reason=f"this kernel has no netem qdisc "
                    f"({NETEM_REFUSED}): the veth cannot carry a delay here (the fallback "
                    "test covers this machine)")
def test_with_netem_the_cross_veth_carries_the_links_delay() -> None:
    """Where the kernel has netem: the cross veth's round trip is twice the link's 5 ms."""
    topology = multihost_topology(load_topology(HERE / "topology.toml", ""), "direct")
    before = network_state()
    with lab_for(topology) as lab:
        assert lab.kernel_impairs
        qdiscs = _qdiscs(lab, "prfaas", lab.device(0, "a"))
        with listening_in_pd(lab, ECHO):
            done = subprocess.run(
                [*lab.exec_prefix("prfaas"), sys.executable, "-c", PINGER,
                 MULTIHOST_HOSTS["pd"]], capture_output=True, text=True, check=True,
                timeout=30)
    rtts = json.loads(done.stdout)
    assert "netem" in qdiscs and "tbf" in qdiscs
    assert 0.010 <= min(rtts) < 0.015
    assert network_state() == before


@pytest.fixture
def multihost_run() -> Iterator[tuple[subprocess.Popen[str], list[str], NetworkState]]:
    """`prfaas multihost` on the small mesh, its output lines, the namespaces and links there
    were before it; stopped at the end, whatever happened."""
    with multihost(HERE / "topology.toml") as run:
        yield run


@contextmanager
def multihost(topology: Path, **env: str
              ) -> Iterator[tuple[subprocess.Popen[str], list[str], NetworkState]]:
    """`prfaas multihost` on `topology` (the test's Procfile), `env` added to its
    environment."""
    before = network_state()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "multihost", "--procfile",
         str(HERE / "Procfile"), "--topology", str(topology)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # The Procfile's `python` is this one.
        env={**os.environ, "PYTHONPATH": str(ROOT),
             "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", **env})
    lines: list[str] = []
    try:
        yield process, lines, before
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()
        NetLab(("prfaas", "pd"), [], owner=process.pid).remove()


def _until_ready(process: subprocess.Popen[str], lines: list[str], limit_s: float) -> str:
    deadline = time.monotonic() + limit_s
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith("ready:"):
            return line
    raise AssertionError("no ready line:\n" + "\n".join(lines[-40:]))


def _stream(api: str, token: str, prompt: str,
            headers: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """A streamed completion: the cluster that prefilled it, and its text pieces."""
    body = {"model": "prfaas", "prompt": prompt, "max_tokens": 6, "stream": True}
    pieces = []
    with httpx.stream("POST", f"{api}/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {token}", **(headers or {})}
                      ) as response:
        assert response.status_code == 200
        cluster = response.headers["x-prfaas-cluster"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return cluster, pieces


def _beyond_loopback_the_web_surfaces_ask_the_token_and_their_own_host(
        dashboard: str, api: str, token: str) -> None:
    """The dashboard, the router's admin API and the link's control API, as the run serves
    them on 198.18.x.y: the admin token asked, a DNS-rebound Host refused."""
    auth = {"authorization": f"Bearer {token}"}
    rebound = {**auth, "host": "evil.example"}
    assert httpx.get(dashboard, timeout=10).status_code == 401
    assert httpx.get(dashboard, headers=auth, timeout=10).status_code == 200
    assert httpx.get(dashboard, headers=rebound, timeout=10).status_code == 403
    admin = api.removesuffix("/v1") + "/admin/state"
    assert httpx.get(admin, timeout=10).status_code == 401
    assert httpx.get(admin, headers=auth, timeout=10).status_code == 200
    assert httpx.get(admin, headers=rebound, timeout=10).status_code == 403
    link = f"http://{MULTIHOST_HOSTS['prfaas']}:18474/link"
    assert httpx.post(link, json={"up": True}, timeout=10).status_code == 401
    assert httpx.post(link, json={"up": True}, headers=auth, timeout=10).status_code == 200
    assert httpx.get(link, headers=rebound, timeout=10).status_code == 403


@pytest.mark.slow
@pytest.mark.timeout(240)
@needs_netns
def test_multihost_serves_across_the_namespaces_and_leaves_nothing(
    multihost_run: tuple[subprocess.Popen[str], list[str], NetworkState],
) -> None:
    process, lines, before = multihost_run
    ready = _until_ready(process, lines, 150)
    match = re.match(r"ready: dashboard (\S+)\?token=(\S+) API (\S+)$", ready)
    assert match, ready
    dashboard, token, api = match.groups()
    assert dashboard.startswith("http://198.18.") and api.startswith("http://198.18.")
    _beyond_loopback_the_web_surfaces_ask_the_token_and_their_own_host(dashboard, api, token)
    short_cluster, short = _stream(api, token, "hello there")
    long_cluster, long = _stream(api, token, " ".join(f"word{i}" for i in range(120)))
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=40) == 0
    assert (short_cluster, long_cluster) == ("pd", "prfaas")
    assert len(short) >= 1 and len(long) >= 1
    assert network_state() == before
    # One line says who adds the link's 5 ms: the kernel's netem, or (none here) the emulator.
    said = ("multihost: the kernel's netem adds link-0's delay 5 ms" if not NETEM_REFUSED
            else "multihost: this kernel has no netem qdisc (")
    assert sum(line.startswith(said) for line in lines) == 1, lines[:5]
    # Each side listened on its own namespace's address.
    assert "198.18.0.1:17110" in "\n".join(lines) and "198.18.0.2:17130" in "\n".join(lines)


def traced_topology(path: Path, port: int) -> Path:
    """tests/multihost/topology.toml with each side's services exporting traces to the root
    namespace's end of that side's veth (`port` there)."""
    data = tomllib.loads((HERE / "topology.toml").read_text(encoding="utf-8"))
    endpoint = {role: f"http://{root_end}:{port}/v1/traces"
                for role, (root_end, _) in ROOT_VETHS.items()}
    for cluster in data["clusters"]:
        cluster["options"]["otlp_endpoint"] = endpoint[cluster["name"]]
    router = next(s for s in data["services"] if s["kind"] == "router")
    router["options"]["otlp_endpoint"] = endpoint["pd"]
    path.write_text(topology_toml(data), encoding="utf-8")
    return path


@pytest.mark.slow
@pytest.mark.timeout(240)
@needs_netns
def test_an_offloaded_request_is_one_trace_across_the_namespaces(tmp_path: Path) -> None:
    """The router and the decode worker in one namespace, the PrfaaS prefill worker in the
    other, each exporting its own spans: one trace, parented across the hosts through the
    messages, the KV's lanes through the link, each span timed on its own host's clock."""
    port = free_port()
    client = "5c0ffee0d15ea5e5deadbeefcafef00d"
    header = {"traceparent": f"00-{client}-00f067aa0ba902b7-01"}
    with multihost(traced_topology(tmp_path / "topology.toml", port),
                   OTEL_BSP_SCHEDULE_DELAY="100") as (process, lines, _):
        ready = _until_ready(process, lines, 150)
        match = re.match(r"ready: dashboard \S+\?token=(\S+) API (\S+)$", ready)
        assert match, ready
        token, api = match.groups()
        # The root ends of the veths exist once the run's namespaces do.
        with collector_at(port, tuple(root_end for root_end, _ in ROOT_VETHS.values())) as spans:
            cluster, pieces = _stream(api, token,
                                      " ".join(f"word{i}" for i in range(120)), header)
            assert cluster == "prfaas" and pieces

            def whole() -> bool:
                names = {s.name for s in spans.trace(client)}
                return {"request", "prefill", "kv.transfer", "decode", "decode.kv"} <= names

            wait_until(whole, "the offloaded request's whole trace")
            trace = spans.trace(client)
    by_id = {s.span_id: s for s in trace}
    (attempt,) = [s for s in trace if s.name == "attempt 0"]
    (prefill,) = [s for s in trace if s.name == "prefill"]
    (decode,) = [s for s in trace if s.name == "decode"]
    assert attempt.service == "router"
    assert (prefill.service, decode.service) == ("prfaas-prefill-0", "pd-decode-0")
    assert prefill.parent_id == decode.parent_id == attempt.span_id
    lanes = [s for s in trace if s.name == "kv.transfer"]
    assert lanes and all(by_id[s.parent_id] is prefill for s in lanes)
    assert {(s.attributes["prfaas.kv.link"], s.attributes["prfaas.kv.via_link"])
            for s in lanes} == {("link-0", True)}
    assert all(s.end >= s.start for s in trace)
