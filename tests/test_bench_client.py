"""The bench client end to end against a tiny fake OpenAI server (a test double, ASGI).

The server runs under hypercorn on an ephemeral 127.0.0.1 port in the test's own trio loop,
so with `autojump_clock` its pacing sleeps are virtual and the measured TTFT and ITL exact.
The `bench_main` test runs the server in a portal thread and the CLI on real time, unpaced.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import hypercorn.trio
import pytest
from hypercorn.config import Config

from services.bench.cli import bench_main, egress_bytes_of
from services.bench.client import ClientConfig, run_benchmark
from services.bench.stats import summarise
from services.bench.workloads import Session, Turn

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class FakeOpenAI:
    """Streams `max_tokens` one-word chunks: first after `ttft_s`, then every `itl_s`.

    Prompts longer than 40 characters "prefill on PrfaaS". The cluster goes in the header
    and the final chunk's `prfaas` field unless `report_cluster` is False. GET /link counts.
    """

    def __init__(self, ttft_s: float = 0.0, itl_s: float = 0.0,
                 report_cluster: bool = True) -> None:
        self.ttft_s, self.itl_s, self.report_cluster = ttft_s, itl_s, report_cluster
        self.requests: list[dict[str, Any]] = []
        self.egress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET" and scope["path"] == "/link":
            self.egress += 1_000_000
            await self._json(send, {"statistics": {"link": {"egress": {"bytes_out": self.egress}}}})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.requests.append({"path": scope["path"], **request})
        if request.get("max_tokens") == 0:
            await self._json(send, {"error": {"message": "max_tokens must be >= 1"}}, 400)
            return
        await self._stream(send, request)

    async def _json(self, send: Send, value: object, status: int = 200) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(value).encode()})

    def _chunk(self, request: dict[str, Any], text: str) -> dict[str, Any]:
        if "messages" in request:
            return {"choices": [{"index": 0, "delta": {"content": text}}]}
        return {"choices": [{"index": 0, "text": text}]}

    async def _stream(self, send: Send, request: dict[str, Any]) -> None:
        prompt = request.get("prompt") or json.dumps(request.get("messages"))
        cluster = "prfaas" if len(prompt) > 40 else "pd"
        headers = [(b"content-type", b"text/event-stream")]
        if self.report_cluster:
            headers.append((b"x-prfaas-cluster", cluster.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        n = request["max_tokens"]
        for i in range(n):
            await anyio.sleep(self.ttft_s if i == 0 else self.itl_s)
            data = json.dumps(self._chunk(request, f" w{i}"))
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                        "more_body": True})
        final: dict[str, Any] = {"choices": [], "usage": {"prompt_tokens": len(prompt.split()),
                                                          "completion_tokens": n}}
        if self.report_cluster:
            final["prfaas"] = {"cluster": cluster, "cached_tokens": 3}
        tail = f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode()
        await send({"type": "http.response.body", "body": tail})


@asynccontextmanager
async def serving(app: FakeOpenAI) -> AsyncIterator[str]:
    """Serve `app` on an ephemeral port for the duration; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.keep_alive_timeout = 3600.0
    config.graceful_timeout = 1.0
    port = sock.getsockname()[1]
    sock.close()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: hypercorn.trio.serve(app, config, shutdown_trigger=stop.wait))
        yield f"http://127.0.0.1:{port}"
        stop.set()


def one_turn(sid: str, arrival: float, words: int, max_tokens: int) -> Session:
    text = " ".join(f"t{i}" for i in range(words))
    return Session(session_id=sid, arrival_s=arrival,
                   turns=(Turn(text=text, planned_tokens=words, max_tokens=max_tokens),))


@pytest.mark.trio
async def test_timings_clusters_and_open_loop_arrivals(autojump_clock: object) -> None:
    app = FakeOpenAI(ttft_s=0.25, itl_s=0.02)
    sessions = [one_turn("long", 0.0, 20, 5), one_turn("short", 1.5, 2, 3),
                one_turn("bad", 2.0, 2, 0)]
    async with serving(app) as url:
        run = await run_benchmark(sessions, ClientConfig(base_url=url), progress=False)
    by_id = {r.request_id: r for r in run.results}
    long, short, bad = by_id["long/0"], by_id["short/0"], by_id["bad/0"]
    assert long.ok and long.ttft_s == pytest.approx(0.25, abs=1e-6)
    assert long.itl_s == pytest.approx((0.02,) * 4, abs=1e-6)
    assert long.latency_s == pytest.approx(0.33, abs=1e-6)
    assert (long.output_tokens, long.prompt_tokens, long.cached_tokens) == (5, 20, 3)
    assert (long.cluster, short.cluster) == ("prfaas", "pd")
    assert short.start_s == pytest.approx(1.5, abs=1e-6)  # open loop: sent at its arrival
    assert not bad.ok and bad.error.startswith("HTTP 400") and "max_tokens" in bad.error
    assert run.duration_s == pytest.approx(2.0, abs=1e-3)  # the last arrival fails at once
    sent = {r["prompt"].split()[0]: r for r in app.requests}
    assert sent["t0"]["stream"] is True and sent["t0"]["stream_options"]["include_usage"]
    summary = summarise(run.results, run.duration_s)
    assert summary.offload_fraction == pytest.approx(0.5)
    assert summary.tpot is not None and summary.tpot.mean == pytest.approx(20.0, abs=1e-3)


