"""A worker's options: what a topology may set for a service of kind "prefill" or "decode"
(its cluster's options under its own), as one typed, frozen config built once when the
worker starts (`worker_config`). A key no worker reads is refused, and the error names it.

One config serves both kinds: a worker process holds a prefill and a decode engine and a
PD-cluster worker switches between them, so each reads the options of both. The engines'
own settings keep their defaults in their configs (`PrefillConfig`, `DecodeConfig`), which
this one builds.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from mesh.errors import ConfigError
from mesh.topology import ServiceSpec, Topology
from services.contract.messages import DEFAULT_LANES
from services.worker.decode import DecodeConfig
from services.worker.prefill import PrefillConfig

_PREFILL = PrefillConfig(name="")
_DECODE = DecodeConfig(name="")
# Options every service takes, read by services/service.py (serve_metrics), not the worker.
SERVICE_KEYS = frozenset({"metrics_port"})


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A worker's options (all optional); services/cli/topology.toml describes them."""

    # The model: every worker of a topology must build the same weights and dtype.
    family: str = "kimi-linear"  # services/model/config.py family_config
    size: str = "default"  # or "tiny"
    checkpoint: str = "auto"  # "auto", "none" (random init) or a file path
    seed: int = 0  # random-init seed
    dtype: str = "float32"  # "auto", "float32", "bfloat16"
    threads: int = 0  # torch threads (0: torch's default)
    # Emulated mode: the hardware profile paced to, and served tokens per paper token.
    profile: str = "cpu"
    scale: float = 1.0
    connections: int = DEFAULT_LANES  # TCP connections one KV stream may be striped over
    cache_mib: float = 256.0  # the prefix cache's budget
    # The prefill engine (PrefillConfig).
    snapshot_every: int = _PREFILL.snapshot_every
    chunk_tokens: int = _PREFILL.chunk_tokens
    max_streaming: int = _PREFILL.max_streaming
    # The decode engine (DecodeConfig); `max_streams` is also its pool of handler slots.
    slots: int = _DECODE.slots
    max_batch: int = _DECODE.max_batch
    max_streams: int = _DECODE.max_streams
    orphan_timeout: float = _DECODE.orphan_timeout
    # Handler slots of the data path's pools (mesh.pools), apart from the node's shared ones
    # (status, role, cache reports, events): a decode stream waiting for its KV never holds a
    # slot the KV upload needs, and neither holds one a status poll needs.
    prefill_slots: int = 64  # prefill calls queued or running (one computes at a time)
    upload_slots: int = 16  # KV upload lanes being received at once
    # Seconds a role switch takes once drained (what a real instance takes to reload).
    conversion_s: float = 0.0
    status_interval: float = 1.0  # seconds between WorkerStatus events (while watched)
    otlp_endpoint: str = ""  # OTLP/HTTP traces URL; "": the OTEL_EXPORTER_OTLP_* variables

    def __post_init__(self) -> None:
        for name in ("connections", "prefill_slots", "upload_slots"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("threads", "conversion_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("scale", "cache_mib", "status_interval"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        self.prefill_config("", "")
        self.decode_config("", "")

    def prefill_config(self, name: str, cluster: str) -> PrefillConfig:
        return PrefillConfig(name=name, cluster=cluster, snapshot_every=self.snapshot_every,
                             chunk_tokens=self.chunk_tokens, max_streaming=self.max_streaming)

    def decode_config(self, name: str, cluster: str) -> DecodeConfig:
        return DecodeConfig(name=name, cluster=cluster, slots=self.slots,
                            max_batch=self.max_batch, max_streams=self.max_streams,
                            orphan_timeout=self.orphan_timeout)


def worker_config(topology: Topology, spec: ServiceSpec) -> WorkerConfig:
    """The options of worker `spec`, its own over its cluster's; a ConfigError names the
    service, the key and where it was set."""
    options = topology.options_of(spec)
    unknown = sorted(set(options) - set(WorkerConfig.__struct_fields__) - SERVICE_KEYS)
    if unknown:
        where = "its own" if unknown[0] in spec.options else f"cluster {spec.cluster!r}'s"
        raise ConfigError(f"service {spec.name!r}: unknown worker option {unknown[0]!r} (in "
                          f"{where} options); known: {sorted(WorkerConfig.__struct_fields__)}")
    return _convert(spec.name, {k: v for k, v in options.items() if k not in SERVICE_KEYS})


def _convert(name: str, options: Mapping[str, object]) -> WorkerConfig:
    try:
        return msgspec.convert(dict(options), WorkerConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"service {name!r}: bad worker option: {exc}") from exc
