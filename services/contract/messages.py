"""The messages the PrfaaS services exchange over the mesh: one module, the whole contract.

Every message is a tagged msgspec Struct; `CODEC_MESSAGES` lists them for the mesh `Codec`
(with the cache directory's own messages, services.cachedir.directory, and the dashboard events,
services.contract.events, which travel on the same connections).

A request's life (docs/architecture.md section 4): the router asks the cache directory for the
longest cached prefix per worker and cluster (`PrefixQuery` -> `PrefixReply`; `prfaas send`
asks what its decode worker lacks instead, `PlanQuery` -> `PlanReply`); it opens a token
stream at the decode worker with `DecodeRequest` and, at the same time, calls the prefill
worker with `PrefillRequest`. The prefill worker pushes the KV to the decode worker as
upload streams, one per connection ("lane"): `KVOpen` first, then `KVChunk` items as each
layer finishes, and on lane 0 a last `KVClose` with the first sampled token; each lane is
answered with `KVAccepted`, and the prefill call with `PrefillDone`. The decode worker
imports the pieces, joins the request to its batch and streams `TokenChunk`s back. Workers
report their cached blocks to the cache directory (`BlocksStored`, `BlocksEvicted`,
`WorkerReport`); it asks for a full report with `ReportCache` after a restart. Any service
streams its dashboard events to a `Subscribe`r and reads its event clock to a
`ClockQuery`.

Errors cross the wire by exception type name (mesh `RemoteError.error`); their small tree is
services.contract.errors.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from services.contract.errors import UnknownWorkerError
from services.contract.events import EVENT_TYPES
from services.contract.prefix import BlockHash
from services.contract.sampling import Sampling, TokenLogprob
from services.contract.types import Role

# The most events a service buffers for one subscriber (Subscribe.maxlen).
MAX_SUBSCRIBE_MAXLEN = 65536


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Which model a worker runs: KV moves only between workers with equal config_hash."""

    family: str
    size: str
    config_hash: str
    dtype: str
    vocab_size: int
    block_size: int
    eos_id: int
    source: str  # "checkpoint PATH" or "random-init seed N"


# The KV lanes (TCP connections) a worker may stripe one KV stream over when its topology
# gives no `connections` option: the worker opens that many, the router stripes over them.
DEFAULT_LANES: Final = 4


