"""LinkShaper: the maths on virtual time, and the fast arithmetic against the per-byte model."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import example, given, settings
from hypothesis import strategies as st

from netem.params import LinkError, LinkParamError, LinkParams
from netem.shaper import Admission, Direction, LinkShaper
from netem.shaper_naive import ChunkEvent, reference_release_times


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_shaper(
    params: LinkParams, seed: int = 0, **kwargs: bool
) -> tuple[LinkShaper, ManualClock]:
    clock = ManualClock()
    return LinkShaper(params, clock, random.Random(seed), **kwargs), clock


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("delay_s", -0.001),
        ("jitter_s", math.nan),
        ("loss_rate", 1.5),
        ("rto_s", 0.0),
        ("bandwidth_bps", -1.0),
        ("bandwidth_bps", math.inf),
        ("delay_s", True),
        ("delay_s", "5"),
    ],
)
def test_params_reject_bad_values_naming_them(field: str, value: object) -> None:
    with pytest.raises(LinkParamError, match=rf"{field} must be .* got {value!r}"):
        LinkParams(**{field: value})  # type: ignore[arg-type]


def test_params_decode_validates_and_round_trips() -> None:
    params = LinkParams(bandwidth_bps=1e9, delay_s=0.02, jitter_s=0.001, loss_rate=0.01, up=False)
    assert msgspec.json.decode(msgspec.json.encode(params), type=LinkParams) == params
    with pytest.raises(msgspec.ValidationError, match="loss_rate"):
        msgspec.json.decode(b'{"loss_rate": -1}', type=LinkParams)
    assert LinkParams().transparent
    assert not LinkParams(up=False).transparent
    assert not LinkParams(bandwidth_bps=1.0).transparent


def test_100_mb_at_1_gbps_with_20_ms_delay_takes_820_ms() -> None:
    shaper, clock = make_shaper(LinkParams(bandwidth_bps=1e9, delay_s=0.020))
    flow = shaper.open_flow(Direction.EGRESS)
    chunk, total = 64 * 1024, 100_000_000
    last = None
    for offset in range(0, total, chunk):
        last = shaper.admit(flow, min(chunk, total - offset))
    assert last is not None
    assert last.wire_done == pytest.approx(0.8, rel=1e-9)
    assert last.release == pytest.approx(0.82, rel=0.01)
    clock.now = last.release
    shaper.released(flow, total)
    shaper.check_integrity()
    assert shaper.statistics().egress.bytes_out == total


@pytest.mark.trio
async def test_100_mb_release_schedule_on_autojump_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A consumer sleeping on trio's virtual clock sees the last byte at 0.8 s + 20 ms."""
    shaper = LinkShaper(
        LinkParams(bandwidth_bps=1e9, delay_s=0.020), trio.current_time, random.Random(0)
    )
    flow = shaper.open_flow(Direction.EGRESS)
    chunk = 1 << 20
    sizes = [chunk] * (100_000_000 // chunk) + [100_000_000 % chunk]
    releases = [shaper.admit(flow, n).release for n in sizes]
    for n, release in zip(sizes, releases, strict=True):
        await trio.sleep_until(release)
        shaper.released(flow, n)
    assert trio.current_time() == pytest.approx(0.82, rel=0.01)
    stats = shaper.statistics().egress
    assert stats.queued_bytes == 0
    assert stats.throughput_bps == pytest.approx(1e9, rel=0.05)
    assert stats.utilisation == pytest.approx(1.0, rel=0.05)


def test_jitter_varies_delay_but_never_reorders_a_flow() -> None:
    shaper, clock = make_shaper(LinkParams(delay_s=0.010, jitter_s=0.008), seed=7)
    flows = [shaper.open_flow(Direction.EGRESS) for _ in range(3)]
    releases: list[list[float]] = [[], [], []]
    gaps = []
    for step in range(300):
        clock.now = step * 0.0005
        release = shaper.admit(flows[step % 3], 100).release
        releases[step % 3].append(release)
        gaps.append(release - clock.now)
    for flow_releases in releases:
        assert flow_releases == sorted(flow_releases)
    assert max(gaps) - min(gaps) > 0.010
    assert min(gaps) >= 0.002


def test_loss_stalls_are_seeded_and_counted() -> None:
    params = LinkParams(loss_rate=0.1, rto_s=0.2)
    counts = []
    for _ in range(2):
        shaper, clock = make_shaper(params, seed=42)
        flow = shaper.open_flow(Direction.EGRESS)
        stalled = 0
        for step in range(1000):
            clock.now = step * 1.0
            stalled += shaper.admit(flow, 10).release - clock.now > 0.1
        stats = shaper.statistics().egress
        assert stats.stalls == stalled
        assert stats.stall_s == pytest.approx(0.2 * stalled)
        counts.append(stalled)
    assert counts[0] == counts[1]
    assert 60 <= counts[0] <= 140


def test_outage_pauses_the_link_then_recovers() -> None:
    shaper, clock = make_shaper(LinkParams(delay_s=0.010))
    flow = shaper.open_flow(Direction.EGRESS)
    release = shaper.admit(flow, 100).release
    assert shaper.wall_time(release) == pytest.approx(0.010)
    clock.now = 0.005
    shaper.set_params(msgspec.structs.replace(shaper.params, up=False))
    assert shaper.wall_time(release) == math.inf
    assert not shaper.transparent(Direction.EGRESS)
    clock.now = 0.5
    late = shaper.admit(flow, 100).release
    shaper.check_integrity()
    clock.now = 1.005
    shaper.set_params(msgspec.structs.replace(shaper.params, up=True))
    assert shaper.wall_time(release) == pytest.approx(1.010)
    # A chunk that arrived during the outage waits for the link to return, plus the delay.
    assert shaper.wall_time(late) == pytest.approx(1.015)
    stats = shaper.statistics()
    assert stats.outages == 1
    assert stats.down_s == pytest.approx(1.0)
    shaper.check_integrity()


def test_live_bandwidth_change_retimes_the_backlog_from_now() -> None:
    shaper, clock = make_shaper(LinkParams(bandwidth_bps=8e6))
    flow = shaper.open_flow(Direction.EGRESS)
    first, second = shaper.admit(flow, 1000), shaper.admit(flow, 1000)
    assert (first.wire_done, second.wire_done) == pytest.approx((0.001, 0.002))
    calls: list[LinkParams] = []
    shaper.add_listener(calls.append)
    clock.now = 0.0005
    shaper.set_params(LinkParams(bandwidth_bps=80e6))
    # Half of the first chunk has left at 8 Mbit/s; its other 500 bytes go at 80 Mbit/s.
    assert first.wire_done == pytest.approx(0.0005 + 500 * 8 / 80e6)
    assert second.wire_done == pytest.approx(0.00055 + 1000 * 8 / 80e6)
    assert shaper.admit(flow, 1000).wire_done == pytest.approx(0.00075)
    assert calls == [LinkParams(bandwidth_bps=80e6)]
    clock.now = 0.0006
    shaper.set_params(LinkParams())
    assert shaper.transparent(Direction.EGRESS)
    # First has left the wire and keeps its time; the rest drain at once, in order.
    assert first.release == pytest.approx(0.00055)
    assert second.release == pytest.approx(0.0006)
    assert shaper.admit(flow, 1000).release == pytest.approx(0.0006)
    assert shaper.statistics().egress.wire_backlog_s == 0.0
    shaper.check_integrity()


def test_delay_change_applies_to_bytes_still_on_the_wire_only() -> None:
    shaper, clock = make_shaper(LinkParams(bandwidth_bps=8e3, delay_s=5.0))
    flow = shaper.open_flow(Direction.EGRESS)
    sent, waiting = shaper.admit(flow, 1000), shaper.admit(flow, 1000)
    clock.now = 1.5
    shaper.set_params(LinkParams(bandwidth_bps=8e3, delay_s=0.1))
    assert sent.release == pytest.approx(6.0)
    # FIFO per flow: the second chunk may not overtake the first one's 5 s delay.
    assert waiting.wire_done == pytest.approx(2.0)
    assert waiting.release == pytest.approx(6.0)
    other = shaper.open_flow(Direction.EGRESS)
    assert shaper.admit(other, 1000).release == pytest.approx(3.1)


def test_slow_link_recovers_when_the_rate_is_restored() -> None:
    """Issue 13: 10 s at 1 kbit/s with 3 MB offered, then 1 Gbit/s: the backlog drains now."""
    shaper, clock = make_shaper(LinkParams(bandwidth_bps=1e3, delay_s=0.02))
    flow = shaper.open_flow(Direction.EGRESS)
    offered = [shaper.admit(flow, 64 * 1024) for _ in range(3_000_000 // (64 * 1024))]
    total = 64 * 1024 * len(offered)
    assert offered[-1].release == pytest.approx(total * 8 / 1e3 + 0.02)
    clock.now = 10.0
    shaper.set_params(LinkParams(bandwidth_bps=1e9, delay_s=0.02))
    # 1,250 bytes left in 10 s at 1 kbit/s; the rest leave from t = 10 s at 1 Gbit/s.
    drained = 10.0 + (total - 1250) * 8 / 1e9
    assert offered[-1].wire_done == pytest.approx(drained, rel=1e-12)
    assert offered[-1].release == pytest.approx(drained + 0.02, rel=1e-12)
    assert shaper.statistics().egress.wire_backlog_s == pytest.approx(drained - 10.0)
    clock.now = drained
    after = shaper.admit(shaper.open_flow(Direction.EGRESS), 1_000_000)
    assert after.release == pytest.approx(drained + 0.008 + 0.02, rel=1e-12)
    shaper.check_integrity()


def test_ingress_can_be_left_unshaped_but_not_immune_to_outages() -> None:
    shaper, _ = make_shaper(LinkParams(bandwidth_bps=8e3, delay_s=1.0), shape_ingress=False)
    ingress = shaper.open_flow(Direction.INGRESS)
    assert shaper.transparent(Direction.INGRESS)
    assert not shaper.transparent(Direction.EGRESS)
    assert shaper.admit(ingress, 10_000).release == 0.0
    shaper.set_params(LinkParams(up=False))
    assert not shaper.transparent(Direction.INGRESS)


def test_statistics_throughput_utilisation_and_drops() -> None:
    shaper, clock = make_shaper(LinkParams(bandwidth_bps=8e6))
    flow = shaper.open_flow(Direction.EGRESS)
    for step in range(40):
        clock.now = step * 0.1
        admission = shaper.admit(flow, 50_000)
        clock.now = admission.release
        shaper.released(flow, 50_000)
    stats = shaper.statistics().egress
    assert stats.throughput_bps == pytest.approx(4e6, rel=0.15)
    assert stats.utilisation == pytest.approx(0.5, rel=0.15)
    shaper.admit(flow, 7)
    assert shaper.statistics().egress.queued_bytes == 7
    shaper.close_flow(flow)
    stats = shaper.statistics().egress
    assert (stats.bytes_dropped, stats.queued_bytes, stats.flows) == (7, 0, 0)
    shaper.check_integrity()


def test_releasing_more_than_queued_is_an_error() -> None:
    shaper, _ = make_shaper(LinkParams(delay_s=0.1))
    flow = shaper.open_flow(Direction.EGRESS)
    shaper.admit(flow, 10)
    with pytest.raises(LinkError, match="released 11 bytes"):
        shaper.released(flow, 11)


def run_fast(
    chunks: list[ChunkEvent],
    params: LinkParams,
    seed: int,
    outages: list[tuple[float, float]],
    changes: Sequence[tuple[float, LinkParams]] = (),
) -> list[float]:
    """Drive LinkShaper through arrivals, outages and changes in time order; wall releases."""
    shaper, clock = make_shaper(params, seed=seed)
    flows = {key: shaper.open_flow(Direction.EGRESS) for key in {c.flow for c in chunks}}
    events: list[tuple[float, str, int]] = [(c.arrival, "chunk", i) for i, c in enumerate(chunks)]
    events += [(t, kind, -1) for a, b in outages for t, kind in ((a, "down"), (b, "up"))]
    events += [(t, "change", i) for i, (t, _) in enumerate(changes)]
    admitted: dict[int, Admission] = {}
    walls = [math.nan] * len(chunks)
    for time, kind, index in sorted(events):
        clock.now = time
        if kind == "chunk":
            admitted[index] = shaper.admit(flows[chunks[index].flow], chunks[index].nbytes)
        elif kind == "change":
            shaper.set_params(msgspec.structs.replace(changes[index][1], up=shaper.params.up))
        else:
            if kind == "down":
                # Chunks whose time came before the outage have left; the rest wait it out.
                for i, admission in list(admitted.items()):
                    if shaper.wall_time(admission.release) <= time:
                        walls[i] = shaper.wall_time(admission.release)
                        del admitted[i]
            shaper.set_params(msgspec.structs.replace(shaper.params, up=kind == "up"))
    for i, admission in admitted.items():
        walls[i] = shaper.wall_time(admission.release)
    shaper.check_integrity()
    return walls


chunk_lists = st.lists(
    st.tuples(st.integers(0, 20), st.integers(0, 2), st.integers(1, 120)), min_size=1, max_size=25
)
param_sets = st.builds(
    LinkParams,
    bandwidth_bps=st.sampled_from([None, 0.0, 1e5, 3e5, 8e6]),
    delay_s=st.sampled_from([0.0, 0.0013, 0.02]),
    jitter_s=st.sampled_from([0.0, 0.0007, 0.03]),
    loss_rate=st.sampled_from([0.0, 0.3]),
    rto_s=st.sampled_from([0.2, 0.05]),
)


def chunk_events(raw: list[tuple[int, int, int]]) -> list[ChunkEvent]:
    chunks, time = [], 0.0
    for gap, flow, nbytes in raw:
        time += gap * 1e-3
        chunks.append(ChunkEvent(time, flow, nbytes))
    return chunks


def outage_spans(outage_slots: list[int]) -> list[tuple[float, float]]:
    slots = sorted(outage_slots)
    # Outage edges sit on half-millisecond offsets so they never tie with an arrival.
    outages = [(s * 1e-3 + 5e-4, s * 1e-3 + 5e-4 + 0.0021) for s in slots]
    return [o for i, o in enumerate(outages) if i == 0 or o[0] > outages[i - 1][1]]


@settings(max_examples=80, deadline=None)
@given(
    raw=chunk_lists,
    params=param_sets,
    seed=st.integers(0, 1000),
    outage_slots=st.lists(st.integers(0, 60), max_size=4, unique=True),
)
def test_fast_arithmetic_equals_per_byte_reference(
    raw: list[tuple[int, int, int]], params: LinkParams, seed: int, outage_slots: list[int]
) -> None:
    chunks, outages = chunk_events(raw), outage_spans(outage_slots)
    fast = run_fast(chunks, params, seed, outages)
    slow = reference_release_times(chunks, params, random.Random(seed), outages)
    assert fast == pytest.approx(slow, abs=1e-9)


def _time(change: tuple[float, LinkParams]) -> float:
    return change[0]


@settings(max_examples=120, deadline=None)
@given(
    raw=chunk_lists,
    params=param_sets,
    seed=st.integers(0, 1000),
    outage_slots=st.lists(st.integers(0, 60), max_size=3, unique=True),
    # One change per instant: two at once are one change, and a zero-length rate in between
    # (unshaped, then shaped again) is where per-byte and per-bit accounting part by a byte.
    change_list=st.lists(st.tuples(st.integers(0, 80), param_sets), max_size=4,
                         unique_by=lambda change: change[0]),
)
# Found by hypothesis in a soak run: a chunk admitted during an outage on an unshaped link
# kept the delay in force at its admission although the delay changed again before the
# link came back (the shaper counted it as off the wire at the frozen link time).
@example(raw=[(1, 0, 1)], params=LinkParams(bandwidth_bps=None, delay_s=0.0), seed=0,
         outage_slots=[0],
         change_list=[(0, LinkParams(bandwidth_bps=None, delay_s=0.0013)),
                      (1, LinkParams(bandwidth_bps=None, delay_s=0.0))])
# Its sibling: the link turns shaped during that outage, and the waiting chunk must still
# cross at the new rate when the link returns (it had sent nothing).
@example(raw=[(1, 0, 1)], params=LinkParams(bandwidth_bps=None), seed=0, outage_slots=[0],
         change_list=[(0, LinkParams(bandwidth_bps=None)),
                      (1, LinkParams(bandwidth_bps=100_000.0))])
def test_rate_and_delay_changes_mid_flight_equal_per_byte_reference(
    raw: list[tuple[int, int, int]],
    params: LinkParams,
    seed: int,
    outage_slots: list[int],
    change_list: list[tuple[int, LinkParams]],
) -> None:
    chunks, outages = chunk_events(raw), outage_spans(outage_slots)
    # Changes sit on quarter-millisecond offsets: never tied with an arrival or outage edge.
    # Jitter and loss stay as they were: this test is about rates and delays (the random
    # draws of a chunk waiting out an outage on an unshaped link differ in the reference
    # when jitter or loss change meanwhile).
    kept = {"jitter_s": params.jitter_s, "loss_rate": params.loss_rate, "rto_s": params.rto_s}
    changes = sorted(((slot * 1e-3 + 2.5e-4, msgspec.structs.replace(new, **kept))
                      for slot, new in change_list), key=_time)
    fast = run_fast(chunks, params, seed, outages, changes)
    slow = reference_release_times(chunks, params, random.Random(seed), outages, changes)
    assert fast == pytest.approx(slow, abs=1e-9)
