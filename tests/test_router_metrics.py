"""/metrics as the router's collector reads it from the scheduler, policy and worker table."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from router_fakes import fake_mesh, generation

from services.router.metrics import SchedulerCollector


@pytest.mark.trio
async def test_the_collector_reads_every_statistic_at_scrape_time(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 100.0}) as mesh:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SchedulerCollector(mesh.scheduler))
        await (await mesh.scheduler.submit(generation(range(1, 300), max_tokens=3))).collect()
        await (await mesh.scheduler.submit(generation(range(1, 20), max_tokens=2))).collect()
        text = generate_latest(registry).decode()
    for line in ('prfaas_router_requests_total{outcome="completed"} 2.0',
                 'prfaas_router_decisions_total{cluster="prfaas"} 1.0',
                 'prfaas_router_decisions_total{cluster="pd"} 1.0',
                 'prfaas_router_tokens_total{kind="completion"} 5.0',
                 "prfaas_router_inflight 0.0", "prfaas_router_offload_fraction 0.5",
                 "prfaas_router_threshold_tokens 100.0",
                 'prfaas_router_worker_up{role="prefill",worker="pd-prefill-0"} 1.0',
                 'prfaas_router_worker_queue{worker="prfaas-prefill-0"} 0.0'):
        assert line in text, line
