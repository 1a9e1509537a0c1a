"""One request's run on virtual time: cancelling, a failing prefill, stop strings.

Over the fake-but-honest mesh of tests/router_fakes.py, through the scheduler that owns the
runner.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import trio
import trio.testing
from router_fakes import fake_mesh, fake_token, generation

from services.contract.events import RequestDone
from services.router.errors import UpstreamFailed


@pytest.mark.trio
async def test_cancelling_frees_the_request_at_the_decode_worker(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        handle = await mesh.scheduler.submit(generation(range(1, 30), max_tokens=50))
        first = await handle.__anext__()
        assert first
        handle.cancel()
        with pytest.raises(UpstreamFailed, match="cancelled"):
            await handle.collect()
        await anyio.sleep(1.0)
        decode = mesh.workers["pd-decode-0"]
        assert decode.aborted == [handle.placement.request_id] and not decode.finished
        stats = mesh.scheduler.statistics()
        assert (stats.cancelled, stats.inflight) == (1, 0)
        mesh.scheduler.check_integrity()
        done = [e for e in await mesh.take_events() if isinstance(e, RequestDone)]
        assert [(d.ok, d.error) for d in done] == [(False, "cancelled")]
        _, result = await (await mesh.scheduler.submit(generation(range(1, 30)))).collect()
        assert result.finish_reason == "length"


@pytest.mark.trio
async def test_a_failing_prefill_fails_only_its_request(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        mesh.workers["pd-prefill-0"].fail_prefill = True
        handle = await mesh.scheduler.submit(generation(range(1, 30)))
        with pytest.raises(UpstreamFailed) as failed:
            await handle.collect()
        assert failed.value.status == 502
        assert "prefill on pd-prefill-0 failed" in failed.value.message
        assert "told to fail" in failed.value.message
        await anyio.sleep(1.0)
        assert mesh.workers["pd-decode-0"].aborted == [handle.placement.request_id]
        mesh.workers["pd-prefill-0"].fail_prefill = False
        _, result = await (await mesh.scheduler.submit(generation(range(1, 30)))).collect()
        assert result.completion_tokens == 4
        stats = mesh.scheduler.statistics()
        assert (stats.failed, stats.completed) == (1, 1)
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_a_stop_string_ends_generation_and_frees_the_decode_worker(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        prompt = list(range(1, 30))
        full = "".join(chr(fake_token(prompt, i) - 1) for i in range(40))
        stop = full[10:12]
        handle = await mesh.scheduler.submit(generation(prompt, max_tokens=40, stop=[stop]))
        text, result = await handle.collect()
        assert text == full[:full.index(stop)] and result.finish_reason == "stop"
        assert result.completion_tokens < 40
        await anyio.sleep(1.0)
        assert mesh.workers["pd-decode-0"].aborted == [handle.placement.request_id]


@pytest.mark.trio
async def test_only_a_whole_answer_without_stop_strings_asks_for_its_tokens_at_the_end(
        autojump_clock: trio.testing.MockClock) -> None:
    # A stop string is matched on the router's text, token by token; a stream shows each.
    async with fake_mesh() as mesh:
        kinds = {"whole": generation(range(1, 30)),
                 "stop": generation(range(1, 30), stop=["zz"]),
                 "stream": msgspec.structs.replace(generation(range(1, 30)), stream=True)}
        for request in kinds.values():
            await (await mesh.scheduler.submit(request)).collect()
        decodes = mesh.workers["pd-decode-0"].decodes
        assert [d.incremental for d in decodes] == [False, True, True]


@pytest.mark.trio
async def test_a_request_that_ends_at_its_workers_finish_reason_aborts_nothing(
        autojump_clock: trio.testing.MockClock) -> None:
    # The decode stream is read to its end: no Abort for a stream the worker has finished
    # (it would cancel the worker's work after its last token, or arrive as a stray frame).
    async with fake_mesh() as mesh:
        handle = await mesh.scheduler.submit(generation(range(1, 30), max_tokens=5))
        _, result = await handle.collect()
        assert result.finish_reason == "length"
        await anyio.sleep(1.0)
        decode = mesh.workers["pd-decode-0"]
        assert decode.finished == [handle.placement.request_id] and decode.aborted == []
        assert decode.node.statistics().stray_frames == 0
