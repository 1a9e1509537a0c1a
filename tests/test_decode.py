"""Decode worker on the in-memory mesh: split prefill + transfer + batched decode equals one
process, bit for bit in the imported cache, for every family; second turns reuse the held
prefix; broken, foreign and late KV fail one request with an explicit error; role switching;
readers that leave.

The workers load the noticing models of tests/kv_exact.py (greedy output varies and depends on
the cache), and the mutation tests perturb one KV byte or one state element after import and
watch each exactness check fail, for all four families."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.errors import RemoteError
from mesh.topology import parse_topology
from services.cli.launch import in_process
from services.cli.send import drive_request
from services.contract import prefix as prefix_module
from services.contract.errors import KVStalled
from services.contract.messages import (
    DecodeRequest,
    KVChunk,
    KVOpen,
    PrefillRequest,
    SetRole,
    StatusQuery,
    TokenChunk,
    WorkerState,
)
from services.contract.sampling import Sampling
from services.model.cache import RequestCache
from services.model.config import kv_bytes_split
from services.model.export import KVPiece, export_layer, merge_pieces
from services.router.errors import UpstreamFailed
from services.router.runner import drive
from services.worker import decode as decode_module
from services.worker import engine as engine_module
from services.worker.decode import DecodeWorker, joined_slice
from services.worker.kv_in import KVAssembly, kv_arrival
from services.worker.service import WorkerService, checkpoint_path
from tests.kv_exact import (
    ALL_FAMILIES,
    MUTATIONS,
    Mutation,
    assert_model_notices,
    cache_bytes,
    noticing_config,
    one_process_cache,
    write_checkpoint,
)
from tests.kv_exact import reference as noticing_reference

MAX = 12
LONG = 64
SAMPLING = Sampling(max_tokens=MAX, stop_on_eos=False)
SAMPLING_LONG = Sampling(max_tokens=LONG, stop_on_eos=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("noticing")
    return {family: write_checkpoint(family, root) for family in ALL_FAMILIES}


Topo = Callable[..., str]


@pytest.fixture
def topo(checkpoints: dict[str, Path]) -> Topo:
    def text(family: str = "kimi-linear", other: str = "kimi-linear") -> str:
        return topology_text(checkpoints, family, other)
    return text


def worker_options(checkpoints: Mapping[str, Path], family: str) -> str:
    return (f'options = {{ family = "{family}", size = "tiny", '
            f'checkpoint = "{checkpoints[family]}" }}')


def topology_text(checkpoints: Mapping[str, Path], family: str, other: str) -> str:
    return f"""
