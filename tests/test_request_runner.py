"""One request's run on virtual time: cancelling, a failing prefill, stop strings, and
migration (a broken prefill continued in the other cluster, the limit, what breakage
migrates where, a seeded request's stream, a hung worker declared lost after `silence_s`).

Over the fake-but-honest mesh of tests/router_fakes.py, through the scheduler that owns the
runner.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch
import trio
import trio.testing
from router_fakes import (
    BLOCK,
    TWO_DECODERS,
    FakeMesh,
    Timing,
    fake_mesh,
    fake_token,
    generation,
    placed_handle,
)

from mesh.errors import DeadlineExceeded, PeerGone, RemoteError, StreamAborted
from services.contract.events import RequestDone, RequestMigrated
from services.contract.messages import PrefillRequest
from services.contract.sampling import Sampling
from services.model.sampling import RequestSampler
from services.model.tokenizer import ByteTokenizer
from services.router.config import LinkEnds, SchedulerConfig
from services.router.errors import DataPathBroken, UpstreamFailed
from services.router.runner import breakage, continued
from services.worker.request_checks import sampling_params


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


# Migration (services/router/runner.py); over real processes: tests/test_migration.py.


@pytest.mark.trio
async def test_a_broken_prefill_moves_to_the_other_cluster_and_the_request_completes(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        mesh.workers["pd-prefill-0"].break_prefill = True
        handle = await mesh.scheduler.submit(generation(range(1, 30)))
        _, result = await handle.collect()
        assert (result.completion_tokens, result.prompt_tokens) == (4, 29)
        assert handle.placement.prefill_worker == "prfaas-prefill-0"
        assert handle.placement.attempt == 1
        [moved] = [e for e in await mesh.take_events() if isinstance(e, RequestMigrated)]
        assert (moved.reason, moved.failed_worker, moved.prefill_worker, moved.cluster,
                moved.tokens_kept) == ("prefill_lost", "pd-prefill-0", "prfaas-prefill-0",
                                       "prfaas", 0)
        # The workers knew the attempts apart; the decode stream of the first was let go.
        ids = [d.request_id for d in mesh.workers["pd-decode-0"].decodes]
        assert ids == [handle.placement.request_id, f"{handle.placement.request_id}.m1"]
        stats = mesh.scheduler.statistics()
        assert stats.migrations == {"prefill_lost": 1} and stats.completed == 1
        assert stats.migrations_resumed == 1
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_a_worker_whose_connection_broke_is_down_until_it_answers_again(
        autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_mesh() as mesh:
        node = mesh.scheduler.node
        call = node.call

        async def dropped(target: str, message: object, *args: object, **kwargs: object
                          ) -> object:
            # The prefill call's connection breaks; status polls still answer.
            if target == "pd-prefill-0" and isinstance(message, PrefillRequest):
                raise PeerGone("connection to pd-prefill-0 closed")
            return await call(target, message, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(node, "call", dropped)
        handle = await mesh.scheduler.submit(generation(range(1, 30)))
        _, result = await handle.collect()
        assert result.completion_tokens == 4
        assert handle.placement.prefill_worker == "prfaas-prefill-0"
        view = {w.name: w for w in mesh.scheduler.workers.statistics().workers}
        assert not view["pd-prefill-0"].up and view["prfaas-prefill-0"].up
        monkeypatch.undo()
        await mesh.control.tick()
        assert {w.name: w for w in mesh.scheduler.workers.statistics().workers}[
            "pd-prefill-0"].up
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_a_request_broken_past_its_migration_limit_fails_explicitly(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, connections=2, migration_limit=1)
    async with fake_mesh(config=config) as mesh:
        for name in ("pd-prefill-0", "prfaas-prefill-0"):
            mesh.workers[name].break_prefill = True
        handle = await mesh.scheduler.submit(generation(range(1, 30)))
        with pytest.raises(UpstreamFailed, match="migrated 1 times, migration_limit=1"):
            await handle.collect()
        stats = mesh.scheduler.statistics()
        assert (stats.migrations, stats.migrations_gave_up, stats.failed) == (
            {"prefill_lost": 1}, 1, 1)
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_with_migration_off_a_broken_prefill_fails_its_request(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, connections=2, migration_limit=0)
    async with fake_mesh(config=config) as mesh:
        mesh.workers["pd-prefill-0"].break_prefill = True
        with pytest.raises(UpstreamFailed, match="told to break"):
            await (await mesh.scheduler.submit(generation(range(1, 30)))).collect()
        assert mesh.scheduler.statistics().migrations == {}


def broken(prefill: Exception | None, decode: Exception | None) -> DataPathBroken:
    return DataPathBroken("broke", prefill=prefill, decode=decode)


@pytest.mark.trio
async def test_breakage_reads_what_each_side_met() -> None:
    p = placed_handle().placement
    gone, remote = PeerGone("connection reset"), RemoteError
    cases = [
        ((remote("p", "KVTransferError", "lanes cut"), gone), ("decode_lost", "d", True)),
        ((None, remote("d", "KVStalled", "no progress")), ("kv_stalled", "p", False)),
        ((gone, remote("d", "KVTransferError", "lane cut")), ("prefill_lost", "p", True)),
        ((remote("p", "KVTransferError", "x"), remote("d", "KVTransferError", "x")),
         ("kv_cut", "p", False)),
        ((None, StreamAborted("aborted")), ("decode_lost", "d", False)),
        ((remote("p", "WrongRole", "draining"), None), ("prefill_lost", "p", False)),
        # Errors of the request itself, or of its deadline, end it.
        ((remote("p", "RequestError", "prompt too long"), None), None),
        ((None, DeadlineExceeded("deadline")), None),
        ((gone, remote("d", "RuntimeError", "a bug")), None),
    ]
    for (prefill, decode), expected in cases:
        assert breakage(broken(prefill, decode), p) == expected, (prefill, decode)


def test_a_continued_seeded_request_keeps_its_place_in_the_seeds_stream() -> None:
    sampling = Sampling(max_tokens=10, temperature=0.8, seed=1234, min_tokens=3)
    after = continued(sampling, 4)
    assert (after.max_tokens, after.min_tokens) == (6, 0)
    params = sampling_params(sampling)
    first = RequestSampler(params)
    second = RequestSampler(msgspec.structs.replace(params, seed=after.seed))
    for i in range(3):
        a, b = first.generator_for(4 + i), second.generator_for(i)
        assert a is not None and b is not None
        assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert continued(sampling, 0) is sampling
    assert continued(Sampling(max_tokens=5), 2).seed is None


@pytest.mark.trio
async def test_a_request_prefills_in_the_other_cluster_while_its_own_has_no_worker(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        mesh.scheduler.workers.lost("pd-prefill-0")
        handle = await mesh.scheduler.submit(generation(range(1, 30)))
        _, result = await handle.collect()
        assert result.completion_tokens == 4
        assert (handle.placement.cluster, handle.placement.prefill_worker) == (
            "prfaas", "prfaas-prefill-0")
        assert "no pd prefill worker serves" in handle.placement.decision.reason
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_a_link_that_stalls_moves_the_requests_waiting_for_kv_over_it_to_pd(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, connections=2, kv_stall_s=2.0,
                             links=(LinkEnds("", "prfaas", "pd"),))
    async with fake_mesh("prfaas", {"threshold": 100.0}, config=config) as mesh:
        mesh.set_link(bandwidth_bps=1000)  # the KV of a long prompt: minutes on the wire
        started = anyio.current_time()
        handle = await mesh.scheduler.submit(generation(range(1, 900)))
        assert handle.placement.cluster == "prfaas"
        # The router's ticks: once its PrfaaS worker has been held a whole estimator window
        # with nothing delivered, the link is known to carry nothing, and its queued bytes
        # are past the bound.
        for _ in range(15):
            await anyio.sleep(1.0)
            await mesh.control.tick()
            if handle.placement.cluster == "pd":
                break
        _, result = await handle.collect()
        assert result.completion_tokens == 4 and anyio.current_time() - started < 20.0
        assert (handle.placement.cluster, handle.placement.attempt) == ("pd", 1)
        [moved] = [e for e in await mesh.take_events() if isinstance(e, RequestMigrated)]
        assert (moved.reason, moved.prefill_worker) == ("kv_stalled", "pd-prefill-0")
        # The link takes no new offload while it is held.
        again = await mesh.scheduler.submit(generation(range(2, 900)))
        assert again.placement.cluster == "pd"
        await again.collect()
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_a_link_that_goes_down_moves_the_requests_waiting_for_kv_over_it_to_pd(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, connections=2, kv_stall_s=2.0)
    async with fake_mesh("prfaas", {"threshold": 100.0}, config=config) as mesh:
        handle = await mesh.scheduler.submit(generation(range(1, 900)))
        mesh.set_link(up=False)
        await anyio.sleep(0.001)
        await mesh.control.tick()
        _, result = await handle.collect()
        assert result.completion_tokens == 4
        assert (handle.placement.cluster, handle.placement.attempt) == ("pd", 1)
        assert mesh.scheduler.statistics().migrations == {"kv_stalled": 1}
        mesh.scheduler.check_integrity()


# A hung worker (alive, silent: SIGSTOP); over real processes: tests/test_migration.py.

SILENCE_S = 3.0
SILENT = SchedulerConfig(block_size=BLOCK, connections=2, silence_s=SILENCE_S)
STATUS_TIMEOUT_S = 2.0  # the control loop's default (services/router/control.py)


async def polling(mesh: FakeMesh) -> None:
    """The control loop's status polls, every second (a worker that does not answer is
    down), without its policy ticks."""
    while True:
        await mesh.scheduler.workers.poll(mesh.scheduler.node, STATUS_TIMEOUT_S, BLOCK)
        await anyio.sleep(1.0)


def migrations(events: list[object]) -> list[RequestMigrated]:
    return [e for e in events if isinstance(e, RequestMigrated)]


@pytest.mark.trio
async def test_a_decode_worker_that_hangs_mid_stream_is_lost_and_rejoins_when_it_wakes(
        autojump_clock: trio.testing.MockClock) -> None:
    prompt, max_tokens = list(range(1, 30)), 40
    async with fake_mesh(config=SILENT, topology_text=TWO_DECODERS) as mesh, \
            anyio.create_task_group() as group:
        group.start_soon(polling, mesh)
        handle = await mesh.scheduler.submit(generation(prompt, max_tokens))
        streamed = await handle.next_delta()
        while streamed.tokens < 5:
            streamed += await handle.next_delta()
        frozen = handle.placement.decode_worker
        mesh.workers[frozen].freeze()
        frozen_at = anyio.current_time()
        delta, result = await handle.collect_delta()
        [moved] = migrations(await mesh.take_events())
        assert (moved.reason, moved.failed_worker) == ("decode_lost", frozen)
        # Noticed within a poll, its timeout and the silence bound (plus one watch period).
        assert moved.ts - frozen_at <= 1.0 + STATUS_TIMEOUT_S + SILENCE_S * 1.2
        # No token repeated or missing: the client got the first attempt's tokens up to the
        # break, then the second attempt's, which continued from exactly those.
        kept = moved.tokens_kept
        first = [fake_token(prompt, i) for i in range(kept)]
        second = [fake_token(prompt + first, i) for i in range(max_tokens - kept)]
        other = handle.placement.decode_worker
        assert other != frozen and mesh.workers[other].decodes[-1].prompt == prompt + first
        assert result.completion_tokens == max_tokens == streamed.tokens + delta.tokens
        assert streamed.text + delta.text == ByteTokenizer().decode(first + second)
        # The frozen worker's stream was given up; once it wakes it answers and takes work.
        assert mesh.workers[frozen].aborted == [f"{handle.placement.request_id}"]
        assert frozen in mesh.scheduler.workers.down()
        mesh.workers[frozen].thaw()
        await anyio.sleep(1.0 + STATUS_TIMEOUT_S)
        assert frozen not in mesh.scheduler.workers.down()
        mesh.scheduler.workers.lost(other)  # the woken worker is the only decode worker
        again = await mesh.scheduler.submit(generation(prompt, 3))
        assert again.placement.decode_worker == frozen
        assert (await again.collect())[1].completion_tokens == 3
        assert mesh.scheduler.statistics().migrations == {"decode_lost": 1}
        mesh.scheduler.check_integrity()
        group.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_prefill_worker_that_hangs_is_lost_and_its_request_prefills_elsewhere(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh(config=SILENT) as mesh, anyio.create_task_group() as group:
        mesh.workers["pd-prefill-0"].freeze()
        started = anyio.current_time()
        # Placed before a poll has seen it silent.
        handle = await mesh.scheduler.submit(generation(range(1, 30)))
        assert handle.placement.prefill_worker == "pd-prefill-0"
        group.start_soon(polling, mesh)
        _, result = await handle.collect()
        assert result.completion_tokens == 4
        assert handle.placement.prefill_worker == "prfaas-prefill-0"
        [moved] = migrations(await mesh.take_events())
        assert (moved.reason, moved.failed_worker) == ("prefill_lost", "pd-prefill-0")
        assert moved.ts - started <= STATUS_TIMEOUT_S + SILENCE_S * 1.2
        mesh.scheduler.check_integrity()
        group.cancel_scope.cancel()


@pytest.mark.trio
async def test_a_slow_worker_that_answers_or_streams_is_not_declared_lost(
        autojump_clock: trio.testing.MockClock) -> None:
    # A prefill of 29 tokens takes 14.5 s on a worker that answers its polls; then a decode
    # worker that answers no poll streams a token every 0.5 s: neither is silent.
    timing = Timing(pd_s_per_token=0.5, decode_step_s=0.5)
    async with fake_mesh(config=SILENT, timing=timing) as mesh, \
            anyio.create_task_group() as group:
        group.start_soon(polling, mesh)
        handle = await mesh.scheduler.submit(generation(range(1, 30), max_tokens=20))
        await handle.next_delta()
        mesh.workers["pd-decode-0"].hung = True
        _, result = await handle.collect()
        assert anyio.current_time() > SILENCE_S * 3
        assert "pd-decode-0" in mesh.scheduler.workers.down()
        assert (result.completion_tokens, handle.placement.attempt) == (20, 0)
        assert mesh.scheduler.statistics().migrations == {}
        group.cancel_scope.cancel()
