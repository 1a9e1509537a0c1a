"""The router's worker table: topology, candidates, counted loads, integrity, block size."""

from __future__ import annotations

import msgspec
import pytest
from router_fakes import INFO, TOPOLOGY

from mesh.errors import ConfigError, PeerGone
from mesh.topology import parse_topology
from services.contract.messages import PrefixMatch, WorkerMatch, WorkerState
from services.router.errors import NotFound
from services.router.placement import Placement
from services.router.policy import RouteInputs, WorkerSnapshot
from services.router.static_policies import threshold_rule
from services.router.workers import (
    ModelMismatch,
    WorkerEntry,
    WorkerTable,
    check_block_size,
    check_vocab_size,
)

MATCH = PrefixMatch(n_blocks=4, clusters=[], workers=[
    WorkerMatch(worker="prfaas-prefill-0", cluster="prfaas", role="prefill", blocks_held=4,
                blocks_resumable=3),
    WorkerMatch(worker="pd-decode-0", cluster="pd", role="decode", blocks_held=2,
                blocks_resumable=0)])


def table() -> WorkerTable:
    return WorkerTable.from_topology(parse_topology(TOPOLOGY))


def test_from_topology_reads_kinds_roles_and_lanes() -> None:
    workers = table()
    assert workers.names == ["prfaas-prefill-0", "pd-prefill-0", "pd-decode-0"]
    assert workers.get("prfaas-prefill-0").spec.kind == "prfaas"
    assert workers.lanes("pd-decode-0") == 4  # no `connections` option: the default
    with pytest.raises(NotFound) as missing:
        workers.get("ghost")
    assert missing.value.status == 404 and "ghost" in missing.value.message


def test_bad_tables_name_the_worker() -> None:
    spec = WorkerSnapshot(name="w", cluster="pd", kind="pd", role="prefill")
    with pytest.raises(ConfigError, match="'w' is listed twice"):
        WorkerTable([spec, spec])
    with pytest.raises(ConfigError, match="decode worker 'x' must be in a PD cluster"):
        WorkerTable([WorkerSnapshot(name="x", cluster="p", kind="prfaas", role="decode")])


def test_candidates_carry_cached_prefixes_and_counted_loads() -> None:
    workers = table()
    workers.dispatched("prfaas-prefill-0", "pd-decode-0")
    [prfaas] = workers.prefill_candidates("prfaas", MATCH, 16)
    assert (prfaas.name, prfaas.queue, prfaas.cached_prefix_tokens) == ("prfaas-prefill-0",
                                                                       1, 48)
    [decode] = workers.decode_candidates(MATCH, 16)
    assert (decode.running, decode.cached_prefix_tokens) == (1, 32)
    assert workers.resumable_blocks("prfaas", MATCH) == 3
    assert workers.resumable_blocks("pd", MATCH) == 0
    assert workers.held_blocks("pd-decode-0", MATCH) == 2
    assert workers.prefill_queue("prfaas") == 1 and workers.prefill_queue("pd") == 0
    workers.prefilled("prfaas-prefill-0")
    workers.released("pd-decode-0")
    assert workers.prefill_queue("prfaas") == 0
    workers.check_integrity([])


def test_a_decode_workers_reported_waiting_is_its_backlog_not_placement_load() -> None:
    # Requests waiting to join a decode batch hold streams too: placement counts the streams
    # alone, the control loops see the worker's backlog.
    workers = table()
    workers.dispatched("pd-prefill-0", "pd-decode-0")
    workers.dispatched("pd-prefill-0", "pd-decode-0")
    entry = workers.get("pd-decode-0")
    entry.polled = WorkerState(name="pd-decode-0", cluster="pd", role="decode", draining=False,
                               queue_depth=2, running=0, cached_blocks=0, model=INFO)
    [decode] = workers.decode_candidates(None, 16)
    assert (decode.load, decode.backlog) == (2, 2)
    [seen] = workers.state().select("pd", "decode")
    assert (seen.waiting, seen.running, seen.backlog + seen.running) == (2, 2, 4)
    [prefill] = workers.state().select("pd", "prefill")
    assert (prefill.queue, prefill.backlog, prefill.load) == (2, 2, 2)


def test_integrity_counts_open_streams_against_active_requests() -> None:
    workers = table()
    workers.dispatched("pd-prefill-0", "pd-decode-0")
    with pytest.raises(AssertionError, match="1 prefills in flight exceed its active"):
        workers.check_integrity([])
    inputs = RouteInputs(request_id="r", total_len=10)
    placement = Placement(request_id="r", cluster="pd", prefill_worker="pd-prefill-0",
                          decode_worker="pd-decode-0", prompt_tokens=10, cached_tokens=0,
                          decode_has_tokens=0, decision=threshold_rule(inputs, 100, True))
    workers.check_integrity([(placement.prefill_worker, placement.decode_worker)])
    workers.prefilled("pd-prefill-0")
    workers.prefilled("pd-prefill-0")
    with pytest.raises(AssertionError, match="prefills -1"):
        workers.check_integrity([(placement.prefill_worker, placement.decode_worker)])


