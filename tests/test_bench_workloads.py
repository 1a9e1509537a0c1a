"""Bench workloads and arrivals: seeded, prefix-preserving, scaled and capped."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from services.bench.arrivals import gamma_arrivals, poisson_arrivals, trace_arrivals
from services.bench.errors import BenchError
from services.bench.workloads import (
    FALLBACK_TEXT,
    AgentShape,
    Scaling,
    WordSource,
    agent_sessions,
    lognormal_sessions,
    next_prompt,
    trace_prompt,
    trace_sessions,
)
from services.paper.workload import TraceRecord

WORDS = WordSource(FALLBACK_TEXT.split())
SCALING = Scaling(scale=1 / 16, max_context=4096, tokens_per_word=1.0)


def record(ids: list[int], length: int, out: int = 64, ts: int = 0) -> TraceRecord:
    return TraceRecord(timestamp=ts, input_length=length, output_length=out, hash_ids=tuple(ids))


def test_word_spans_are_seeded_and_wrap() -> None:
    assert WORDS.span(7, 30) == WordSource(FALLBACK_TEXT.split()).span(7, 30)
    assert WORDS.span(7, 30) != WORDS.span(8, 30)
    assert len(WORDS.span(3, 1000).split(" ")) == 1000  # longer than the list: wraps
    assert WORDS.span(3, 0) == ""
    with pytest.raises(BenchError, match="words must hold at least one word"):
        WordSource([])


def test_equal_hash_ids_give_equal_text_and_shared_prefixes() -> None:
    budget = 4000
    a, _ = trace_prompt(record([1, 2, 3], 1536), words=WORDS, scaling=SCALING, budget=budget)
    b, _ = trace_prompt(record([1, 2, 9, 10], 2000), words=WORDS, scaling=SCALING, budget=budget)
    c, _ = trace_prompt(record([1, 2, 3], 1536), words=WORDS, scaling=SCALING, budget=budget)
    assert a == c
    block = 512 // 16  # 32 words per block at 1 token per word
    shared = " ".join(a.split(" ")[: 2 * block])
    assert b.startswith(shared + " ") and a.startswith(shared + " ")
    assert a[len(shared):] != b[len(shared):]  # block 3 differs: ids 3 and 9
    other_seed, _ = trace_prompt(record([1, 2, 3], 1536), words=WORDS, scaling=SCALING,
                                 budget=budget, seed=1)
    assert other_seed != a


def test_trace_prompt_scales_blocks_and_the_partial_tail() -> None:
    text, planned = trace_prompt(record([5, 6, 7], 1100), words=WORDS, scaling=SCALING,
                                 budget=10_000)
    # 512 + 512 + 76 trace tokens -> 32 + 32 + ceil(4.75) = 69 served tokens (1 word each).
    assert planned == 69 and len(text.split(" ")) == 69
    full, _ = trace_prompt(record([5, 6, 7], 1536), words=WORDS, scaling=SCALING, budget=10_000)
    assert full.startswith(text)  # a partial block is the start of the same id's full block


def test_trace_sessions_cap_context_and_keep_outputs() -> None:
    scaling = Scaling(scale=1.0, max_context=600, tokens_per_word=1.0)
    records = [record([1, 2], 1000, out=100), record([3], 10, out=5000)]
    sessions = trace_sessions(records, [0.0, 1.5], words=WORDS, scaling=scaling)
    first, second = (s.turns[0] for s in sessions)
    assert first.max_tokens == 100 and first.planned_tokens == 500  # 600 - 100
    assert second.max_tokens == 599 and second.planned_tokens == 1  # output capped first
    assert [s.arrival_s for s in sessions] == [0.0, 1.5]
    with pytest.raises(BenchError, match="arrivals must have one time per record"):
        trace_sessions(records, [0.0], words=WORDS, scaling=scaling)


def test_lognormal_sessions_are_seeded_scaled_and_capped() -> None:
    scaling = Scaling(scale=1 / 64, max_context=1024)
    make = lambda seed: lognormal_sessions(  # noqa: E731
        [0.0] * 200, rng=random.Random(seed), words=WORDS, scaling=scaling, seed=seed)
    a, b, c = make(1), make(1), make(2)
    assert a == b and a != c
    planned = [s.turns[0].planned_tokens for s in a]
    assert max(planned) <= 1024 - 16 and min(planned) >= 2  # 128 / 64, 1024 out / 64
    # The paper's mean, about 27.5K tokens, scaled by 1/64 (capped tail pulls it down a bit).
    assert 300 < statistics.mean(planned) < 470
    assert {s.turns[0].max_tokens for s in a} == {16}


def test_agent_prompts_grow_by_answer_and_new_text() -> None:
    (session,) = agent_sessions([0.0], rng=random.Random(0), words=WORDS, scaling=SCALING,
                                shape=AgentShape(turns=3, think_s=2.0))
    assert len(session.turns) == 3
    assert [t.think_s for t in session.turns] == [0.0, 2.0, 2.0]
    prompt, prompts = "", []
    for k, turn in enumerate(session.turns):
        prompt = next_prompt(prompt, f" answer{k - 1}" if k else "", turn.text)
        prompts.append(prompt)
    for shorter, longer in itertools.pairwise(prompts):
        assert longer.startswith(shorter) and len(longer) > len(shorter)
    assert " answer0\n" in prompts[1]


def test_agent_turns_stop_at_the_context_cap() -> None:
    scaling = Scaling(scale=1.0, max_context=3000, tokens_per_word=1.0)
    shape = AgentShape(turns=10, first_tokens=1000, turn_tokens=200, output_len=100)
    (session,) = agent_sessions([0.0], rng=random.Random(0), words=WORDS, scaling=scaling,
                                shape=shape)
    context = 0
    for k, turn in enumerate(session.turns):
        context += turn.planned_tokens + (100 if k else 0)
        assert context + 100 <= 3000
    assert 1 < len(session.turns) < 10


def test_poisson_and_gamma_arrivals_keep_the_mean_rate() -> None:
    poisson = poisson_arrivals(4000, 5.0, random.Random(0))
    assert poisson[0] == 0.0 and poisson == sorted(poisson)
    assert 4000 / poisson[-1] == pytest.approx(5.0, rel=0.05)
    bursty = gamma_arrivals(4000, 5.0, 0.25, random.Random(0))
    assert 4000 / bursty[-1] == pytest.approx(5.0, rel=0.15)
    gaps = lambda t: [b - a for a, b in itertools.pairwise(t)]  # noqa: E731
    # Coefficient of variation: 1 for Poisson, 1/sqrt(0.25) = 2 for burstiness 0.25.
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)  # noqa: E731
    assert cv(gaps(poisson)) == pytest.approx(1.0, abs=0.1)
    assert cv(gaps(bursty)) == pytest.approx(2.0, abs=0.3)
    assert gamma_arrivals(3, float("inf"), 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


def test_trace_arrivals_speed_up() -> None:
    assert trace_arrivals([1000, 1000, 3000, 9000], speedup=2.0) == [0.0, 0.0, 1.0, 4.0]
    assert trace_arrivals([]) == []


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gamma_arrivals(3, 0.0, 1.0, random.Random()), "rate must be > 0"),
        (lambda: gamma_arrivals(3, 1.0, -1.0, random.Random()), "burstiness must be a finite"),
        (lambda: gamma_arrivals(-1, 1.0, 1.0, random.Random()), "n must be >= 0, got -1"),
        (lambda: trace_arrivals([1], speedup=0.0), "speedup must be a finite number > 0"),
        (lambda: Scaling(scale=0.0), "scale must be a finite number > 0, got 0.0"),
        (lambda: Scaling(max_context=1), "max_context must be >= 2, got 1"),
        (lambda: AgentShape(turns=0), "turns must be >= 1, got 0"),
    ],
)
def test_bad_options_are_named(call: object, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        call()  # type: ignore[operator]
