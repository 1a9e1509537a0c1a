"""Prefill worker: the streamed pieces equal a one-process export, striped over lanes; only
the uncached suffix is computed; only what the decode side lacks is sent; the stream overlaps
the compute; bad requests name the bad value."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch
import trio

from mesh.errors import RemoteError
from mesh.mailbox import Mailbox
from mesh.node import Node
from mesh.server import Context
from mesh.topology import parse_topology
from services.cli.launch import InProcessMesh, in_process
from services.contract.messages import (
    KVAccepted,
    KVChunk,
    KVClose,
    KVOpen,
    PrefillDone,
    PrefillRequest,
)
from services.contract.sampling import Sampling
from services.model.cache import RequestCache
from services.model.config import family_config
from services.model.export import KVPiece, import_cache
from services.model.generate import prefill
from services.model.model import HybridLM, build_model
from services.worker.engine import Emit, PrefillJob, expected_kv_bytes
from services.worker.service import WorkerService
from tests.prompts import tokens

TOPOLOGY = parse_topology("""
[[clusters]]
name = "prfaas"
kind = "prfaas"
options = { family = "kimi-linear", size = "tiny", checkpoint = "none", profile = "h200" }
[[services]]
name = "p"
kind = "prefill"
cluster = "prfaas"
port = 1
options = { connections = 3 }
[[services]]
name = "d"
kind = "recorder"
port = 2
""")


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return build_model(family_config("kimi-linear", "tiny"), seed=0)


class Upload(msgspec.Struct):
    opening: KVOpen
    items: list[msgspec.Struct]
    arrivals: list[float]
    over: bool = False  # the sender ended or aborted the lane


def recorder(mesh: InProcessMesh) -> tuple[Node, list[Upload]]:
    """A stand-in decode worker that keeps every upload lane it is sent."""
    uploads: list[Upload] = []
    node = Node("d", mesh.client().codec, mesh.transport, TOPOLOGY.address)

    @node.accepts_stream(KVOpen)
    async def on_kv(opening: KVOpen, items: Mailbox[msgspec.Struct], ctx: Context) -> KVAccepted:
        upload = Upload(opening, [], [])
        uploads.append(upload)
        try:
            async for item in items:
                upload.items.append(item)
                upload.arrivals.append(anyio.current_time())
        finally:
            upload.over = True
        return KVAccepted(request_id=opening.request_id, lane=opening.lane,
                          pieces=len(upload.items), bytes=0)

    return node, uploads


async def run_prefill(request: PrefillRequest, mode: str = "live", time_scale: float = 1.0,
                      repeat: tuple[PrefillRequest, ...] = ()) -> tuple[
                          list[PrefillDone], list[Upload], float]:
    async with in_process(TOPOLOGY, ["p"], mode=mode, time_scale=time_scale) as mesh:  # type: ignore[arg-type]
        node, uploads = recorder(mesh)
        async with node, mesh.client() as client:
            await node.listen()
            started = anyio.current_time()
            with trio.fail_after(60):
                done = [await client.call("p", r, PrefillDone) for r in (request, *repeat)]
        service = mesh.services["p"]
        assert isinstance(service, WorkerService)
        service.prefill.check_integrity()
    return done, uploads, started


def pieces_of(uploads: list[Upload], request_id: str) -> dict[int, KVPiece]:
    return {item.layer: KVPiece.from_bytes(item.data)
            for upload in uploads if upload.opening.request_id == request_id
            for item in upload.items if isinstance(item, KVChunk)}


def assert_caches_close(got: RequestCache, want: RequestCache) -> None:
    assert got.length == want.length
    for a, b in zip(got.layers, want.layers, strict=True):
        for name in ("buffers", "state", "conv_tail", "k", "v"):
            x, y = getattr(a, name, None), getattr(b, name, None)
            if name == "buffers" and x is not None:
                x = [t[:, : got.length] for t in x]
                y = [t[:, : want.length] for t in y]
                for t, u in zip(x, y, strict=True):
                    torch.testing.assert_close(t, u, rtol=1e-4, atol=1e-4)
            elif x is not None:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.trio
async def test_pieces_equal_a_one_process_export_striped_over_lanes(model: HybridLM) -> None:
    prompt = tokens(150)
    request = PrefillRequest(request_id="r", prompt=prompt, decode_worker="d", connections=3)
    (done,), uploads, _ = await run_prefill(request)
    reference = prefill(model, prompt)
    lanes = sorted(uploads, key=lambda u: u.opening.lane)
    assert [u.opening.lane for u in lanes] == [0, 1, 2]
    for upload in lanes:
        layers = [i.layer for i in upload.items if isinstance(i, KVChunk)]
        assert layers == list(range(upload.opening.lane, 4, 3))
        assert upload.opening.pieces == len(layers)
        assert (upload.opening.start, upload.opening.end) == (0, 150)
    assert lanes[0].items[-1] == KVClose(request_id="r", first_token=int(
        reference.logits.argmax()))
    pieces = pieces_of(uploads, "r")
    assert_caches_close(import_cache(model.cfg, pieces.values()), reference.cache)
    assert done.kv_bytes == sum(len(p.to_bytes()) for p in pieces.values())
    assert (done.pieces, done.lanes, done.first_token) == (4, 3, lanes[0].items[-1].first_token)


@pytest.mark.trio
async def test_only_the_decode_sides_missing_kv_is_sent(model: HybridLM) -> None:
    prompt = tokens(150)
    request = PrefillRequest(request_id="r", prompt=prompt, decode_worker="d",
                             decode_has_tokens=64)
    (done,), uploads, _ = await run_prefill(request)
    pieces = pieces_of(uploads, "r")
    starts = {p.header.kind: p.header.start for p in pieces.values()}
    assert starts == {"full_attn": 64, "linear_state": 150}
    payload = sum(p.header.payload_bytes for p in pieces.values())
    assert payload == expected_kv_bytes(model.cfg, 150, 64, "float32")
    assert done.sent_from_token == 64
    base = prefill(model, prompt[:64]).cache
    rebuilt = import_cache(model.cfg, pieces.values(), base=base)
    assert_caches_close(rebuilt, prefill(model, prompt).cache)


@pytest.mark.trio
async def test_a_shared_prefix_is_resumed_not_recomputed(model: HybridLM) -> None:
    first = PrefillRequest(request_id="a", prompt=tokens(140), decode_worker="d")
    longer = tokens(140)[:130] + tokens(60, 5)
    second = PrefillRequest(request_id="b", prompt=longer, decode_worker="d")
    (one, two), uploads, _ = await run_prefill(first, repeat=(second,))
    assert (one.reused_tokens, one.computed_tokens) == (0, 140)
    assert (two.reused_tokens, two.computed_tokens) == (128, 190 - 128)
    rebuilt = import_cache(model.cfg, pieces_of(uploads, "b").values())
    assert_caches_close(rebuilt, prefill(model, longer).cache)


@pytest.mark.trio
async def test_pieces_leave_while_layers_compute_unless_told_to_wait() -> None:
    prompt = tokens(100)
    # The process's first bf16 prefill takes about 0.15 s (kernel set-up), as long as the
    # modeled compute below: warm up first, so the real compute stays ahead of the pacing.
    await run_prefill(PrefillRequest(request_id="warm", prompt=prompt, decode_worker="d"))
    results = {}
    for overlap in (True, False):
        request = PrefillRequest(request_id="o", prompt=prompt, decode_worker="d",
                                 overlap=overlap)
        # Emulated H200 pacing: about 0.2 s of modeled compute, spread over the 4 layers.
        (done,), uploads, started = await run_prefill(request, "emulated", 0.5)
        first_arrival = min(t for u in uploads for t in u.arrivals) - started
        results[overlap] = (first_arrival, done)
    overlapped, held = results[True], results[False]
    assert overlapped[1].compute_s > 0.15
    assert overlapped[0] < 0.6 * overlapped[1].compute_s
    assert held[0] >= 0.9 * held[1].compute_s


@pytest.mark.trio
async def test_a_compute_that_fails_sends_no_close() -> None:
    """A compute that breaks after its first piece: the caller gets its error, and no lane
    carries a KVClose, so the decode side never takes the cut stream for a whole one (it
    counts the pieces missing)."""
    request = PrefillRequest(request_id="f", prompt=tokens(100), decode_worker="d",
                             connections=2)
    async with in_process(TOPOLOGY, ["p"]) as mesh:
        service = mesh.services["p"]
        assert isinstance(service, WorkerService)
        engine = service.prefill._compute.engine
        compute = engine.compute_prefill

        def fail_after_one_piece(job: PrefillJob, emit: Emit, snapshot_every: int) -> int:
            def emit_once(step: int, chunk: KVChunk) -> None:
                if step > 0:
                    raise RuntimeError("the compute broke")
                emit(step, chunk)
            return compute(job, emit_once, snapshot_every)

        engine.compute_prefill = fail_after_one_piece  # type: ignore[method-assign]
        node, uploads = recorder(mesh)
        async with node, mesh.client() as client:
            await node.listen()
            with trio.fail_after(60), pytest.raises(RemoteError) as failure:
                await client.call("p", request, PrefillDone)
            # Both lanes are over at once: aborted, not left open until their deadline.
            with trio.fail_after(5):
                while len(uploads) < 2 or not all(u.over for u in uploads):
                    await trio.sleep(0.01)
        service.prefill.check_integrity()
    assert "the compute broke" in failure.value.detail
    assert sorted(u.opening.lane for u in uploads) == [0, 1]
    assert [type(i) for u in uploads for i in u.items] == [KVChunk]


@pytest.mark.trio
@pytest.mark.parametrize(("change", "message"), [
    ({"decode_has_tokens": 10}, "decode_has_tokens must be a multiple of 64 in [0, 100), got 10"),
    ({"connections": 4}, "connections must be in [1, 3], got 4"),
    ({"prompt": [1, 600]}, "prompt token ids must be in [0, 512), got 600"),
    ({"prompt": []}, "prompt must hold at least one token, got 0"),
    ({"sampling": Sampling(top_p=0.0)}, "top_p must be in (0, 1], got 0.0"),
    ({"hashes": [1]}, "hashes: hashes[0] is not the hash of block 0 of the tokens"),
    ({"hashes": [1, 2]}, "hashes must name at most the 1 full blocks of 100 tokens, got 2"),
])
async def test_bad_requests_name_the_value(change: dict[str, object], message: str) -> None:
    request = msgspec.structs.replace(
        PrefillRequest(request_id="bad", prompt=tokens(100), decode_worker="d"), **change)
    with pytest.raises(RemoteError) as failure:
        await run_prefill(request)
    assert message in failure.value.detail


@pytest.mark.trio
async def test_an_idle_worker_gives_its_compute_memory_back() -> None:
    async with in_process(TOPOLOGY, ["p"]) as mesh:
        service = mesh.services["p"]
        assert isinstance(service, WorkerService)
        engine = service.prefill._compute.engine
        releases: list[int] = []

        def release_memory() -> None:
            releases.append(service.prefill.busy)

        engine.release_memory = release_memory  # type: ignore[method-assign]
        node, _ = recorder(mesh)
        async with node, mesh.client() as client:
            await node.listen()

            async def one(name: str) -> None:
                request = PrefillRequest(request_id=name, prompt=tokens(100), decode_worker="d")
                await client.call("p", request, PrefillDone)

            with trio.fail_after(60):
                await one("alone")
                assert releases == [0]
                async with trio.open_nursery() as nursery:
                    for name in ("x", "y", "z"):
                        nursery.start_soon(one, name)
    # Only once nothing was queued or running: not after each of three requests sent at once.
    assert 2 <= len(releases) < 4 and set(releases) == {0}
