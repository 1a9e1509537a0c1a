"""Length distributions (exact vs empirical) and the Mooncake trace reader."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.data import trace_path
from services.paper.workload import (
    EmpiricalLengths,
    TraceFormatError,
    TraceRecord,
    TruncatedLogNormal,
    incremental_lengths,
    load_trace,
)

ROOT = Path(__file__).resolve().parents[1]
TRACES = trace_path().parent
CONVERSATION = TRACES / "conversation_trace.jsonl"
PAPER = TruncatedLogNormal.paper()
THRESHOLDS = (2000.0, 5000.0, 19400.0, 60000.0, 120000.0)


def simpson_partial_expectation(dist: TruncatedLogNormal, a: float, b: float,
                                n: int = 4000) -> float:
    """Slow reference: integrate x f(x) dx in u = ln x, f the truncated density."""
    mass = 0.5 * (math.erf((math.log(dist.hi) - dist.mu) / (dist.sigma * math.sqrt(2)))
                  - math.erf((math.log(dist.lo) - dist.mu) / (dist.sigma * math.sqrt(2))))
    lo, hi = math.log(max(a, dist.lo)), math.log(min(b, dist.hi))
    h = (hi - lo) / n

    def integrand(u: float) -> float:
        z = (u - dist.mu) / dist.sigma
        return math.exp(u) * math.exp(-0.5 * z * z) / (dist.sigma * math.sqrt(2 * math.pi))

    total = integrand(lo) + integrand(hi)
    total += sum((4 if i % 2 else 2) * integrand(lo + i * h) for i in range(1, n))
    return total * h / 3 / mass


def test_paper_distribution_matches_the_papers_derived_numbers() -> None:
    # docs/paper-notes.md 5.1: mean about 27.5K, P(L > 19.4K) = 0.496, E[L | L > 19.4K] about 45K.
    assert PAPER.mean() == pytest.approx(27486, abs=5)
    assert PAPER.survival(19400) == pytest.approx(0.496, abs=0.0005)
    assert PAPER.conditional_means(19400)[1] == pytest.approx(45046, abs=5)


def test_truncation_bound_reading_changes_the_mean_slightly() -> None:
    decimal = TruncatedLogNormal(9.90, 1.00, 128, 128000)
    assert decimal.mean() == pytest.approx(27313, abs=5)
    assert decimal.survival(19400) < PAPER.survival(19400)


@pytest.mark.parametrize(("a", "b"), [(128, 131072), (1000, 19400), (19400, 131072), (50, 300)])
def test_partial_expectation_matches_numerical_integration(a: float, b: float) -> None:
    assert PAPER.partial_expectation(a, b) == pytest.approx(
        simpson_partial_expectation(PAPER, a, b), rel=1e-7)


def test_cdf_and_survival_are_complementary_and_bounded() -> None:
    xs = [100, 128, 129, 1000, 19400, 100000, 131072, 200000]
    cdfs = [PAPER.cdf(x) for x in xs]
    assert cdfs == sorted(cdfs)
    assert cdfs[0] == 0.0 and cdfs[-1] == 1.0
    for x in xs:
        assert PAPER.cdf(x) + PAPER.survival(x) == pytest.approx(1.0)


def test_conditional_means_recombine_to_the_mean() -> None:
    for t in THRESHOLDS:
        p = PAPER.survival(t)
        short, long = PAPER.conditional_means(t)
        assert short <= t < long
        assert (1 - p) * short + p * long == pytest.approx(PAPER.mean(), rel=1e-12)


def test_empty_sides_take_their_limit_values() -> None:
    assert PAPER.conditional_means(math.inf) == pytest.approx((PAPER.mean(), PAPER.hi))
    assert PAPER.conditional_means(-math.inf) == pytest.approx((PAPER.lo, PAPER.mean()))


def test_quantile_inverts_cdf() -> None:
    for q in (1e-6, 0.01, 0.5, 0.9, 0.999999):
        assert PAPER.cdf(PAPER.quantile(q)) == pytest.approx(q, abs=1e-9)
    with pytest.raises(ValueError, match="q must"):
        PAPER.quantile(1.0)


def test_discretised_distribution_agrees_with_exact() -> None:
    grid = PAPER.discretise(20000)
    assert grid.mean() == pytest.approx(PAPER.mean(), rel=2e-3)
    for t in THRESHOLDS:
        assert grid.survival(t) == pytest.approx(PAPER.survival(t), abs=1e-4)
        for approx, exact in zip(grid.conditional_means(t), PAPER.conditional_means(t),
                                 strict=True):
            assert approx == pytest.approx(exact, rel=5e-3)


def test_seeded_samples_agree_with_exact_and_repeat() -> None:
    samples = PAPER.samples(random.Random(7), 40000)
    assert samples == PAPER.samples(random.Random(7), 40000)
    assert all(isinstance(x, int) and 128 <= x <= 131072 for x in samples)
    empirical = EmpiricalLengths.from_samples(samples)
    assert empirical.mean() == pytest.approx(PAPER.mean(), rel=0.02)
    for t in THRESHOLDS[:4]:
        assert empirical.survival(t) == pytest.approx(PAPER.survival(t), abs=0.01)
        for approx, exact in zip(empirical.conditional_means(t), PAPER.conditional_means(t),
                                 strict=True):
            assert approx == pytest.approx(exact, rel=0.02)


def test_inverse_cdf_sampling_matches_rejection_sampling() -> None:
    rng = random.Random(3)
    rejected: list[float] = []
    while len(rejected) < 20000:
        x = rng.lognormvariate(PAPER.mu, PAPER.sigma)
        if PAPER.lo <= x <= PAPER.hi:
            rejected.append(x)
    inverse = PAPER.samples(random.Random(4), 20000)
    assert sum(inverse) / len(inverse) == pytest.approx(sum(rejected) / len(rejected), rel=0.03)


def naive_conditional_means(values: list[float], t: float) -> tuple[float, float]:
    short = [x for x in values if x <= t]
    long = [x for x in values if x > t]
    edge = min(max(t, min(values)), max(values))
    return (sum(short) / len(short) if short else edge, sum(long) / len(long) if long else edge)


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=63), st.integers(-10, 10**6 + 10))
def test_empirical_conditional_means_match_naive_filtering(values: list[int], t: int) -> None:
    dist = EmpiricalLengths.from_samples(values)
    floats = [float(x) for x in values]
    assert dist.conditional_means(t) == pytest.approx(naive_conditional_means(floats, t))
    assert dist.survival(t) == pytest.approx(sum(x > t for x in values) / len(values))


def test_invalid_parameters_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="sigma"):
        TruncatedLogNormal(9.9, 0.0, 128, 1000)
    with pytest.raises(ValueError, match="hi"):
        TruncatedLogNormal(9.9, 1.0, 128, 100)
    with pytest.raises(ValueError, match="values"):
        EmpiricalLengths.from_samples([])
    with pytest.raises(ValueError, match="samples"):
        EmpiricalLengths.from_samples([2.0, math.nan, 1.0])


def test_conversation_trace_loads_and_matches_its_readme() -> None:
    records = load_trace(CONVERSATION)
    assert len(records) == 12031
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in records[:500])
    assert [r.timestamp for r in records] == sorted(r.timestamp for r in records)
    lengths = sorted(incremental_lengths(records))
    # README: incremental p50 2,470; 9.7 % of requests above 19.4K tokens.
    assert lengths[len(lengths) // 2] == 2470
    assert sum(x > 19400 for x in lengths) / len(lengths) == pytest.approx(0.097, abs=0.001)
    assert load_trace(CONVERSATION, limit=3) == records[:3]


def test_incremental_lengths_reuse_only_a_seen_prefix() -> None:
    records = [
        TraceRecord(0, 1200, 10, (1, 2, 3)),
        TraceRecord(1, 1300, 10, (1, 2, 4)),
        TraceRecord(2, 1200, 10, (1, 2, 3)),
        TraceRecord(3, 600, 10, (9, 2)),
    ]
    assert incremental_lengths(records) == [1200, 1300 - 1024, 0, 600]


def test_malformed_trace_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}'
    path.write_text(f"{good}\n\n{good.replace('5', '-5')}\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3"):
        load_trace(path)
    path.write_text(f"{good}\n\n{{\"timestamp\": 1}}\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:3"):
        load_trace(path)
    assert len(load_trace(path, limit=1)) == 1


# The paper's workload parameters and t* as numbers (mu, the 128K cap, t* in tokens).
PAPER_LITERALS = (9.90, 131072, 19_400)
# Router modules another change still has to move onto services.paper (issue 43): each must
# still hold a literal while it is listed, so the list shrinks as they are fixed.
PENDING: frozenset[str] = frozenset()


def paper_literals(path: Path) -> list[int]:
    """Lines of `path` holding one of PAPER_LITERALS as a code number (not in a string)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and type(node.value) in (int, float)
            and node.value in PAPER_LITERALS]


def test_paper_workload_and_t_star_are_stated_only_in_services_paper() -> None:
    found = {str(path.relative_to(ROOT)): lines
             for path in sorted((ROOT / "services").rglob("*.py"))
             if "paper" not in path.relative_to(ROOT / "services").parts[:1]
             and (lines := paper_literals(path))}
    assert set(found) == PENDING, found


def test_the_literal_scan_sees_a_paper_number(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text('"""mu 9.90"""\nMU = 9.90\nCAP = 131072.0\nT = 19400\n')
    assert paper_literals(source) == [2, 3, 4]
