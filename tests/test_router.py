"""The router's HTTP surface: OpenAI endpoints, errors, admin API, metrics, disconnects.

The Quart app runs in-process (its test client, asyncio) over the fake-but-honest mesh of
tests/router_fakes.py, on real time with millisecond fake work.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import pytest
from router_fakes import BLOCK, TOPOLOGY, FakeMesh, Timing, fake_mesh, fake_token

from mesh.errors import ConfigError
from mesh.hosts import allowed_hosts
from mesh.topology import parse_topology
from services.model.tokenizer import ByteTokenizer
from services.router.config import SchedulerConfig, router_config
from services.router.dynamic_policy import PrfaasDynamicPolicy
from services.router.load import DemoWorkload, WorkloadConfig
from services.router.openai import CLUSTER_HEADER, THREAD_BODY_BYTES, RouterApp, run_router
from services.router.openai_schema import CompletionRequest, Limits, completion_generation
from services.router.policies import create_policy
from services.service import ServiceContext

FAST = Timing(prfaas_s_per_token=1e-5, pd_s_per_token=1e-5, decode_step_s=0.001)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def router(config: SchedulerConfig | None = None, policy: str = "prfaas",
                 options: dict[str, object] | None = None, admin_token: str | None = None,
                 hosts: frozenset[str] | None = None,
                 ) -> AsyncIterator[tuple[FakeMesh, RouterApp]]:
    async with fake_mesh(policy, options, timing=FAST, config=config) as mesh:
        corpus = ByteTokenizer().encode("to be or not to be " * 50)
        workload = DemoWorkload(mesh.scheduler, corpus, WorkloadConfig(scale=1 / 256,
                                                                       max_tokens=2))
        app = RouterApp(mesh.scheduler, mesh.control, workload,
                        Limits(max_context=400, models=("prfaas",)), admin_token, hosts)
        async with anyio.create_task_group() as group:
            group.start_soon(workload.run)
            yield mesh, app
            group.cancel_scope.cancel()


def expected_text(prompt: str, n: int) -> str:
    ids = ByteTokenizer().encode(prompt)
    return "".join(chr(fake_token(ids, i) - 1) for i in range(n))


def sse_data(body: str | bytes) -> list[str]:
    events = (body.decode() if isinstance(body, bytes) else body).split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e.removeprefix("data: ") for e in events[:-1]]


@pytest.mark.anyio
async def test_completion_whole_body_has_text_usage_and_placement() -> None:
    async with router() as (_, app):
        client = app.app.test_client()
        response = await client.post("/v1/completions", json={
            "model": "prfaas", "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert response.status_code == 200
        assert response.headers[CLUSTER_HEADER] == "pd"
        body = await response.get_json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"][0]["text"] == expected_text(PROMPT, 6)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 6,
                                 "total_tokens": len(PROMPT) + 6,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        info = body["prfaas"]
        assert info["cluster"] == "pd" and info["cached_tokens"] == 0
        assert info["request_id"] == response.headers["x-request-id"]
        assert (info["prefill_worker"], info["decode_worker"]) == ("pd-prefill-0",
                                                                   "pd-decode-0")


@pytest.mark.anyio
async def test_completion_stream_is_openai_sse_with_usage_and_done() -> None:
    async with router() as (_, app):
        client = app.app.test_client()
        response = await client.post("/v1/completions", json={
            "model": "prfaas", "prompt": PROMPT, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}})
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = sse_data(await response.get_data())
        assert data[-1] == "[DONE]"
        chunks = [msgspec.json.decode(d) for d in data[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == expected_text(PROMPT, 5)
        final, usage = chunks[-2], chunks[-1]
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["prfaas"]["cluster"] == response.headers[CLUSTER_HEADER]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
        assert all(c["object"] == "text_completion" for c in chunks)


@pytest.mark.anyio
async def test_chat_stream_and_whole() -> None:
    async with router() as (_, app):
        client = app.app.test_client()
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello"}]
        response = await client.post("/v1/chat/completions", json={
            "model": "prfaas", "messages": messages, "max_tokens": 4, "stream": True})
        chunks = [msgspec.json.decode(d) for d in sse_data(await response.get_data())[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"][0]["delta"] == {}
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        whole = await (await client.post("/v1/chat/completions", json={
            "model": "prfaas", "messages": messages, "max_completion_tokens": 4})).get_json()
        assert whole["object"] == "chat.completion"
        assert whole["choices"][0]["message"] == {"role": "assistant", "content": streamed}
        prompt = "System: Be brief.\nUser: Hello\nAssistant:"
        assert streamed == expected_text(prompt, 4)
        assert whole["usage"]["prompt_tokens"] == len(prompt)


BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "n": 9}, 400, "n"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "x", "min_tokens": "some"}, 400, "min_tokens"),
    ("completions", {"prompt": "x", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 999]}, 400, "prompt"),
    ("completions", {"prompt": "x" * 500}, 400, "prompt"),
    ("completions", {"prompt": "x" * 100, "max_tokens": 350}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                          "max_completion_tokens": 1}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "y" * 500}]}, 400,
     "messages"),
]


class ThreadRecorder(ByteTokenizer):
    """The byte tokenizer, noting the thread each prompt was encoded in."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text)


