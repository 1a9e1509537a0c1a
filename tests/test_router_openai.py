"""The official `openai` package against the router, over real HTTP, with the real services.

One asyncio event loop in a background thread (an anyio blocking portal) runs the whole
mesh in-process on the memory transport: the cache directory, a PrfaaS prefill worker, a PD
prefill worker and a PD decode worker (services/worker/service.py with a random-init model, the same
weights everywhere), and `run_router` itself with hypercorn on a free 127.0.0.1 port. The
test thread talks to it with the synchronous `openai` client, and reads the router's
decision events the way the dashboard does (a mesh `Subscribe` stream).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import anyio
import anyio.abc
import anyio.from_thread
import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from torch import Tensor

from mesh.node import Node
from mesh.topology import Topology, parse_topology
from mesh.transport import Address, MemoryHub, MemoryTransport
from mesh.wire import Codec
from services.cli.serve import run_service
from services.contract.events import RoutingDecision
from services.contract.messages import CODEC_MESSAGES, Subscribe
from services.model.config import family_config
from services.model.generate import generate, prefill
from services.model.model import HybridLM, build_model
from services.model.tokenizer import load_default
from services.router.openai_schema import ChatMessage, render_chat
from services.service import ServiceContext
from tests.ports import free_port
from tests.topologies import MEMORY_PORTS, mesh_toml

pytestmark = pytest.mark.slow

THRESHOLD = 97  # 19,400 x scale 0.005: a long prompt is offloaded, a short one is not



def topology(http_port: int) -> Topology:
    worker = 'family = "kimi-linear", size = "default", checkpoint = "none", seed = 3'
    return parse_topology(mesh_toml(MEMORY_PORTS, worker=worker, options={
        "router": f"http_port = {http_port}, scale = 0.005, max_context = 2048, tick_s = 0.5",
        "prfaas-prefill-0": "connections = 2"}))


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


@pytest.fixture(scope="module")
def model() -> HybridLM:
    """The model every worker builds, for one-process references."""
    return build_model(family_config("kimi-linear", "default"), seed=3, dtype="float32")


def reference_logprobs(model: HybridLM, prompt: list[int], n: int) -> tuple[list[int], Tensor]:
    """Greedy tokens from one process, and the float32 log_softmax of the logits each was
    drawn from ([n, V]: one prefill over the prompt and the tokens)."""
    tokens = generate(model, prompt, n, stop_on_eos=False).tokens
    logits = prefill(model, prompt + tokens[:-1], all_logits=True).all_logits
    assert logits is not None
    return tokens, torch.log_softmax(logits[-n:].float(), dim=-1)


def test_max_completion_tokens_caps_both_endpoints(client: openai.OpenAI) -> None:
    done = client.completions.create(model="prfaas", prompt="Once upon", temperature=0,
                                     extra_body={"max_completion_tokens": 3,
                                                 "ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="prfaas", messages=[{"role": "user", "content": "Hi"}], temperature=0,
        max_completion_tokens=4, extra_body={"ignore_eos": True})
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert chat.choices[0].finish_reason == "length"


def test_n_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    ask = {"model": "prfaas", "prompt": "The king", "max_tokens": 6, "temperature": 1.0,
           "seed": 11, "n": 3, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**ask)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.text for c in whole.choices]
    assert len(set(texts)) == 3, texts
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    streamed = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(stream=True, **ask):  # type: ignore[call-overload]
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    # Each choice's seed derives from the request's: the same request gives the same choices.
    assert streamed == texts and finished == {0, 1, 2}
    with pytest.raises(openai.BadRequestError, match="n=9"):
        client.completions.create(model="prfaas", prompt="x", max_tokens=1, n=9)


def test_chat_logprobs_are_the_models_log_softmax(client: openai.OpenAI,
                                                  model: HybridLM) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Speak."}]
    reply = client.chat.completions.create(model="prfaas", messages=messages, max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].logprobs is not None
    content = reply.choices[0].logprobs.content or []
    tokenizer = load_default()
    prompt = tokenizer.encode(render_chat([ChatMessage(role="user", content="Speak.")]))
    tokens, logp = reference_logprobs(model, prompt, 5)
    assert len(content) == 5
    for i, (entry, token) in enumerate(zip(content, tokens, strict=True)):
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert entry.bytes == list(tokenizer.token_bytes(token))
        assert entry.logprob == pytest.approx(float(logp[i, token]), abs=1e-3)
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert top[0] == pytest.approx(entry.logprob)


def test_completion_logprobs_format(client: openai.OpenAI, model: HybridLM) -> None:
    done = client.completions.create(model="prfaas", prompt="To be, or not", max_tokens=4,
                                     temperature=0, logprobs=2, echo=True,
                                     extra_body={"ignore_eos": True})
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    tokens, logp = reference_logprobs(model, load_default().encode("To be, or not"), 4)
    assert logprobs.token_logprobs == pytest.approx(
        [float(logp[i, t]) for i, t in enumerate(tokens)], abs=1e-3)
    assert logprobs.top_logprobs is not None
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    # Offsets count the echoed prompt.
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == len("To be, or not")
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_stop_token_ids_stop_and_min_tokens_holds_them_off(client: openai.OpenAI) -> None:
    first = client.completions.create(model="prfaas", prompt="Good night", max_tokens=1,
                                      temperature=0, logprobs=0)
    assert first.choices[0].logprobs is not None
    token = load_default().encode(first.choices[0].text)
    assert len(token) == 1
    stopped = client.completions.create(model="prfaas", prompt="Good night", max_tokens=6,
                                        temperature=0, extra_body={"stop_token_ids": token,
                                                                   "ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    held = client.completions.create(model="prfaas", prompt="Good night", max_tokens=6,
                                     temperature=0, extra_body={"stop_token_ids": token,
                                                                "min_tokens": 6})
    assert held.choices[0].finish_reason == "length"
    assert held.usage is not None and held.usage.completion_tokens == 6


def test_continuous_usage_and_no_textless_chunks_around_split_characters(
        client: openai.OpenAI, model: HybridLM) -> None:
    prompt, seed = "\u00dcber caf\u00e9 na\u00efve \u65e5\u672c", 0
    # Precondition: this draw has a token that ends inside a multi-byte character.
    tokenizer = load_default()
    tokens = generate(model, tokenizer.encode(prompt), 24, temperature=1.5, seed=seed,
                      stop_on_eos=False).tokens
    assert any(tokenizer.decode(tokens[:i]).endswith("\ufffd") for i in range(1, 25))
    chunks = list(client.completions.create(
        model="prfaas", prompt=prompt, max_tokens=24, temperature=1.5, seed=seed, logprobs=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "stream_options": {"include_usage": True,
                                                           "continuous_usage_stats": True}}))
    texts = [c for c in chunks if c.choices and not c.choices[0].finish_reason]
    assert texts and all(c.choices[0].text for c in texts)
    counts = [len(c.choices[0].logprobs.tokens or []) for c in chunks if c.choices
              and c.choices[0].logprobs]
    assert sum(counts) == 24 and max(counts) > 1  # the split character's tokens came together
    used = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert len(used) == len(chunks) and used[-1] == 24
    text_used = [c.usage.completion_tokens for c in texts if c.usage is not None]
    assert all(a < b for a, b in itertools.pairwise(text_used))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tokenizer.decode(tokens)


def test_unknown_fields_are_ignored_with_a_warning(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model="prfaas", prompt="Hello", max_tokens=2, extra_body={"foo": 1, "bar": [2]})
    assert raw.http_response.status_code == 200
    assert raw.headers["warning"] == '299 - "ignored fields: foo, bar"'
    assert raw.parse().choices[0].text is not None
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model="prfaas", prompt="x", max_tokens=2,
                                  extra_body={"min_tokens": "many"})
