"""mesh.histogram: bounds are inclusive (le), weighted observations, and the exposition
Prometheus parses back to the same counts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mesh.errors import ConfigError
from mesh.histogram import Histogram


def scrape(histogram: Histogram) -> dict[tuple[str, str, str], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(histogram)
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("path", ""), s.labels.get("le", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_value_on_a_bound_counts_in_that_bucket_and_above_every_bound_in_inf() -> None:
    histogram = Histogram("demo_seconds", "demo", ["path"], [0.1, 0.25, 1.0])
    series = histogram.labels("/v1")
    for value in (0.1, 0.1000001, 0.25, 7.0):
        series.observe(value)
    assert series.counts == [1, 2, 0, 1]
    got = scrape(histogram)
    assert [got["demo_seconds_bucket", "/v1", le] for le in ("0.1", "0.25", "1.0", "+Inf")] \
        == [1, 3, 3, 4]
    assert got["demo_seconds_count", "/v1", ""] == 4
    assert got["demo_seconds_sum", "/v1", ""] == pytest.approx(7.4500001)


def test_a_weighted_observation_counts_as_that_many() -> None:
    histogram = Histogram("demo_seconds", "demo", ["path"], [1.0, 2.0])
    histogram.labels("a").observe(1.5, 9)
    histogram.labels("b").observe(0.5)
    got = scrape(histogram)
    assert got["demo_seconds_bucket", "a", "1.0"] == 0
    assert got["demo_seconds_bucket", "a", "2.0"] == 9
    assert got["demo_seconds_sum", "a", ""] == pytest.approx(13.5)
    assert got["demo_seconds_count", "b", ""] == 1
    assert histogram.labels("a") is histogram.labels("a")


@pytest.mark.parametrize("buckets", [[], [2.0, 1.0], [1.0, 1.0], [1.0, float("inf")]])
def test_buckets_must_be_finite_and_increasing(buckets: list[float]) -> None:
    with pytest.raises(ConfigError, match="buckets must be finite and increasing"):
        Histogram("demo_seconds", "demo", [], buckets)


def test_label_values_must_match_the_label_names() -> None:
    with pytest.raises(ConfigError, match="takes labels"):
        Histogram("demo_seconds", "demo", ["a", "b"], [1.0]).labels("x")


def test_the_direct_exposition_parses_to_the_samples_a_registry_writes() -> None:
    histogram = Histogram("demo_seconds", 'a "doc"\\ with\nlines', ["path", "policy"],
                          [0.001, 0.025, 1.5, 600.0])
    for path, values in (('/v1 "x"\\y', [0.0005, 0.025, 0.0251, 700.0]), ("/v2\n", [3.0])):
        for value in values:
            histogram.labels(path, "prfaas").observe(value, 3)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(histogram)

    def parsed(text: str) -> list[tuple[str, str, list[tuple[str, dict[str, str], float]]]]:
        return [(f.name, f.documentation, [(s.name, s.labels, s.value) for s in f.samples])
                for f in text_string_to_metric_families(text)]

    assert parsed(histogram.exposition()) == parsed(generate_latest(registry).decode())