@pytest.mark.trio
async def test_multi_turn_chat_sends_the_growing_history(autojump_clock: object) -> None:
    app = FakeOpenAI(ttft_s=0.1, itl_s=0.01, report_cluster=False)
    turns = tuple(Turn(text=f"question {k}", planned_tokens=2, max_tokens=2, think_s=0.5)
                  for k in range(3))
    session = Session(session_id="s", arrival_s=0.0, turns=turns)
    async with serving(app) as url:
        run = await run_benchmark([session], ClientConfig(base_url=url, endpoint="chat"),
                                  progress=False)
    assert [r.turn for r in run.results] == [0, 1, 2] and all(r.ok for r in run.results)
    assert all(r.cluster is None for r in run.results)  # tolerant when nothing is reported
    history = [r["messages"] for r in app.requests]
    assert [m["content"] for m in history[2]] == [
        "question 0", " w0 w1", "question 1", " w0 w1", "question 2"]
    assert history[1] == history[2][:3]
    assert {r["path"] for r in app.requests} == {"/v1/chat/completions"}
    # Each turn waits for the previous answer (0.11 s) and the think time (0.5 s).
    starts = [r.start_s for r in run.results]
    assert starts == pytest.approx([0.0, 0.61, 1.22], abs=1e-6)


@pytest.mark.trio
async def test_completions_prompt_grows_with_answers(autojump_clock: object) -> None:
    app = FakeOpenAI()
    turns = tuple(Turn(text=f"q{k}", planned_tokens=1, max_tokens=2) for k in range(3))
    async with serving(app) as url:
        await run_benchmark([Session(session_id="s", arrival_s=0.0, turns=turns)],
                            ClientConfig(base_url=url), progress=False)
    prompts = [r["prompt"] for r in app.requests]
    assert prompts == ["q0", "q0 w0 w1\nq1", "q0 w0 w1\nq1 w0 w1\nq2"]


@pytest.mark.trio
async def test_unreachable_server_fails_requests_not_the_run(autojump_clock: object) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    run = await run_benchmark([one_turn("x", 0.0, 3, 2)],
                              ClientConfig(base_url=f"http://127.0.0.1:{port}"), progress=False)
    (failed,) = run.results
    assert not failed.ok and "ConnectError" in failed.error


def test_egress_parsing_is_tolerant() -> None:
    assert egress_bytes_of({"statistics": {"link": {"egress": {"bytes_out": 42}}}}) == 42
    assert egress_bytes_of({"statistics": {"link": {}}}) is None
    assert egress_bytes_of([1]) is None


def test_bench_main_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app = FakeOpenAI()
    with anyio.from_thread.start_blocking_portal("trio") as portal, \
            portal.wrap_async_context_manager(serving(app)) as url:
        code = bench_main([
            "--url", url, "--link-url", url, "--workload", "trace", "--num-requests", "12",
            "--request-rate", "inf", "--scale", "1/512", "--max-context", "64",
            "--goodput", "ttft:60000", "--out-dir", str(tmp_path), "--json", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "successful requests" in out and "offloaded to PrfaaS" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["good_requests"] == 12 and summary["egress_bytes"] == 1_000_000
    assert 0.0 <= summary["offload_fraction"] <= 1.0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert len(report["requests"]) == 12 and report["options"]["workload"] == "trace"
    for name in ("ttft.png", "itl.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The trace's first requests share hash id 0: their prompts share that block's text.
    prompts = [r["prompt"] for r in app.requests]
    assert len({p.split()[0] for p in prompts[:3]}) == 1


def test_bench_main_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--goodput", "latency:5", "--no-files"]) == 2
    assert "--goodput keys are ttft, tpot, e2el; got 'latency:5'" in capsys.readouterr().err
    assert bench_main(["--num-requests", "0", "--no-files"]) == 2
    assert "--num-requests must be >= 1, got 0" in capsys.readouterr().err
    assert bench_main(["--workload", "trace", "--trace", "/nonexistent.jsonl"]) == 2