def test_draining_and_down_workers_are_not_candidates() -> None:
    workers = table()
    workers.get("pd-prefill-0").draining = True
    assert not workers.has_prefill("pd") and workers.has_prefill("prfaas")
    workers.get("pd-decode-0").up = False
    assert workers.decode_candidates(None, 16) == []
    views = {v.name: v for v in workers.statistics().workers}
    assert views["pd-prefill-0"].role == "draining" and not views["pd-decode-0"].up
    assert workers.statistics().up == 2
    assert {w.name: w.role for w in workers.state().workers}["pd-prefill-0"] == "draining"


def test_ready_needs_a_decode_worker_and_a_prefill_worker_of_each_cluster_kind() -> None:
    workers = table()

    def answer(name: str) -> None:
        entry = workers.get(name)
        entry.polled = WorkerState(name=name, cluster=entry.spec.cluster, role=entry.role,
                                   draining=False, queue_depth=0, running=0, cached_blocks=0,
                                   model=INFO)

    assert not workers.ready()
    answer("pd-prefill-0")
    answer("pd-decode-0")
    # A long prompt would find no PrfaaS prefill worker yet.
    assert not workers.ready()
    answer("prfaas-prefill-0")
    assert workers.ready()
    workers.get("pd-prefill-0").up = False  # nor would a short one find a PD one
    assert not workers.ready()


def polled(block_size: int) -> WorkerEntry:
    entry = WorkerEntry(WorkerSnapshot(name="pd-decode-0", cluster="pd", kind="pd",
                                       role="decode"), "decode")
    entry.polled = WorkerState(name="pd-decode-0", cluster="pd", role="decode", draining=False,
                               queue_depth=0, running=0, cached_blocks=0,
                               model=msgspec.structs.replace(INFO, block_size=block_size))
    return entry


def test_block_size_check_names_both_values() -> None:
    check_block_size([polled(64)], 64)
    check_block_size([WorkerEntry(polled(32).spec, "decode")], 64)  # never polled: unknown
    with pytest.raises(ModelMismatch) as wrong:
        check_block_size([polled(64), polled(32)], 64)
    assert str(wrong.value).startswith("the router's block_size is 64, but worker pd-decode-0 "
                                       "runs fake/tiny with block_size 32")
    assert isinstance(wrong.value, ConfigError)


def test_vocab_check_refuses_workers_whose_tokens_the_router_cannot_decode() -> None:
    check_vocab_size([_with_vocab(polled(64), 257)], 257)
    check_vocab_size([WorkerEntry(polled(64).spec, "decode")], 257)  # never polled: unknown
    with pytest.raises(ModelMismatch, match="tokenizer has 257 tokens, but worker pd-decode-0 "
                       "runs fake/tiny with vocab_size 512"):
        check_vocab_size([_with_vocab(polled(64), 512)], 257)


def _with_vocab(entry: WorkerEntry, vocab_size: int) -> WorkerEntry:
    assert entry.polled is not None
    model = msgspec.structs.replace(entry.polled.model, vocab_size=vocab_size)
    entry.polled = msgspec.structs.replace(entry.polled, model=model)
    return entry


@pytest.mark.trio
async def test_a_status_reader_polls_in_process_as_the_status_call_would() -> None:
    """`poll(read=...)`: each worker's state read in this process (the simulation's path):
    one that cannot answer is down until it answers again, a worker's own role is taken
    unless the router is converting it, and a wrong block size is refused as after a call."""
    workers = table()
    answers: dict[str, WorkerState] = {}
    for name in workers.names:
        entry = workers.get(name)
        role = "prefill" if name == "pd-decode-0" else entry.role
        answers[name] = WorkerState(name=name, cluster=entry.spec.cluster, role=role,
                                    draining=False, queue_depth=2, running=1,
                                    cached_blocks=0, model=INFO)

    def read(name: str) -> WorkerState:
        if name not in answers:
            raise PeerGone(f"{name} is gone")
        return answers[name]

    gone = answers.pop("pd-prefill-0")
    await workers.poll(None, 1.0, INFO.block_size, read=read)  # type: ignore[arg-type]
    assert not workers.get("pd-prefill-0").up
    assert workers.get("pd-decode-0").role == "prefill"
    assert workers.get("prfaas-prefill-0").polled == answers["prfaas-prefill-0"]
    answers["pd-prefill-0"] = gone
    await workers.poll(None, 1.0, INFO.block_size, read=read)  # type: ignore[arg-type]
    assert workers.get("pd-prefill-0").up and workers.get("pd-prefill-0").polled == gone
    with pytest.raises(ModelMismatch, match="block_size"):
        await workers.poll(None, 1.0, INFO.block_size * 2, read=read)  # type: ignore[arg-type]