class PrefillRequest(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Prefill `prompt` and push its KV to `decode_worker`, sending only what it lacks.

    decode_has_tokens: the block-aligned prefix the decode worker already holds (from the
    cache directory's plan); the full-attention KV before it is not sent. connections: TCP
    connections (lanes) the KV is striped over. overlap False holds every piece until the
    compute is done (the one-after-the-other baseline of the overlap benchmark).
    chunk_tokens: compute (and stream) the suffix in chunks of this many tokens.
    """

    request_id: str
    prompt: list[int]
    decode_worker: str
    decode_has_tokens: int = 0
    sampling: Sampling = Sampling()
    connections: int = 1
    overlap: bool = True
    chunk_tokens: int | None = None  # None: the worker's own setting; 0: one chunk
    # A cached prefix this worker lacks, to fetch from another worker before computing
    # (the abundant prefix rule's cross-cluster cache transfer, paper section 3.3)
    pull: PrefixPull | None = None
    # Seconds the decode worker may take to accept every lane once the compute is done
    # before the job fails with KVStalled (0: no bound); the router sets it for KV that
    # crosses a link. The decode side bounds the gaps between pieces (DecodeRequest.kv_stall).
    kv_stall: float = 0.0
    # The hash chain of the prompt's first blocks as the sender made it (the router sends
    # its lookup's): the worker hashes only the blocks after them, and checks the last one
    # (services.contract.prefix.check_chain_end). Empty: the worker hashes the whole prompt.
    hashes: list[BlockHash] = []
    # The W3C traceparent of the router's span for this attempt (services/contract/tracing.py): the
    # worker's spans join the request's trace. Empty: not traced.
    trace: str = ""


class PrefixPull(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prefill worker gets the cached prefix of its prompt's first `tokens` tokens
    (a block multiple, ending at a state snapshot of `holder`) before it computes the rest.
    connections: lanes the holder may stripe the prefix's KV over."""

    holder: str
    tokens: int
    connections: int = 1


class PushPrefix(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """To the worker holding `prompt` (a cached prefix, ending at one of its snapshots):
    stream its KV to `target` as a KV upload (KVOpen with purpose "prefix"; lane 0 ends with
    KVClose, first_token -1), sending full-attention KV from token `target_has_tokens` on
    (the target holds the rest) and every fixed-size state at the prefix's end."""

    request_id: str
    prompt: list[int]
    target: str
    target_has_tokens: int = 0
    connections: int = 1


class PrefixPushed(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The holder's answer once the target accepted every lane of the prefix's KV."""

    request_id: str
    worker: str
    tokens: int
    kv_bytes: int
    pieces: int
    lanes: int


class PrefillDone(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """What a prefill did: tokens computed and reused, bytes sent, and its timings (s)."""

    request_id: str
    worker: str
    prompt_tokens: int
    reused_tokens: int  # resumed from the prefill worker's own prefix cache
    computed_tokens: int
    sent_from_token: int  # full-attention KV of tokens [sent_from_token, prompt_tokens) sent
    kv_bytes: int  # piece bytes (headers + payload) pushed to the decode worker
    pieces: int
    lanes: int
    chunks: int = 1  # token chunks the suffix was computed in
    first_token: int
    queue_s: float  # waiting for the worker
    compute_s: float  # prefill start to last layer done (paced time included)
    transfer_s: float  # last layer done to the last lane accepted by the decode worker
    total_s: float  # prefill start to the last lane accepted: "KV fully received"


class DecodeRequest(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Open a token stream for `request_id`; the KV arrives separately from a prefill worker.
    `incremental` false: the first token at once, the rest at the finish (a whole answer)."""

    request_id: str
    prompt: list[int]
    sampling: Sampling = Sampling()
    kv_timeout: float = 60.0
    incremental: bool = True
    # Seconds the KV may make no progress (no lane opened, no piece arrived) before the
    # stream fails with KVStalled; 0: no bound but kv_timeout. The router sets it for KV that
    # crosses a link, so that a stalled transfer is abandoned and re-prefilled in the PD cluster.
    kv_stall: float = 0.0
    # The prompt's first blocks' hash chain, as in PrefillRequest: the worker hashes only the
    # rest of the prompt and its output when it keeps the finished cache.
    hashes: list[BlockHash] = []
    # The W3C traceparent of the router's span for this attempt, as in PrefillRequest.
    trace: str = ""


class TokenChunk(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """New tokens of one request from output index `index` on; the last has finish_reason."""

    request_id: str
    tokens: list[int]
    index: int = 0
    finish_reason: str | None = None
    # On the first chunk: the tokens whose KV the decode worker already held (not sent).
    reused_tokens: int = 0
    # One per token when the request asked for logprobs (Sampling.logprobs), else None.
    logprobs: list[TokenLogprob] | None = None


class KVOpen(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Starts one lane of a KV upload covering tokens [start, end) of the prompt.

    The model identity lets the decode worker refuse a stream for another model before any
    piece arrives; `pieces` is how many KVChunk items this lane carries.
    """

    request_id: str
    family: str
    config_hash: str
    dtype: str
    start: int
    end: int
    pieces: int
    lane: int = 0
    lanes: int = 1
    # "decode": a prompt's KV for the decode worker; "prefix": a cached prefix pushed to a
    # prefill worker's prefix store (PushPrefix)
    purpose: Literal["decode", "prefix"] = "decode"


class KVChunk(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """One exported KV piece (services.model.export: header + payload, crc32): a layer's
    full-attention KV from token `start` on, or its state (services.worker.kv_out)."""

    request_id: str
    layer: int
    data: memoryview  # a view of the received frame, decoded without a copy (senders wrap)
    start: int = 0
    # The simulation's pieces carry their modeled size here and no bytes (data is empty).
    nbytes: int = 0

    @property
    def size(self) -> int:
        """Payload bytes this piece stands for: its bytes, or its modeled size."""
        return self.nbytes or len(self.data)


class KVClose(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The last item of lane 0: the prefill is done and this is the first sampled token
    (-1 on a prefix push: nothing was sampled)."""

    request_id: str
    first_token: int
    # The first token's logprob when the request asked for logprobs.
    first_logprob: TokenLogprob | None = None


class KVAccepted(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The decode worker's answer to one finished upload lane."""

    request_id: str
    lane: int
    pieces: int
    bytes: int


class SetRole(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Convert a PD worker: stop taking work, drain what it has, then switch."""

    role: Role
    reason: str = ""


class StatusQuery(msgspec.Struct, frozen=True, tag=True):
    """Ask a worker for its `WorkerState`."""


class WorkerState(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """A worker's role and load, as the router's placement needs them."""

    name: str
    cluster: str
    role: Role
    draining: bool
    queue_depth: int
    running: int
    cached_blocks: int
    model: ModelInfo
    # Decode streams it serves at once (its `max_streams` option; 0: not said). The router
    # admits at most the sum over its decode workers and sends none a stream more.
    max_streams: int = 0
    # Its KV sends so far (services/worker/send_meter.py): bytes the transport took, and the
    # time some send waited for it. The router estimates each link's bandwidth from these.
    kv_sent_bytes: int = 0
    kv_held_s: float = 0.0


# The cache directory's messages: what workers report, what lookups and plans answer.


class BlockRun(msgspec.Struct, frozen=True):
    """Blocks `first .. first+len(hashes)-1` of one chain. `parent` is the hash of block
    `first-1` (None iff first == 0); `snapshot_at` lists the absolute block indices at whose
    end the state snapshot is held too."""

    hashes: list[BlockHash]
    snapshot_at: list[int] = []
    first: int = 0
    parent: BlockHash | None = None


class BlocksStored(msgspec.Struct, frozen=True, tag=True):
    worker: str
    runs: list[BlockRun]


class BlocksEvicted(msgspec.Struct, frozen=True, tag=True):
    """Blocks dropped; with `snapshots_only` their KV stays and only their snapshots go."""

    worker: str
    hashes: list[BlockHash]
    snapshots_only: bool = False


class WorkerReport(msgspec.Struct, frozen=True, tag=True):
    """A worker's whole cache, sent after a directory restart (or to re-sync one worker)."""

    worker: str
    cluster: str
    role: Role
    runs: list[BlockRun]


# What a worker tells the cache directory of its cache (cast to it, or handed over in process).
CacheReport = BlocksStored | BlocksEvicted | WorkerReport


class PrefixQuery(msgspec.Struct, frozen=True, tag=True):
    hashes: list[BlockHash]
    role: Role | None = None


class WorkerMatch(msgspec.Struct, frozen=True):
    worker: str
    cluster: str
    role: Role
    blocks_held: int
    blocks_resumable: int


class ClusterMatch(msgspec.Struct, frozen=True):
    """Per-cluster maxima; `best_worker` resumes most (ties: holds most, then first by name)."""

    cluster: str
    blocks_held: int
    blocks_resumable: int
    best_worker: str | None


class PrefixMatch(msgspec.Struct, frozen=True):
    """`workers`: those holding at least block 0, by name. `clusters`: every cluster, by name."""

    n_blocks: int
    workers: list[WorkerMatch]
    clusters: list[ClusterMatch]

    def cluster(self, name: str) -> ClusterMatch:
        for match in self.clusters:
            if match.cluster == name:
                return match
        raise UnknownWorkerError(f"cluster {name!r} has no registered workers")


class TransferPlan(msgspec.Struct, frozen=True):
    """What `target_worker` lacks of a request's blocks. `send`: every block index from its
    first missing one (`target_held`) on that it does not hold; those below `source_held` can
    come from the source's cache, the rest must be computed. `states_needed` is False only if
    the target can resume at the last hashed block (a partial tail block always needs them)."""

    n_blocks: int
    target_worker: str
    target_held: int
    target_resumable: int
    source_worker: str | None
    source_held: int
    cross_cluster: bool
    send: list[int]
    states_needed: bool


class PlanQuery(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Ask the cache directory what `target_worker` lacks of the chain `hashes`."""

    hashes: list[BlockHash]
    target_worker: str
    source_worker: str | None = None


class PlanReply(msgspec.Struct, frozen=True, tag=True):
    plan: TransferPlan


class PrefixReply(msgspec.Struct, frozen=True, tag=True):
    """The cache directory's answer to a `PrefixQuery`."""

    match: PrefixMatch


class ReportCache(msgspec.Struct, frozen=True, tag=True):
    """The cache directory asks a worker for its full `WorkerReport` (after a restart)."""


class Subscribe(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """Open a stream of this service's dashboard events (services.contract.events) from now on;
    the service buffers up to `maxlen` of them for this subscriber (1..MAX_SUBSCRIBE_MAXLEN:
    a peer cannot make it hold an unbounded backlog)."""

    maxlen: Annotated[int, msgspec.Meta(ge=1, le=MAX_SUBSCRIBE_MAXLEN)] = 1024


class ClockQuery(msgspec.Struct, frozen=True, tag=True):
    """Asks a service for the clock its events are stamped with (`ClockReading`): the
    dashboard maps each service's `ts` onto its own clock, machines' clocks being apart."""


class ClockReading(msgspec.Struct, frozen=True, tag=True):
    """A service's event clock when it answered a `ClockQuery` (seconds)."""

    now: float


class Echo(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The echo service answers with the same message, `hops` + 1."""

    text: str
    hops: int = 0


CODEC_MESSAGES: tuple[type[msgspec.Struct], ...] = (
    PrefillRequest,
    PrefillDone,
    PushPrefix,
    PrefixPushed,
    DecodeRequest,
    TokenChunk,
    KVOpen,
    KVChunk,
    KVClose,
    KVAccepted,
    SetRole,
    StatusQuery,
    WorkerState,
    PlanQuery,
    PlanReply,
    PrefixQuery,
    PrefixReply,
    ReportCache,
    BlocksStored,
    BlocksEvicted,
    WorkerReport,
    Subscribe,
    ClockQuery,
    ClockReading,
    Echo,
    *EVENT_TYPES,
)
