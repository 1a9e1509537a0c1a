"""The `link` service: the emulated line between two clusters, on the mesh.

`prfaas serve link-0` runs `netem.serve_link` with one proxy route per worker of the link's
receiving cluster (`services.cli.serve.link_routes`, the same table the senders' resolvers use),
shaped to the topology's bandwidth, delay, jitter and loss (the bandwidth alone when the
link's options.impairments is "kernel": the network adds the rest); the control API
(Toxiproxy-style, and `/metrics`) listens on options.control_port; both on the service's
bind host. The control API answers only requests whose Host names its bind host, the
service's host or loopback; changes through it need the run's admin token when one is set
(PRFAAS_ADMIN_TOKEN). A mesh node on the service's own port serves the event stream, where a
`LinkStats` sample is published every options.stats_interval s.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc

from mesh.errors import ConfigError
from mesh.events import EventBus
from mesh.topology import LinkSpec
from mesh.transport import Address
from netem.control import serve_link
from netem.params import LinkParams
from netem.proxy import ProxyConfig, ProxyStatistics, Route
from netem.shaper import LinkStatistics
from services.contract.access import token_from_env
from services.contract.events import Event, LinkStats
from services.service import (
    ServiceContext,
    link_impairer,
    link_routes,
    link_service_of,
    serve_events,
)

log = logging.getLogger(__name__)


def link_of_service(ctx: ServiceContext) -> LinkSpec:
    """The topology link this `link` service emulates."""
    for link in ctx.topology.links:
        if link_service_of(ctx.topology, link).name == ctx.name:
            return link
    raise ConfigError(f"link service {ctx.name!r} emulates no link of the topology")


def link_params(link: LinkSpec) -> LinkParams:
    """What the emulator starts at: the link's bandwidth, and its delay, jitter and loss
    unless the network between the clusters adds those (options.impairments "kernel")."""
    if link_impairer(link) == "kernel":
        return LinkParams(bandwidth_bps=link.bandwidth_bps)
    return LinkParams(bandwidth_bps=link.bandwidth_bps, delay_s=link.delay_s,
                      jitter_s=link.jitter_s, loss_rate=link.loss_rate)


def proxy_routes(ctx: ServiceContext, link: LinkSpec) -> list[Route]:
    """The link's routes, each listening on this service's bind host (senders dial its host)."""
    return [Route(listen_port=r.listen.port, upstream_port=r.upstream.port,
                  listen_host=ctx.spec.bind_host, upstream_host=r.upstream.host,
                  reverse=r.reverse)
            for r in link_routes(ctx.topology, link)]


def proxy_config(ctx: ServiceContext) -> ProxyConfig:
    """options.chunk_bytes: the shaping granularity (netem's default suits fast links; a slow
    demo link wants smaller chunks, or each one holds bytes back for chunk / bandwidth)."""
    default = ProxyConfig()
    return ProxyConfig(chunk_bytes=ctx.option("chunk_bytes", default.chunk_bytes))


def link_stats(source: str, link: str, stats: LinkStatistics) -> LinkStats:
    """A dashboard sample of a shaper; the egress direction is a -> b (PrfaaS -> PD). The
    simulation publishes the same samples of its in-memory links (services/sim/feed.py)."""
    params, egress = stats.params, stats.egress
    return LinkStats(
        ts=stats.time, source=source, link=link,
        bandwidth_bps=params.bandwidth_bps or 0.0, delay_s=params.delay_s,
        jitter_s=params.jitter_s, loss=params.loss_rate, up=params.up,
        throughput_bps=egress.throughput_bps, utilisation=egress.utilisation,
        queued_bytes=egress.queued_bytes, stalls=egress.stalls,
    )


async def run_link(
    ctx: ServiceContext, *, task_status: anyio.abc.TaskStatus[Address] = anyio.TASK_STATUS_IGNORED
) -> None:
    """The `link` runner of `prfaas serve`."""
    link = link_of_service(ctx)
    routes = proxy_routes(ctx, link)
    if not routes:
        raise ConfigError(f"link {link.name!r}: cluster {link.b!r} has no workers to route to")
    params = link_params(link)
    bus: EventBus[Event] = EventBus()
    node = ctx.node()
    serve_events(node, bus)

    def publish(stats: ProxyStatistics) -> None:
        bus.publish(link_stats(ctx.name, link.name, stats.link))

    async with node, anyio.create_task_group() as tg:
        address = await node.listen()
        endpoints = await tg.start(lambda task_status: serve_link(
            routes, params, ctx.option("control_port", 8474), name=link.name,
            control_host=ctx.spec.bind_host, control_names=(ctx.spec.host,),
            admin_token=token_from_env(),
            on_stats=publish, stats_interval_s=ctx.option("stats_interval", 1.0),
            config=proxy_config(ctx), task_status=task_status,
        ))
        log.info("link %s: %d routes %s, control %s", link.name, len(routes),
                 endpoints.routes, endpoints.control)
        task_status.started(address)
