"""The dashboard's configuration: one frozen struct, built at the edge and passed down."""

from __future__ import annotations

from typing import Literal

import msgspec

from ui.errors import UiConfigError


class DashboardConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds, windows and names the dashboard needs; every bound keeps memory fixed."""

    title: str = "PrfaaS mesh"
    # What the page's mode badge says while live events flow: "simulated" when the source is
    # the simulation (prfaas sim-dashboard), so nobody mistakes it for the real mesh.
    live_mode: Literal["live", "simulated"] = "live"
    # The routing policies the page offers before the router's state says (the source side
    # passes services.router.policies' registered names; the dashboard knows none itself).
    policies: tuple[str, ...] = ()
    # Clusters whose prefill counts as offloaded (the PrfaaS side of the link).
    prfaas_clusters: tuple[str, ...] = ("prfaas",)
    # The topology's links as (name, PrfaaS end, PD end): the page draws each between its
    # clusters; a link that reports without being named here is drawn between the first ones.
    links: tuple[tuple[str, str, str], ...] = ()
    max_decisions: int = 200  # routing decisions kept for a page that connects mid-run
    max_flows: int = 64  # KV flows in flight kept; the oldest is forgotten beyond this
    max_timelines: int = 512  # requests whose phases are kept for the waterfall
    max_workers: int = 256
    bucket_s: float = 1.0  # one chart point per bucket of event time
    window_s: float = 10.0  # sliding window of the chart statistics
    keep_points: int = 600  # chart points kept (10 minutes at one a second)
    client_buffer: int = 4096  # events queued per browser before the oldest are dropped
    batch_window_s: float = 0.05  # events arriving this close together share one SSE message
    max_batch: int = 512  # events per SSE message at most
    heartbeat_s: float = 10.0  # an SSE comment this often keeps idle connections open
    table_rows: int = 100  # rows the page's decision table keeps
    # Served tokens per paper token (the router's `scale`): the page shows t both as served
    # and at the paper length it stands for (served / token_scale). 1: lengths are the paper's.
    token_scale: float = 1.0
    # The workload rate the page offers (req/s): one the deployment holds without queues
    # growing (docs/dashboard.md, "Load").
    default_rate: float = 0.2

    def __post_init__(self) -> None:
        for name in ("max_decisions", "max_flows", "max_timelines", "max_workers"):
            _check_positive(name, getattr(self, name))
        for name in ("keep_points", "client_buffer", "max_batch", "table_rows"):
            _check_positive(name, getattr(self, name))
        for name in ("bucket_s", "heartbeat_s", "token_scale", "default_rate"):
            _check_positive(name, getattr(self, name))
        if self.window_s < self.bucket_s:
            raise UiConfigError(
                f"window_s must be >= bucket_s={self.bucket_s}, got {self.window_s}"
            )
        if self.batch_window_s < 0:
            raise UiConfigError(f"batch_window_s must be >= 0, got {self.batch_window_s}")
        if not self.prfaas_clusters:
            raise UiConfigError("prfaas_clusters must name at least one cluster, got ()")


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise UiConfigError(f"{name} must be > 0, got {value!r}")