[[clusters]]
name = "prfaas"
kind = "prfaas"
{worker_options(checkpoints, family)}
[[clusters]]
name = "pd"
kind = "pd"
{worker_options(checkpoints, family)}
[[services]]
name = "p"
kind = "prefill"
cluster = "prfaas"
port = 1
options = {{ connections = 2 }}
[[services]]
name = "q"
kind = "prefill"
cluster = "pd"
port = 2
[[services]]
name = "d"
kind = "decode"
cluster = "pd"
port = 3
[[services]]
name = "x"
kind = "prefill"
cluster = "prfaas"
port = 4
{worker_options(checkpoints, other)}
"""


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13) % 500 + 1 for i in range(n)]


def reference(family: str, prompt: list[int], n: int = MAX) -> list[int]:
    return noticing_reference(family, prompt, n)


def decoder(mesh: object, name: str = "d") -> DecodeWorker:
    service = mesh.services[name]  # type: ignore[attr-defined]
    assert isinstance(service, WorkerService)
    return service.decode


@dataclass
class Imported:
    """One import on the decode worker: its base, the raw pieces, the cache it decodes from."""

    base: RequestCache | None
    pieces: dict[tuple[int, int], bytes]
    cache: RequestCache


@dataclass
class Imports:
    mutation: Mutation | None = None
    seen: list[Imported] = field(default_factory=list)


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[Imports]:
    """Records every import of the decode worker (and applies `mutation` to the result)."""
    record = Imports()
    # The real model's engine imports a stream's pieces (services/worker/engine.py).
    real = engine_module.import_pieces

    def recording(cfg: object, dtype: str, base: RequestCache | None,
                  pieces: Mapping[tuple[int, int], bytes]) -> RequestCache:
        kept = None if base is None else base.clone(keep_snapshots=False)
        cache = real(cfg, dtype, base, pieces)  # type: ignore[arg-type]
        if record.mutation is not None:
            record.mutation(cache)
        record.seen.append(Imported(kept, dict(pieces), cache.clone(keep_snapshots=False)))
        return cache

    monkeypatch.setattr(engine_module, "import_pieces", recording)
    yield record


def sent_payloads(pieces: Mapping[tuple[int, int], bytes]) -> dict[int, bytes]:
    by_layer: dict[int, list[KVPiece]] = {}
    for layer, start in sorted(pieces):
        by_layer.setdefault(layer, []).append(KVPiece.from_bytes(pieces[layer, start]))
    return {layer: bytes(merge_pieces(group).payload if len(group) > 1 else group[0].payload)
            for layer, group in by_layer.items()}


def assert_import_is_exact(imported: Imported, start: int) -> None:
    """Bit for bit: the imported cache holds the base's first `start` tokens of full-attention
    KV and then exactly the bytes that were sent (KV of [start, end) and the end states)."""
    cache = imported.cache
    sent = sent_payloads(imported.pieces)
    assert sorted(sent) == list(range(cache.cfg.n_layers))
    for layer in range(cache.cfg.n_layers):
        assert bytes(export_layer(cache, layer, start).payload) == sent[layer], layer
        if start and cache.cfg.layer_kinds[layer] in ("mla", "gqa"):
            assert imported.base is not None
            held = export_layer(cache, layer, 0, start).payload
            assert held == export_layer(imported.base, layer, 0, start).payload, layer


async def split_scenario(topo: Topo, family: str, prompt: list[int]) -> tuple[object, object]:
    async with in_process(parse_topology(topo(family)), ["p", "d"]) as mesh:
        async with mesh.client() as client:
            with trio.fail_after(60):
                result = await drive_request(client, prompt, prefill_worker="p",
                                             decode_worker="d", request_id="r",
                                             sampling=SAMPLING_LONG, connections=2)
        decode = decoder(mesh)
        decode.check_integrity()
        return result, decode.statistics()


def check_split(family: str, prompt: list[int], outcome: tuple[object, object],
                imports: Imports) -> None:
    result, stats = outcome
    assert len(imports.seen) == 1
    assert cache_bytes(imports.seen[0].cache) == cache_bytes(one_process_cache(family, prompt))
    assert_import_is_exact(imports.seen[0], 0)
    assert result.tokens == reference(family, prompt, LONG)  # type: ignore[attr-defined]
    assert result.finish_reason == "length"  # type: ignore[attr-defined]
    prefill = result.prefill  # type: ignore[attr-defined]
    assert prefill.lanes == 2 and prefill.computed_tokens == 150
    assert (stats.finished, stats.failed, stats.kv_bytes_in) == (  # type: ignore[attr-defined]
        1, 0, prefill.kv_bytes)


@pytest.mark.trio
@pytest.mark.parametrize("family", ALL_FAMILIES)
async def test_split_request_equals_one_process_generation(
    topo: Topo, imports: Imports, family: str
) -> None:
    prompt = tokens(150)
    assert_model_notices(family, prompt, LONG)
    check_split(family, prompt, await split_scenario(topo, family, prompt), imports)


@pytest.mark.trio
async def test_chunked_prefill_streams_equal_one_process_generation(topo: Topo) -> None:
    prompt = tokens(200)
    async with in_process(parse_topology(topo()), ["p", "d"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            result = await drive_request(client, prompt, prefill_worker="p", decode_worker="d",
                                         request_id="chunky", sampling=SAMPLING,
                                         connections=2, chunk_tokens=64)
    assert result.tokens == reference("kimi-linear", prompt)
    assert (result.prefill.chunks, result.prefill.pieces) == (4, 4 + 3)


async def second_turn_scenario(topo: Topo, family: str) -> tuple[object, ...]:
    first = tokens(150)
    async with in_process(parse_topology(topo(family)), ["p", "d"]) as mesh:
        async with mesh.client() as client:
            with trio.fail_after(60):
                one = await drive_request(client, first, prefill_worker="p", decode_worker="d",
                                          request_id="t1", sampling=SAMPLING_LONG)
                second = first + one.tokens + tokens(40, 3)
                two = await drive_request(client, second, prefill_worker="p",
                                          decode_worker="d", request_id="t2",
                                          sampling=SAMPLING_LONG, decode_has=HELD)
        stats = decoder(mesh).statistics()
    return one, two, second, stats


# The decode worker keeps the prompt and all generated tokens but the last (its KV is never
# computed): 150 + 63 tokens, so 3 whole blocks.
HELD = (150 + LONG - 1) // 64 * 64


def check_second_turn(family: str, outcome: tuple[object, ...], imports: Imports) -> None:
    _, two, second, stats = outcome
    fixed, per_token = kv_bytes_split(noticing_config(family), "float32")
    assert len(imports.seen) == 2
    assert_import_is_exact(imports.seen[0], 0)
    assert_import_is_exact(imports.seen[1], HELD)
    assert two.tokens == reference(family, second, LONG)  # type: ignore[attr-defined]
    prefill = two.prefill  # type: ignore[attr-defined]
    assert prefill.reused_tokens == 128  # the prefill worker resumed from its own cache
    assert prefill.sent_from_token == HELD == 192
    # S_kv of the incremental part, from the config: the new tokens' KV and the end states;
    # the worker's count adds each piece's header.
    incremental = fixed + per_token * (len(second) - HELD)  # type: ignore[arg-type]
    assert sum(map(len, sent_payloads(imports.seen[1].pieces).values())) == incremental
    assert incremental < prefill.kv_bytes < 1.05 * incremental
    assert stats.reused_tokens == HELD  # type: ignore[attr-defined]


@pytest.mark.trio
@pytest.mark.parametrize("family", ALL_FAMILIES)
async def test_second_turn_sends_only_the_new_tokens_kv(
    topo: Topo, imports: Imports, family: str
) -> None:
    outcome = await second_turn_scenario(topo, family)
    assert_model_notices(family, outcome[2], LONG)  # type: ignore[arg-type]
    check_second_turn(family, outcome, imports)


@pytest.mark.trio
@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("family", ALL_FAMILIES)
async def test_exactness_checks_fail_when_the_imported_kv_is_perturbed(
    topo: Topo, imports: Imports, family: str, mutation: str
) -> None:
    """Mutation check: one flipped KV byte or one changed state element after import makes
    both exactness tests above fail."""
    imports.mutation = MUTATIONS[mutation]
    prompt = tokens(150)
    split = await split_scenario(topo, family, prompt)
    with pytest.raises(AssertionError):
        check_split(family, prompt, split, imports)
    imports.seen.clear()
    second = await second_turn_scenario(topo, family)
    with pytest.raises(AssertionError):
        check_second_turn(family, second, imports)


def counts_of(service: WorkerService) -> tuple[int, int]:
    """(queue_depth, running) as the worker's statistics count them."""
    prefill, decode = service.prefill.statistics(), service.decode.statistics()
    return prefill.queue_depth + decode.waiting, prefill.running + decode.running


