"""The KV transfers a worker received, as Prometheus histograms.

`prfaas_kv_transfer_seconds` and `prfaas_kv_transfer_bytes` are labelled by the receiving
service, the link the KV crossed ("local" inside a cluster) and its kind: "full" (the decode
worker held none of the prompt), "incremental" (it held a prefix, so only the rest came),
"prefix" (a cached prefix pulled to a prefill worker). Seconds run from the first piece's
arrival to the end of the import, both on the receiver's clock (the sender's clock is another
host's on a mesh across hosts). Bytes are the pieces' payload (the modeled size in the
simulation). The receiver observes (the worker, once a transfer's pieces are imported): it
alone knows when the KV was imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from mesh import native
from mesh.histogram import Histogram
from services.service import BYTES_BUCKETS, SECONDS_BUCKETS
from services.worker.kv_in import KVAssembly

LABELS = ("service", "link", "kind")
LOCAL = "local"


class KVTransferMetrics(Collector):
    """One worker's KV-transfer histograms (module docstring); `imported` after each import."""

    def __init__(self, service: str,
                 link_of: Callable[[str], str | None] = lambda peer: None) -> None:
        self.service = service
        self._link_of = link_of
        self.seconds = Histogram("prfaas_kv_transfer_seconds", "KV transfer time, first piece "
                                 "received to the last imported", LABELS, SECONDS_BUCKETS)
        self.bytes = Histogram("prfaas_kv_transfer_bytes", "KV bytes of one transfer",
                               LABELS, BYTES_BUCKETS)

    def imported(self, assembly: KVAssembly) -> None:
        """Observes the transfer `assembly` held, imported just now."""
        opening = assembly.opening
        if opening is None:
            return
        kind = "prefix" if opening.purpose == "prefix" else (
            "incremental" if opening.start > 0 else "full")
        labels = (self.service, self._link_of(assembly.peer) or LOCAL, kind)
        started = assembly.first_piece_at if assembly.first_piece_at is not None \
            else assembly.created
        self.seconds.labels(*labels).observe(native.clock()() - started)
        self.bytes.labels(*labels).observe(assembly.received_bytes)

    def collect(self) -> Iterator[Metric]:
        yield from self.seconds.collect()
        yield from self.bytes.collect()
