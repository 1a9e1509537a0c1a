"""Response bodies and server-sent events of one generation, from a request's handle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from router_fakes import DONE, placed_handle

from services.contract.sampling import Sampling
from services.router.errors import UpstreamFailed
from services.router.openai_responses import Kind, Responder, stream_events
from services.router.requests import GenerationRequest, RequestHandle


def stream(kind: Kind, request: RequestHandle, **generation: Any) -> AsyncIterator[bytes]:
    body = GenerationRequest(prompt=[1, 2, 3], sampling=Sampling(max_tokens=2), **generation)
    return stream_events(Responder(kind, request, "m"), body)


async def events(kind: Kind, request: RequestHandle, **generation: Any) -> list[Any]:
    raw = b"".join([chunk async for chunk in stream(kind, request, **generation)])
    frames = raw.decode().split("\n\n")
    assert frames[-1] == "" and all(f.startswith("data: ") for f in frames[:-1])
    return [f.removeprefix("data: ") for f in frames[:-1]]


@pytest.mark.trio
async def test_a_chat_stream_is_role_text_finish_usage_done() -> None:
    request = placed_handle()
    request.outbox.put("hi")
    request.outbox.close(DONE)
    data = await events("chat", request, include_usage=True)
    assert data[-1] == "[DONE]"
    role, text, final, usage = (msgspec.json.decode(d) for d in data[:-1])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text["choices"][0]["delta"] == {"content": "hi"} and "prfaas" not in text
    assert final["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": "length"}
    assert final["prfaas"]["decode_worker"] == "d" and final["id"] == "chatcmpl-r"
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    # It had ended before its stream did: nothing is left to cancel.
    assert not request.scope.cancel_called


@pytest.mark.trio
async def test_an_error_mid_stream_is_an_error_event() -> None:
    request = placed_handle()
    request.outbox.put("par")
    request.outbox.close(None, UpstreamFailed("prefill on p failed"))
    data = await events("completion", request, echo_text="ABC")
    texts = [msgspec.json.decode(d) for d in data]
    assert [t["choices"][0]["text"] for t in texts[:2]] == ["ABC", "par"]
    assert texts[2] == {"error": {"message": "prefill on p failed", "type": "upstream_error",
                                  "param": None, "code": None}}


@pytest.mark.trio
async def test_whole_bodies_carry_usage_and_placement() -> None:
    body = Responder("completion", placed_handle(), "m").whole("ok", DONE)
    decoded = msgspec.json.decode(msgspec.json.encode(body))
    assert decoded["object"] == "text_completion" and decoded["choices"][0]["text"] == "ok"
    assert decoded["usage"]["completion_tokens"] == 2 and decoded["prfaas"]["cluster"] == "pd"
    chat = msgspec.json.decode(msgspec.json.encode(
        Responder("chat", placed_handle(), "m").whole("ok", DONE)))
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ok"}


@pytest.mark.trio
async def test_a_client_leaving_mid_stream_cancels_its_running_request() -> None:
    request = placed_handle()
    request.outbox.put("hi")
    chunks = stream("completion", request)
    assert b'"text":"hi"' in await chunks.__anext__()
    await chunks.aclose()  # what the HTTP server does when its client goes
    assert request.scope.cancel_called


@pytest.mark.trio
async def test_a_stream_ends_when_its_end_comes_right_behind_its_last_text() -> None:
    # The stream waits for a change in the request's outbox; the last text and the end come
    # together, while it waits: it takes the text, and must then see the end, not wait again.
    request = placed_handle()
    request.outbox.put("a")
    chunks: list[bytes] = []

    async def read() -> None:
        async for chunk in stream("completion", request):
            chunks.append(chunk)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            assert len(chunks) == 1  # "a", and the stream waits
            request.outbox.put("b")
            request.outbox.close(DONE)
    assert chunks[-1] == b"data: [DONE]\n\n"
    assert b'"text":"b"' in chunks[1] and b'"finish_reason":"length"' in chunks[2]