@pytest.mark.trio
async def test_concurrent_requests_share_the_batch(topo: Topo) -> None:
    """Also: a worker's status (`state`, read at every poll) counts what its statistics do."""
    prompts = [tokens(70 + 40 * i, i) for i in range(3)]
    results: dict[int, list[int]] = {}
    seen: set[tuple[int, int]] = set()
    async with in_process(parse_topology(topo()), ["p", "q", "d"]) as mesh:

        async def watch() -> None:
            while True:
                for name in "pqd":
                    service = mesh.services[name]
                    assert isinstance(service, WorkerService)
                    state = service.state()
                    assert (state.queue_depth, state.running) == counts_of(service)
                    seen.add(counts_of(service))
                await trio.sleep(0.001)

        async with mesh.client() as client, anyio.create_task_group() as watching:
            watching.start_soon(watch)
            async with anyio.create_task_group() as tg:

                async def one(i: int) -> None:
                    result = await drive_request(client, prompts[i],
                                                 prefill_worker="pq"[i % 2],
                                                 decode_worker="d", request_id=f"c{i}",
                                                 sampling=SAMPLING)
                    results[i] = result.tokens

                with trio.fail_after(60):
                    for i in range(3):
                        tg.start_soon(one, i)
            watching.cancel_scope.cancel()
        stats = decoder(mesh).statistics()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference("kimi-linear", prompt)
    assert stats.finished == 3
    assert stats.steps < 3 * (MAX - 1)  # some steps decoded more than one request
    assert any(running for _, running in seen) and any(queued for queued, _ in seen)
    # The worker times the real engine's steps: each step's batch and the tokens it held.
    # Every request makes its first token in the prefill and MAX - 1 here, one a step.
    assert stats.step_sequences == 3 * (MAX - 1) and stats.step_seconds > 0
    lengths = sum(len(p) for p in prompts)
    assert lengths * 1 <= stats.step_context_tokens <= (lengths + 3 * MAX) * MAX


