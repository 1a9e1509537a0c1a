"""The demo workload on virtual time, over the fake mesh of tests/router_fakes.py."""

from __future__ import annotations

import anyio
import pytest
import trio
import trio.testing
from router_fakes import decisions, fake_mesh

from services.model.tokenizer import ByteTokenizer
from services.router.errors import RouterError
from services.router.load import DemoWorkload, WorkloadConfig, corpus_tokens

SCALE = 1 / 64  # router tokens per paper token (as tests/test_router_admin.py)


@pytest.mark.trio
async def test_demo_workload_mixes_short_and_long_and_prfaas_splits_them_at_t(
        autojump_clock: trio.testing.MockClock) -> None:
    async with fake_mesh("prfaas", {"threshold": 19400 * SCALE, "prefix_rule": "scarce"}) as mesh:
        corpus = ByteTokenizer().encode("Now is the winter of our discontent. " * 40)
        workload = DemoWorkload(mesh.scheduler, corpus, WorkloadConfig(
            scale=SCALE, max_tokens=2, max_outstanding=8, seed=3))
        async with anyio.create_task_group() as group:
            group.start_soon(workload.run)
            workload.start(rate=4.0, kind="mixed")
            await anyio.sleep(30.0)
            workload.stop()
            await anyio.sleep(5.0)
            group.cancel_scope.cancel()
        stats = workload.statistics()
        assert stats.sent > 80 and stats.failed == 0 and stats.outstanding == 0
        assert stats.completed + stats.failed == stats.sent
        made = decisions(await mesh.take_events())
        assert len(made) == stats.sent
        offloaded = [d for d in made if d.cluster == "prfaas"]
        local = [d for d in made if d.cluster == "pd"]
        assert 0.25 < len(offloaded) / len(made) < 0.75
        assert all(d.incremental_len > 19400 * SCALE for d in offloaded)
        assert all(d.incremental_len <= 19400 * SCALE for d in local)
        assert all(d.prefill_worker == "prfaas-prefill-0" for d in offloaded)
        with pytest.raises(RouterError) as bad:
            workload.start(rate=0.0)
        assert bad.value.param == "rate"




def test_corpus_tokens_are_the_training_text_or_a_built_in_one() -> None:
    tokens = corpus_tokens(ByteTokenizer(), max_chars=100)
    assert 0 < len(tokens) <= 100
