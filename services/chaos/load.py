"""Requests with deadlines, each sorted into exactly one outcome.

    completed  200 and a whole answer (a stream that ends with `data: [DONE]`)
    error      an explicit refusal: HTTP >= 400, or an error object inside the stream
    hung       no answer by its deadline (the client gave up)
    lost       neither answer nor error: the connection refused, reset or closed early,
               or a stream that ended without [DONE] and without an error
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from typing import Literal

import anyio
import httpx
import msgspec

Outcome = Literal["completed", "error", "hung", "lost"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "error", "hung", "lost")


class Result(msgspec.Struct, frozen=True):
    outcome: Outcome
    status: int | None  # the HTTP status, None when none arrived
    sent: float  # monotonic seconds
    admitted: float | None  # when the status line arrived: the admission decision
    done: float
    detail: str = ""


class LoadConfig(msgspec.Struct, frozen=True, kw_only=True):
    deadline_s: float = 30.0
    max_tokens: int = 8
    short_chars: int = 200  # stays in the PD cluster (t is about 600 router tokens)
    long_chars: int = 4000  # about 900 tokens: offloaded to the PrfaaS cluster
    rate: float = 4.0  # requests per second of the background load


def prompt(rng: random.Random, chars: int) -> str:
    words = ("ROMEO", "JULIET", "thou", "art", "the", "sun", "and", "moon", "night", "day")
    text = ""
    while len(text) < chars:
        text += rng.choice(words) + " "
    return text[:chars]


def completion_body(rng: random.Random, config: LoadConfig) -> dict[str, object]:
    chars = config.long_chars if rng.random() < 0.5 else config.short_chars
    return {"model": "prfaas", "prompt": prompt(rng, chars), "max_tokens": config.max_tokens,
            "stream": True, "temperature": 0}


async def send_one(client: httpx.AsyncClient, body: dict[str, object],
                   deadline_s: float) -> Result:
    """One streaming completion, sorted into its outcome (module docstring)."""
    sent = time.monotonic()
    status: int | None = None
    admitted: float | None = None
    with anyio.move_on_after(deadline_s) as scope:
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                status, admitted = response.status_code, time.monotonic()
                if status >= 400:
                    await response.aread()
                    return Result("error", status, sent, admitted, time.monotonic(),
                                  response.text[:200])
                outcome, detail = await _read_stream(response)
                return Result(outcome, status, sent, admitted, time.monotonic(), detail)
        except httpx.HTTPError as exc:
            return Result("lost", status, sent, admitted, time.monotonic(), repr(exc)[:200])
    assert scope.cancelled_caught
    return Result("hung", status, sent, admitted, time.monotonic(), "deadline passed")


async def _read_stream(response: httpx.Response) -> tuple[Outcome, str]:
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            return "completed", ""
        if line.startswith("data: ") and '"error"' in line:
            try:
                if "error" in json.loads(line[6:]):
                    return "error", line[6:200]
            except json.JSONDecodeError:
                return "lost", f"unreadable event {line[:100]!r}"
    return "lost", "stream ended without [DONE] or an error"


class Load:
    """A background load at `rate` requests per second until stopped; keeps every result."""

    def __init__(self, client: httpx.AsyncClient, config: LoadConfig, seed: int = 0) -> None:
        self.client, self.config = client, config
        self.rng = random.Random(seed)
        self.results: list[Result] = []
        self.sent = 0

    async def _one(self) -> None:
        body = completion_body(self.rng, self.config)
        self.results.append(await send_one(self.client, body, self.config.deadline_s))

    async def run(self, duration_s: float) -> None:
        """Sends for `duration_s`, then waits for every request's outcome."""
        async with anyio.create_task_group() as tg:
            end = time.monotonic() + duration_s
            while time.monotonic() < end:
                self.sent += 1
                tg.start_soon(self._one)
                await anyio.sleep(1.0 / self.config.rate)

    async def burst(self, count: int) -> None:
        """`count` requests at once; returns when every one has its outcome."""
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                self.sent += 1
                tg.start_soon(self._one)


# The share of the admission limit the background load keeps busy in steady state (Little's
# law: rate x latency requests in flight). A fault slows the requests it moves (migration
# re-prefills them), so the rest of the limit is the room a failover needs before it would
# be refused; the overload scenarios, not the faults, are what fill the limit. At 30% a kill
# on a fast warm-up (3.8 req/s at 0.31 s) filled the limit of 4 for a moment and was answered
# 429 five times in two scenarios; at 20% a failover's half second of re-prefill fits.
LOAD_OCCUPANCY = 0.2


def sized_rate(results: Sequence[Result], max_inflight: int, ceiling: float) -> float:
    """Requests per second that keep `LOAD_OCCUPANCY` of the admission limit in flight, at the
    mean latency of the completed `results` (a warm-up's): at most `ceiling`, at least 0.25."""
    latencies = [r.done - r.sent for r in results if r.outcome == "completed"]
    if not latencies:
        raise ValueError("no completed request to size the load from")
    mean = sum(latencies) / len(latencies)
    return max(0.25, min(ceiling, LOAD_OCCUPANCY * max_inflight / mean))


def counts(results: Sequence[Result]) -> dict[str, int]:
    return {outcome: sum(r.outcome == outcome for r in results) for outcome in OUTCOMES}
