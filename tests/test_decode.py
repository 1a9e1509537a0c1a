"""Decode worker on the in-memory mesh: split prefill + transfer + batched decode equals one
process; second turns reuse the held prefix; broken, foreign and late KV fail one request with
an explicit error; role switching; readers that leave."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import trio
import trio.testing

from mesh.errors import RemoteError
from mesh.topology import parse_topology
from services.cli.launch import in_process
from services.cli.send import drive_request
from services.contract.messages import (
    DecodeRequest,
    KVChunk,
    KVOpen,
    Sampling,
    SetRole,
    StatusQuery,
    TokenChunk,
    WorkerState,
)
from services.model.config import family_config
from services.model.generate import generate
from services.model.model import HybridLM, build_model
from services.worker.decode import DecodeWorker
from services.worker.service import WorkerService, checkpoint_path

MAX = 12
SAMPLING = Sampling(max_tokens=MAX, stop_on_eos=False)


def topology_text(family: str = "kimi-linear", other: str = "kimi-linear") -> str:
    worker = 'options = {{ family = "{}", size = "tiny", checkpoint = "none" }}'
    return f"""
[[clusters]]
name = "prfaas"
kind = "prfaas"
{worker.format(family)}
[[clusters]]
name = "pd"
kind = "pd"
{worker.format(family)}
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
options = {{ family = "{other}" }}
"""


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13) % 500 + 1 for i in range(n)]


_models: dict[str, HybridLM] = {}


def reference(family: str, prompt: list[int], n: int = MAX) -> list[int]:
    if family not in _models:
        _models[family] = build_model(family_config(family, "tiny"), seed=0)
    return generate(_models[family], prompt, n, stop_on_eos=False).tokens


def decoder(mesh: object, name: str = "d") -> DecodeWorker:
    service = mesh.services[name]  # type: ignore[attr-defined]
    assert isinstance(service, WorkerService)
    return service.decode


@pytest.mark.trio
@pytest.mark.parametrize("family", ["kimi-linear", "qwen-next"])
async def test_split_request_equals_one_process_generation(family: str) -> None:
    prompt = tokens(150)
    async with in_process(parse_topology(topology_text(family)), ["p", "d"]) as mesh:
        async with mesh.client() as client:
            with trio.fail_after(60):
                result = await drive_request(client, prompt, prefill_worker="p",
                                             decode_worker="d", request_id="r",
                                             sampling=SAMPLING, connections=2)
        decode = decoder(mesh)
        decode.check_integrity()
        stats = decode.statistics()
    assert result.tokens == reference(family, prompt)
    assert result.finish_reason == "length"
    assert result.prefill.lanes == 2 and result.prefill.computed_tokens == 150
    assert (stats.finished, stats.failed, stats.kv_bytes_in) == (1, 0, result.prefill.kv_bytes)


@pytest.mark.trio
async def test_chunked_prefill_streams_equal_one_process_generation() -> None:
    prompt = tokens(200)
    async with in_process(parse_topology(topology_text()), ["p", "d"]) as mesh, \
            mesh.client() as client:
        with trio.fail_after(60):
            result = await drive_request(client, prompt, prefill_worker="p", decode_worker="d",
                                         request_id="chunky", sampling=SAMPLING,
                                         connections=2, chunk_tokens=64)
    assert result.tokens == reference("kimi-linear", prompt)
    assert (result.prefill.chunks, result.prefill.pieces) == (4, 4 + 3)


@pytest.mark.trio
async def test_second_turn_sends_only_the_new_tokens_kv() -> None:
    first = tokens(150)
    async with in_process(parse_topology(topology_text()), ["p", "d"]) as mesh:
        async with mesh.client() as client:
            with trio.fail_after(60):
                one = await drive_request(client, first, prefill_worker="p", decode_worker="d",
                                          request_id="t1", sampling=SAMPLING)
                second = first + one.tokens + tokens(40, 3)
                held = (len(first) + MAX - 1) // 64 * 64
                two = await drive_request(client, second, prefill_worker="p",
                                          decode_worker="d", request_id="t2",
                                          sampling=SAMPLING, decode_has=held)
        stats = decoder(mesh).statistics()
    assert two.tokens == reference("kimi-linear", second)
    assert two.prefill.reused_tokens == 128  # the prefill worker resumed from its own cache
    assert two.prefill.sent_from_token == held == 128
    assert two.prefill.kv_bytes < one.prefill.kv_bytes
    assert stats.reused_tokens == held


@pytest.mark.trio
async def test_concurrent_requests_share_the_batch() -> None:
    prompts = [tokens(70 + 40 * i, i) for i in range(3)]
    results: dict[int, list[int]] = {}
    async with in_process(parse_topology(topology_text()), ["p", "q", "d"]) as mesh:
        async with mesh.client() as client, anyio.create_task_group() as tg:

            async def one(i: int) -> None:
                result = await drive_request(client, prompts[i], prefill_worker="pq"[i % 2],
                                             decode_worker="d", request_id=f"c{i}",
                                             sampling=SAMPLING)
                results[i] = result.tokens

            with trio.fail_after(60):
                for i in range(3):
                    tg.start_soon(one, i)
        stats = decoder(mesh).statistics()
    for i, prompt in enumerate(prompts):
        assert results[i] == reference("kimi-linear", prompt)
    assert stats.finished == 3
    assert stats.steps < 3 * (MAX - 1)  # some steps decoded more than one request


@pytest.mark.trio
async def test_kv_for_another_model_is_refused_with_a_clear_error() -> None:
    topology = parse_topology(topology_text("kimi-linear", "qwen-next"))
    async with in_process(topology, ["x", "d"]) as mesh, mesh.client() as client:
        with trio.fail_after(60), pytest.raises(RemoteError) as failure:
            await drive_request(client, tokens(80), prefill_worker="x", decode_worker="d",
                                request_id="wrong", sampling=SAMPLING)
        assert failure.value.error == "KVTransferError"
        assert "config_hash" in failure.value.detail and "qwen-next" in failure.value.detail
        assert decoder(mesh).statistics().failed == 1


async def cut_stream(client: object, request_id: str, pieces_sent: int) -> None:
    """A fake prefill worker that opens a lane, sends some pieces, then breaks off."""
    cfg = family_config("kimi-linear", "tiny")
    opening = KVOpen(request_id=request_id, family=cfg.family, config_hash=cfg.config_hash(),
                     dtype="float32", start=0, end=80, pieces=cfg.n_layers)
    with pytest.raises(RuntimeError, match="prefill died"):
        async with client.stream_to("d", opening) as sink:  # type: ignore[attr-defined]
            for layer in range(pieces_sent):
                await sink.send(KVChunk(request_id=request_id, layer=layer, start=0,
                                      data=b"\0" * 64))
            raise RuntimeError("prefill died")


@pytest.mark.trio
async def test_a_stream_cut_mid_way_fails_that_request_and_others_go_on() -> None:
    async with in_process(parse_topology(topology_text()), ["p", "d"]) as mesh:
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
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with in_process(parse_topology(topology_text()), ["d"]) as mesh, \
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
async def test_pd_worker_switches_role_after_draining() -> None:
    async with in_process(parse_topology(topology_text()), ["p", "q", "d"]) as mesh, \
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
async def test_a_reader_that_leaves_frees_its_batch_slot() -> None:
    long = Sampling(max_tokens=400, stop_on_eos=False)
    async with in_process(parse_topology(topology_text()), ["p", "d"]) as mesh, \
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
