"""The service messages: every one round-trips through the mesh codec, errors name values."""

from __future__ import annotations

import msgspec
import pytest

from mesh.wire import HEADER_SIZE, Call, Codec, Item
from services.contract.events import KVFlow
from services.contract.messages import (
    CODEC_MESSAGES,
    BlockRun,
    BlocksEvicted,
    BlocksStored,
    ClockQuery,
    ClockReading,
    ClusterMatch,
    DecodeRequest,
    Echo,
    KVAccepted,
    KVChunk,
    KVClose,
    KVOpen,
    ModelInfo,
    PlanQuery,
    PlanReply,
    PrefillDone,
    PrefillRequest,
    PrefixMatch,
    PrefixPushed,
    PrefixQuery,
    PrefixReply,
    PushPrefix,
    ReportCache,
    SetRole,
    StatusQuery,
    Subscribe,
    TokenChunk,
    TransferPlan,
    WorkerMatch,
    WorkerReport,
    WorkerState,
)
from services.contract.sampling import Sampling
from services.model.sampling import SamplingError
from services.worker.request_checks import sampling_params

INFO = ModelInfo(family="kimi-linear", size="tiny", config_hash="0123456789abcdef",
                 dtype="float32", vocab_size=512, block_size=64, eos_id=0,
                 source="random-init seed 0")
PLAN = TransferPlan(n_blocks=3, target_worker="d", target_held=1, target_resumable=0,
                    source_worker="p", source_held=3, cross_cluster=True, send=[1, 2],
                    states_needed=True)
MATCH = PrefixMatch(n_blocks=2, workers=[WorkerMatch("p", "prfaas", "prefill", 2, 1)],
                    clusters=[ClusterMatch("prfaas", 2, 1, "p")])

EXAMPLES: list[msgspec.Struct] = [
    PrefillRequest(request_id="r", prompt=[1, 2, 3], decode_worker="d", decode_has_tokens=64,
                   sampling=Sampling(max_tokens=5, temperature=0.5, seed=7), connections=2,
                   overlap=False, hashes=[5591920404487023243]),
    PrefillDone(request_id="r", worker="p", prompt_tokens=3, reused_tokens=0,
                computed_tokens=3, sent_from_token=0, kv_bytes=100, pieces=4, lanes=1, chunks=1,
                first_token=9, queue_s=0.0, compute_s=0.1, transfer_s=0.01, total_s=0.11),
    DecodeRequest(request_id="r", prompt=[1, 2], kv_timeout=5.0, hashes=[0, 2**63 - 1]),
    TokenChunk(request_id="r", tokens=[4], index=3, finish_reason="length",
               reused_tokens=64),
    KVOpen(request_id="r", family="kimi-linear", config_hash="ab", dtype="float32", start=0,
           end=3, pieces=2, lane=1, lanes=2),
    KVChunk(request_id="r", layer=3, start=64, data=b"\x00\x01" * 10),
    KVClose(request_id="r", first_token=9),
    KVAccepted(request_id="r", lane=0, pieces=2, bytes=40),
    PushPrefix(request_id="r/prefix", prompt=[1, 2], target="p", target_has_tokens=0,
               connections=2),
    PrefixPushed(request_id="r/prefix", worker="q", tokens=64, kv_bytes=1000, pieces=4,
                 lanes=2),
    SetRole(role="decode", reason="long-term loop"),
    StatusQuery(),
    WorkerState(name="w", cluster="pd", role="prefill", draining=True, queue_depth=1,
                running=0, cached_blocks=3, model=INFO),
    PlanQuery(hashes=[1, 2, 3], target_worker="d"),
    PlanReply(PLAN),
    PrefixQuery([5, 6], role="decode"),
    PrefixReply(MATCH),
    ReportCache(),
    BlocksStored("w", [BlockRun([1, 2], [1])]),
    BlocksEvicted("w", [2], snapshots_only=True),
    WorkerReport("w", "pd", "decode", [BlockRun([1], [])]),
    Subscribe(maxlen=8),
    ClockQuery(),
    ClockReading(now=12.5),
    Echo(text="hi", hops=2),
    KVFlow(ts=1.0, source="p", request_id="r", src="p", dst="d", via_link="link-0",
           phase="progress", layers_done=1, layers_total=4, bytes_done=10, bytes_total=40,
           incremental=False, tokens_sent=3),
]


def test_every_codec_message_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} >= set(CODEC_MESSAGES) - {
        t for t in CODEC_MESSAGES if t.__module__ == "services.contract.events"}


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_through_the_mesh_codec(message: msgspec.Struct) -> None:
    codec = Codec(CODEC_MESSAGES)
    frame = codec.encode(Call(7, message, 1.5))
    envelope = codec.decode(memoryview(frame)[4:])
    assert isinstance(envelope, Call)
    assert envelope.body == message
    assert type(envelope.body) is type(message)


def test_a_kv_piece_is_decoded_as_a_view_of_its_frame_not_a_copy() -> None:
    codec = Codec(CODEC_MESSAGES)
    payload = bytes(range(256)) * 64
    frame = bytes(codec.encode(Item(3, KVChunk(request_id="r", layer=1,
                                               data=memoryview(payload))))[HEADER_SIZE:])
    envelope = codec.decode(frame)
    assert isinstance(envelope, Item) and isinstance(envelope.body, KVChunk)
    assert envelope.body.data == payload and envelope.body.data.obj is frame


def test_sampling_maps_to_model_params_and_rejects_bad_values() -> None:
    params = sampling_params(Sampling(max_tokens=3, temperature=0.7, top_p=0.9, seed=1))
    assert (params.max_new_tokens, params.temperature, params.top_p, params.seed) == (
        3, 0.7, 0.9, 1)
    with pytest.raises(SamplingError, match="max_new_tokens must be >= 1, got 0"):
        sampling_params(Sampling(max_tokens=0))


def test_bad_hash_in_a_plan_query_is_refused_on_decode() -> None:
    codec = Codec(CODEC_MESSAGES)
    frame = codec.encode(Call(1, PlanQuery(hashes=[-1], target_worker="d")))
    with pytest.raises(Exception, match="hashes"):
        codec.decode(memoryview(frame)[4:])
