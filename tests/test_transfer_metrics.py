"""The workers' KV-transfer histograms: first piece received to import done, on the receiver's
clock (virtual here: exact), the pieces' bytes, and the link and kind of the transfer."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from services.contract.messages import KVChunk, KVOpen
from services.worker.kv_in import KVAssembly
from services.worker.kv_metrics import KVTransferMetrics


def opening(start: int, purpose: str = "decode") -> KVOpen:
    return KVOpen(request_id="r", family="f", config_hash="0", dtype="float32", start=start,
                  end=128, pieces=2, purpose=purpose)  # type: ignore[arg-type]


async def transfer(metrics: KVTransferMetrics, kv: KVOpen, peer: str) -> None:
    """Opened at 0; pieces of 1,000 and 500 (modeled) bytes at 1 s and 2 s; imported at 3 s."""
    assembly = KVAssembly("r", trio.current_time())
    assembly.peer = peer
    assembly.open_lane(kv)
    for size in (1000, 500):
        await trio.sleep(1.0)
        assembly.add(KVChunk(request_id="r", layer=size, data=memoryview(b""), nbytes=size))
    await trio.sleep(1.0)
    metrics.imported(assembly)


@pytest.mark.trio
async def test_a_transfer_counts_from_its_first_piece_to_its_import(
        autojump_clock: trio.testing.MockClock) -> None:
    metrics = KVTransferMetrics("d0", lambda peer: "link-0" if peer.startswith("p") else None)
    await transfer(metrics, opening(0), "p0#1")
    await transfer(metrics, opening(64), "q0")
    await transfer(metrics, opening(64, "prefix"), "p0")
    seconds = dict(metrics.seconds.items())
    assert set(seconds) == {("d0", "link-0", "full"), ("d0", "local", "incremental"),
                            ("d0", "link-0", "prefix")}
    assert [(s.count, s.sum) for s in seconds.values()] == [(1, 2.0)] * 3
    full = metrics.bytes.labels("d0", "link-0", "full")
    assert (full.count, full.sum) == (1, 1500)
    # 1,500 bytes: the bucket (1 KiB, 2 KiB].
    assert full.counts[1] == 1
