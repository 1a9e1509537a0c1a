"""A prefill worker's view of its own KV transfers (services/worker/send_meter.py)."""

from __future__ import annotations

import pytest

from services.worker.send_meter import SendMeter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_held_counts_the_time_some_job_waits_once_whatever_their_number() -> None:
    clock = Clock()
    meter = SendMeter(clock)
    clock.now = 1.0
    meter.waiting()  # job A's compute ends at 1 s
    clock.now = 2.0
    meter.waiting()  # job B's at 2 s, A still crossing
    clock.now = 3.0
    assert meter.reading().held_s == pytest.approx(2.0)  # the open span counts
    meter.crossed()
    meter.delivered(1000)
    clock.now = 4.0
    meter.crossed()
    meter.delivered(500)
    clock.now = 10.0  # nothing waits from 4 s on
    reading = meter.reading()
    assert reading.held_s == pytest.approx(3.0)  # 1 s .. 4 s, not 2 + 3 s
    assert reading.sent_bytes == 1500
    meter.check_integrity()


def test_a_job_that_crossed_at_once_holds_nothing() -> None:
    clock = Clock()
    meter = SendMeter(clock)
    clock.now = 5.0
    meter.waiting()
    meter.crossed()
    assert meter.reading().held_s == 0.0
    meter.crossed()  # one crossed too many: the books no longer balance
    with pytest.raises(AssertionError, match="-1 waiting"):
        meter.check_integrity()
