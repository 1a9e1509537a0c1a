"""A request's handle and outbox: text as the client takes it, the result, the error, ids."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from router_fakes import DONE, placed_handle

from services.router.errors import UpstreamFailed
from services.router.requests import Delta, RequestIds


@pytest.mark.trio
async def test_text_accumulates_until_taken_then_the_result(
        autojump_clock: trio.testing.MockClock) -> None:
    request = placed_handle()
    request.outbox.put("a")
    request.outbox.put("")  # nothing to wake the reader for
    request.outbox.put("b")
    assert await request.__anext__() == "ab"

    async def writer() -> None:
        await trio.sleep(1.0)
        request.outbox.put("c")
        request.outbox.close(DONE)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        text, result = await request.collect()
    assert (text, result) == ("c", DONE) and request.result == DONE


@pytest.mark.trio
async def test_a_failed_request_raises_its_error_after_its_text() -> None:
    request = placed_handle()
    request.outbox.put("partial")
    request.outbox.close(None, UpstreamFailed("decode on d failed"))
    assert await request.__anext__() == "partial"
    with pytest.raises(UpstreamFailed, match="decode on d failed"):
        await request.__anext__()
    request.cancel()
    assert request.scope.cancel_called


def test_request_ids_are_unique_and_differ_between_routers() -> None:
    one, two = RequestIds(), RequestIds()
    ids = [one.next() for _ in range(100)]
    assert len(set(ids)) == 100 and ids[0].startswith("req-") and ids[0].endswith("-1")
    assert two.next() != ids[0]


@pytest.mark.trio
async def test_tokens_without_text_wait_for_the_next_text() -> None:
    request = placed_handle()
    request.outbox.put(Delta("", 1))  # half a character: nothing to send yet
    assert request.poll_delta() is None
    request.outbox.put(Delta("\u00e9", 1))
    taken = request.poll_delta()
    assert taken is not None and (taken.text, taken.tokens) == ("\u00e9", 2)
    request.outbox.put(Delta("", 1))  # an end-of-text token: no text, ever
    request.outbox.close(DONE)
    assert request.done
    with pytest.raises(StopAsyncIteration):
        await request.next_delta()
    assert request.finish() == Delta("", 1) and request.result == DONE


@pytest.mark.trio
async def test_release_cancels_a_running_request_and_leaves_an_ended_one_alone() -> None:
    running, ended = placed_handle(), placed_handle()
    ended.outbox.close(DONE)
    running.release()
    ended.release()
    assert running.scope.cancel_called and not ended.scope.cancel_called
