"""What `make demo` prints at the default level: no Lifespan warnings, no duplicate lines,
no warnings for peers that are still starting, and a quiet exit on Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_fakes import TOPOLOGY

from mesh.errors import RemoteError
from mesh.metrics import with_lifespan
from mesh.node import Node
from mesh.server import Context
from mesh.topology import parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport
from mesh.wire import Codec
from services.cli import main as cli_main
from services.cli.launch import launch
from services.contract.errors import KVTransferError
from services.contract.messages import CODEC_MESSAGES, StatusQuery, WorkerState
from services.router.workers import WorkerTable
from tests.ports import distinct_ports

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")


def cachedir_topology(path: Path) -> Path:
    node_port, metrics_port = distinct_ports(2)
    path.write_text(f'[[services]]\nname = "cachedir"\nkind = "cachedir"\nport = {node_port}\n'
                    f'options = {{ metrics_port = {metrics_port} }}\n', encoding="utf-8")
    return path


def test_a_service_with_metrics_logs_each_line_once_and_no_lifespan_warning(
        tmp_path: Path) -> None:
    topology = cachedir_topology(tmp_path / "topology.toml")
    port = parse_topology(topology.read_text()).service("cachedir").options["metrics_port"]
    with launch(topology, ["cachedir"], log_dir=tmp_path):
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10.0)
    assert response.status_code == 200 and "prfaas_" in response.text
    lines = [STAMP.sub("", line) for line in (tmp_path / "cachedir.log").read_text().splitlines()]
    assert any("Running on" in line for line in lines)
    assert not [line for line in lines if "Lifespan" in line], lines
    assert [line for line, n in Counter(lines).items() if n > 1] == []
    assert not [line for line in lines if "Traceback" in line or " WARNING " in line], lines


@pytest.mark.trio
async def test_the_metrics_app_answers_lifespan_itself() -> None:
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def no_lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("the wrapped app never sees a lifespan scope")

    await with_lifespan(no_lifespan)({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete",
                                         "lifespan.shutdown.complete"]


@pytest.mark.trio
async def test_a_worker_still_starting_is_info_not_a_warning(
        caplog: pytest.LogCaptureFixture, autojump_clock: object) -> None:
    topology = parse_topology(TOPOLOGY)
    workers = WorkerTable.from_topology(topology)
    node = Node("router", Codec(CODEC_MESSAGES), MemoryTransport(MemoryHub()), topology.address)
    async with node:
        with caplog.at_level(logging.INFO, "services.router.workers"):
            await workers.poll(node, timeout=1.0, block_size=64)
    records = [r for r in caplog.records if r.name == "services.router.workers"]
    assert records and all(r.levelno == logging.INFO for r in records)
    assert all("is not up yet" in r.getMessage() for r in records)
    assert not any(workers.get(name).up for name in workers.names)


def test_an_early_interrupt_ends_prfaas_up_quietly(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(name: str) -> Any:
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM stops `prfaas up` before this line")

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(cli_main, "resolve", interrupted)
    try:
        assert cli_main.main(["up"]) == 0
        # Stopping already: a second signal (make forwards its own SIGTERM) is ignored.
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    assert "prfaas up: interrupted" in capsys.readouterr().err


def test_an_interrupt_ends_other_commands_with_130_and_no_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(name: str) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "resolve", interrupted)
    assert cli_main.main(["plan"]) == 130
    assert capsys.readouterr().err == "prfaas plan: interrupted\n"


@pytest.mark.trio
async def test_a_handler_failing_on_purpose_logs_one_line_without_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    transport = MemoryTransport(MemoryHub())
    codec = Codec(CODEC_MESSAGES)
    worker = Node("worker", codec, transport, {"worker": Address("worker", 1)})

    @worker.handles(StatusQuery)
    async def on_status(msg: StatusQuery, ctx: Context) -> WorkerState:
        raise KVTransferError("no complete KV for 'r1' within kv_timeout=60.0 s")

    async with worker, Node("router", codec, transport, {"worker": Address("worker", 1)}) as cli:
        await worker.listen()
        with pytest.raises(RemoteError, match="KVTransferError"):
            await cli.call("worker", StatusQuery(), WorkerState)
    failed = [r for r in caplog.records if r.name == "mesh.handlers"]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    assert failed[0].exc_info is None
    assert failed[0].getMessage().endswith("KVTransferError: no complete KV for 'r1' within "
                                           "kv_timeout=60.0 s")