@pytest.mark.anyio
async def test_a_large_body_is_tokenized_off_the_event_loop() -> None:
    # A prompt of THREAD_BODY_BYTES or more is encoded in a worker thread, so the loop goes on
    # serving other requests meanwhile; a short one on the loop itself. Same answers either way.
    long_prompt = "to be or not to be " * (THREAD_BODY_BYTES // 19 + 1)
    async with fake_mesh("prfaas", None, timing=FAST) as mesh:
        recorder = ThreadRecorder()
        mesh.scheduler.tokenizer = recorder
        app = RouterApp(mesh.scheduler, mesh.control,
                        DemoWorkload(mesh.scheduler, [1, 2, 3], WorkloadConfig()),
                        Limits(max_context=2 * THREAD_BODY_BYTES, models=("prfaas",)))
        client = app.app.test_client()
        loop_thread = threading.get_ident()
        for prompt in (PROMPT, long_prompt):
            for path, body in (("/v1/completions", {"prompt": prompt}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": prompt}]})):
                response = await client.post(path, json={"model": "prfaas", "max_tokens": 2,
                                                          **body})
                assert response.status_code == 200
                usage = (await response.get_json())["usage"]
                assert usage["prompt_tokens"] >= len(prompt)
        assert recorder.threads[:2] == [loop_thread] * 2
        assert len(recorder.threads) == 4 and loop_thread not in recorder.threads[2:]
        # A bad large body is still a 400 with its message, from the thread.
        response = await client.post("/v1/completions", json={
            "model": "prfaas", "prompt": long_prompt, "max_tokens": 2, "n": 0})
        assert response.status_code == 400
        assert "n" in (await response.get_json())["error"]["message"]


@pytest.mark.anyio
async def test_every_bad_request_gets_its_error_and_the_router_keeps_serving() -> None:
    async with router() as (mesh, app):
        client = app.app.test_client()
        for path, fields, status, param in BAD_REQUESTS:
            response = await client.post(f"/v1/{path}", json={"model": "prfaas", **fields})
            body = await response.get_json()
            assert (response.status_code, body["error"]["param"]) == (status, param), fields
            assert body["error"]["message"] and body["error"]["type"]
        broken = await client.post("/v1/completions", data=b"{not json",
                                   headers={"content-type": "application/json"})
        assert broken.status_code == 400
        assert "not valid JSON" in (await broken.get_json())["error"]["message"]
        too_long = await client.post("/v1/completions", json={"model": "prfaas",
                                                               "prompt": "x" * 500})
        assert (await too_long.get_json())["error"]["code"] == "context_length_exceeded"
        missing = await client.get("/v1/nothing")
        assert missing.status_code == 404 and "error" in await missing.get_json()
        wrong_method = await client.get("/v1/completions")
        assert wrong_method.status_code == 405
        assert mesh.scheduler.statistics().admitted == 0
        ok = await client.post("/v1/completions", json={"model": "prfaas", "prompt": "hi"})
        assert ok.status_code == 200


@pytest.mark.anyio
async def test_full_queues_answer_429_and_no_worker_503() -> None:
    async with router(SchedulerConfig(block_size=BLOCK, max_inflight=1)) as (mesh, app):
        client = app.app.test_client()
        mesh.workers["pd-prefill-0"].hung = True  # its status polls hang; prefills still run
        busy = await mesh.scheduler.submit(
            await _generation(app, "hello", 200))
        full = await client.post("/v1/completions", json={"model": "prfaas", "prompt": "x"})
        assert full.status_code == 429
        body = await full.get_json()
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == \
            "queue_full"
        busy.cancel()
        with pytest.raises(Exception, match="cancelled"):
            await busy.collect()
        mesh.control.drain("pd-decode-0")
        none = await client.post("/v1/completions", json={"model": "prfaas", "prompt": "x",
                                                          "stream": True})
        assert none.status_code == 503
        assert "no decode worker" in (await none.get_json())["error"]["message"]
        await client.post("/admin/workers/pd-decode-0/role", json={"role": "decode"})
        with anyio.fail_after(10):
            while mesh.scheduler.workers.get("pd-decode-0").converting:
                await anyio.sleep(0.05)
        again = await client.post("/v1/completions", json={"model": "prfaas", "prompt": "x"})
        assert again.status_code == 200


async def _generation(app: RouterApp, prompt: str, max_tokens: int) -> Any:
    request = CompletionRequest(model="prfaas", prompt=prompt, max_tokens=max_tokens)
    return completion_generation(request, app.scheduler.tokenizer, app.limits)


@pytest.mark.anyio
async def test_a_client_that_disconnects_frees_its_request() -> None:
    async with router() as (mesh, app):
        client = app.app.test_client()
        body = msgspec.json.encode({"model": "prfaas", "prompt": PROMPT, "max_tokens": 300,
                                    "stream": True})
        async with client.request("/v1/completions", method="POST",
                                  headers={"content-type": "application/json"}) as connection:
            await connection.send(body)
            await connection.send_complete()
            first = await connection.receive()
            assert first.startswith(b"data: ")
            await connection.disconnect()
        with anyio.fail_after(10):
            while mesh.scheduler.active():
                await anyio.sleep(0.01)
        decode = mesh.workers["pd-decode-0"]
        with anyio.fail_after(10):
            while not decode.aborted:
                await anyio.sleep(0.01)
        assert len(decode.aborted) == 1 and not decode.finished
        assert mesh.scheduler.statistics().cancelled == 1
        mesh.scheduler.check_integrity()


@pytest.mark.anyio
async def test_models_health_and_metrics() -> None:
    async with router() as (mesh, app):
        client = app.app.test_client()
        models = await (await client.get("/v1/models")).get_json()
        assert [m["id"] for m in models["data"]] == ["prfaas"]
        # Not ready until a status poll has heard a prefill and a decode worker answer.
        starting = await client.get("/health")
        assert starting.status_code == 503
        assert (await starting.get_json())["status"] == "starting"
        await mesh.control.tick()
        ready = await client.get("/health")
        health = await ready.get_json()
        assert ready.status_code == 200
        assert health["status"] == "ready" and health["workers_up"] == 3
        await client.post("/v1/completions", json={"model": "prfaas", "prompt": "hi",
                                                   "max_tokens": 3})
        text = await (await client.get("/metrics")).get_data(as_text=True)
        assert ('prfaas_router_requests_total{finish_reason="length",outcome="completed"} 1.0'
                in text)
        assert 'prfaas_router_tokens_total{kind="completion"} 3.0' in text
        assert 'prfaas_router_worker_up{role="decode",worker="pd-decode-0"} 1.0' in text
        assert "prfaas_router_threshold_tokens 19400.0" in text
        assert "\nprocess_resident_memory_bytes " in text


@pytest.mark.anyio
async def test_admin_api_needs_the_token_and_refuses_foreign_origins() -> None:
    async with router(admin_token="s3cret") as (_, app):
        client = app.app.test_client()
        good = {"authorization": "Bearer s3cret"}
        missing = await client.post("/admin/threshold", json={"t": 50})
        wrong = await client.post("/admin/threshold", json={"t": 50},
                                  headers={"authorization": "Bearer nope"})
        state = await client.get("/admin/state")
        evil = await client.post("/admin/threshold", data=b'{"t": 50}', headers={
            **good, "origin": "http://evil.example", "content-type": "text/plain"})
        assert [r.status_code for r in (missing, wrong, state, evil)] == [401, 401, 401, 403]
        assert (await evil.get_json())["status"] == 403
        assert app.scheduler.policy.threshold == 19400.0
        ok = await client.post("/admin/threshold", json={"t": 50}, headers=good)
        assert ok.status_code == 200 and (await ok.get_json())["threshold"] == 50.0
        # The API itself takes no token; the admin token guards /admin/* only.
        assert (await client.get("/v1/models")).status_code == 200


@pytest.mark.anyio
async def test_admin_api_without_a_token_still_refuses_foreign_origins() -> None:
    async with router() as (_, app):
        client = app.app.test_client()
        evil = await client.post("/admin/policy", data=b'{"policy": "naive-hetero"}',
                                 headers={"origin": "http://evil.example",
                                          "content-type": "text/plain"})
        assert evil.status_code == 403
        assert app.scheduler.policy.name == "prfaas"


@pytest.mark.anyio
async def test_admin_api_refuses_a_host_that_is_not_its_own_dns_rebinding() -> None:
    token = "an-admin-token-of-32-characters."
    async with router(admin_token=token, hosts=allowed_hosts("127.0.0.1")) as (_, app):
        client = app.app.test_client()
        auth = {"authorization": f"Bearer {token}"}
        # A page at evil.example, its name rebound to 127.0.0.1: same-origin with itself.
        rebound = await client.post("/admin/threshold", json={"t": 50}, headers={
            **auth, "host": "evil.example:8000", "origin": "http://evil.example:8000"})
        assert rebound.status_code == 403
        assert "Host 'evil.example:8000'" in (await rebound.get_json())["error"]
        assert app.scheduler.policy.threshold == 19400.0
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000"):
            ok = await client.post("/admin/threshold", json={"t": 50},
                                   headers={**auth, "host": host})
            assert ok.status_code == 200, host


@pytest.mark.anyio
async def test_admin_api_changes_policy_threshold_roles_and_runs_the_demo_load() -> None:
    async with router() as (mesh, app):
        client = app.app.test_client()
        state = await (await client.get("/admin/state")).get_json()
        assert state["policy"] == "prfaas" and state["threshold"] == 19400.0
        assert {w["name"] for w in state["workers"]} == set(mesh.workers)
        response = await client.post("/admin/threshold", json={"t": 50})
        assert (await response.get_json())["threshold"] == 50.0
        long = await client.post("/v1/completions", json={"model": "prfaas",
                                                          "prompt": "y" * 80})
        assert long.headers[CLUSTER_HEADER] == "prfaas"
        await client.post("/admin/threshold", json={"t": None})
        response = await client.post("/admin/policy", json={"policy": "naive-hetero"})
        assert (await response.get_json())["policy"] == "naive-hetero"
        short = await client.post("/v1/completions", json={"model": "prfaas", "prompt": "y"})
        assert short.headers[CLUSTER_HEADER] == "prfaas"
        errors = [
            await client.post("/admin/policy", json={"policy": "nope"}),
            await client.post("/admin/threshold", json={"t": 5}),
            await client.post("/admin/threshold", json={"t": "x"}),
            await client.post("/admin/threshold", json={"t": -3}),
            await client.post("/admin/workers/ghost/drain"),
            await client.post("/admin/workers/prfaas-prefill-0/role", json={"role": "decode"}),
            await client.post("/admin/workers/pd-prefill-0/role", json={"role": "chef"}),
            await client.post("/admin/workload", json={"action": "start", "rate": -1}),
            await client.post("/admin/workload", json={"action": "start", "kind": "weird"}),
        ]
        bodies = [await r.get_json() for r in errors]
        assert [(r.status_code, b["status"]) for r, b in zip(errors, bodies, strict=True)] == [
            (400, 400), (409, 409), (400, 400), (400, 400), (404, 404), (409, 409),
            (400, 400), (400, 400), (400, 400)]
        assert all(isinstance(b["error"], str) and b["error"] for b in bodies)
        started = await client.post("/admin/workload", json={"action": "start", "rate": 50,
                                                             "kind": "mixed"})
        assert (await started.get_json())["workload"]["running"] is True
        with anyio.fail_after(20):
            while app.workload.statistics().completed < 5:
                await anyio.sleep(0.02)
        stopped = await (await client.post("/admin/workload", json={"action": "stop"})
                         ).get_json()
        assert stopped["workload"]["running"] is False
        assert stopped["workload"]["failed"] == 0
        assert app.control.statistics().conversions == 0
        role = await client.post("/admin/workers/pd-prefill-0/role", json={"role": "decode"})
        roles = {w["name"]: w["role"] for w in (await role.get_json())["workers"]}
        assert roles["pd-prefill-0"] == "draining"


def test_router_options() -> None:
    config = router_config({"http_port": 8001, "policy": "prfaas-dynamic", "scale": 0.5})
    assert config.http_port == 8001
    assert config.policy_options()["prfaas"]["threshold"] == 9700.0
    with pytest.raises(ValueError, match="frobnicate"):
        router_config({"frobnicate": 1})
    # The default prefix rule is "auto": abundant while the link is calm (the cache moves).
    assert config.prefix_rule == "auto"
    assert config.policy_options()["prfaas"]["prefix_rule"] == "auto"
    auto = router_config({"block_size": 16}).scheduler_config()
    assert auto.block_size == 16 and auto.links == ()


def test_router_reads_the_prefix_rules_old_name_bandwidth() -> None:
    """A topology's router option `bandwidth` (the prefix rule's old name) still sets
    `prefix_rule`, and reaches the policies; a value that is no rule is refused by name."""
    config = router_config({"bandwidth": "scarce"})
    assert config.prefix_rule == "scarce"
    assert config.policy_options()["prfaas-dynamic"]["prefix_rule"] == "scarce"
    with pytest.raises(ConfigError, match="prefix_rule"):
        router_config({"prefix_rule": "sometimes"})
    with pytest.raises(ConfigError, match="deprecated name bandwidth"):
        router_config({"prefix_rule": "auto", "bandwidth": "scarce"})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_size", 0, "block_size must be >= 1, got 0"),
    ("max_inflight", 0, "max_inflight must be >= 1, got 0"),
    ("connections", -1, "connections must be >= 1, got -1"),
    ("lookup_timeout_s", 0.0, "lookup_timeout_s must be > 0, got 0.0"),
    ("kv_timeout_s", float("nan"), "kv_timeout_s must be > 0, got nan"),
])
def test_scheduler_config_refuses_bounds_that_admit_nothing(field: str, value: float,
                                                            message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**{field: value})


def test_router_passes_each_policys_own_options_over_the_derived_ones() -> None:
    config = router_config({"scale": 0.5, "policies": {
        "prfaas-dynamic": {"dwell_s": 0.5, "tilt": 1.5}, "homogeneous": {}}})
    dynamic = config.policy_options()["prfaas-dynamic"]
    assert dynamic == {"token_scale": 0.5, "prefix_rule": "auto", "dwell_s": 0.5, "tilt": 1.5}
    assert config.policy_options()["prfaas"]["threshold"] == 9700.0
    policy = create_policy("prfaas-dynamic", dynamic)
    assert isinstance(policy, PrfaasDynamicPolicy)
    assert (policy.config.dwell_s, policy.config.tilt) == (0.5, 1.5)
    with pytest.raises(ConfigError, match="frobnicate"):
        router_config({"policies": {"frobnicate": {}}})
    # A topology's options are flat: dotted keys, merged over (and overriding) `policies`.
    dotted = router_config({"policies": {"prfaas-dynamic": {"dwell_s": 2.0}},
                            "prfaas-dynamic.dwell_s": 0.5, "prfaas-dynamic.roles.period_s": 9.0})
    assert dotted.policies == {"prfaas-dynamic": {"dwell_s": 0.5, "roles": {"period_s": 9.0}}}
    with pytest.raises(ConfigError, match="frobnicate"):
        router_config({"frobnicate.x": 1})
    # The link estimator's dotted options go to it, not to a policy.
    measured = router_config({"link_estimator.window_s": 3.0,
                              "link_estimator.provisioned_bps": 1e9})
    assert (measured.link_estimator.window_s, measured.link_estimator.provisioned_bps) == (
        3.0, 1e9)
    assert measured.scheduler_config().link_estimator == measured.link_estimator
    with pytest.raises(ConfigError, match="held_min"):
        router_config({"link_estimator.held_min": 2.0})


@pytest.mark.trio
async def test_run_router_refuses_trio() -> None:
    topology = parse_topology(TOPOLOGY)
    with pytest.raises(ConfigError, match="asyncio"):
        await run_router(ServiceContext(topology, topology.service("router")))
