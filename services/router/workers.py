"""The router's worker table: per worker its cluster, its current role, whether it is
draining or converting, whether it answers, and the loads the router itself counts (it sees
every request): a prefill worker's queue is its requests not yet prefilled; a decode worker's
running count is its open token streams.

Every reader (placement, the policy's control loops, GET /admin/state) gets the same record of
a worker, a `WorkerSnapshot`. The control loops (services/router/control.py) keep the table
current with `poll` and act on its entries. A worker whose model has another KV block size
than the router's is refused at its first status poll (`ModelMismatch`): prefix hashes would
never match and the cached lengths the router sends (`decode_has_tokens`) would point
mid-block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import anyio
import msgspec

from mesh.errors import ConfigError, MeshError
from mesh.node import Node
from mesh.topology import Topology
from services.contract.messages import (
    DEFAULT_LANES,
    PrefixMatch,
    StatusQuery,
    WorkerState,
)
from services.contract.types import Cluster, Role, WorkerRole
from services.router.errors import NotFound
from services.router.link_meter import readings_of
from services.router.policy import ClusterState, WorkerSnapshot
from services.service import WORKER_KINDS

log = logging.getLogger(__name__)

# A worker's state read in this process, not polled over the mesh: the simulation, whose
# workers all run in the router's event loop, reads each one's `WorkerService.state()` (what
# the status handler answers) at the same instant, without two messages and a task per
# worker each tick. Raises MeshError where the worker could not have answered.
StatusReader = Callable[[str], WorkerState]


class ModelMismatch(ConfigError):
    """A worker runs a model whose KV block size differs from the router's `block_size`."""


class WorkerTableStatistics(msgspec.Struct, frozen=True):
    workers: tuple[WorkerSnapshot, ...]

    @property
    def up(self) -> int:
        return sum(w.up for w in self.workers)


@dataclass
class WorkerEntry:
    """The table's bookkeeping of one worker: its snapshot as the topology gave it (`spec`),
    the role it serves, the flags the control loops set, the router's counts of its requests
    and its last status report; `snapshot` is what every reader gets."""

    spec: WorkerSnapshot
    role: Role
    draining: bool = False  # the router sends it nothing new
    converting: bool = False
    up: bool = True  # optimistic until a status poll fails
    prefills: int = 0
    decodes: int = 0
    polled: WorkerState | None = None

    @property
    def serving(self) -> bool:
        remote_draining = self.polled is not None and self.polled.draining
        return self.up and not (self.draining or self.converting or remote_draining)

    @property
    def shown_role(self) -> WorkerRole:
        return "draining" if self.draining or self.converting else self.role

    def snapshot(self, cached_prefix_tokens: int = 0) -> WorkerSnapshot:
        """The worker now; `cached_prefix_tokens`: its prefix of a request being placed."""
        s, role = self.spec, self.role
        prefill = role == "prefill"
        return WorkerSnapshot(
            name=s.name, kind=s.kind, cluster=s.cluster, up=self.up, lanes=s.lanes,
            role="draining" if self.draining or self.converting else role,
            queue=self.prefills if prefill else 0, running=0 if prefill else self.decodes,
            waiting=0 if prefill else _polled_queue(self), converting=self.converting,
            cached_prefix_tokens=cached_prefix_tokens)


