"""The official `openai` package against the router, over real HTTP, with the real services.

One asyncio event loop in a background thread (an anyio blocking portal) runs the whole
mesh in-process on the memory transport: the cache directory, a PrfaaS prefill worker, a PD
prefill worker and a PD decode worker (services/worker/service.py with a random-init model, the same
weights everywhere), and `run_router` itself with hypercorn on a free 127.0.0.1 port. The
test thread talks to it with the synchronous `openai` client, and reads the router's
decision events the way the dashboard does (a mesh `Subscribe` stream).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.from_thread
import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from mesh.node import Node
from mesh.topology import Topology, parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport
from mesh.wire import Codec
from services.cli.serve import run_service
from services.contract.events import RoutingDecision
from services.contract.messages import CODEC_MESSAGES, Subscribe
from services.model.config import family_config
from services.model.generate import generate
from services.model.model import build_model
from services.model.tokenizer import load_default
from services.router.openai.schema import ChatMessage, render_chat
from services.service import ServiceContext

pytestmark = pytest.mark.slow

THRESHOLD = 97  # 19,400 x scale 0.005: a long prompt is offloaded, a short one is not


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def topology(http_port: int) -> Topology:
    return parse_topology(f"""
[[clusters]]
name = "prfaas"
kind = "prfaas"
options = {{ family = "kimi-linear", size = "default", checkpoint = "none", seed = 3 }}
[[clusters]]
name = "pd"
kind = "pd"
options = {{ family = "kimi-linear", size = "default", checkpoint = "none", seed = 3 }}
[[services]]
name = "router"
kind = "router"
port = 7100
options = {{ http_port = {http_port}, scale = 0.005, max_context = 2048, tick_s = 0.5 }}
[[services]]
name = "cachedir"
kind = "cachedir"
port = 7101
[[services]]
name = "prfaas-prefill-0"
kind = "prefill"
cluster = "prfaas"
port = 7110
options = {{ connections = 2 }}
[[services]]
name = "pd-prefill-0"
kind = "prefill"
cluster = "pd"
port = 7120
[[services]]
name = "pd-decode-0"
kind = "decode"
cluster = "pd"
port = 7130
""")


@dataclass
class Mesh:
    topology: Topology
    hub: MemoryHub = field(default_factory=MemoryHub)
    decisions: list[RoutingDecision] = field(default_factory=list)

    def context(self, name: str) -> ServiceContext:
        def resolve(peer: str) -> Address:
            return self.topology.address(peer.split("#", 1)[0])

        return ServiceContext(self.topology, self.topology.service(name),
                              transport=MemoryTransport(self.hub), resolve=resolve)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        async with anyio.create_task_group() as group:
            for name in ("cachedir", "prfaas-prefill-0", "pd-prefill-0", "pd-decode-0",
                         "router"):
                await group.start(run_service, self.context(name))
            await group.start(self._watch)
            task_status.started()

    async def _watch(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        node = Node("watcher", Codec(CODEC_MESSAGES), MemoryTransport(self.hub),
                    self.topology.address)
        async with node, node.open_stream("router", Subscribe(), timeout=3600) as events:
            task_status.started()
            async for event in events:
                if isinstance(event, RoutingDecision):
                    self.decisions.append(event)


@pytest.fixture(scope="module")
def router_url() -> Iterator[tuple[str, Mesh]]:
    port = free_port()
    mesh = Mesh(topology(port))
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        future, _ = portal.start_task(mesh.run)
        try:
            yield f"http://127.0.0.1:{port}/v1", mesh
        finally:
            future.cancel()


@pytest.fixture
def client(router_url: tuple[str, Mesh]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=router_url[0], api_key="none", max_retries=0,
                       timeout=60.0) as client:
        yield client


def reference(prompt: str, n: int) -> str:
    """The same greedy tokens from one process: the model every worker builds."""
    tokenizer = load_default()
    model = build_model(family_config("kimi-linear", "default"), seed=3, dtype="float32")
    tokens = generate(model, tokenizer.encode(prompt), n, stop_on_eos=False).tokens
    return tokenizer.decode(tokens)


LONG = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: "
        "rough winds do shake the darling buds of May, and summer's lease hath all too short "
        "a date; sometime too hot the eye of heaven shines, and often is his gold complexion "
        "dimm'd; and every fair from fair sometime declines, by chance or nature's changing "
        "course untrimm'd; but thy eternal summer shall not fade, nor lose possession of that "
        "fair thou ow'st; nor shall death brag thou wander'st in his shade.")


def test_completions_whole_and_streamed_equal_one_process_generation(
        client: openai.OpenAI) -> None:
    whole = client.completions.create(model="prfaas", prompt="To be, or not to be:",
                                      max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    expected = reference("To be, or not to be:", 12)
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert (whole.model_extra or {})["prfaas"]["cluster"] == "pd"
    stream = client.completions.create(model="prfaas", prompt="To be, or not to be:",
                                       max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == \
        whole.usage.prompt_tokens


def test_chat_streaming_and_not(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Speak, friend."}]
    whole = client.chat.completions.create(model="prfaas", messages=messages,
                                           max_tokens=8, temperature=0)
    text = whole.choices[0].message.content
    stream = client.chat.completions.create(model="prfaas", messages=messages,
                                            max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == streamed
    prompt = render_chat([ChatMessage(role="user", content="Speak, friend.")])
    if whole.choices[0].finish_reason == "length":
        assert text == reference(prompt, 8)


def test_errors_reach_the_client_and_the_router_keeps_serving(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="prfaas", prompt="x", max_tokens=0)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="prfaas", prompt="word " * 3000, max_tokens=2)
    ok = client.completions.create(model="prfaas", prompt="x", max_tokens=2)
    assert ok.choices[0].text is not None


def test_second_turn_decision_shows_the_cached_prefix(
        client: openai.OpenAI, router_url: tuple[str, Mesh]) -> None:
    mesh = router_url[1]
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]
    first = client.chat.completions.create(model="prfaas", messages=messages,
                                           max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    answer = first.choices[0].message.content or ""
    one = (first.model_extra or {})["prfaas"]
    assert one["cluster"] == "prfaas"
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="prfaas", messages=messages,
                                            max_tokens=6, temperature=0)
    two = (second.model_extra or {})["prfaas"]
    # The router's default prefix rule is "auto": on a calm link the PrfaaS cache of the
    # first turn counts, the short rest prefills on PD, which pulls that cache first and
    # resumes from it (whole 64-token blocks).
    assert two["cluster"] == "pd" and two["prefill_worker"] == "pd-prefill-0"
    assert two["cached_tokens"] >= 64 and two["cached_tokens"] % 64 == 0
    decisions = {d.request_id: d for d in mesh.decisions}
    d1, d2 = decisions[one["request_id"]], decisions[two["request_id"]]
    assert d1.cached_prfaas == 0 and d1.incremental_len > THRESHOLD
    assert d2.cached_prfaas == two["cached_tokens"] and d2.cached_pd == 0
    assert d2.incremental_len == d2.total_len - d2.cached_prfaas <= THRESHOLD
    assert d2.total_len > d1.total_len


def test_a_client_that_disconnects_mid_stream_frees_its_request(
        router_url: tuple[str, Mesh]) -> None:
    base = router_url[0].removesuffix("/v1")
    body = {"model": "prfaas", "prompt": "Once more unto the breach", "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=30.0) as http:
        with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            # Keep the line iterator alive: closing it closes the connection (the disconnect).
            lines = reply.iter_lines()
            assert isinstance(lines, Generator)
            first = next(line for line in lines if line)
            assert first.startswith("data: ") and "error" not in first, first
            assert http.get("/health").json()["inflight"] == 1
            lines.close()
        deadline = time.monotonic() + 20.0
        while http.get("/health").json()["inflight"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/health").json()["inflight"] == 0
        metrics = http.get("/metrics").text
        assert 'prfaas_router_requests_total{outcome="cancelled"} 1.0' in metrics
