"""The sliding-window rate meter behind the link's throughput figures."""

from __future__ import annotations

import pytest

from netem.rate import RateWindow


def test_a_steady_stream_reads_its_rate() -> None:
    meter = RateWindow(1.0)
    for step in range(100):  # 1,000 bytes every 0.1 s for 10 s: 10,000 B/s
        meter.add(step * 0.1 + 0.01, 1000)
    # Whole buckets of 0.1 s: the reading is off by at most one bucket's share (10%).
    for now in (9.95, 9.99, 10.0):
        assert meter.rate(now) == pytest.approx(10_000, rel=0.1)


def test_a_young_meter_averages_only_over_the_time_it_has_seen() -> None:
    meter = RateWindow(10.0)
    meter.add(100.0, 3000)
    meter.add(101.0, 3000)
    # 6,000 bytes in the first 2 s: 3,000 B/s, not 600 over the whole window.
    assert meter.rate(102.0) == pytest.approx(3000)


def test_bytes_older_than_the_window_leave_it() -> None:
    meter = RateWindow(1.0)
    meter.add(0.05, 50_000)
    for step in range(10, 20):
        meter.add(step * 0.1 + 0.05, 1000)
    assert meter.rate(1.99) == pytest.approx(10_000, rel=0.02)
    assert meter.rate(5.0) == 0.0


def test_a_burst_and_its_fall() -> None:
    meter = RateWindow(2.0, buckets=4)
    for step in range(40):  # 0.05 s apart from 0.01 s: 20 chunks a second of 500 bytes
        meter.add(step * 0.05 + 0.01, 500)
    assert meter.rate(1.99) == pytest.approx(10_000, rel=0.03)
    # Silent from 2 s on. At 3.0 the window is the current bucket and the three before it,
    # from 1.5 s: it holds the stream's last half second, 5,000 bytes over 1.5 s.
    assert meter.rate(3.0) == pytest.approx(5_000 / 1.5, rel=0.01)
    assert meter.rate(4.0) == 0.0