class WorkerTable:
    """Every prefill and decode worker the router may use (module docstring)."""

    def __init__(self, specs: Sequence[WorkerSnapshot]) -> None:
        """`specs`: each worker as the topology gives it (name, cluster, kind, first role,
        lanes)."""
        self._workers: dict[str, WorkerEntry] = {}
        for spec in specs:
            if spec.name in self._workers:
                raise ConfigError(f"worker {spec.name!r} is listed twice")
            if spec.role == "decode" and spec.kind != "pd":
                raise ConfigError(f"decode worker {spec.name!r} must be in a PD cluster, "
                                 f"got kind {spec.kind!r}")
            if spec.role == "draining":
                raise ConfigError(f"worker {spec.name!r} must start as prefill or decode, "
                                  "got draining")
            self._workers[spec.name] = WorkerEntry(spec, spec.role)

    @classmethod
    def from_topology(cls, topology: Topology) -> WorkerTable:
        """Services of kind prefill/decode; a cluster's kind ("prfaas" or "pd") tells which."""
        specs = []
        for service in topology.services:
            if service.kind in WORKER_KINDS:
                kind = topology.cluster_kind(service)
                if kind not in ("prfaas", "pd"):
                    raise ConfigError(f"worker {service.name!r}: cluster {service.cluster!r} "
                                     f"must be of kind prfaas or pd, got {kind!r}")
                lanes = topology.options_of(service).get("connections", DEFAULT_LANES)
                specs.append(WorkerSnapshot(
                    name=service.name, cluster=service.cluster, kind=kind,  # type: ignore[arg-type]
                    role=service.kind, lanes=int(lanes)))  # type: ignore[arg-type]
        return cls(specs)

    @property
    def names(self) -> list[str]:
        return list(self._workers)

    def get(self, name: str) -> WorkerEntry:
        worker = self._workers.get(name)
        if worker is None:
            raise NotFound(f"no worker named {name!r}; known: {', '.join(self._workers)}",
                           param="name")
        return worker

    def _serving(self, kind: Cluster, role: Role, cluster: str | None = None
                 ) -> list[WorkerEntry]:
        return [w for w in self._workers.values()
                if w.spec.kind == kind and w.role == role and w.serving
                and cluster in (None, w.spec.cluster)]

    def clusters(self, kind: Cluster) -> list[str]:
        """The names of the clusters of `kind` that hold workers, in topology order."""
        return list(dict.fromkeys(w.spec.cluster for w in self._workers.values()
                                  if w.spec.kind == kind))

    def cluster_of(self, name: str) -> str:
        return self.get(name).spec.cluster

    @staticmethod
    def _blocks(match: PrefixMatch | None) -> dict[str, tuple[int, int]]:
        if match is None:
            return {}
        return {w.worker: (w.blocks_held, w.blocks_resumable) for w in match.workers}

    def prefill_candidates(self, kind: Cluster, match: PrefixMatch | None,
                           block_size: int, cluster: str | None = None
                           ) -> list[WorkerSnapshot]:
        """Serving prefill workers of `kind` (in `cluster`, if named); their cached prefix is
        what they can resume."""
        blocks = self._blocks(match)
        return [w.snapshot(blocks.get(w.spec.name, (0, 0))[1] * block_size)
                for w in self._serving(kind, "prefill", cluster)]

    def decode_candidates(self, match: PrefixMatch | None,
                          block_size: int) -> list[WorkerSnapshot]:
        """Serving decode workers with room for one more stream; their cached prefix is the
        KV they hold."""
        blocks = self._blocks(match)
        return [w.snapshot(blocks.get(w.spec.name, (0, 0))[0] * block_size)
                for w in self._serving("pd", "decode") if not _full(w)]

    def decode_full(self) -> bool:
        """Whether decode workers serve, and every one holds as many streams as it said it
        can (`WorkerState.max_streams`)."""
        serving = self._serving("pd", "decode")
        return bool(serving) and all(_full(w) for w in serving)

    def decode_capacity(self) -> int | None:
        """Streams the serving decode workers can hold together; None until one has said."""
        said = [w.polled.max_streams for w in self._serving("pd", "decode")
                if w.polled is not None and w.polled.max_streams > 0]
        return sum(said) if said else None

    def resumable_blocks(self, kind: Cluster, match: PrefixMatch | None,
                         cluster: str | None = None) -> int:
        """The longest prefix a serving prefill worker of `kind` (in `cluster`, if named) can
        resume from (blocks)."""
        blocks = self._blocks(match)
        return max((blocks.get(w.spec.name, (0, 0))[1]
                    for w in self._serving(kind, "prefill", cluster)), default=0)

    def resumable_of(self, name: str, match: PrefixMatch | None) -> int:
        """The prefix (blocks) worker `name` can resume from."""
        return self._blocks(match).get(name, (0, 0))[1]

    def holder(self, match: PrefixMatch | None, blocks: int, exclude: str) -> str | None:
        """A live worker other than `exclude` that can resume `blocks` blocks (to push them
        to another worker): prefill workers first, then the least busy."""
        have = self._blocks(match)
        holders = [w for w in self._workers.values() if w.up and w.spec.name != exclude
                   and have.get(w.spec.name, (0, 0))[1] >= blocks]
        best = min(holders, key=lambda w: (w.role != "prefill", w.prefills + w.decodes,
                                           w.spec.name), default=None)
        return best.spec.name if best else None

    def lanes(self, name: str) -> int:
        return self.get(name).spec.lanes

    def held_blocks(self, name: str, match: PrefixMatch | None) -> int:
        return self._blocks(match).get(name, (0, 0))[0]

    def send_readings(self, cluster: str) -> dict[str, tuple[int, float]]:
        """Each worker of `cluster`'s KV send counters, from its last status report."""
        return readings_of({w.spec.name: w.polled for w in self._workers.values()
                            if w.spec.cluster == cluster})

    def prefill_queue(self, kind: Cluster, cluster: str | None = None) -> int:
        return sum(w.prefills for w in self._workers.values()
                   if w.spec.kind == kind and w.role == "prefill"
                   and cluster in (None, w.spec.cluster))

    def ready(self) -> bool:
        """Whether any request can be served: a decode worker and, in each kind of cluster
        that has prefill workers, a prefill worker serve, each having answered a status poll
        (until the first poll, `up` is only a guess). A short prompt needs the PD cluster's
        prefill and a long one the PrfaaS cluster's: one of them alone is not ready."""
        answering = [w for w in self._workers.values() if w.serving and w.polled is not None]
        kinds = {w.spec.kind for w in self._workers.values() if w.spec.role == "prefill"}
        return any(w.role == "decode" for w in answering) and all(
            any(w.role == "prefill" and w.spec.kind == kind for w in answering)
            for kind in kinds)

    def has_prefill(self, kind: Cluster, cluster: str | None = None) -> bool:
        return bool(self._serving(kind, "prefill", cluster))

    def dispatched(self, prefill: str, decode: str) -> None:
        self._workers[prefill].prefills += 1
        self._workers[decode].decodes += 1

    def prefilled(self, prefill: str) -> None:
        self._workers[prefill].prefills -= 1

    def released(self, decode: str) -> None:
        self._workers[decode].decodes -= 1

    def down(self) -> set[str]:
        """The workers that answered no status poll or whose connection broke (not up)."""
        return {name for name, worker in self._workers.items() if not worker.up}

    def lost(self, name: str) -> None:
        """A request's connection to `name` broke: it is down (placed nothing new) until it
        answers a status poll again."""
        worker = self._workers[name]
        if worker.up:
            log.warning("worker %s is down: a request's connection to it broke", name)
        worker.up = False

    async def poll(self, node: Node, timeout: float, block_size: int,
                   vocab_size: int | None = None, *, read: StatusReader | None = None) -> None:
        """Asks every worker for its state at once; one that does not answer is down.
        With `read`, each state is read in this process instead (`StatusReader`).

        Raises ModelMismatch if a worker's model has a KV block size other than `block_size`
        (the router's), or more tokens than the router's tokenizer (`vocab_size`) can turn
        back into text: it is refused before any request is placed by its report.
        """
        if read is None:
            async with anyio.create_task_group() as group:
                for worker in self._workers.values():
                    group.start_soon(self._poll_one, node, worker, timeout)
        else:
            # Read at once: no checkpoint stands in for the replies (tests/test_sim.py: the
            # records are those of polling over the mesh).
            for worker in self._workers.values():
                self._read_one(worker, read)
        check_block_size(self._workers.values(), block_size)
        if vocab_size is not None:
            check_vocab_size(self._workers.values(), vocab_size)

    async def _poll_one(self, node: Node, worker: WorkerEntry, timeout: float) -> None:
        try:
            state = await node.call(worker.spec.name, StatusQuery(), WorkerState,
                                    timeout=timeout)
        except MeshError as exc:
            self._silent(worker, exc)
            return
        self._answered(worker, state)

    def _read_one(self, worker: WorkerEntry, read: StatusReader) -> None:
        try:
            state = read(worker.spec.name)
        except MeshError as exc:
            self._silent(worker, exc)
            return
        self._answered(worker, state)

    @staticmethod
    def _silent(worker: WorkerEntry, exc: MeshError) -> None:
        # A worker that never answered is still starting (every worker, at `make demo`).
        if worker.up and worker.polled is None:
            log.info("worker %s is not up yet: %s", worker.spec.name, exc)
        elif worker.up:
            log.warning("worker %s is down: %s", worker.spec.name, exc)
        worker.up = False

    @staticmethod
    def _answered(worker: WorkerEntry, state: WorkerState) -> None:
        if not worker.up:
            log.info("worker %s is %s", worker.spec.name, "back" if worker.polled else "up")
        worker.up, worker.polled = True, state
        if not worker.converting:
            worker.role = state.role

    def state(self) -> ClusterState:
        """The workers as the policy's control loops see them."""
        return ClusterState(workers=self.snapshots())

    def snapshots(self) -> tuple[WorkerSnapshot, ...]:
        return tuple(w.snapshot() for w in self._workers.values())

    def statistics(self) -> WorkerTableStatistics:
        return WorkerTableStatistics(workers=self.snapshots())

    def check_integrity(self, active: Sequence[tuple[str, str]]) -> None:
        """`active`: the (prefill worker, decode worker) of every request in flight."""
        for worker in self._workers.values():
            name = worker.spec.name
            decodes = sum(decode == name for _, decode in active)
            if worker.prefills < 0 or worker.decodes != decodes:
                raise AssertionError(f"worker {name}: prefills {worker.prefills}, decodes "
                                     f"{worker.decodes} != {decodes} open streams")
            if worker.prefills > sum(prefill == name for prefill, _ in active):
                raise AssertionError(f"worker {name}: {worker.prefills} prefills in flight "
                                     "exceed its active requests")


