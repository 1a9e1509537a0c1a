"""The router's built-in demo load (POST /admin/workload): Poisson arrivals of corpus prompts.

`DemoWorkload` sends requests through the scheduler like any client, open loop but bounded
(`max_outstanding`); `corpus_tokens` gives it text to cut prompts from.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import msgspec

from mesh.errors import ConfigError
from services.contract.sampling import Sampling
from services.contract.types import DEFAULT_TOKEN_SCALE
from services.model.tokenizer import TokenizerLike, default_corpus_path
from services.paper.workload import (
    PAPER_MAX_TOKENS,
    PAPER_MIN_TOKENS,
    PAPER_MU,
    PAPER_SIGMA,
    TruncatedLogNormal,
)
from services.router.errors import InvalidRequest, RouterError
from services.router.requests import GenerationRequest

if TYPE_CHECKING:
    from services.router.scheduler import Scheduler

log = logging.getLogger(__name__)


class WorkloadConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Router tokens per paper token (the paper's lengths, scaled down).
    scale: float = DEFAULT_TOKEN_SCALE
    max_prompt: int = 4000
    max_tokens: int = 32
    max_outstanding: int = 16  # open loop, but bounded: arrivals beyond it are dropped
    max_rate: float = 100.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("scale", "max_prompt", "max_tokens", "max_outstanding", "max_rate"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")


WORKLOAD_KINDS = ("mixed", "short", "long")


class WorkloadStatistics(msgspec.Struct, frozen=True):
    running: bool
    rate: float
    kind: str
    outstanding: int
    sent: int
    completed: int
    failed: int
    dropped: int  # arrivals skipped because max_outstanding requests were open


class DemoWorkload:
    """The built-in demo load: open-loop Poisson arrivals of corpus prompts, bounded.

    Prompt lengths follow the paper's log-normal (services.paper.workload, section 4.1)
    times `scale`, so "mixed" straddles the default threshold the way the paper's workload
    straddles t*; "short" and "long" keep the halves below and above its median.
    Prompts are spans of the tokenized corpus at random offsets.
    """

    def __init__(self, scheduler: Scheduler, corpus: Sequence[int],
                 config: WorkloadConfig | None = None) -> None:
        if not corpus:
            raise ConfigError("corpus must hold at least one token, got none")
        self.scheduler = scheduler
        self.config = cfg = config or WorkloadConfig()
        self._corpus = list(corpus)
        self._lengths = TruncatedLogNormal(
            PAPER_MU + math.log(cfg.scale), PAPER_SIGMA, PAPER_MIN_TOKENS * cfg.scale,
            min(PAPER_MAX_TOKENS * cfg.scale, cfg.max_prompt))
        self._rng = random.Random(cfg.seed)
        self._wake = anyio.Event()
        self.rate, self.kind, self.running = 0.0, "mixed", False
        self._counts = dict.fromkeys(("sent", "completed", "failed", "dropped"), 0)
        self._outstanding = 0

    def start(self, rate: float, kind: str = "mixed") -> None:
        if not (math.isfinite(rate) and 0 < rate <= self.config.max_rate):
            raise InvalidRequest(f"rate must be in (0, {self.config.max_rate:g}] requests per "
                                 f"second, got {rate!r}", param="rate")
        if kind not in WORKLOAD_KINDS:
            raise InvalidRequest(f"kind must be one of {', '.join(WORKLOAD_KINDS)}, got "
                                 f"{kind!r}", param="kind")
        self.rate, self.kind, self.running = rate, kind, True
        self._wake.set()

    def stop(self) -> None:
        self.running = False

    def statistics(self) -> WorkloadStatistics:
        return WorkloadStatistics(running=self.running, rate=self.rate, kind=self.kind,
                                  outstanding=self._outstanding, **self._counts)

    async def run(self) -> None:
        """Sends requests while started, until cancelled; owns every request it sends."""
        async with anyio.create_task_group() as group:
            while True:
                while not self.running:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                await anyio.sleep(self._rng.expovariate(self.rate))
                self._arrive(group)

    def _arrive(self, group: anyio.abc.TaskGroup) -> None:
        if not self.running:
            return
        if self._outstanding >= self.config.max_outstanding:
            self._counts["dropped"] += 1
            return
        self._outstanding += 1
        group.start_soon(self._one, self._prompt())

    def _length(self) -> int:
        median = self._lengths.quantile(0.5)
        while True:
            n = self._lengths.sample(self._rng)
            if self.kind == "mixed" or (n <= median) == (self.kind == "short"):
                return max(1, n)

    def _prompt(self) -> list[int]:
        n, corpus = self._length(), self._corpus
        start = self._rng.randrange(len(corpus))
        return [corpus[(start + i) % len(corpus)] for i in range(n)]

    async def _one(self, prompt: list[int]) -> None:
        sampling = Sampling(max_tokens=self.config.max_tokens, temperature=0.0)
        self._counts["sent"] += 1
        number = self._counts["sent"]
        try:
            handle = await self.scheduler.submit(GenerationRequest(prompt=prompt,
                                                                   sampling=sampling))
            await handle.collect()
            self._counts["completed"] += 1
        except RouterError as exc:
            self._counts["failed"] += 1
            log.info("demo request %d failed: %s", number, exc.message)
        finally:
            self._outstanding -= 1


def corpus_tokens(tokenizer: TokenizerLike, max_chars: int = 400_000) -> list[int]:
    """The demo workload's text: the training corpus, else a short built-in text."""
    path = default_corpus_path()
    try:
        text = path.read_text(encoding="utf-8")[:max_chars]
    except OSError as exc:
        log.warning("corpus %s unavailable (%s): the demo load uses a built-in text", path, exc)
        text = "To be, or not to be, that is the question. " * 200
    return tokenizer.encode(text)