@pytest.mark.trio
async def test_a_whole_answer_comes_as_its_first_token_then_the_rest(
    topo: Topo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """incremental=False: the first token at once, the others together at the finish (or
    every HELD_TOKENS); the same tokens as a step-by-step stream."""
    prompt = tokens(90)
    seen: dict[str, list[TokenChunk]] = {"each": [], "whole": [], "held": []}
    async with in_process(parse_topology(topo()), ["p", "d"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            for kind in seen:
                if kind == "held":
                    monkeypatch.setattr(decode_module, "HELD_TOKENS", 5)
                result = await drive_request(
                    client, prompt, prefill_worker="p", decode_worker="d",
                    request_id=f"whole-{kind}", sampling=SAMPLING,
                    incremental=kind == "each", on_chunk=seen[kind].append)
                assert result.tokens == reference("kimi-linear", prompt)
    shapes = {kind: [(c.index, len(c.tokens), c.finish_reason) for c in chunks]
              for kind, chunks in seen.items()}
    assert shapes["each"] == [(i, 1, None) for i in range(MAX - 1)] + [(MAX - 1, 1, "length")]
    assert shapes["whole"] == [(0, 1, None), (1, MAX - 1, "length")]
    assert shapes["held"] == [(0, 1, None), (1, 5, None), (6, 5, None), (11, 1, "length")]


@pytest.mark.trio
async def test_kv_for_another_model_is_refused_with_a_clear_error(topo: Topo) -> None:
    topology = parse_topology(topo("kimi-linear", "qwen-next"))
    async with in_process(topology, ["x", "d"]) as mesh, mesh.client() as client:
        with trio.fail_after(60), pytest.raises(UpstreamFailed, match="decode on d") as failed:
            await drive_request(client, tokens(80), prefill_worker="x", decode_worker="d",
                                request_id="wrong", sampling=SAMPLING)
        failure = failed.value.__cause__
        assert isinstance(failure, RemoteError) and failure.error == "KVTransferError"
        assert "config_hash" in failure.detail and "qwen-next" in failure.detail
        assert decoder(mesh).statistics().failed == 1


async def cut_stream(client: object, request_id: str, pieces_sent: int) -> None:
    """A fake prefill worker that opens a lane, sends some pieces, then breaks off."""
    cfg = noticing_config("kimi-linear")
    opening = KVOpen(request_id=request_id, family=cfg.family, config_hash=cfg.config_hash(),
                     dtype="float32", start=0, end=80, pieces=cfg.n_layers)
    with pytest.raises(RuntimeError, match="prefill died"):
        async with client.stream_to("d", opening) as sink:  # type: ignore[attr-defined]
            for layer in range(pieces_sent):
                await sink.send(KVChunk(request_id=request_id, layer=layer, start=0,
                                      data=memoryview(b"\0" * 64)))
            raise RuntimeError("prefill died")


@pytest.mark.trio
async def test_a_stream_cut_mid_way_fails_that_request_and_others_go_on(topo: Topo) -> None:
    async with in_process(parse_topology(topo()), ["p", "d"]) as mesh:
        async with mesh.client() as client, mesh.client("fake-prefill") as fake:
            request = DecodeRequest(request_id="cut", prompt=tokens(80), sampling=SAMPLING)
            with trio.fail_after(30):
                async with client.open_stream("d", request) as stream:
                    await cut_stream(fake, "cut", 2)
                    with pytest.raises(RemoteError) as failure:
                        async for _ in stream:
                            pass
                good = await drive_request(client, tokens(80), prefill_worker="p",
                                           decode_worker="d", request_id="after",
                                           sampling=SAMPLING)
        decoder(mesh).check_integrity()
    assert failure.value.error == "KVTransferError"
    assert "cut off after 2 of 5 items" in failure.value.detail
    assert good.tokens == reference("kimi-linear", tokens(80))


@pytest.mark.trio
async def test_no_kv_within_kv_timeout_fails_the_request(
    autojump_clock: trio.testing.MockClock, topo: Topo,
) -> None:
    async with in_process(parse_topology(topo()), ["d"]) as mesh, \
            mesh.client() as client:
        request = DecodeRequest(request_id="late", prompt=tokens(80), kv_timeout=30.0)
        start = trio.current_time()
        with pytest.raises(RemoteError) as failure:
            async with client.open_stream("d", request, timeout=100) as stream:
                async for _ in stream:
                    pass
        assert failure.value.error == "KVTransferError"
        assert "within kv_timeout=30.0 s" in failure.value.detail
        assert 30.0 <= trio.current_time() - start < 31.0


@pytest.mark.trio
async def test_pd_worker_switches_role_after_draining(topo: Topo) -> None:
    async with in_process(parse_topology(topo()), ["p", "q", "d"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            with pytest.raises(RemoteError) as wrong:
                async with client.open_stream("q", DecodeRequest(
                        request_id="w", prompt=tokens(70))) as stream:
                    async for _ in stream:
                        pass
            assert wrong.value.error == "WrongRole" and "holds role prefill" in wrong.value.detail
            state = await client.call("q", SetRole(role="decode"), WorkerState)
            assert (state.role, state.draining) == ("decode", False)
            result = await drive_request(client, tokens(70), prefill_worker="p",
                                         decode_worker="q", request_id="now-decode",
                                         sampling=SAMPLING)
            assert result.tokens == reference("kimi-linear", tokens(70))
            with pytest.raises(RemoteError, match="only PD-cluster workers switch roles"):
                await client.call("p", SetRole(role="decode"), WorkerState)
            status = await client.call("p", StatusQuery(), WorkerState)
    assert (status.role, status.model.family, status.model.vocab_size) == (
        "prefill", "kimi-linear", 512)


@pytest.mark.trio
async def test_a_reader_that_leaves_frees_its_batch_slot(topo: Topo) -> None:
    long = Sampling(max_tokens=400, stop_on_eos=False)
    async with in_process(parse_topology(topo()), ["p", "d"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            request = DecodeRequest(request_id="bye", prompt=tokens(70), sampling=long)
            async with client.open_stream("d", request) as stream, \
                    anyio.create_task_group() as tg:
                tg.start_soon(drive_prefill_only, client, tokens(70), long)
                seen = [chunk async for chunk, _ in zip_chunks(stream, 3)]
            decode = decoder(mesh)
            await decode.wait_idle()
            decode.check_integrity()
    assert [c.index for c in seen] == [0, 1, 2]
    assert decode.statistics().running == 0
    # It left the batch within a few steps of its reader, not at its 400th token.
    assert decode.statistics().tokens < 100


@pytest.mark.trio
async def test_a_request_bringing_its_chain_is_hashed_only_past_it(
    topo: Topo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router sends its lookup's chain with the prompt: the prefill worker hashes none of
    it again (it checks the last block), the decode worker only the output's blocks, and both
    keep the chains hashing everything would give."""
    prompt = tokens(150)
    chain = prefix_module.block_hashes(prompt, 64)
    hashed: list[int] = []
    keyed = prefix_module._keyed

    def counted(data: bytes | memoryview, prev: int, person: bytes) -> int:
        hashed.append(len(data))
        return keyed(data, prev, person)

    monkeypatch.setattr(prefix_module, "_keyed", counted)
    out: list[int] = []

    def take(chunk: TokenChunk) -> str | None:
        out.extend(chunk.tokens)
        return chunk.finish_reason

    async with in_process(parse_topology(topo()), ["p", "d"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            await drive(client, "p", PrefillRequest(
                request_id="h", prompt=prompt, decode_worker="d", sampling=SAMPLING_LONG,
                hashes=chain), "d", DecodeRequest(
                request_id="h", prompt=prompt, sampling=SAMPLING_LONG, hashes=chain),
                timeout=60.0, on_chunk=take)
        kept = {name: mesh.services[name].report().runs[0].hashes  # type: ignore[attr-defined]
                for name in ("p", "d")}
    # Two checks of the last given block, one block of output: (150 + 63) // 64 = 3 blocks.
    assert len(hashed) == 3
    assert kept["p"] == chain
    assert kept["d"] == prefix_module.block_hashes((prompt + out)[:HELD], 64)


@settings(max_examples=200, deadline=None)
@given(first=st.lists(st.integers(0, 9), max_size=12), second=st.lists(st.integers(0, 9),
       max_size=12), data=st.data())
def test_a_slice_of_two_lists_is_the_slice_of_them_joined(first: list[int], second: list[int],
                                                          data: st.DataObject) -> None:
    """What _keep hashes of a finished request (its prompt's last blocks and its output, up
    to the cache's length, which may stop short of the last token)."""
    end = data.draw(st.integers(0, len(first) + len(second) + 2))
    start = data.draw(st.integers(0, end))
    assert joined_slice(first, second, start, end) == (first + second)[start:end]


async def drive_prefill_only(client: object, prompt: list[int], sampling: Sampling) -> None:
    from services.contract.messages import PrefillDone, PrefillRequest

    await client.call("p", PrefillRequest(  # type: ignore[attr-defined]
        request_id="bye", prompt=prompt, decode_worker="d", sampling=sampling), PrefillDone)


async def zip_chunks(stream: object, n: int):  # type: ignore[no-untyped-def]
    count = 0
    async for chunk in stream:  # type: ignore[attr-defined]
        assert isinstance(chunk, TokenChunk)
        yield chunk, count
        count += 1
        if count == n:
            return


def test_checkpoint_choice() -> None:
    assert checkpoint_path("none", "kimi-linear", "default") is None
    assert checkpoint_path("auto", "kimi-linear", "tiny") is None
    assert checkpoint_path("auto", "mimo", "default") is None
    assert checkpoint_path("/x/w.safetensors", "mimo", "tiny") == Path("/x/w.safetensors")


# The stall bound of KV that crosses a link (DecodeRequest.kv_stall).


def stall_opening(lane: int) -> KVOpen:
    return KVOpen(request_id="r", family="f", config_hash="0", dtype="float32", start=0,
                  end=8, pieces=4, lane=lane, lanes=2)


async def arrival_after(assembly: KVAssembly, kv_stall: float,
                        deadline: float = math.inf) -> tuple[str, float]:
    """How `kv_arrival` ended ("whole", "stalled", "not whole" at its deadline, or "still
    waiting" after 20 s, when a cancel scope ends the wait) and when."""
    request = DecodeRequest(request_id="r", prompt=[1] * 8, kv_stall=kv_stall)
    with anyio.move_on_after(20.0):
        try:
            await kv_arrival(request, assembly, deadline)
        except KVStalled:
            return "stalled", anyio.current_time()
        return "whole" if assembly.finished else "not whole", anyio.current_time()
    return "still waiting", anyio.current_time()


@pytest.mark.trio
async def test_kv_that_stops_arriving_stalls_after_the_bound_from_its_last_piece(
        autojump_clock: trio.testing.MockClock) -> None:
    assembly = KVAssembly("r", anyio.current_time())

    async def lanes() -> None:
        await anyio.sleep(5.0)  # queued at the prefill worker: not a stall
        assembly.open_lane(stall_opening(0))
        for start in range(3):
            await anyio.sleep(0.8)  # pieces closer than the bound
            assembly.add(KVChunk(request_id="r", layer=0, start=start,
                                 data=memoryview(b"kv")))

    async with anyio.create_task_group() as group:
        group.start_soon(lanes)
        how, when = await arrival_after(assembly, 1.0)
    assert how == "stalled" and when == pytest.approx(5.0 + 3 * 0.8 + 1.0)


@pytest.mark.trio
async def test_kv_that_keeps_arriving_or_never_starts_does_not_stall(
        autojump_clock: trio.testing.MockClock) -> None:
    assembly = KVAssembly("r", anyio.current_time())

    async def lanes() -> None:
        for lane in range(2):
            await anyio.sleep(0.9)
            assembly.open_lane(stall_opening(lane))
            await anyio.sleep(0.9)
            assembly.first_token = 3
            assembly.close_lane(lane)

    async with anyio.create_task_group() as group:
        group.start_soon(lanes)
        assert (await arrival_after(assembly, 1.0))[0] == "whole"
    never = KVAssembly("r", anyio.current_time())
    assert (await arrival_after(never, 1.0))[0] == "still waiting"


@pytest.mark.trio
@pytest.mark.parametrize("kv_stall", [0.0, 0.5, 1.0, 3.0])
async def test_kv_arrival_ends_at_its_deadline_not_whole_and_not_stalled(
        autojump_clock: trio.testing.MockClock, kv_stall: float) -> None:
    """The deadline (the request's kv_timeout) ends the wait with the KV not whole, and is
    not taken for a stall even where the stall bound falls on it; a lane that closes wakes
    the waiter at once, before either bound."""
    start = anyio.current_time()
    assembly = KVAssembly("r", start)

    async def lanes() -> None:
        await anyio.sleep(1.0)
        assembly.open_lane(stall_opening(0))  # lane 1 never opens: never whole

    async with anyio.create_task_group() as group:
        group.start_soon(lanes)
        how, when = await arrival_after(assembly, kv_stall, start + 2.0)
    expected = ("stalled", start + 1.0 + kv_stall) if 0 < kv_stall < 1.0 else (
        "not whole", start + 2.0)
    assert (how, when) == expected
    begun = anyio.current_time()
    woken = KVAssembly("r", begun)

    async def both_lanes() -> None:
        for lane in range(2):
            await anyio.sleep(0.25)
            woken.open_lane(stall_opening(lane))
            woken.first_token = 3
            woken.close_lane(lane)

    async with anyio.create_task_group() as group:
        group.start_soon(both_lanes)
        how, when = await arrival_after(woken, kv_stall, begun + 10.0)
    assert how == "whole" and when == pytest.approx(begun + 0.5)