def _full(worker: WorkerEntry) -> bool:
    limit = worker.polled.max_streams if worker.polled is not None else 0
    return 0 < limit <= worker.decodes


def _polled_queue(worker: WorkerEntry) -> int:
    return worker.polled.queue_depth if worker.polled else 0


def check_block_size(workers: Iterable[WorkerEntry], block_size: int) -> None:
    """ModelMismatch naming every polled worker whose model block size is not `block_size`."""
    wrong = [f"{w.spec.name} runs {w.polled.model.family}/{w.polled.model.size} with block_size "
             f"{w.polled.model.block_size}" for w in workers
             if w.polled is not None and w.polled.model.block_size != block_size]
    if wrong:
        raise ModelMismatch(f"the router's block_size is {block_size}, but worker "
                            f"{'; '.join(wrong)}: prefix hashes and cached lengths would not "
                            "match; set the router option block_size to the workers' model "
                            "block size")


def check_vocab_size(workers: Iterable[WorkerEntry], vocab_size: int) -> None:
    """ModelMismatch naming every polled worker whose model can emit token ids the router's
    tokenizer (of `vocab_size` tokens) cannot decode."""
    wrong = [f"{w.spec.name} runs {w.polled.model.family}/{w.polled.model.size} with vocab_size "
             f"{w.polled.model.vocab_size}" for w in workers
             if w.polled is not None and w.polled.model.vocab_size > vocab_size]
    if wrong:
        raise ModelMismatch(f"the router's tokenizer has {vocab_size} tokens, but worker "
                            f"{'; '.join(wrong)}: its output could not be decoded; set the "
                            "router option tokenizer to match the workers' model")
