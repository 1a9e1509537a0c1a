"""The scheduler on virtual time: admission, cache-aware placement, decisions and their reasons.

Over the fake-but-honest mesh of tests/router_fakes.py.
"""

from __future__ import annotations

import anyio
import msgspec
import pytest
import trio
import trio.testing
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from router_fakes import BLOCK, FakeMesh, decisions, fake_mesh, fake_token, generation

from services.contract.events import RequestDone, RoutingDecision
from services.contract.messages import PrefixPull
from services.contract.prefix import block_hashes
from services.contract.tracing import Tracer
from services.router.config import SchedulerConfig
from services.router.errors import NoWorkerAvailable, QueueFull


@pytest.mark.trio
async def test_one_request_streams_tokens_and_reports_everything(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        prompt = list(range(1, 41))
        handle = await mesh.scheduler.submit(generation(prompt, max_tokens=5))
        text, result = await handle.collect()
        expected = "".join(chr(fake_token(prompt, i) - 1) for i in range(5))
        assert text == expected
        assert result.finish_reason == "length"
        assert (result.prompt_tokens, result.completion_tokens) == (40, 5)
        events = await mesh.take_events()
        [decision] = decisions(events)
        assert decision.request_id == handle.placement.request_id
        assert (decision.cluster, decision.prefill_worker, decision.decode_worker) == (
            "pd", "pd-prefill-0", "pd-decode-0")
        assert decision.total_len == 40 and decision.incremental_len == 40
        assert decision.threshold == 19400.0 and "PD prefill" in decision.reason
        [done] = [e for e in events if isinstance(e, RequestDone)]
        assert done.ok and done.output_tokens == 5 and done.ttft_s > 0
        assert done.tpot_s == pytest.approx(mesh.timing.decode_step_s, rel=0.01)
        mesh.scheduler.check_integrity()
        assert mesh.scheduler.statistics().completed == 1


async def one_request_to_its_end(mesh: FakeMesh) -> tuple[RoutingDecision, RequestDone]:
    """Runs a 40-token request to its end: its routing decision and its RequestDone event."""
    handle = await mesh.scheduler.submit(generation(range(1, 41)))
    await handle.collect()
    await trio.testing.wait_all_tasks_blocked()
    events = await mesh.take_events()
    [decision] = decisions(events)
    [done] = [e for e in events if isinstance(e, RequestDone)]
    return decision, done


@pytest.mark.trio
async def test_a_traced_requests_dashboard_events_name_its_trace(
        autojump_clock: trio.testing.MockClock) -> None:
    # The dashboard's timeline shows the events' trace id: the one its spans were exported in.
    spans = InMemorySpanExporter()
    async with fake_mesh(tracer=Tracer("router", spans, batch=False)) as mesh:
        decision, done = await one_request_to_its_end(mesh)
    [request] = [s for s in spans.get_finished_spans() if s.name == "request"]
    assert request.attributes is not None
    assert request.attributes["gen_ai.request.id"] == decision.request_id == done.request_id
    assert decision.trace_id == done.trace_id == f"{request.context.trace_id:032x}"
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {
        request.context.trace_id}
    # The workers' messages carry the attempt span's traceparent: their spans' parent.
    [attempt] = [s for s in spans.get_finished_spans() if s.name == "attempt 0"]
    ctx = attempt.context
    carried = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    [prefill] = mesh.workers["pd-prefill-0"].prefills
    [decode] = mesh.workers["pd-decode-0"].decodes
    assert prefill.trace == decode.trace == carried


@pytest.mark.trio
async def test_untraced_the_messages_and_events_carry_no_trace(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        assert mesh.scheduler.tracer is None
        decision, done = await one_request_to_its_end(mesh)
    assert decision.trace_id == done.trace_id == ""
    assert [m.trace for m in mesh.workers["pd-prefill-0"].prefills] == [""]
    assert [m.trace for m in mesh.workers["pd-decode-0"].decodes] == [""]


@pytest.mark.trio
async def test_long_prompts_offload_and_short_ones_stay(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        short = await mesh.scheduler.submit(generation(range(1, 50)))
        long = await mesh.scheduler.submit(generation(range(1, 300)))
        await short.collect()
        await long.collect()
        by_id = {d.request_id: d for d in decisions(await mesh.take_events())}
        assert by_id[short.placement.request_id].cluster == "pd"
        offloaded = by_id[long.placement.request_id]
        assert offloaded.cluster == "prfaas" and offloaded.prefill_worker == "prfaas-prefill-0"
        assert "> t = 100" in offloaded.reason
        [prefill] = mesh.workers["prfaas-prefill-0"].prefills
        assert prefill.connections == 2 and prefill.decode_worker == "pd-decode-0"
        assert mesh.workers["pd-prefill-0"].prefills[0].connections == 1
        # The lookup's chain goes with the prompt: the blocks below its last token (298 // 16).
        chain = block_hashes(list(range(1, 300)), BLOCK)[:18]
        assert prefill.hashes == chain and len(chain) == 18
        assert [d.hashes for d in mesh.workers["pd-decode-0"].decodes
                if len(d.prompt) == 299] == [chain]


@pytest.mark.trio
@pytest.mark.parametrize("in_process", [False, True])
async def test_second_turn_sees_the_cached_prefix_and_sends_only_the_rest(
        autojump_clock: trio.testing.MockClock, in_process: bool) -> None:
    """Also with the cache directory asked in process (the simulation's path): the same
    decisions, and no lookup call over the mesh (only the two prefill calls)."""
    # Scarce bandwidth: each cluster's cache counts alone (no cross-cluster cache transfer).
    async with fake_mesh("prfaas", {"threshold": 100.0, "prefix_rule": "scarce"},
                         directory_in_process=in_process) as mesh:
        first = list(range(1, 201))
        handle = await mesh.scheduler.submit(generation(first, max_tokens=8))
        answer, _ = await handle.collect()
        await anyio.sleep(1.0)  # the user reads; the workers' cache reports land meanwhile
        second = first + [ord(c) + 1 for c in answer] + list(range(60, 90))
        handle2 = await mesh.scheduler.submit(generation(second))
        _, result = await handle2.collect()
        one, two = decisions(await mesh.take_events())
        assert one.cached_prfaas == one.cached_pd == 0
        assert two.cluster == "prfaas" and two.total_len == len(second)
        # The PrfaaS worker resumes from its whole first prompt's full blocks.
        assert two.cached_prfaas == 192
        assert result.cached_tokens == 192
        # The decode worker held the first turn (prompt + answer): only the rest crossed.
        assert handle2.placement.decode_has_tokens == 208
        decode = mesh.workers["pd-decode-0"]
        assert decode.kv_bytes[handle2.placement.request_id] == len(second) - 208
        assert mesh.scheduler.node.statistics().calls_out == (2 if in_process else 4)


@pytest.mark.trio
async def test_the_abundant_rule_pulls_the_other_clusters_cache_to_the_compute_worker(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, connections=2)
    async with fake_mesh("prfaas", {"threshold": 100.0, "prefix_rule": "auto"},
                         config=config) as mesh:
        first = list(range(1, 201))
        answer, _ = await (await mesh.scheduler.submit(generation(first, max_tokens=8))
                           ).collect()
        await anyio.sleep(1.0)
        second = first + [ord(c) + 1 for c in answer] + list(range(60, 90))
        handle = await mesh.scheduler.submit(generation(second))
        await handle.collect()
        one, two = decisions(await mesh.take_events())
        assert one.cluster == "prfaas" and handle.placement.cluster == "pd"
        # Calm link: the 192 tokens cached in PrfaaS count (l = 46 <= t), so PD prefills
        # and fetches them from the PrfaaS worker first, striped over the link's lanes.
        assert (two.cluster, two.incremental_len, two.cached_prfaas) == ("pd", 46, 192)
        assert not two.bandwidth_scarce and "pull 192 cached tokens from prfaas" in two.reason
        assert handle.placement.pull == PrefixPull(holder="prfaas-prefill-0", tokens=192,
                                                   connections=2)


@pytest.mark.trio
async def test_queue_full_and_no_worker_are_refused_before_starting(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, max_inflight=2)
    async with fake_mesh(config=config) as mesh:
        handles = [await mesh.scheduler.submit(generation(range(1, 20))) for _ in range(2)]
        with pytest.raises(QueueFull) as full:
            await mesh.scheduler.submit(generation(range(1, 20)))
        assert full.value.status == 429 and "max_inflight=2" in full.value.message
        for handle in handles:
            await handle.collect()
        outcomes: list[str] = []

        async def one() -> None:
            try:
                await (await mesh.scheduler.submit(generation(range(1, 20)))).collect()
                outcomes.append("done")
            except QueueFull:
                outcomes.append("full")

        # Submitted at once, all placing (awaiting the cache directory) together.
        async with anyio.create_task_group() as group:
            for _ in range(5):
                group.start_soon(one)
        assert sorted(outcomes) == ["done", "done", "full", "full", "full"]
        assert mesh.scheduler.policy.statistics().finished == 4
        mesh.workers["pd-decode-0"].hung = True
        await mesh.control.tick()
        with pytest.raises(NoWorkerAvailable) as none:
            await mesh.scheduler.submit(generation(range(1, 20)))
        assert none.value.status == 503 and "decode" in none.value.message
        assert mesh.scheduler.statistics().rejected_no_worker == 1
        view = {w.name: w for w in mesh.scheduler.workers.statistics().workers}
        assert not view["pd-decode-0"].up and view["pd-prefill-0"].up



@pytest.mark.trio
async def test_an_unreachable_cache_directory_means_uncached_not_failed(
        autojump_clock: trio.testing.MockClock) -> None:
    config = SchedulerConfig(block_size=BLOCK, cachedir="no-such-cachedir")
    async with fake_mesh(config=config) as mesh:
        _, result = await (await mesh.scheduler.submit(generation(range(1, 40)))).collect()
        assert result.finish_reason == "length"
        assert mesh.scheduler.statistics().lookup_failures == 1




@pytest.mark.trio
async def test_admission_follows_what_the_decode_workers_can_hold(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        decode = mesh.workers["pd-decode-0"]
        said = msgspec.structs.replace(decode.state(), max_streams=2)
        decode.state = lambda: said  # type: ignore[method-assign]
        assert mesh.scheduler.statistics().admission_limit == 64  # nothing said yet
        await mesh.control.tick()
        assert mesh.scheduler.statistics().admission_limit == 2
        handles = [await mesh.scheduler.submit(generation(range(1, 20))) for _ in range(2)]
        with pytest.raises(QueueFull) as full:
            await mesh.scheduler.submit(generation(range(1, 20)))
        assert full.value.headers() == {"Retry-After": "1"}
        assert "decode capacity 2" in full.value.message
        for handle in handles:
            await handle.collect()
        await (await mesh.scheduler.submit(generation(range(1, 20)))).collect()
        assert mesh.scheduler.statistics().rejected_full == 1
        mesh.scheduler.check_integrity()


@pytest.mark.trio
async def test_the_counted_prefix_stays_below_the_last_token(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh() as mesh:
        prompt = list(range(1, 2 * BLOCK + 1))  # two whole blocks
        await (await mesh.scheduler.submit(generation(prompt))).collect()
        await anyio.sleep(1.0)  # the cache reports land
        again = await mesh.scheduler.submit(generation(prompt))
        await again.collect()
        assert again.placement.decode_has_tokens == BLOCK
        _, two = decisions(await mesh.take_events())
        assert two.cached_pd == BLOCK and two.incremental_len == BLOCK
