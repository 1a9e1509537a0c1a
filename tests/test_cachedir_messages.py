"""Tests for services.contract.messages: every message round-trips msgpack."""

from __future__ import annotations

import msgspec
import pytest

from services.cachedir.directory import CacheDirectory, CacheEvent
from services.contract.messages import (
    BlockRun,
    BlocksEvicted,
    BlocksStored,
    ClusterMatch,
    PrefixMatch,
    PrefixQuery,
    TransferPlan,
    WorkerMatch,
    WorkerReport,
)
from services.contract.prefix import MAX_HASH


def test_messages_round_trip_msgpack() -> None:
    run = BlockRun([0, MAX_HASH, 7], [2], first=3, parent=MAX_HASH - 1)
    messages: list[object] = [
        run,
        BlocksStored("w0", [run, BlockRun([5])]),
        BlocksEvicted("w0", [MAX_HASH], snapshots_only=True),
        WorkerReport("w0", "pd", "decode", [run]),
        PrefixQuery([1, 2, MAX_HASH], role="prefill"),
        PrefixMatch(3, [WorkerMatch("w0", "pd", "decode", 2, 1)], [ClusterMatch("pd", 2, 1, "w0")]),
        TransferPlan(3, "w0", 1, 0, "w1", 3, True, [1, 2], True),
        CacheEvent("stored", "w0", "pd", 3, 1, 9, 1.5),
        CacheDirectory({"w0": "pd"}).statistics(),
    ]
    for message in messages:
        encoded = msgspec.msgpack.encode(message)
        assert msgspec.msgpack.decode(encoded, type=type(message)) == message
    report = BlocksStored | BlocksEvicted | WorkerReport
    for message in messages[1:4]:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=report) == message
    too_big = msgspec.msgpack.encode(BlocksEvicted("w", [MAX_HASH + 1]))
    with pytest.raises(msgspec.ValidationError, match=r"\$.hashes\[0\]"):
        msgspec.msgpack.decode(too_big, type=BlocksEvicted)
